"""The test run leaves the checkout as it found it (tests/checkout_guard.py), and what once wrote a stray
folder into it cannot any more; and on a GPU host the suite starts its longest GPU modules first."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from pdflash.tiny import make_tiny_checkpoint

TESTS = pathlib.Path(__file__).resolve().parent


def test_a_bad_architecture_writes_nothing(tmp_path, monkeypatch):
    """make_tiny_checkpoint("qwen3_moe", path), arguments swapped, used to write a tokenizer into
    ./qwen3_moe/ before it noticed the architecture: that is the stray folder once committed."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        make_tiny_checkpoint("qwen3_moe", str(tmp_path / "somewhere"))
    assert list(tmp_path.iterdir()) == []


def _git(repo: pathlib.Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"})


def _run(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # this run may be an xdist worker's
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "checkout_guard", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def _repo(tmp_path: pathlib.Path) -> pathlib.Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "tracked.txt").write_text("as committed\n")
    (repo / "test_writes.py").write_text(
        "import os, pathlib\n"
        "def test_writes_a_stray_folder():\n"
        "    if os.environ.get('WRITE_STRAY'):\n"
        "        pathlib.Path('qwen3_moe').mkdir()\n"
        "        pathlib.Path('qwen3_moe/tokenizer.json').write_text('{}')\n"
        "def test_rewrites_a_tracked_file():\n"
        "    if os.environ.get('REWRITE'):\n"
        "        pathlib.Path('tracked.txt').write_text('changed\\n')\n"
    )
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    return repo


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_suite_fails_when_a_test_leaves_something_in_the_checkout(tmp_path, monkeypatch):
    repo = _repo(tmp_path)
    clean = _run(repo)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "checkout not clean" not in clean.stdout

    # The developer's own uncommitted edits are not the run's doing.
    (repo / "notes.txt").write_text("mine\n")
    assert _run(repo).returncode == 0

    monkeypatch.setenv("WRITE_STRAY", "1")
    dirty = _run(repo)
    monkeypatch.delenv("WRITE_STRAY")
    assert dirty.returncode == 1, dirty.stdout + dirty.stderr
    assert "2 passed" in dirty.stdout and "checkout not clean" in dirty.stdout
    assert "?? qwen3_moe/tokenizer.json" in dirty.stdout and "notes.txt" not in dirty.stdout

    shutil.rmtree(repo / "qwen3_moe")
    monkeypatch.setenv("REWRITE", "1")
    first = _run(repo)  # tracked.txt becomes dirty: reported
    again = _run(repo)  # already dirty, rewritten with the same content: nothing new
    assert first.returncode == 1 and " M tracked.txt" in first.stdout, first.stdout
    assert again.returncode == 0, again.stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_guard_sees_the_whole_run_under_xdist(tmp_path, monkeypatch):
    """With pytest-xdist (`-n 2`) the controller compares, once, before the workers start and after they end; a
    worker does not (its session covers part of the run only)."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    repo = _repo(tmp_path)
    clean = _run(repo, "-n", "2")
    assert clean.returncode == 0 and "2 passed" in clean.stdout, clean.stdout + clean.stderr
    monkeypatch.setenv("WRITE_STRAY", "1")
    dirty = _run(repo, "-n", "2")
    assert dirty.returncode == 1, dirty.stdout + dirty.stderr
    assert "2 passed" in dirty.stdout and dirty.stdout.count("checkout not clean") == 1, dirty.stdout
    assert "?? qwen3_moe/tokenizer.json" in dirty.stdout


def test_gpu_modules_are_collected_first_on_a_cuda_host(monkeypatch):
    """tests/conftest.py: on a CUDA host the GPU modules are collected first, the longest first, so xdist (which hands
    out whole modules in collection order) starts them first; elsewhere the order is left alone."""
    import torch

    from tests import conftest

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    names = ["tests/test_a.py::x", "tests/test_kernels_gpu.py::y", "tests/test_gpu_verifier.py::z[mixtral]", "tests/test_a.py::w"]
    items = [Item(n) for n in names]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == names
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [names[2], names[1], names[0], names[3]]
