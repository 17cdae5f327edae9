"""Run the whole stack (scheduler, verifier, drafter) as three real processes on loopback ports."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdflash.server import CHANNEL_OPTIONS
from pdflash.v1 import drafter_pb2, scheduler_pb2, verifier_pb2


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open while picking: separate picks can repeat a port)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(host: str, port: int) -> bool:
    """True when a listening socket already holds host:port, as the service's own bind would find (SO_REUSEADDR as
    gRPC sets it, so a port a stopped stack left in TIME_WAIT counts as free). A host that does not resolve, or a
    bind refused for another reason, is left for the service itself to report."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return False
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


# The gRPC service each process serves: readiness asks for it by name, so another server that happens to
# answer on the port (a stale process, a port picked twice) is never taken for this one.
SERVICE_NAMES = {
    "drafter": drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
    "scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    "verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
}


def check_health(target: str, service: str = "", timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True when target answers SERVING for service ("" = the whole server). credentials: TLS, None = plaintext."""
    return health_status(target, service, timeout, credentials)[0] == "SERVING"


def health_status(target: str, service: str = "", timeout: float = 2.0,
                  credentials: grpc.ChannelCredentials | None = None) -> tuple[str, str]:
    """(status, why): SERVING / NOT_SERVING / ... as the server answers, or UNREACHABLE or UNKNOWN_SERVICE with a
    line saying why (nothing listening, TLS refused, a service name the server does not know)."""
    try:
        with (grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS) if credentials is not None
              else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), ""
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return "UNKNOWN_SERVICE", f"{target} does not serve {service!r} (its services: pdflash.v1.Drafter, " \
                                      "pdflash.v1.Scheduler or pdflash.v1.Verifier, or '' for the whole server)"
        return "UNREACHABLE", f"{target}: {e.code().name}: {e.details()}"


@dataclasses.dataclass
class StackSpec:
    model: str = ""
    drafter: str = ""
    no_dflash: bool = False
    drafter_host: str = "127.0.0.1"
    drafter_port: int = 50051
    scheduler_port: int = 50052
    verifier_port: int = 50053
    metrics_ports: tuple[int, int, int] = (9101, 9102, 9103)  # drafter, scheduler, verifier; -1 = off
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    scheduler_args: list[str] = dataclasses.field(default_factory=list)
    verifier_args: list[str] = dataclasses.field(default_factory=list)
    drafter_args: list[str] = dataclasses.field(default_factory=list)
    log_dir: str | None = None
    # TLS on every hop (PEM paths): the three servers serve tls_cert/tls_key; tls_ca (required with
    # them) is the CA that signed them, which every client checks. tls_mutual: the servers also require
    # client certificates signed by tls_ca; the drafter's upstream calls and the stack's health probes
    # present tls_client_cert/key (default: tls_cert/key, which then needs clientAuth usage too).
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_mutual: bool = True
    tls_client_cert: str = ""
    tls_client_key: str = ""
    # Secrets travel in the environment, not on command lines (where `ps` shows them).
    auth_token: str = ""  # the drafter's bearer token
    ticket_secret: str = ""  # shared by the scheduler (signs) and the verifier (checks)
    # On a host of 2+ cores the drafter and the scheduler share one core (the last one this process may
    # use) and leave the others to the verifier, whose verify forwards use every core but one (--colocated).
    pin: bool = True

    @property
    def client_cert(self) -> str:
        return (self.tls_client_cert or self.tls_cert) if self.tls_mutual else ""

    @property
    def client_key(self) -> str:
        return (self.tls_client_key or self.tls_key) if self.tls_mutual else ""

    def credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of this stack's services presents (None = plaintext)."""
        from pdflash.tls import channel_credentials

        if not self.tls_cert:
            return None
        return channel_credentials(self.tls_ca, self.client_cert, self.client_key)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StartupError(RuntimeError):
    """A service exited, or never became SERVING, while the stack started. `str()` is one line."""

    def __init__(self, service: str, line: str):
        super().__init__(line)
        self.service = service


class Stack:
    """Starts the three services; `wait_ready()` blocks until the drafter is SERVING."""

    def __init__(self, spec: StackSpec):
        self.spec = spec
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        # Each service leaves the reason it failed in <_state>/<name>.reason ($PDFLASH_TERMINATION_LOG).
        self._state: str | None = None

    def log_path(self, name: str) -> str | None:
        """The file a service logs to (None: it logs to this process's terminal)."""
        return os.path.join(self.spec.log_dir, f"{name}.log") if self.spec.log_dir else None

    def _reason_file(self, name: str) -> str:
        if self._state is None:
            self._state = tempfile.mkdtemp(prefix="pdflash-stack-")
        return os.path.join(self._state, f"{name}.reason")

    def failure(self, name: str, when: str = "") -> str:
        """One line on a service that exited: which, how (and `when`), why (its own last words), where its log is."""
        p = self.procs[name]
        rc = p.returncode if p.returncode is not None else p.poll()
        how = f"was killed by {_signal_name(-rc)}" if rc is not None and rc < 0 else f"exited with code {rc}"
        try:
            with open(self._reason_file(name), encoding="utf-8") as f:
                why = " ".join(f.read().split())
        except OSError:
            why = ""
        where = self.log_path(name) or "the terminal, above"
        return f"{name} (pid {p.pid}) {how}{' ' + when if when else ''}" + (f": {why}" if why else "") + f"; its log: {where}"

    @property
    def drafter(self) -> str:
        return f"127.0.0.1:{self.spec.drafter_port}"

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.spec.scheduler_port}"

    @property
    def verifier(self) -> str:
        return f"127.0.0.1:{self.spec.verifier_port}"

    def _tls_args(self, name: str) -> list[str]:
        s = self.spec
        if not s.tls_cert:
            return []
        if not (s.tls_key and s.tls_ca):
            raise ValueError("StackSpec: tls_cert needs tls_key and tls_ca (the CA that signed the services' certificates)")
        args = ["--tls-cert", s.tls_cert, "--tls-key", s.tls_key] + (["--tls-ca", s.tls_ca] if s.tls_mutual else [])
        if name in ("drafter", "scheduler"):  # the drafter calls the other two; the scheduler the verifier (hints)
            args += ["--upstream-tls-ca", s.tls_ca]
            if s.client_cert:
                args += ["--upstream-tls-cert", s.client_cert, "--upstream-tls-key", s.client_key]
        return args

    def _env(self, name: str) -> dict[str, str]:
        env = {**os.environ, **self.spec.extra_env}
        if self.spec.auth_token and name == "drafter":
            env["PDFLASH_AUTH_TOKEN"] = self.spec.auth_token
        if self.spec.ticket_secret and name in ("scheduler", "verifier"):
            env["PDFLASH_TICKET_SECRET"] = self.spec.ticket_secret
        return env

    def _pin_args(self) -> list[str]:
        """--cpus for the drafter and the scheduler: the last usable core (none on a 1-core host)."""
        from pdflash.torch_thread import usable_cores

        if not self.spec.pin or usable_cores() < 2:
            return []
        try:
            core = max(os.sched_getaffinity(0))
        except AttributeError:  # not Linux: no affinity to set
            return []
        return ["--cpus", str(core)]

    def _cmd(self, name: str) -> list[str]:
        s = self.spec
        base = [sys.executable, "-m", "pdflash.cli"]
        if name == "scheduler":
            return base + ["serve-scheduler", "--port", str(s.scheduler_port), "--metrics-port", str(s.metrics_ports[1]),
                           "--verifier", self.verifier,  # prefetch hints for admitted demands
                           *self._tls_args(name), *self._pin_args(), *s.scheduler_args]
        if name == "verifier":
            cmd = base + ["serve-verifier", "--port", str(s.verifier_port), "--metrics-port", str(s.metrics_ports[2]),
                          *self._tls_args(name)]
            if s.model:
                cmd += ["--model", s.model]
            cmd += ["--colocated"]  # the three share this machine (VerifierConfig.thread_counts)
            if s.no_dflash or s.drafter:  # the drafter's feature layers, which the verifier's warm-up cannot know
                from drafter_svc.compat import target_layers

                layers = () if s.no_dflash else target_layers(s.drafter)
                cmd += ["--warmup-feature-layers", ",".join(map(str, layers)) or "none"]
            return cmd + s.verifier_args
        cmd = base + [
            "serve-drafter", "--host", s.drafter_host, "--port", str(s.drafter_port),
            "--scheduler", self.scheduler, "--verifier", self.verifier, "--metrics-port", str(s.metrics_ports[0]),
            *self._tls_args(name), *self._pin_args(),
        ]
        if s.model:
            cmd += ["--model", s.model]
        if s.drafter:
            cmd += ["--drafter", s.drafter]
        if s.no_dflash:
            cmd += ["--no-dflash"]
        return cmd + s.drafter_args

    def start_one(self, name: str) -> subprocess.Popen:
        """Start (or restart, after it died or was killed) one of the three services.

        Each runs in its own session: a Ctrl-C at the terminal reaches the process that started the stack,
        which stops the services itself (SIGTERM, then `stop`'s grace), instead of racing them to it."""
        env = self._env(name)
        reason = self._reason_file(name)
        if os.path.exists(reason):
            os.remove(reason)
        env["PDFLASH_TERMINATION_LOG"] = reason
        out = None
        if self.spec.log_dir:
            os.makedirs(self.spec.log_dir, exist_ok=True)
            out = open(self.log_path(name), "ab")
            self._logs.append(out)
        p = subprocess.Popen(self._cmd(name), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = p
        return p

    def ports(self) -> dict[str, tuple[str, int]]:
        """Where each service listens: (host, port)."""
        s = self.spec
        return {"drafter": (s.drafter_host, s.drafter_port), "scheduler": ("127.0.0.1", s.scheduler_port),
                "verifier": ("127.0.0.1", s.verifier_port)}

    def busy_ports(self) -> list[str]:
        """The services whose port something already listens on (another stack, say), as 'name host:port'."""
        return [f"{name} {host}:{port}" for name, (host, port) in self.ports().items() if port and port_in_use(host, port)]

    def start(self) -> "Stack":
        """Start the three services. StartupError, before any starts, when one's port is already taken: otherwise the
        readiness probe could be answered by whatever holds it (another stack) while this one's service fails to bind."""
        busy = self.busy_ports()
        if busy:
            raise StartupError(busy[0].split()[0], f"port in use: {', '.join(busy)} (another pdflash stack? stop it, or "
                                                   "pick others with --port, --scheduler-port, --verifier-port)")
        for name in ("scheduler", "verifier", "drafter"):
            self.start_one(name)
        return self

    def wait_ready(self, timeout: float = 180.0, name: str = "drafter", abort: Callable[[], bool] | None = None) -> None:
        """Block until `name` is SERVING. StartupError (one line) when a service exits first, the timeout passes
        or abort() turns true (a signal asked to stop)."""
        target = {"drafter": self.drafter, "scheduler": self.scheduler, "verifier": self.verifier}[name]
        creds = self.spec.credentials()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if abort is not None and abort():
                raise StartupError(name, "start-up interrupted: asked to stop")
            for n, p in self.procs.items():
                if p.poll() is not None:
                    raise StartupError(n, self.failure(n, "during start-up"))
            if check_health(target, SERVICE_NAMES[name], timeout=1.0, credentials=creds):
                return
            time.sleep(0.2)
        where = self.log_path(name) or "the terminal, above"
        raise StartupError(name, f"{name} not SERVING after {timeout:.0f}s (--startup-timeout); its log: {where}")

    def stop(self, grace: float = 10.0) -> None:
        """Stop the services front to back: the drafter first (it stops taking requests and lets those in flight
        finish within its --grace-s, while the scheduler and the verifier they need still serve), then the other two.
        Each stage waits at most `grace` seconds before killing what is left."""
        for stage in (("drafter",), ("scheduler", "verifier")):
            procs = [p for n, p in self.procs.items() if n in stage]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._state is not None:
            shutil.rmtree(self._state, ignore_errors=True)
            self._state = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How `pdflash up` keeps a stack running, as compose's `restart: unless-stopped` does: a service that
    exits is started again after a delay that doubles with each crash in the window (capped); `max_crashes`
    crashes of one service within `window_s` seconds stop the stack instead."""

    max_crashes: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def delay(self, crashes_in_window: int) -> float:
        """Seconds to wait before restarting after the n-th crash within the window (n >= 1)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, crashes_in_window - 1))

    def gives_up(self, crashes_in_window: int) -> bool:
        return crashes_in_window >= self.max_crashes

    def record(self, crashes: collections.deque[float], now: float) -> int:
        """Add a crash at `now` to one service's crash times; forget those older than the window; the count left."""
        crashes.append(now)
        while crashes and crashes[0] <= now - self.window_s:
            crashes.popleft()
        return len(crashes)


