#!/usr/bin/env bash
# stop 57 call 3: the README's GPU commands as a new user runs them (pdflash demo / up on CUDA, own tiny model, bad input)
OUT=$1
bash benchmarks/gpu.sh $OUT none > $OUT/install.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
pd() { python3 -m pdflash.cli "$@"; }
step() { echo; echo "=== $*"; }
python3 -c "from pdflash.tiny import make_tiny_checkpoint as m; m('/tmp/tiny-gptoss', arch='gpt_oss'); m('/tmp/tiny-mixtral', arch='mixtral')" > /dev/null 2>&1
step "1 demo on cuda (embedded pair)"; ( time timeout 240 python3 -m pdflash.cli demo --device cuda --log-dir $OUT/l1 ) > $OUT/s1.txt 2>&1; echo "rc=$?"; tail -8 $OUT/s1.txt
step "2 demo, own gpt_oss model, MXFP4 offloaded, kv 1 GiB"; ( time timeout 200 python3 -m pdflash.cli demo --model /tmp/tiny-gptoss --device cuda --experts mxfp4 --expert-cache-gb 0.001 --kv-cache-gb 1 --log-dir $OUT/l2 ) > $OUT/s2.txt 2>&1; echo "rc=$?"; tail -6 $OUT/s2.txt
step "3 demo, own mixtral model, native experts"; ( time timeout 200 python3 -m pdflash.cli demo --model /tmp/tiny-mixtral --device cuda --log-dir $OUT/l3 ) > $OUT/s3.txt 2>&1; echo "rc=$?"; tail -6 $OUT/s3.txt
step "4 bad: --kv-cache-gb -1"; timeout 60 python3 -m pdflash.cli up --device cuda --kv-cache-gb -1 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}"
step "5 bad: cache too small"; timeout 200 python3 -m pdflash.cli demo --model /tmp/tiny-gptoss --device cuda --experts mxfp4 --expert-cache-gb 0.000001 --log-dir $OUT/l5 > $OUT/s5.txt 2>&1; echo "rc=$?"; tail -3 $OUT/s5.txt
step "6 bad: kv pool too big"; timeout 200 python3 -m pdflash.cli demo --device cuda --kv-cache-gb 5000 --log-dir $OUT/l6 > $OUT/s6.txt 2>&1; echo "rc=$?"; tail -3 $OUT/s6.txt
pkill -f "pdflash.cli serve-" ; cd $OUT && tar czf all.tgz s*.txt l1 l2 l3 l5 l6 install.txt 2>/dev/null; ls
