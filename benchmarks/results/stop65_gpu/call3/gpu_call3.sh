#!/usr/bin/env bash
# stop 65 call 3: Jamba-1.5-Mini-shaped model (8 layers) end to end, experts bf16 (with transformers' rows) and MXFP4
OUT=${1:?}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/py312/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/device.txt"
timeout 240 python3 benchmarks/e2e_gpu.py --targets jamba-8l --blocks 16 --prompts 2 --new-tokens 64 --out "$OUT" --tag _jamba > "$OUT/e2e_native.txt" 2>&1; echo "exit $?" >> "$OUT/e2e_native.txt"
timeout 150 python3 benchmarks/e2e_gpu.py --targets jamba-8l --blocks 16 --prompts 2 --new-tokens 64 --no-hf --mxfp4-experts --out "$OUT" --tag _jamba_mxfp4 > "$OUT/e2e_mxfp4.txt" 2>&1; echo "exit $?" >> "$OUT/e2e_mxfp4.txt"
for f in e2e_native e2e_mxfp4; do echo "== $f"; grep -E "^\| jamba|^- jamba|exit|Error" "$OUT/$f.txt" | cut -c1-400; done
