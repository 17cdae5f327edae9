#!/bin/bash
# stop 61 call 4: the hybrids on the paged forward (Qwen3.5 with the M-RoPE fix, LFM2's short convolutions, Granite-4.0-H's
# Mamba-2, Kimi Linear without positions), then the GDN GPU tests again
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
timeout 110 python3 benchmarks/arch_matrix.py --device cuda --mxfp4 --budget-s 95 --out "$OUT" --archs qwen3_5_moe_text lfm2_moe granitemoehybrid kimi_linear > "$OUT/arch_matrix.txt" 2>&1
grep -E "^\| [a-z]" "$OUT/arch_matrix_gpu.md" | cut -c1-260; grep "paged KV off" $OUT/arch_matrix.txt | cut -c1-250
timeout 40 python3 -m pytest -q -p no:cacheprovider --timeout=35 tests/test_gdn_gpu.py 2>&1 | grep -v "^\[transformers\]" | tail -6 | tee $OUT/gpu_tests.txt
