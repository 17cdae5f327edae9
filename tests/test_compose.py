"""The container deployment works for real: docker/compose_test.sh builds the image, brings the
compose stack up, generates through the published drafter port, scrapes its metrics, stops it
gracefully and tears it down (`down -v`).

Skips only when this machine cannot provide a Docker engine (not root, no apt-get); on CI as root
that is a failure, not a skip. Slow: about 10 minutes from nothing on a 2-core CPU machine.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "compose_test.sh"
CANNOT_PROVIDE_DOCKER = 3  # docker/engine.sh's exit code


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.mark.slow
@pytest.mark.timeout(2600)
def test_compose_stack_generates():
    if os.geteuid() != 0 and not _in_ci():
        pytest.skip("docker/engine.sh needs root to install and start a Docker engine")
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=2300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script still runs `down -v`
        out, err = proc.communicate(timeout=180)
    log = f"exit {proc.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-12000:]}"
    if proc.returncode == CANNOT_PROVIDE_DOCKER and not (_in_ci() and os.geteuid() == 0):
        pytest.skip("docker cannot be provided here: " + err.strip().splitlines()[-1])
    assert proc.returncode == 0, log
