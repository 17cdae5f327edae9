#!/usr/bin/env bash
# stop 64 call 2: which grid / routing-free settings serve up-only experts (Nemotron 3 Nano, fragment words) best:
# p0 (one program a tile, served), p8 (persistent), d128 / d128q (no routing launch up to 128 pairs, grouped; q: on the
# persistent grid: Qwen3's served form), on issue-12-style calls and verify-shaped spread calls
OUT=${1:?}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 420 python3 benchmarks/persist_ab.py --models nemotron-3-nano --per-sm 0,8 --direct-pairs 128 --direct-persist \
  --tokens 1,4,16,64 --verify-tokens 2,4,8,16 --out $OUT > $OUT/persist_ab.txt 2>&1; echo "exit $?" >> $OUT/persist_ab.txt
grep -E "^\| nemo|exit|Error" $OUT/persist_ab.txt | cut -c1-220