class Supervisor:
    """Restarts the services of a started stack that exit unexpectedly (see RestartPolicy).

    `step()` is one look at the processes: it starts services whose delay has passed, notes services that
    exited and says which restarted ones are SERVING again; it returns a one-line reason when the stack
    must stop (a service crashed too often). Every event is reported through `say` as one line.
    """

    def __init__(self, stack: Stack, policy: RestartPolicy = RestartPolicy(), say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.stack = stack
        self.policy = policy
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock
        self.crashes: dict[str, collections.deque[float]] = {n: collections.deque() for n in stack.procs}
        self.pending: dict[str, float] = {}  # service -> when to start it again
        self.recovering: set[str] = set()  # started again, not yet SERVING

    def step(self) -> str | None:
        now = self.clock()
        for name, proc in list(self.stack.procs.items()):
            if name in self.pending:
                if now >= self.pending[name]:
                    del self.pending[name]
                    host, port = self.stack.ports()[name]
                    if port and port_in_use(host, port):  # another process took it: its health answers are not ours
                        held = f"{name} cannot restart: {host}:{port} is held by another process"
                        n, window, delay = self._count_failure(name, now)
                        if delay is None:
                            return f"{held} ({n} failed starts in {window}): stopping the stack"
                        self.say(f"{held}; trying again in {delay:g} s")
                        continue
                    p = self.stack.start_one(name)
                    self.recovering.add(name)
                    self.say(f"{name} restarted (pid {p.pid})")
                continue
            if proc.poll() is None:
                continue
            self.recovering.discard(name)
            n, window, delay = self._count_failure(name, now)
            if delay is None:
                return f"{self.stack.failure(name)}; it crashed {n} times in {window}: stopping the stack"
            self.say(f"{self.stack.failure(name)}; restarting it in {delay:g} s "
                     f"(crash {n} in {window}; {self.policy.max_crashes} stop the stack)")
        creds = self.stack.spec.credentials()
        for name in sorted(self.recovering):
            if check_health(getattr(self.stack, name), SERVICE_NAMES[name], timeout=0.5, credentials=creds):
                self.recovering.discard(name)
                self.say(f"{name} is serving again")
        return None

    def _count_failure(self, name: str, now: float) -> tuple[int, str, float | None]:
        """A service that failed to run (it exited, or cannot start again), counted against the restart policy:
        (failures in the window, the window as said, the delay before its next start; None: the policy gives up)."""
        n = self.policy.record(self.crashes.setdefault(name, collections.deque()), now)
        window = f"{self.policy.window_s:g} s"
        if self.policy.gives_up(n):
            return n, window, None
        delay = self.policy.delay(n)
        self.pending[name] = now + delay
        return n, window, delay

    def run(self, should_stop: Callable[[], bool], interval_s: float = 0.25) -> str | None:
        """step() until should_stop() (None) or a service crashed too often (its reason)."""
        while not should_stop():
            reason = self.step()
            if reason is not None:
                return reason
            time.sleep(interval_s)
        return None
