#!/usr/bin/env bash
# stop 56 call 3 (warm H100): end to end, gpt-oss-24l MXFP4, the one launch forced (PDFLASH_FP4_ONE_LAUNCH_PAIRS=128) against the H100's default (none), alternating
O=/tmp/o3; mkdir -p $O
for r in 1 2; do for v in "" 128; do
  tag=${v:-def}$r
  PDFLASH_FP4_ONE_LAUNCH_PAIRS=$v E2E_S=110 E2E_ARGS="--no-hf --mxfp4-experts --targets gptoss-24l --blocks 16" bash benchmarks/gpu.sh $O/$tag e2e > $O/$tag.run.txt 2>&1
  echo "== $tag"; grep -E "^\|" $O/$tag/e2e_gpu_*.md | head -8
done; done
tar czf $OUT/e2e.tgz -C $O .
