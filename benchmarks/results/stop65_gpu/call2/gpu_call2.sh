#!/usr/bin/env bash
# stop 65 call 2: the Jamba (Mamba v1) GPU tests; then the reasons for call 1's suite failures (one test each, tracebacks)
OUT=${1:?}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/device.txt"
t() { local name=$1 lim=$2; shift 2; echo "== $name"; timeout $lim python3 -m pytest -p no:cacheprovider -q --tb=short "$@" > "$OUT/$name.txt" 2>&1; echo "exit $?" >> "$OUT/$name.txt"; tail -4 "$OUT/$name.txt"; }
t jamba 300 tests/test_gdn_gpu.py -k "jamba or mamba_v1" --durations=5
t verifier 120 -x tests/test_gpu_verifier.py -k "qwen3_moe and every_drafter"
t identity 100 -x tests/test_e2e_identity.py -k "qwen3_moe and cuda and none"
t gdn517 40 -x tests/test_gdn.py -k "references_are or (layer_forward and qwen3_next and 2)"
for f in verifier identity gdn517; do echo "== $f: first error lines"; grep -m6 -E "^E |Error" "$OUT/$f.txt"; done
