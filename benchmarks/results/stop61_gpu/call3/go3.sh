#!/bin/bash
# stop 61 call 3: the GDN GPU tests again (the engine test's fixture fixed), then the hybrids in the arch matrix
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 250 python3 -m pytest -q -p no:cacheprovider --timeout=230 --durations=4 tests/test_gdn_gpu.py 2>&1 | grep -v "^\[transformers\]" | tail -40 > $OUT/gdn_tests.txt
tail -12 $OUT/gdn_tests.txt | cut -c1-400
timeout 250 python3 benchmarks/arch_matrix.py --device cuda --mxfp4 --budget-s 220 --out "$OUT" --archs qwen3_next qwen3_5_moe_text kimi_linear > "$OUT/arch_matrix.txt" 2>&1
grep -E "^\| [a-z]" "$OUT/arch_matrix_gpu.md" | cut -c1-300
