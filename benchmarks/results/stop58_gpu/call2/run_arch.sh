#!/usr/bin/env bash
# stop 58, call 3: the architecture matrix after the load-time checks, then the real-shape verifier tests
OUT=$1
bash benchmarks/gpu.sh $OUT none > $OUT/install.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 200 python3 benchmarks/arch_matrix.py --device cuda --mxfp4 --out $OUT \
  --archs deepseek_v3 deepseek_v2 glm4_moe_lite ernie4_5_moe qwen3_next jamba phimoe qwen3_moe gpt_oss mixtral \
  > $OUT/matrix.txt 2>&1
grep -E "^[a-z0-9_]+ +(native|mxfp4)" $OUT/matrix.txt | cut -c1-250
grep -E "paged KV off" $OUT/matrix.txt | cut -c1-400
SUITE_S=240 SUITE_FILES="tests/test_gpu_verifier.py::test_every_drafter_and_width_equals_block_one tests/test_gpu_verifier.py::test_waves_equal_their_solo_runs" bash benchmarks/gpu.sh $OUT suite 2>&1 | tail -8
cd $OUT && tar czf all.tgz *.txt *.json *.md 2>/dev/null; ls
