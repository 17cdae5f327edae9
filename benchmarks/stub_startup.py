"""How fast the stub server starts (the issue's bar: well under a second), next to the real stack.

Each row is a fresh process, timed from the moment it is spawned (interpreter start and imports included):

- `pdflash stub` process: `python -m pdflash.cli stub --port P` until its health answers SERVING (the
  parent polls every 2 ms), and until its first completion has streamed back;
- StubServer in a new process: `from pdflash.testing import StubServer; StubServer().start()`, the import
  and the start timed inside that process (what a test session pays once for its first `pdflash_stub`);
- StubServer in a warm process: start to SERVING when pdflash is imported already (each further
  `pdflash_stub` of a session);
- the real stack on a tiny random checkpoint (`pdflash_stack`'s machinery: three processes, the model loaded),
  spawn to SERVING, for scale (`--stack-repeats 0` skips it).

`--light-venv DIR` also times the new-process rows with the light install (a virtual environment made there
when missing, with `pip install` of this checkout; delete DIR to reinstall): no torch, transformers, or what
they pull in, such as rich, which structlog imports when it is there. That is what a client developer's test
environment pays.

    python benchmarks/stub_startup.py [--repeats 10] [--stack-repeats 1] [--light-venv /tmp/pdflash-light]

Prints a table and writes benchmarks/results/stub_startup.json. Medians; min and max are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "stub_startup.json"

IN_NEW_PROCESS = """
import time
t0 = time.perf_counter()
from pdflash.testing import StubServer
t1 = time.perf_counter()
stub = StubServer().start()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
stub.stop()
"""


def _env(python: str = sys.executable) -> dict[str, str]:
    """This checkout first on the path; another interpreter (the light venv) uses what is installed in it."""
    if python != sys.executable:
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def light_venv(d: pathlib.Path) -> str:
    """The light install in a virtual environment at d (made when missing); returns its python."""
    py = d / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(d)], check=True, env=_env(str(py)))
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)], check=True, env=_env(str(py)))
    return str(py)


def stub_process(python: str = sys.executable) -> tuple[float, float]:
    """Spawn `pdflash stub` -> health SERVING, and -> a first completion received (seconds)."""
    from pdflash.client import Client
    from pdflash.stack import check_health, free_ports

    port = free_ports(1)[0]
    address = f"127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "pdflash.cli", "stub", "--port", str(port), "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(python))
    try:
        while not check_health(address, "pdflash.v1.Drafter", timeout=0.5):
            if proc.poll() is not None:
                raise RuntimeError(f"pdflash stub exited with {proc.returncode}")
            time.sleep(0.002)
        serving = time.perf_counter() - t0
        with Client(address) as c:
            c.generate("def fib(n):", max_tokens=16)
        answered = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    return serving, answered


def stub_in_new_process(python: str = sys.executable) -> tuple[float, float, float]:
    """(spawn -> started, of which the import, of which the start) in a fresh interpreter."""
    t0 = time.perf_counter()
    out = subprocess.run([python, "-c", IN_NEW_PROCESS], capture_output=True, text=True, env=_env(python), check=True)
    total = time.perf_counter() - t0
    imp, start = map(float, out.stdout.split())
    return total, imp, start


def stub_warm() -> float:
    from pdflash.testing import StubServer

    t0 = time.perf_counter()
    stub = StubServer().start()
    dt = time.perf_counter() - t0
    stub.stop()
    return dt


def real_stack(root: pathlib.Path) -> float:
    from pdflash.stack import Stack, StackSpec, free_ports
    from pdflash.tiny import make_tiny_checkpoint

    model = root / "target"
    if not (model / "config.json").exists():
        make_tiny_checkpoint(model)
    ports = free_ports(3)
    spec = StackSpec(model=str(model), no_dflash=True, drafter_port=ports[0], scheduler_port=ports[1], verifier_port=ports[2],
                     metrics_ports=(-1, -1, -1), log_dir=str(root / "logs"), pin=False, extra_env={"PYTHONPATH": _env()["PYTHONPATH"]})
    t0 = time.perf_counter()
    stack = Stack(spec).start()
    try:
        stack.wait_ready(600)
        return time.perf_counter() - t0
    finally:
        stack.stop()


def summary(xs: list[float]) -> dict:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": xs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stack-repeats", type=int, default=1)
    ap.add_argument("--light-venv", type=pathlib.Path, default=None, metavar="DIR")
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args(argv)

    pythons = {"": sys.executable}
    if args.light_venv is not None:
        pythons["light install, "] = light_venv(args.light_venv)
    rows = {}
    for label, python in pythons.items():
        stub_process(python)  # warm the OS file cache: every row then measures a warm-cache start
        proc = [stub_process(python) for _ in range(args.repeats)]
        fresh = [stub_in_new_process(python) for _ in range(args.repeats)]
        rows |= {
            f"{label}pdflash stub process: spawn -> SERVING": summary([p[0] for p in proc]),
            f"{label}pdflash stub process: spawn -> first completion received": summary([p[1] for p in proc]),
            f"{label}StubServer, new process: spawn -> started": summary([f[0] for f in fresh]),
            f"{label}StubServer, new process: import pdflash.testing + StubServer": summary([f[1] for f in fresh]),
            f"{label}StubServer, new process: start() -> SERVING": summary([f[2] for f in fresh]),
        }
    rows["StubServer, warm process: start() -> SERVING"] = summary([stub_warm() for _ in range(args.repeats)])
    if args.stack_repeats:
        with tempfile.TemporaryDirectory() as d:
            rows["real stack, tiny qwen3_moe (3 processes): spawn -> SERVING"] = summary(
                [real_stack(pathlib.Path(d)) for _ in range(args.stack_repeats)])

    print(f"| what (median of {args.repeats}; the stack: {args.stack_repeats}) | ms | min-max ms |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "command": "python benchmarks/stub_startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
