#!/usr/bin/env bash
# stop 63 call 4: Qwen3's grouped routing-free calls of 17-128 pairs launch P blocks x N tiles of which only the experts'
# leading blocks are live (8 x 4 tokens: 768 programs, 192 live): fewer persistent programs a multiprocessor
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
C=qwen3-30b-a3b:8:1,qwen3-30b-a3b:8:4,qwen3-30b-a3b:8:16,qwen3-30b-a3b:32:1,qwen3-30b-a3b:32:4,qwen3-30b-a3b:128:1
run() { name=$1; shift; mkdir -p $OUT/$name; env "$@" timeout 80 python3 benchmarks/moe_call_breakdown.py --cases $C --out $OUT/$name > $OUT/$name/log.txt 2>&1; echo "== $name ($*)"; grep -E "^\| qwen" $OUT/$name/log.txt | cut -d'|' -f2,7,11,12; }
run served X=1
for p in 1 2 4; do run persist$p PDFLASH_FP4_PERSIST=$p; done
run persist2_direct PDFLASH_FP4_PERSIST=2 PDFLASH_FP4_PERSIST_DIRECT=1
