#!/usr/bin/env bash
# Bring up a private Docker engine and the offline base image the pdflash Dockerfile builds FROM.
#
# Use:   eval "$(docker/engine.sh)"      # logs go to stderr; stdout is one `export DOCKER_HOST=...` line
#        docker/engine.sh --status       # exit 0 when the engine answers on its socket, 1 when not
#        docker/engine.sh --stop         # stop the engine this script started (dockerd and its containerd)
#
# Idempotent: each step is skipped when its result is already there (packages installed, engine
# answering on its socket, base image present). Needs root and apt-get; exits 3 (and says why) when
# the machine cannot provide them, so callers can skip instead of fail.
#
# Why a hand-made base image: no image registry is reachable on the project's CI machines, so
# `FROM python:3.11-slim` cannot be pulled. debootstrap builds a minimal Debian bookworm root file
# system from the Debian mirror (reachable), which is imported as $PDFLASH_BASE_IMAGE.
set -euo pipefail

STATE=${PDFLASH_DOCKER_STATE:-/var/lib/pdflash-docker}   # data root and the debootstrap rootfs
RUNDIR=${PDFLASH_DOCKER_RUN:-/run/pdflash-docker}        # short path: socket, exec root, pid file
BASE_IMAGE=${PDFLASH_BASE_IMAGE:-pdflash-base:bookworm}
SUITE=${PDFLASH_DEBIAN_SUITE:-bookworm}
MIRROR=${PDFLASH_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SOCK=$RUNDIR/docker.sock
PIDFILE=$RUNDIR/dockerd.pid
CONTAINERD_PIDFILE=$RUNDIR/exec/containerd/containerd.pid   # the containerd dockerd starts for itself
LOG=$STATE/dockerd.log
# Extra dockerd arguments, e.g. `-b none --iptables=false` for a second engine beside another on this host.
read -r -a DOCKERD_ARGS <<<"${PDFLASH_DOCKERD_ARGS:-}"
export DOCKER_HOST=unix://$SOCK

log() { echo "engine.sh: $*" >&2; }
cannot() { log "cannot provide docker: $*"; exit 3; }

engine_up() { docker version >/dev/null 2>&1; }

# stop_pid NAME PIDFILE: SIGTERM, up to 30 s to exit, then SIGKILL. Returns 1 if it is still there.
stop_pid() {
    local name=$1 file=$2 pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 0
    log "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    log "$name (pid $pid) did not stop within 30 s: SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    return 1
}

stop_engine() {
    # dockerd stops the containerd it started; one left behind (dockerd killed hard, say) is stopped too.
    local ok=0
    stop_pid dockerd "$PIDFILE" || ok=1
    stop_pid containerd "$CONTAINERD_PIDFILE" || ok=1
    rm -f "$PIDFILE" "$SOCK"
    return $ok
}

case ${1:-} in
    --stop) stop_engine; exit $? ;;
    --status) engine_up; exit $? ;;
esac

[[ $(id -u) == 0 ]] || cannot "not root"

# 1. Packages. docker.io brings dockerd, containerd and runc; Debian's docker-compose is 1.29,
#    which (unlike podman-compose) waits for `condition: service_healthy`.
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
    command -v apt-get >/dev/null || cannot "no apt-get to install ${need[*]}"
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || cannot "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 || cannot "apt-get install ${need[*]} failed"
fi

# 2. The engine, with its own roots so it never touches a system dockerd.
mkdir -p "$STATE/data" "$RUNDIR/exec"
if ! engine_up; then
    [[ -f $PIDFILE ]] && ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null && rm -f "$PIDFILE" "$SOCK"
    log "starting dockerd (log: $LOG)"
    # setsid: the daemon outlives this script and is not killed with the caller's process group.
    setsid dockerd --data-root "$STATE/data" --exec-root "$RUNDIR/exec" --pidfile "$PIDFILE" \
        -H "unix://$SOCK" "${DOCKERD_ARGS[@]}" >>"$LOG" 2>&1 </dev/null &
    for _ in $(seq 120); do engine_up && break; sleep 0.5; done
    engine_up || { tail -n 30 "$LOG" >&2; cannot "dockerd did not answer on $SOCK within 60 s"; }
fi
log "engine up: $(docker version --format '{{.Server.Version}}' 2>/dev/null) on $SOCK"

# 3. The base image: minimal bookworm with Python 3.11, pip, venv and the host's CA bundle
#    (pip inside the image must trust the same certificates as the host's pip).
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    rootfs=$STATE/rootfs-$SUITE
    if [[ ! -f $rootfs/.pdflash-complete ]]; then
        rm -rf "$rootfs"
        log "debootstrap $SUITE into $rootfs (a minute or two)"
        debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
            "$SUITE" "$rootfs" "$MIRROR" >&2 || cannot "debootstrap failed"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        touch "$rootfs/.pdflash-complete"
    fi
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    log "importing $rootfs as $BASE_IMAGE"
    tar -C "$rootfs" --exclude=./.pdflash-complete -c . \
        | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >&2
fi
log "base image $BASE_IMAGE present"
echo "export DOCKER_HOST=$DOCKER_HOST"
