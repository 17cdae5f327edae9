#!/usr/bin/env bash
# stop 63 call 3: Qwen3 8-expert calls of 4-16 tokens an expert under other tiles / grids (where do 10 us over the one-token call go?); the runner's GPU test on qwen3_moe after the qkv HB constexpr
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
C=qwen3-30b-a3b:8:1,qwen3-30b-a3b:8:4,qwen3-30b-a3b:8:16,qwen3-30b-a3b:32:4
run() { name=$1; shift; mkdir -p $OUT/$name; env "$@" timeout 70 python3 benchmarks/moe_call_breakdown.py --cases $C --out $OUT/$name > $OUT/$name/log.txt 2>&1; echo "== $name ($*)"; grep -E "^\| qwen" $OUT/$name/log.txt | cut -d'|' -f2-9; }
run served X=1
run staged_tiles PDFLASH_FP4_TILES=4x4w4aa3,4x4w4
run no_persist PDFLASH_FP4_PERSIST_DIRECT=0
run no_group PDFLASH_FP4_DIRECT_GROUP=0 PDFLASH_FP4_PERSIST_DIRECT=0
run staged_no_group PDFLASH_FP4_TILES=4x4w4aa3,4x4w4 PDFLASH_FP4_DIRECT_GROUP=0 PDFLASH_FP4_PERSIST_DIRECT=0
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout=190 tests/test_gpu_verifier.py -k "qwen3_moe and (every_drafter or paged)" > $OUT/gpu_verifier_qwen3.txt 2>&1; tail -3 $OUT/gpu_verifier_qwen3.txt
