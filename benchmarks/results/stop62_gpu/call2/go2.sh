#!/bin/bash
# stop 62 call 2: Nemotron-shaped GPU tests after the 5.17 cache fix; the runner's graph tests (CPU-only since stop 61's
# recurrent rows); Nemotron-shaped end to end
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 170 python3 -m pytest -v -rfE -p no:cacheprovider --timeout=160 tests/test_gdn_gpu.py -k nemotron > $OUT/gpu_tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/gpu_tests.txt | sed 's/^tests\///' | cut -c1-200 | tail -8
timeout 150 python3 benchmarks/e2e_gpu.py --targets nano-5l --blocks 16 --prompts 2 --new-tokens 64 --out $OUT > $OUT/e2e_nano.txt 2>&1
tail -12 $OUT/e2e_nano.txt | cut -c1-220
timeout 230 python3 -m pytest -v -rfE -p no:cacheprovider --timeout=200 tests/test_gpu_verifier.py::test_every_drafter_and_width_equals_block_one tests/test_gpu_verifier.py::test_waves_equal_their_solo_runs "tests/test_offload_gpu.py::test_waves_on_offloaded_experts_equal_resident_mxfp4" > $OUT/verifier_tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/verifier_tests.txt | sed 's/^tests\///' | cut -c1-150 | tail -16
