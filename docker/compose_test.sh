#!/usr/bin/env bash
# End-to-end check of the container deployment, for real: engine + base image (docker/engine.sh),
# CPU torch wheel (docker/wheels.sh), `docker-compose build`, `up` (which waits for the scheduler
# and verifier to be healthy), a generation through the published drafter port from this host and
# from inside the drafter container, the drafter's metrics, then `down -v` whatever happened.
#
# Use: docker/compose_test.sh        (root; tests/test_compose.py runs it)
# Exit 0: passed. 3: docker cannot be provided on this machine (callers skip). Other: failed.
# Env: PDFLASH_BASE_IMAGE (default pdflash-base:bookworm, the offline image engine.sh makes),
#      PDFLASH_TAG (default test), KEEP_STACK=1 leaves the stack up for inspection.
set -euo pipefail
cd "$(dirname "$0")/.."

phase_start=$SECONDS
phase() { echo "compose_test: [$((SECONDS - phase_start))s] $*" >&2; }

engine_env=$(docker/engine.sh) || exit $?   # 3 = cannot provide docker: propagate for the skip
eval "$engine_env"
phase "engine ready ($DOCKER_HOST)"
docker/wheels.sh

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export PDFLASH_BASE_IMAGE=${PDFLASH_BASE_IMAGE:-pdflash-base:bookworm}
export PDFLASH_TAG=${PDFLASH_TAG:-test}
export PDFLASH_PUBLISH_ADDR=127.0.0.1
export PDFLASH_PUBLIC_PORT=${PDFLASH_PUBLIC_PORT:-$(free_port)}
export PDFLASH_PUBLIC_METRICS_PORT=${PDFLASH_PUBLIC_METRICS_PORT:-$(free_port)}
export PDFLASH_STUB_PORT=${PDFLASH_STUB_PORT:-$(free_port)}
project=pdflash-test-$$
dc() { docker-compose --ansi never -p "$project" -f compose.yaml "$@"; }
dcs() { dc --profile stub "$@"; }   # the stub profile too (its service only starts when named)

finish() {
    rc=$?
    if ((rc != 0)); then
        echo "compose_test: FAILED (exit $rc); service states and logs follow" >&2
        dc ps >&2 || true
        dc logs --no-color --tail=150 >&2 || true
    fi
    if [[ ${KEEP_STACK:-0} == 1 ]]; then
        echo "compose_test: stack left up: DOCKER_HOST=$DOCKER_HOST docker-compose -p $project down -v" >&2
    else
        dcs down -v --remove-orphans >&2 || true
        phase "down -v done"
    fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM; trap 'exit 130' INT   # killed (a test timeout): still tear down

dc config -q
dcs config -q
build_log=$(mktemp)
dc build >"$build_log" 2>&1 || { tail -n 60 "$build_log" >&2; exit 1; }
rm -f "$build_log"
phase "image built"
dc up -d   # returns once the drafter is created: compose waited for scheduler/verifier healthy
phase "up returned; waiting for the drafter to be healthy"

drafter=$(dc ps -q drafter)
for _ in $(seq 200); do
    state=$(docker inspect --format '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$drafter")
    [[ $state == "running healthy" ]] && break
    [[ $state == running* ]] || { echo "compose_test: drafter is $state" >&2; exit 1; }
    sleep 3
done
[[ $state == "running healthy" ]] || { echo "compose_test: drafter still '$state'" >&2; exit 1; }
phase "all healthy"

# Only the drafter is published: the internal services must not be reachable from the host.
for svc in scheduler verifier; do
    if [[ -n $(docker inspect --format '{{range $p, $b := .NetworkSettings.Ports}}{{if $b}}{{$p}} {{end}}{{end}}' "$(dc ps -q $svc)") ]]; then
        echo "compose_test: $svc publishes a port; only the drafter may" >&2; exit 1
    fi
done

# A generation inside the drafter container (the image's own client) ...
out=$(dc exec -T drafter pdflash generate "def fib(n):" --max-tokens 16 --stats)
echo "compose_test: in-container generate -> ${out@Q}" >&2
[[ -n $out ]] || { echo "compose_test: empty generation" >&2; exit 1; }

# ... and one from this host through the published port, with the host's client when installed.
target=127.0.0.1:$PDFLASH_PUBLIC_PORT
if command -v pdflash >/dev/null; then
    out=$(pdflash generate "def fib(n):" --max-tokens 16 --stats --target "$target")
else
    out=$(docker run --rm --network host "pdflash:$PDFLASH_TAG" generate "def fib(n):" --max-tokens 16 --stats --target "$target")
fi
echo "compose_test: host generate via $target -> ${out@Q}" >&2
[[ -n $out ]] || { echo "compose_test: empty generation" >&2; exit 1; }
phase "generated"

# The drafter's metrics, published next to its port, count what was just generated.
metrics=$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
    "http://127.0.0.1:$PDFLASH_PUBLIC_METRICS_PORT/metrics") || { echo "compose_test: no metrics endpoint" >&2; exit 1; }
grep -E '^pdflash_generation_tokens_total [1-9]' <<<"$metrics" >&2 \
    || { echo "compose_test: pdflash_generation_tokens_total not counted" >&2; exit 1; }

# Graceful stop within stop_grace_period: exit codes 0 (or 143 = SIGTERM default) and no SIGKILL (137).
dc stop >&2
for svc in drafter verifier scheduler; do
    code=$(docker inspect --format '{{.State.ExitCode}}' "$(dc ps -q $svc)")
    [[ $code == 0 || $code == 143 ]] || { echo "compose_test: $svc exited $code on stop" >&2; exit 1; }
done
phase "stopped gracefully"

# The stub profile: the same image serves the public API without a model, for tests of clients.
dcs up -d stub
stub=$(dcs ps -q stub)
for _ in $(seq 60); do
    state=$(docker inspect --format '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$stub")
    [[ $state == "running healthy" ]] && break
    [[ $state == running* ]] || { echo "compose_test: stub is $state" >&2; exit 1; }
    sleep 1
done
[[ $state == "running healthy" ]] || { echo "compose_test: stub still '$state'" >&2; exit 1; }
out=$(dcs exec -T stub pdflash generate "echo me" --max-tokens 16)
[[ $out == "echo me" ]] || { echo "compose_test: the stub answered ${out@Q}, not the echoed prompt" >&2; exit 1; }
if command -v pdflash >/dev/null; then
    out=$(pdflash health "127.0.0.1:$PDFLASH_STUB_PORT" --service pdflash.v1.Drafter)
    echo "compose_test: stub health via its published port -> $out" >&2
fi
dcs stop stub >&2
phase "stub profile served; PASSED"
