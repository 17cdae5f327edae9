#!/bin/bash
# stop 61 call 1: GDN's first GPU run (tests + qnext-4l), then MLA's GPU tests at the 2-stage default
OUT=$1
GDN_TESTS_S=230 GDN_E2E_S=200 bash benchmarks/gpu.sh $OUT gdn
export PYTHONPATH=/tmp/site:$PWD
timeout 130 python3 -m pytest -q -p no:cacheprovider --timeout=120 tests/test_mla_gpu.py 2>&1 | tail -4 | tee $OUT/mla_tests_2stage.txt
