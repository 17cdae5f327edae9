#!/usr/bin/env bash
# stop 64 call 4: Nemotron 3 Nano block shapes end to end (nano-5l, MXFP4 experts resident): fragment words (served)
# against pair words (PDFLASH_FP4_FRAGMENTS=0), the same process settings otherwise
OUT=${1:?}; mkdir -p $OUT/fragments $OUT/pairs
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
A="--targets nano-5l --mxfp4-experts --blocks 16 --prompts 2 --new-tokens 64 --no-hf"
timeout 170 python3 benchmarks/e2e_gpu.py $A --out $OUT/fragments > $OUT/fragments/log.txt 2>&1; echo "fragments exit $?" >> $OUT/fragments/log.txt
PDFLASH_FP4_FRAGMENTS=0 timeout 170 python3 benchmarks/e2e_gpu.py $A --out $OUT/pairs > $OUT/pairs/log.txt 2>&1; echo "pairs exit $?" >> $OUT/pairs/log.txt
for d in fragments pairs; do echo "== $d"; grep -E "^\| nano|exit" $OUT/$d/log.txt | cut -c1-200; done
