#!/usr/bin/env bash
# stop 55 call 6: FEW_BLOCKS (a routed gate/up GEMM as two launches picked by the block count): bits tests, then the A/B
O=/tmp/o6; mkdir -p $O
bash benchmarks/gpu.sh $O none > $O/setup.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -v -rfE -p no:cacheprovider --timeout=140 tests/test_fragments.py -k "few_blocks" > $O/few_tests.txt 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $O/few_tests.txt | tail -14
timeout 190 python3 benchmarks/persist_ab.py --per-sm 8 --few --tokens 4,16 --verify-tokens 8,16,32,64 \
  --models qwen3-30b-a3b,gpt-oss-20b --rounds 3 --out $O > $O/few_ab.txt 2>&1
echo "ab rc=$?"; grep -E "^\|" $O/few_ab.txt | cut -d'|' -f2-12
tar czf $OUT/all.tgz -C $O .
