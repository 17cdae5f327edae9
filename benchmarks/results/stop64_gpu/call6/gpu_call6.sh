#!/usr/bin/env bash
# stop 64 call 6: the one launch on up-only experts (bits = four launches; compile), and its A/B on Nemotron 3 Nano's shape
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 --timeout=110 -rfE tests/test_fragments.py -k "one_launch or up_only or unsplit" > $OUT/tests.txt 2>&1; echo "tests exit $?" >> $OUT/tests.txt
timeout 110 python3 benchmarks/persist_ab.py --models nemotron-3-nano --per-sm 0 --one-launch --rounds 3 --tokens 1,4,16 --verify-tokens 4,8,16 --out $OUT > $OUT/persist_ab.txt 2>&1; echo "ab exit $?" >> $OUT/persist_ab.txt
grep -E "passed|failed|FAILED|ERROR|exit" $OUT/tests.txt | cut -c1-200 | tail -8
grep -E "^\| nemo|exit|Error" $OUT/persist_ab.txt | cut -c1-200
