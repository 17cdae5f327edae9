#!/usr/bin/env bash
# stop 57 call 1: Mixtral/Qwen3 one launch A/B, then issue 12's table with the routing step as a program a chunk
OUT=$1
bash benchmarks/gpu.sh $OUT none > $OUT/install.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/ab $OUT/k
timeout 170 python3 benchmarks/persist_ab.py --per-sm 8 --one-launch --tokens 1,4,16 --verify-tokens 4,8,16,32,64 --models mixtral-8x7b,qwen3-30b-a3b --out $OUT/ab > $OUT/ab/ab.txt 2>&1
tail -40 $OUT/ab/ab.txt
KERNELS_S=290 bash benchmarks/gpu.sh $OUT/k kernels > $OUT/k/run.txt 2>&1
cd $OUT && tar czf all.tgz ab k install.txt && cd - >/dev/null
python3 - $OUT/k <<'PY'
import json,sys,glob
f=glob.glob(sys.argv[1]+'/kernels_*.json')[0]; d=json.load(open(f))
print(d['device'], d.get('copy_gbps') or '', d['invariance'])
for r in d['moe']:
    if r['tokens_per_expert']<=16: print(r['model'][:8], r['weights'], r['tokens_per_expert'], r['active_experts'], r['us'], r['speedup'], round(r['hbm_fraction'],3))
l=d['linear']; print('linear max ratio', max(x['ratio'] for x in l), sum(x['ratio']<=1.2 for x in l), len(l))
PY
