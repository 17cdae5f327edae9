#!/usr/bin/env bash
# stop 63 call 1: up-only kernel table, the gdn/mla GPU tests (drafts_and_waves helper), the MoE call breakdown at 8 experts
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
timeout 140 python3 benchmarks/kernel_bench.py --up-only --out $OUT > $OUT/up_only.txt 2>&1; echo "up-only exit $?" >> $OUT/up_only.txt
timeout 270 python3 -m pytest -v -p no:cacheprovider --timeout=250 --durations=8 tests/test_gdn_gpu.py tests/test_mla_gpu.py > $OUT/gdn_mla_tests.txt 2>&1; echo "tests exit $?" >> $OUT/gdn_mla_tests.txt
timeout 110 python3 benchmarks/moe_call_breakdown.py --cases qwen3-30b-a3b:8:1,qwen3-30b-a3b:8:4,qwen3-30b-a3b:8:16,gpt-oss-20b:8:1,gpt-oss-20b:8:4,gpt-oss-20b:8:16 --out $OUT > $OUT/breakdown.txt 2>&1; echo "breakdown exit $?" >> $OUT/breakdown.txt
echo "== up-only"; grep -E "^\||exit|Error" $OUT/up_only.txt | cut -c1-170 | tail -20
echo "== tests"; grep -E "PASSED|FAILED|ERROR|passed|failed|exit" $OUT/gdn_mla_tests.txt | cut -c1-150 | tail -30
echo "== breakdown"; tail -22 $OUT/breakdown.txt | cut -c1-200
