"""The container deployment works for real: docker/compose_test.sh builds the image, brings the
compose stack up, generates through the published drafter port, scrapes its metrics, stops it
gracefully and tears it down (`down -v`).

Skips only when this machine cannot provide a Docker engine (not root, no apt-get); on CI as root
that is a failure, not a skip. Slow: about 10 minutes from nothing on a 2-core CPU machine.

The private Docker engine (dockerd and its containerd) is stopped afterwards when this test started it;
one that was already running is left as it was. PDFLASH_KEEP_DOCKER=1 keeps an engine the test started
running, for repeated local runs (the next run finds it up and leaves it up).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "compose_test.sh"
ENGINE = ROOT / "docker" / "engine.sh"
CANNOT_PROVIDE_DOCKER = 3  # docker/engine.sh's exit code
RUNDIR = pathlib.Path(os.environ.get("PDFLASH_DOCKER_RUN", "/run/pdflash-docker"))  # as docker/engine.sh has it


def _engine_running() -> bool:
    return subprocess.run(["bash", str(ENGINE), "--status"], capture_output=True, timeout=60).returncode == 0


def _engine_pids() -> dict[str, int]:
    """The engine's processes that are alive: dockerd and the containerd it started."""
    pids = {}
    for name, f in (("dockerd", RUNDIR / "dockerd.pid"), ("containerd", RUNDIR / "exec" / "containerd" / "containerd.pid")):
        try:
            pid = int(f.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            continue
        pids[name] = pid
    return pids


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.mark.slow
@pytest.mark.timeout(2600)
def test_compose_stack_generates():
    if os.geteuid() != 0 and not _in_ci():
        pytest.skip("docker/engine.sh needs root to install and start a Docker engine")
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    was_running = _engine_running()
    keep = os.environ.get("PDFLASH_KEEP_DOCKER", "").lower() in ("1", "true", "yes")
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=2300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script still runs `down -v`
        out, err = proc.communicate(timeout=180)
    finally:
        started = _engine_pids() if not was_running else {}
        stopped = None
        if started and not keep:  # the engine this run started: stop it (dockerd, then its containerd)
            stopped = subprocess.run(["bash", str(ENGINE), "--stop"], capture_output=True, text=True, timeout=180)
    log = f"exit {proc.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-12000:]}"
    if stopped is not None:
        assert stopped.returncode == 0, f"docker/engine.sh --stop failed:\n{stopped.stderr}"
        left = {n: pid for n, pid in started.items() if _alive(pid)}
        assert not left, f"the Docker engine this test started is still running: {left}"
    elif was_running:
        assert _engine_running(), "an engine that was running before the test must be left running"
    if proc.returncode == CANNOT_PROVIDE_DOCKER and not (_in_ci() and os.geteuid() == 0):
        pytest.skip("docker cannot be provided here: " + err.strip().splitlines()[-1])
    assert proc.returncode == 0, log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
