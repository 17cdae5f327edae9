#!/bin/bash
# stop 61 call 2: GDN GPU tests (paged forward + graphs + waves, and transformers' cache), then qnext-4l's verify loop
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 250 python3 -m pytest -q -p no:cacheprovider --timeout=230 -x tests/test_gdn_gpu.py 2>&1 | grep -v "^\[transformers\]" | tail -60 > $OUT/gdn_tests.txt
tail -25 $OUT/gdn_tests.txt
timeout 240 python3 benchmarks/e2e_gpu.py --out "$OUT" --targets qnext-4l --blocks 16 --prompts 2 --new-tokens 64 > "$OUT/gdn_e2e.txt" 2>&1
echo "e2e exit $?"; grep -v "^\[transformers\]" $OUT/gdn_e2e.txt | tail -22 | cut -c1-250
