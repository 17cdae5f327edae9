"""The light install for developers of pdflash clients: the client, the generated stubs, `pdflash stub` and the
pytest plugin, without torch and transformers (`pip install pdflash`; serving is the `serve` extra).

For real: a fresh virtual environment, the package installed from this checkout (its dependencies from the
package index), and the README's example test run there as a new user would: it passes against
`pdflash_stub`, and `pdflash_stack` skips, saying what to install. About 25 s on the 2-core machine, most
of it pip.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "test_readme_client_example.py"
SERVING = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "prometheus-client"}
# What pip says when it cannot reach the package index at all
OFFLINE = ("Failed to establish a new connection", "Temporary failure in name resolution", "Network is unreachable",
           "No route to host", "Connection refused")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_dependency_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    light = _names(project["dependencies"])
    assert not light & SERVING, f"the light install must not pull {light & SERVING}"
    assert {"grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "protobuf"} <= light
    extras = project["optional-dependencies"]
    assert SERVING <= _names(extras["serve"])
    assert "pdflash[serve]" in extras["test"], "`-e .[test]` (README, .ci/run) must still install everything serving needs"
    assert project["entry-points"]["pytest11"] == {"pdflash.testing": "pdflash.testing"}
    assert "['optional-dependencies']['serve']" in (ROOT / "Dockerfile").read_text(), "the image serves: it needs the extra"


def test_readme_shows_the_example_test_verbatim():
    readme = (ROOT / "README.md").read_text()
    assert EXAMPLE.read_text().strip() in readme, "README's 'Testing your client' example must be tests/test_readme_client_example.py"


def _source_copy(dest: pathlib.Path) -> pathlib.Path:
    """The checkout without build leftovers (a stale build/ would end up in the wheel)."""
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
                                    "runs", ".cache", "tests", "benchmarks", "training", "docker", ".whl")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_light_install_in_a_fresh_venv(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    run = functools.partial(subprocess.run, env=env, capture_output=True, text=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    py, pdflash = venv / "bin" / "python", venv / "bin" / "pdflash"
    src = _source_copy(tmp_path / "src")
    pip = run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src), "pytest"], timeout=600)
    if pip.returncode != 0 and not _in_ci() and any(w in pip.stderr for w in OFFLINE):
        pytest.skip("the package index is unreachable from this machine (the GPU machine has no network); CI has it")
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    listed = run([str(py), "-m", "pip", "list", "--format=freeze"], check=True, timeout=120).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert "pdflash" in installed and not installed & SERVING, sorted(installed)

    user = tmp_path / "my-project"  # outside the checkout: no conftest of pdflash's own
    user.mkdir()
    shutil.copy(EXAMPLE, user / "test_my_client.py")
    tests = run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"], cwd=user, timeout=300)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "1 passed, 1 skipped" in tests.stdout and "pip install 'pdflash[serve]'" in tests.stdout, tests.stdout

    stub = run([str(pdflash), "stub", "--help"], timeout=120)
    assert stub.returncode == 0 and "--replay" in stub.stdout
    up = run([str(pdflash), "up"], timeout=120)
    assert up.returncode == 2 and "pdflash[serve]" in up.stderr and "torch" in up.stderr, up.stderr
