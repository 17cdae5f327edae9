"""`pdflash up` and `pdflash demo` as a new user runs them: a model of one's own, start-up failures in one
line, supervision (a killed service comes back; repeated crashes stop the stack), the demo's terminal.

Every stack here runs on the CPU in float32 (`--device cpu --dtype float32 --drafter-dtype float32`, PLACEMENT), on a
GPU host too, and the references are transformers' greedy decoding there (conftest.DEVICE/DTYPE); the stack on CUDA is
tests/test_e2e_identity.py's cuda-bfloat16 and tests/test_drafter_gpu.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from benchmarks.load import greedy_reference
from pdflash.client import Client
from pdflash.defaults import ASSETS, default_drafter_dir
from pdflash.stack import Stack, StackSpec, StartupError, free_ports, port_in_use
from pdflash.tiny import ARCHITECTURES
from pdflash.types import DrafterKind
from tests.conftest import DEVICE, DTYPE, start_stack

PROMPT = "import os\n\ndef main():\n    "
MAX_TOKENS = 16
DEMO_DRAFTER = ASSETS / "drafter"  # made for the embedded target: hidden 256, the tiny targets have 64
NOISE = ("Traceback", "Event loop is closed", "was never awaited")
PLACEMENT = ("--device", DEVICE, "--dtype", DTYPE, "--drafter-dtype", DTYPE)  # `up` and `demo`: pinned, never auto


class Up:
    """`pdflash <command> ...` as a process of its own, on free ports; its stdout and stderr go to files."""

    def __init__(self, tmp_path, *args: str, command: str = "up"):
        self.port, self.scheduler_port, self.verifier_port = free_ports(3)
        self.dir = tmp_path
        self.out, self.err = tmp_path / f"{command}.stdout", tmp_path / f"{command}.stderr"
        argv = [sys.executable, "-m", "pdflash.cli", command, *args, *PLACEMENT, "--port", str(self.port),
                "--scheduler-port", str(self.scheduler_port), "--verifier-port", str(self.verifier_port)]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            # cwd: the test's directory, so nothing a run writes can land in the checkout; TMPDIR likewise.
            self.proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "TMPDIR": str(tmp_path)})

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 240.0) -> re.Match:
        """The first line of its stderr matching `pattern` (fails if the process ends or time runs out first)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stderr().splitlines():
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                pytest.fail(f"exited {self.proc.returncode} before printing {pattern!r}:\n{self.stderr()[-6000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no line matching {pattern!r} after {timeout:.0f}s:\n{self.stderr()[-6000:]}")
            time.sleep(0.2)

    def pids(self) -> dict[str, int]:
        m = self.wait_for(r"pids (scheduler \d+, verifier \d+, drafter \d+)")
        return {name: int(pid) for name, pid in (part.split() for part in m.group(1).split(", "))}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def generate(target: str, deadline_s: float = 0.0) -> list[int]:
    """Greedy tokens of PROMPT; with deadline_s, UNAVAILABLE (a peer just restarted) is retried until then."""
    end = time.monotonic() + deadline_s
    with Client(target) as c:
        while True:
            try:
                return c.generate(PROMPT, max_tokens=MAX_TOKENS, timeout=120).token_ids
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                    raise
                time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- a model of one's own --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_up_serves_a_model_of_ones_own(tiny, tmp_path, arch):
    """No --drafter and a model that is not the embedded one: n-gram drafting, said why, exact output."""
    model, logs = tiny.target(arch), tmp_path / "logs"
    up = Up(tmp_path, "--model", str(model), "--log-dir", str(logs))
    try:
        up.wait_for(r"serving: drafter")
        with Client(up.target) as c:
            info = c.model_info()
        assert info.architecture == arch
        assert set(info.drafters) == {DrafterKind.NONE, DrafterKind.NGRAM}
        assert tuple(generate(up.target)) == greedy_reference(str(model), PROMPT, MAX_TOKENS, device=DEVICE)
    finally:
        rc = up.stop()
    err = up.stderr()
    assert rc == 0, err
    if default_drafter_dir() is not None:  # an embedded drafter ships: say why it is not used
        assert f"serving n-gram drafting: the embedded DFlash drafter was made for the embedded demo target, not for {model}" in err
        assert "no DFlash drafter for this model" in (logs / "drafter.log").read_text()
    assert err.splitlines()[-1] == "pdflash up: stopping"
    everything = err + "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
    assert not any(n in everything for n in NOISE), everything[-6000:]


