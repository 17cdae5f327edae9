"""Run the whole stack (scheduler, verifier, drafter) as three real processes on loopback ports."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

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


# The gRPC service each process serves: readiness asks for it by name, so another server that happens to
# answer on the port (a stale process, a port picked twice) is never taken for this one.
SERVICE_NAMES = {
    "drafter": drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
    "scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    "verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
}


def check_health(target: str, service: str = "", timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True when target answers SERVING for service ("" = the whole server). credentials: TLS, None = plaintext."""
    try:
        with (grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS) if credentials is not None
              else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


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


class Stack:
    """Starts the three services; `wait_ready()` blocks until the drafter is SERVING."""

    def __init__(self, spec: StackSpec):
        self.spec = spec
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

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
        if name == "drafter":
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
                           *self._tls_args(name), *self._pin_args(), *s.scheduler_args]
        if name == "verifier":
            cmd = base + ["serve-verifier", "--port", str(s.verifier_port), "--metrics-port", str(s.metrics_ports[2]),
                          *self._tls_args(name)]
            if s.model:
                cmd += ["--model", s.model]
            cmd += ["--colocated"]  # the three share this machine (VerifierConfig.thread_counts)
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
        """Start (or restart, after it died or was killed) one of the three services."""
        env = self._env(name)
        out = None
        if self.spec.log_dir:
            os.makedirs(self.spec.log_dir, exist_ok=True)
            out = open(os.path.join(self.spec.log_dir, f"{name}.log"), "ab")
            self._logs.append(out)
        p = subprocess.Popen(self._cmd(name), env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        self.procs[name] = p
        return p

    def start(self) -> "Stack":
        for name in ("scheduler", "verifier", "drafter"):
            self.start_one(name)
        return self

    def wait_ready(self, timeout: float = 180.0, name: str = "drafter") -> None:
        target = {"drafter": self.drafter, "scheduler": self.scheduler, "verifier": self.verifier}[name]
        creds = self.spec.credentials()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited with code {p.returncode} during start-up" +
                                       (f"; see {self.spec.log_dir}/{n}.log" if self.spec.log_dir else ""))
            if check_health(target, SERVICE_NAMES[name], timeout=1.0, credentials=creds):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{name} not SERVING after {timeout:.0f}s")

    def stop(self, grace: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
