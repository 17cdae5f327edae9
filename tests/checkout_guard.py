"""pytest plugin: the run must leave the checkout as it found it.

`git status --porcelain` is taken when the session starts and again when it ends; any entry that appeared
or changed (a stray folder a test wrote into the repository, a tracked file rewritten) fails the run and
is listed. What was already there (the developer's own edits) is not the suite's doing and is ignored;
ignored files (.gitignore: caches, .hypothesis/, ...) are not reported by git. Outside a git checkout, or
without git, there is nothing to compare and the plugin does nothing. Loaded by tests/conftest.py.

Under pytest-xdist (`-n N`) only the controller compares: its session starts before the workers start and ends after
they have all finished, so it sees the whole run; a worker's own session covers only part of it (another worker may be
mid-test at either end), and workers skip the check.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

_KEY = pytest.StashKey[tuple[pathlib.Path, dict[str, str]]]()


def _status(root: pathlib.Path) -> dict[str, str] | None:
    """path -> porcelain status (plus a content hash for files already dirty, so a rewrite is seen)."""
    if shutil.which("git") is None:
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain=v1", "-z", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    codes: dict[str, str] = {}
    items = iter(out.stdout.split("\0"))
    for item in items:
        if not item:
            continue
        codes[item[3:]] = item[:2]
        if item[0] in "RC":  # a rename or copy: its source path follows
            next(items, None)
    files = [path for path in codes if (root / path).is_file()]
    digests: dict[str, str] = {}
    if files:  # a dirty file rewritten by the run must show up too: compare contents, not only codes
        h = subprocess.run(["git", "-C", str(root), "hash-object", "--stdin-paths"], input="\n".join(files) + "\n",
                           capture_output=True, text=True, timeout=120)
        if h.returncode == 0:
            digests = dict(zip(files, h.stdout.split()))
    return {path: f"{code} {digests.get(path, '')}" for path, code in codes.items()}


def _root(config: pytest.Config) -> pathlib.Path | None:
    try:
        out = subprocess.run(["git", "-C", str(config.rootpath), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return pathlib.Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # set by pytest-xdist in its worker processes only


def pytest_sessionstart(session: pytest.Session) -> None:
    if _xdist_worker(session.config):
        return
    root = _root(session.config)
    if root is None:
        return
    before = _status(root)
    if before is not None:
        session.config.stash[_KEY] = (root, before)


def left_behind(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(f"{after[p][:2]} {p}" for p in after if before.get(p) != after[p])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _KEY not in session.config.stash or exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    root, before = session.config.stash[_KEY]
    after = _status(root)
    if after is None:
        return
    changed = left_behind(before, after)
    if not changed:
        return
    lines = [f"the test run left these behind in the checkout {root} (git status --porcelain changed):", *changed,
             "a test wrote into the repository: write to tmp_path instead, or remove what it made"]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "checkout not clean", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines))
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
