#!/usr/bin/env bash
# Run the CPU end-to-end benchmark on another Linux host (e.g. the GPU machine, CPU only), from a copy of
# the repository. Wheels for what that host's Python lacks go in .whl/py<ver>/ (pip download on a machine
# with the package index, see benchmarks/README.md); nothing is fetched from the network here.
#   bash benchmarks/on_host.sh OUT_DIR [e2e.py options...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: on_host.sh OUT_DIR [e2e.py options]}"; shift
ver="$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
if [ -d ".whl/py$ver" ]; then
  python3 -m pip install -q --no-index --find-links ".whl/py$ver" grpcio==1.85.1 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 structlog pyyaml 2>&1 | grep -v WARN || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_VISIBLE_DEVICES="" TOKENIZERS_PARALLELISM=false
python3 -c "import os, torch, transformers, grpc; print(f'{os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}, grpcio {grpc.__version__}')"
mkdir -p "$out"
python3 benchmarks/e2e.py --out "$out/e2e_cpu" "$@"