def test_up_refuses_a_drafter_made_for_another_target_before_anything_starts(tiny, tmp_path):
    logs = tmp_path / "logs"
    up = Up(tmp_path, "--model", str(tiny.target("mixtral")), "--drafter", str(DEMO_DRAFTER), "--log-dir", str(logs))
    assert up.proc.wait(120) == 2
    lines = up.stderr().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"pdflash up: configuration error: --drafter {DEMO_DRAFTER}: drafter {DEMO_DRAFTER} has "
                               "hidden_size 256 but target ") and lines[0].endswith("the drafter was made for another target")
    assert not logs.exists(), "nothing may start"
    # The drafter service on its own says the same, in one line, before it loads anything.
    r = subprocess.run([sys.executable, "-m", "pdflash.cli", "serve-drafter", "--model", str(tiny.target("mixtral")),
                        "--drafter", str(DEMO_DRAFTER), "--port", "0", "--metrics-port", "-1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "made for another target" in r.stderr, r.stderr


# -- start-up failures: one line ----------------------------------------------------------------------------


def broken_copy(src, dst, what: str):
    shutil.copytree(src, dst)
    if what == "weights":
        (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:1000])
    else:
        (dst / "tokenizer.json").write_text("{ this is not a tokenizer")
    return dst


def test_a_service_that_cannot_start_says_why_in_one_line(tiny, tmp_path):
    """serve-verifier on weights that do not load: one error line (no traceback, no event-loop noise), exit 1,
    and the reason in its termination log for whoever supervises it."""
    model = broken_copy(tiny.target("qwen3_moe"), tmp_path / "broken", "weights")
    reason = tmp_path / "verifier.reason"
    r = subprocess.run([sys.executable, "-m", "pdflash.cli", "serve-verifier", "--model", str(model), "--port", "0",
                        "--metrics-port", "-1", "--device", DEVICE, "--dtype", DTYPE], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PDFLASH_TERMINATION_LOG": str(reason)})
    assert r.returncode == 1
    assert not any(n in r.stderr for n in NOISE), r.stderr
    errors = [line for line in r.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1 and '"event": "cannot serve"' in errors[0], r.stderr
    assert reason.read_text().startswith(f"cannot load the checkpoint in {model}: SafetensorError: ")


@pytest.mark.slow
def test_up_start_up_failure_is_one_line(tiny, tmp_path):
    """The drafter cannot load the checkpoint's tokenizer: `pdflash up` ends with one line naming the service, why
    and where its log is (here the terminal: no --log-dir), and nobody prints a traceback."""
    model = broken_copy(tiny.target("qwen3_moe"), tmp_path / "broken", "tokenizer")
    up = Up(tmp_path, "--model", str(model), "--no-dflash")
    assert up.proc.wait(300) == 1
    err = up.stderr()
    last = err.splitlines()[-1]
    assert re.fullmatch(r"pdflash up: could not start: drafter \(pid \d+\) exited with code 1 during start-up: .+; "
                        r"its log: the terminal, above", last), last
    assert not any(n in err for n in NOISE), err[-6000:]


# -- supervision ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_up_restarts_a_killed_service_and_stops_after_repeated_crashes(tiny, tmp_path):
    logs = tmp_path / "logs"
    up = Up(tmp_path, "--model", str(tiny.target("qwen3_moe")), "--log-dir", str(logs),
            "--max-crashes", "2", "--crash-window", "600")
    try:
        pids = up.pids()
        before = generate(up.target)

        os.kill(pids["verifier"], signal.SIGKILL)
        up.wait_for(rf"^pdflash up: verifier \(pid {pids['verifier']}\) was killed by SIGKILL; its log: "
                    rf"{re.escape(str(logs / 'verifier.log'))}; restarting it in 0.5 s \(crash 1 in 600 s; 2 stop the stack\)$")
        restarted = int(up.wait_for(r"^pdflash up: verifier restarted \(pid (\d+)\)$").group(1))
        assert restarted != pids["verifier"] and alive(restarted)
        up.wait_for(r"^pdflash up: verifier is serving again$")
        assert generate(up.target, deadline_s=60) == before, "requests after the restart succeed, with the same output"
        assert all(alive(pids[n]) for n in ("scheduler", "drafter")), "the others keep running"

        os.kill(restarted, signal.SIGKILL)  # the second crash within the window: the stack stops
        up.wait_for(rf"verifier \(pid {restarted}\) was killed by SIGKILL; its log: .*; it crashed 2 times in 600 s: "
                    r"stopping the stack$")
        assert up.proc.wait(120) == 1
    finally:
        up.stop()
    for pid in (pids["scheduler"], pids["drafter"], restarted):
        assert not alive(pid), "stopping the stack stops every service"
    assert "Traceback" not in up.stderr()


def _processes_with(arg: str) -> list[int]:
    """Pids of service processes (`pdflash serve-*`) whose command line has `arg` (a port of this test's stack)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if arg.encode() in argv and any(a.startswith(b"serve-") for a in argv):
                out.append(int(d))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_ctrl_c_during_start_up_stops_every_service(tiny, tmp_path):
    """The services run in sessions of their own (a terminal's Ctrl-C reaches `pdflash up` only): SIGINT to
    `pdflash up` while it starts (or just after) stops them all."""
    up = Up(tmp_path, "--model", str(tiny.target("qwen3_moe")), "--log-dir", str(tmp_path / "logs"))
    deadline = time.monotonic() + 120
    while not _processes_with(str(up.verifier_port)) and time.monotonic() < deadline:  # the verifier is starting
        time.sleep(0.05)
    assert _processes_with(str(up.verifier_port)), up.stderr()
    up.proc.send_signal(signal.SIGINT)
    rc = up.proc.wait(120)
    last = up.stderr().splitlines()[-1]
    assert (rc, last) in ((130, "pdflash up: could not start: start-up interrupted: asked to stop"), (0, "pdflash up: stopping"))
    assert not _processes_with(str(up.verifier_port)) and not _processes_with(str(up.scheduler_port))


def test_restart_policy_backs_off_and_gives_up_on_repeated_crashes():
    import collections

    from pdflash.stack import RestartPolicy

    p = RestartPolicy()  # `pdflash up`'s defaults: 5 crashes in 60 s stop the stack
    assert [p.delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    crashes: collections.deque[float] = collections.deque()
    assert [p.record(crashes, t) for t in (0, 10, 20, 30)] == [1, 2, 3, 4]
    assert not p.gives_up(4)
    assert p.record(crashes, 71) == 3, "crashes older than the window are forgotten (0 and 10 here)"
    assert p.record(crashes, 72) == 4 and p.record(crashes, 73) == 5 and p.gives_up(5)


# -- the demo's terminal -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_keeps_service_logs_out_of_the_completion(tiny, tmp_path):
    from transformers import AutoTokenizer

    model = tiny.target("qwen3_moe")
    demo = Up(tmp_path, "--model", str(model), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), command="demo")
    assert demo.proc.wait(300) == 0, demo.stderr()
    want = AutoTokenizer.from_pretrained(str(model)).decode(list(greedy_reference(str(model), PROMPT, MAX_TOKENS, device=DEVICE)),
                                                            skip_special_tokens=True)
    assert demo.stdout() == PROMPT + want + "\n", "stdout: the prompt and the streamed completion, nothing else"
    err = demo.stderr().splitlines()
    logs = re.fullmatch(r"pdflash demo: service logs: (.+)", err[0])
    assert logs, err
    rest = [line for line in err[1:] if not line.startswith("pdflash demo: serving n-gram drafting")]
    assert rest[0].startswith("model ") and rest[1] == ">>> " + PROMPT.splitlines()[0]
    assert rest[2:4] == ["... " + line for line in PROMPT.splitlines()[1:3]], "the prompt's other lines as a REPL shows them"
    assert re.match(r"--- \d+ tokens in ", rest[-1]), err
    assert not any(line.lstrip().startswith("{") for line in err), "no service log line on the terminal"
    log_dir = tmp_path / logs.group(1) if not os.path.isabs(logs.group(1)) else logs.group(1)
    for name in ("scheduler", "verifier", "drafter"):
        text = open(os.path.join(log_dir, f"{name}.log")).read()
        assert '"event": "effective configuration"' in text, name


# -- ports taken, and stopping with requests in flight ------------------------------------------------------------


def listening(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:port (0: a free one), as another server would hold it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_stack_refuses_a_port_in_use_before_any_service_starts():
    """Another stack (or anything) on one of the ports: one line naming the service and the port, and nothing
    started, instead of a stack whose readiness probe the other server answers while its own service crash-loops."""
    with listening() as held:
        busy = held.getsockname()[1]
        assert port_in_use("127.0.0.1", busy) and port_in_use("0.0.0.0", busy)
        drafter, scheduler, verifier = free_ports(3)
        assert not port_in_use("127.0.0.1", drafter)
        stack = Stack(StackSpec(drafter_port=drafter, scheduler_port=busy, verifier_port=verifier))
        assert stack.busy_ports() == [f"scheduler 127.0.0.1:{busy}"]
        with pytest.raises(StartupError, match=re.escape(f"port in use: scheduler 127.0.0.1:{busy} (another pdflash stack?")) as e:
            stack.start()
        assert e.value.service == "scheduler" and stack.procs == {}
    assert not port_in_use("localhost-does-not-resolve.invalid", 1), "a host that does not resolve: the service says why"


class _Exited:
    """A service process that has exited (what Supervisor sees of a crashed one)."""

    pid, returncode = 4242, 1

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


def test_the_supervisor_does_not_restart_onto_a_port_another_process_took(monkeypatch):
    """A crashed service whose port something else took meanwhile: said as such and retried with the crash back-off,
    then the stack stops; never "serving again" on the other server's health answers."""
    from pdflash.stack import RestartPolicy, Supervisor

    with listening() as held:
        busy = held.getsockname()[1]
        drafter, verifier = free_ports(2)
        stack = Stack(StackSpec(drafter_port=drafter, scheduler_port=busy, verifier_port=verifier))
        stack.procs = {"scheduler": _Exited()}
        started = []
        monkeypatch.setattr(stack, "start_one", lambda name: started.append(name))
        now = [0.0]
        said = []
        sup = Supervisor(stack, RestartPolicy(max_crashes=3, window_s=60), say=said.append, clock=lambda: now[0])
        reason = None
        for _ in range(40):
            reason = sup.step()
            if reason:
                break
            now[0] += 0.5
        stack.stop()
    assert started == [] and not any("serving again" in line for line in said), said
    assert said[0].startswith("scheduler (pid 4242) exited with code 1; its log: the terminal, above; restarting it in 0.5 s"), said
    assert said[1] == f"scheduler cannot restart: 127.0.0.1:{busy} is held by another process; trying again in 1 s", said
    assert reason == f"scheduler cannot restart: 127.0.0.1:{busy} is held by another process (3 failed starts in 60 s): " \
                     "stopping the stack", reason


def test_up_on_a_port_in_use_is_one_line_and_starts_nothing(tmp_path):
    with listening() as held:
        busy = held.getsockname()[1]
        scheduler, verifier = free_ports(2)
        r = subprocess.run([sys.executable, "-m", "pdflash.cli", "up", "--port", str(busy), "--scheduler-port", str(scheduler),
                            "--verifier-port", str(verifier), *PLACEMENT], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == (f"pdflash up: could not start: port in use: drafter 127.0.0.1:{busy} (another pdflash "
                                         "stack? stop it, or pick others with --port, --scheduler-port, --verifier-port)")
    assert "serving" not in r.stderr and not any(n in r.stderr for n in NOISE), r.stderr


@pytest.mark.slow
def test_demo_runs_on_free_ports_when_another_stack_holds_the_defaults(tiny, tmp_path):
    """`pdflash demo` is self-contained: with a default port taken it answers from its own stack on free ports (it
    used to print the other stack's answer, its own services having failed to bind)."""
    try:
        held = listening(50053)
    except OSError:  # something holds it already: the case under test as it is
        held = None
    try:
        r = subprocess.run([sys.executable, "-m", "pdflash.cli", "demo", "--model", str(tiny.target("qwen3_moe")),
                            "--max-tokens", "8", *PLACEMENT], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env={**os.environ, "TMPDIR": str(tmp_path)})
    finally:
        if held is not None:
            held.close()
    assert r.returncode == 0, r.stderr[-4000:]
    note = [line for line in r.stderr.splitlines() if "port in use" in line]
    assert len(note) == 1 and re.search(r"the demo runs on free ports \d+, \d+, \d+, without metrics", note[0]), r.stderr
    assert "model tiny-qwen3_moe (qwen3_moe)" in r.stderr or "(qwen3_moe)" in r.stderr, r.stderr
    assert re.search(r"--- 8 tokens in ", r.stderr), r.stderr


@pytest.mark.slow
def test_stopping_the_stack_lets_a_request_in_flight_finish(tiny, tmp_path):
    """Ctrl-C / SIGTERM to `pdflash up` (Stack.stop) stops the drafter first, which finishes what is in flight within
    its --grace-s while the scheduler and the verifier still serve; they stop after it. (All three used to stop at
    once, so a request in flight failed on its next admission: UNAVAILABLE, "retry shortly".)"""
    stack = start_stack(tiny.target("qwen3_moe"), None, tmp_path, drafter_args=["--grace-s", "60"])
    stopper = threading.Thread(target=stack.stop, kwargs={"grace": 60})
    try:
        with Client(stack.drafter) as c:
            stream = c.stream(Client.request(PROMPT, max_tokens=300, ignore_eos=True, drafter="none"), timeout=120)
            first = next(stream)
            assert first.HasField("chunk")
            stopper.start()
            deadline = time.monotonic() + 10
            while stack.procs["drafter"].poll() is None and not any(
                    "shutting down" in line for line in (tmp_path / "drafter.log").read_text().splitlines()):
                assert time.monotonic() < deadline, "the drafter was not asked to stop"
                time.sleep(0.05)
            rest = list(stream)
    finally:
        if stopper.is_alive():
            stopper.join(90)
        stack.stop()
    final = rest[-1].final
    assert final.usage.completion_tokens == 300, "the request in flight when the stop began finished whole"
    assert all(p.poll() is not None for p in stack.procs.values())
