#!/usr/bin/env bash
# stop 55 call 1: the refactor's bits tests, issue 12's table with DIRECT_SHAPES, Qwen3 MXFP4 end to end
O=/tmp/o; mkdir -p $O/t $O/k $O/e
bash benchmarks/gpu.sh $O/t none > $O/t/setup.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -v -rfE -p no:cacheprovider --timeout=140 tests/test_fragments.py -k "direct_pairs_give or grouped_direct or direct_pairs_are" > $O/t/direct_tests.txt 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $O/t/direct_tests.txt | tail -14
KERNELS_S=230 bash benchmarks/gpu.sh $O/k kernels > $O/k/run.txt 2>&1
grep -E "\| mxfp4 \| (1|4|16) \|" $O/k/kernels_*.md | cut -d'|' -f2-13
grep -iE "invariance|goal|bit" $O/k/kernels.txt | tail -6
E2E_S=170 E2E_ARGS="--no-hf --mxfp4-experts --targets qwen3-8l --blocks 16" bash benchmarks/gpu.sh $O/e e2e > $O/e/run.txt 2>&1
tail -25 $O/e/run.txt
tar czf $OUT/all.tgz -C $O .
