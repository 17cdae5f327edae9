#!/usr/bin/env bash
# stop 63 call 6: issue 12's kernels table on an H200 (the last one is stop 55's)
OUT=${1:?}; mkdir -p $OUT
KERNELS_S=${KERNELS_S:-200} bash benchmarks/gpu.sh $OUT kernels > $OUT/gpu_sh.txt 2>&1
grep -E "^\| [a-z].*\| mxfp4 \| (1|4|16) \||nvariance" $OUT/kernels.txt | cut -d'|' -f2-13 | head -30
