#!/usr/bin/env bash
# stop 63 call 2: issue 12's kernels table on this card (benchmarks/kernel_bench.py via gpu.sh kernels)
OUT=${1:?}; mkdir -p $OUT
KERNELS_S=${KERNELS_S:-330} bash benchmarks/gpu.sh $OUT kernels > $OUT/gpu_sh.txt 2>&1
grep -E "^\| [a-z].*\| mxfp4 \| (1|4|16) \||invariance|Invariance|device copy" $OUT/kernels.txt | cut -d'|' -f2-13 | head -30
tail -3 $OUT/kernels.txt
