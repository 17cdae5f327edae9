#!/bin/bash
# stop 62 call 1: stop 61's unrun rows (hybrids on the paged forward) and Nemotron-H (up-only relu^2 experts, Mamba-2),
# then the GDN/Mamba-2/Nemotron GPU tests
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 200 python3 benchmarks/arch_matrix.py --device cuda --mxfp4 --budget-s 185 --out "$OUT" --archs nemotron_h qwen3_5_moe_text lfm2_moe granitemoehybrid kimi_linear > "$OUT/arch_matrix.txt" 2>&1
grep -E "^\| [a-z]" "$OUT/arch_matrix_gpu.md" | cut -c1-260; grep -E "paged KV off|Error|error" $OUT/arch_matrix.txt | cut -c1-250 | head -8
timeout 360 python3 -m pytest -v -rfE -p no:cacheprovider --timeout=200 tests/test_gdn_gpu.py > $OUT/gpu_tests.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/gpu_tests.txt | sed 's/^tests\///' | cut -c1-200 | tail -20
