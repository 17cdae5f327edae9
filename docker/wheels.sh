#!/usr/bin/env bash
# Put a CPU-only torch wheel into docker/wheels/, the build context directory the Dockerfile
# installs torch from. Why: PyPI's Linux torch is the CUDA build (several GB of nvidia-* wheels);
# the CPU build lives on the PyTorch index, which CI machines cannot reach, but pip finds it on
# their disk (pip.conf find-links). Elsewhere pip may fetch it from an index you configure
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). When no CPU wheel is found the
# directory stays empty and the Dockerfile asks the PyTorch CPU index itself.
#
# Use: docker/wheels.sh   (env TORCH_VERSION, PYTHON_VERSION: those of the image, 2.13.0 / 3.11)
set -euo pipefail
cd "$(dirname "$0")/wheels"
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
want="torch-${TORCH_VERSION}+cpu-cp${PYTHON_VERSION/./}-"
if ls "$want"*.whl >/dev/null 2>&1; then
    echo "wheels.sh: $(ls "$want"*.whl) already here" >&2
    exit 0
fi
rm -f torch-*.whl   # one torch wheel at most: the Dockerfile installs torch-*.whl
if pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --platform manylinux_2_28_x86_64 "torch==${TORCH_VERSION}+cpu" -d . >&2; then
    echo "wheels.sh: $(ls torch-*.whl) ready" >&2
else
    echo "wheels.sh: no CPU torch ${TORCH_VERSION} wheel for Python ${PYTHON_VERSION} found;" \
         "the image build will use the PyTorch CPU index" >&2
fi
