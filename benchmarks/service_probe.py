"""What a load run's services did, level by level: the verifier's forwards (how many verifies shared each: verify
waves) from its /metrics, and where each service process spent its CPU (py-spy, sampling, when it is installed).

Used by benchmarks/load.py (`--profile-services`). Why: on the H100 (stop 49) 8 concurrent clients through gRPC got
836 tok/s with verify waves off and 876 with them on, against 2.03x in process (benchmarks/waves.py): whether waves
formed, and which process bounds the rounds, was not visible.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import urllib.request

# verifier metrics (pdflash/metrics.py) a level's deltas are taken of
_COUNTERS = ("pdflash_verify_wave_sessions_count", "pdflash_verify_wave_sessions_sum",
             "pdflash_verify_latency_seconds_count", "pdflash_verify_latency_seconds_sum")


def scrape(port: int, timeout: float = 5.0) -> dict[str, float]:
    """The verifier's counters above, from its Prometheus endpoint on 127.0.0.1:port (0.0 where absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    got = dict.fromkeys(_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in got and not s.labels:
                got[s.name] = float(s.value)
    return got


def forwards(before: dict[str, float], after: dict[str, float]) -> dict:
    """A level's verifies and the forwards that ran them. With waves on every verify goes through a wave (a lone one is
    a wave of one), so the waves are the forwards; with them off each verify is one."""
    d = {k: after[k] - before[k] for k in _COUNTERS}
    verifies = int(d["pdflash_verify_latency_seconds_count"])
    waves = int(d["pdflash_verify_wave_sessions_count"])
    fwd = waves if waves else verifies
    return dict(verifies=verifies, forwards=fwd, verifies_per_forward=round(verifies / fwd, 2) if fwd else None,
                verify_server_ms_mean=round(1e3 * d["pdflash_verify_latency_seconds_sum"] / verifies, 2) if verifies else None)


@dataclasses.dataclass
class Profiler:
    """py-spy recording each named process (pid) until `stop`; raw (collapsed) stacks, 200 samples a second."""

    pids: dict[str, int]
    out_dir: pathlib.Path
    rate: int = 200
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)
    _errs: list = dataclasses.field(default_factory=list)

    @staticmethod
    def unavailable() -> str:
        """'' when py-spy can be run, else why not."""
        return "" if shutil.which("py-spy") else "py-spy is not on PATH (pip install py-spy)"

    def start(self, tag: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            path = self.out_dir / f"{tag}_{name}.txt"
            self._errs.append(open(self.out_dir / f"{tag}_{name}.err", "w"))
            self.procs[name] = subprocess.Popen(
                ["py-spy", "record", "-p", str(pid), "-r", str(self.rate), "-f", "raw", "-o", str(path), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=self._errs[-1])

    def stop(self, tag: str, top: int = 12) -> dict[str, dict]:
        """Ends the recordings (py-spy writes its file on SIGINT) -> per process: samples, CPU seconds and the functions
        with the most samples, on-CPU ("self") and with their callees ("inclusive", frames in nearly every sample left
        out: the event loop, the module's main)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        out = {}
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self._errs:
            f.close()
        self._errs = []
        for name in self.procs:
            path = self.out_dir / f"{tag}_{name}.txt"
            if not path.exists() or not path.stat().st_size:
                err = (self.out_dir / f"{tag}_{name}.err").read_text()[-300:]
                out[name] = {"error": err.strip() or "no samples (the process idled through the level, or py-spy could not attach)"}
                continue
            out[name] = summarize(path.read_text(), self.rate, top)
        self.procs = {}
        return out


def summarize(raw: str, rate: int, top: int = 12) -> dict:
    """py-spy's raw output ('frame;frame;... count' lines, frames 'function (file:line)') -> the summary `stop` gives."""
    total, own, incl = 0, collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count, frames = int(n), [f.split(" (")[0] for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    if not total:
        return {"samples": 0, "cpu_s": 0.0, "self": [], "inclusive": []}
    share = lambda c: [(f, round(v / total, 3)) for f, v in c]  # noqa: E731
    return {"samples": total, "cpu_s": round(total / rate, 2), "self": share(own.most_common(top)),
            "inclusive": share([(f, v) for f, v in incl.most_common() if v < 0.95 * total][:top])}


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, every thread) a process has used so far, from /proc (None where there is none)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15 of stat)


def cpu_per_verify(before: dict[str, float | None], after: dict[str, float | None], verifies: int) -> dict[str, dict]:
    """Each service's CPU seconds over a level and CPU ms per verify (a round of one session): which process a round
    costs most host time in (the one that bounds the rounds a second once the forwards are cheap)."""
    out = {}
    for name, t0 in before.items():
        t1 = after.get(name)
        if t0 is None or t1 is None:
            continue
        out[name] = {"cpu_s": round(t1 - t0, 3), "cpu_ms_per_verify": round(1e3 * (t1 - t0) / verifies, 3) if verifies else None}
    return out


def pids_of(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """A started pdflash.stack.Stack's service processes (name -> pid), the live ones."""
    return {name: p.pid for name, p in procs.items() if p.poll() is None and os.path.exists(f"/proc/{p.pid}")}
