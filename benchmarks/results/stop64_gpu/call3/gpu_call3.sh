#!/usr/bin/env bash
# stop 64 call 3: the up-only table as served after DIRECT_SHAPES' Nemotron entry; the GPU kernel and fragment tests (regressions)
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 130 python3 benchmarks/kernel_bench.py --up-only --out $OUT > $OUT/up_only.txt 2>&1; echo "up-only exit $?" >> $OUT/up_only.txt
timeout 400 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout=380 -rfE tests/test_fragments.py tests/test_kernels_gpu.py > $OUT/kernel_tests.txt 2>&1; echo "tests exit $?" >> $OUT/kernel_tests.txt
echo "== tests"; grep -E "passed|failed|FAILED|ERROR|exit" $OUT/kernel_tests.txt | cut -c1-200 | tail -12
echo "== up-only"; grep -E "^\| nemo.*mxfp4|exit" $OUT/up_only.txt | cut -d'|' -f2-8,11
