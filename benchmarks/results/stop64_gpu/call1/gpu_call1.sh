#!/usr/bin/env bash
# stop 64 call 1: up-only experts as fragment words (Nemotron 3 Nano shapes): the GPU tests, the up-only table on
# fragment words, the Nemotron-H real-shape model test (MXFP4 experts now fragment words), then the pair-word table (A/B)
OUT=${1:?}; mkdir -p $OUT; T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
left() { echo $(( 560 - $(date +%s) + T0 )); }
timeout 170 python3 -m pytest -q -p no:cacheprovider --timeout=160 -rfE tests/test_fragments.py tests/test_up_only_experts.py \
  -k "nemotron or small-up or up_only" > $OUT/frag_tests.txt 2>&1; echo "tests exit $? at $(( $(date +%s) - T0 )) s" >> $OUT/frag_tests.txt
timeout 130 python3 benchmarks/kernel_bench.py --up-only --out $OUT > $OUT/up_only.txt 2>&1; echo "up-only exit $? at $(( $(date +%s) - T0 )) s" >> $OUT/up_only.txt
L=$(left); if [ $L -gt 60 ]; then timeout $(( L > 200 ? 200 : L - 10 )) python3 -m pytest -q -p no:cacheprovider --timeout=190 -rfE tests/test_gdn_gpu.py -k "nemotron_h" > $OUT/nemotron_h.txt 2>&1; echo "nemotron exit $? at $(( $(date +%s) - T0 )) s" >> $OUT/nemotron_h.txt; fi
L=$(left); if [ $L -gt 70 ]; then mkdir -p $OUT/pairs; PDFLASH_FP4_FRAGMENTS=0 timeout $(( L - 5 )) python3 benchmarks/kernel_bench.py --up-only --out $OUT/pairs > $OUT/pairs/up_only.txt 2>&1; echo "pairs exit $? at $(( $(date +%s) - T0 )) s" >> $OUT/pairs/up_only.txt; fi
echo "== tests"; grep -E "passed|failed|FAILED|ERROR|exit" $OUT/frag_tests.txt | cut -c1-200 | tail -15
echo "== nemotron"; grep -E "passed|failed|FAILED|exit" $OUT/nemotron_h.txt 2>/dev/null | cut -c1-200 | tail -5
echo "== up-only fragments"; grep -E "^\| nemo|exit" $OUT/up_only.txt | cut -d'|' -f2-8,11 | tail -26
echo "== up-only pairs"; grep -E "^\| nemo|exit" $OUT/pairs/up_only.txt 2>/dev/null | grep mxfp4 | cut -d'|' -f2-8,11 | tail -13
