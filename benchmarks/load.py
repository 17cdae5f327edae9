"""Load: many concurrent streaming clients against one stack, on loopback, bounded in time and count.

Checks what must hold under load, then reports how fast it was:
  - zero errors, and every output equal to its greedy reference (`greedy_reference`: transformers `generate` on the
    CPU; on CUDA the verifier's own block-1 decoding in process, paged KV as served);
  - afterwards no verifier session and no scheduler budget still held (no leaks);
  - time to first token and inter-token latency (p50 / p99) and output tokens/s over the whole run.
Inter-token latency is per token: a chunk of n tokens that arrives g seconds after the previous one
counts n gaps of g/n (a verify round's tokens share its latency, as in the drafter's metrics).

    python benchmarks/load.py [--clients 1,8,32 --requests 4 --max-tokens 48 --drafters ngram,none,hybrid]
    python benchmarks/load.py --model DIR [--drafter DIR]          # another checkpoint
    python benchmarks/load.py --target HOST:PORT --scheduler HOST:PORT --verifier HOST:PORT --model DIR
    python benchmarks/load.py --verifier-args "--max-wave-sessions 1"   # verify waves off (on CUDA they are on by default)
    python benchmarks/load.py --profile-services   # + where each service spent its CPU, per level (py-spy)

Each concurrency level in --clients runs in turn against the same stack. Without --target a stack is
started on free loopback ports (the default model: the embedded demo pair, else a tiny random
checkpoint). A started stack's verifier serves /metrics on a free port: each level reports its verifies and the
forwards that ran them (verifies per forward > 1: verify waves formed; `benchmarks/service_probe.py`) and each
service process's CPU ms per verify (from /proc); with
`--profile-services` py-spy samples every service process during each level (their top functions in the JSON, the raw
stacks beside it). Prints a table; writes benchmarks/results/load.json. Exit code 1 when any request failed,
any output differed from its reference, or something leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import pathlib
import platform
import shlex
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from pdflash.client import Client  # noqa: E402  (builds the requests)
from pdflash.server import CHANNEL_OPTIONS  # noqa: E402
from pdflash.v1 import drafter_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self.",
    "for i in range(10):\n    print(",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Node:\n    def __init__(self, value, children=None):\n",
    "with open(path) as f:\n    for line in f:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while",
]


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    drafter: str


@dataclasses.dataclass
class Record:
    job: Job
    token_ids: list[int] = dataclasses.field(default_factory=list)
    start: float = 0.0
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (arrival, tokens)
    end: float = 0.0
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    def inter_token_s(self) -> list[float]:
        out = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
            out += [(t1 - t0) / n] * n if n else []
        return out


@functools.lru_cache(maxsize=None)
def _hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


@functools.lru_cache(maxsize=None)
def greedy_reference(model_dir: str, prompt: str | tuple[int, ...], max_tokens: int, device: str = "auto") -> tuple[int, ...]:
    """What a stack serving on `device` must reproduce exactly:
    - "cpu": transformers' own greedy decoding of the checkpoint in float32 on the CPU (the stack serves float32 there);
    - "cuda" / "cuda:N": the verifier's own block-1 decoding on that GPU, in process, in bfloat16 with the
      batch-invariant kernels (what the stack serves there; greedy output on the GPU is defined up to the kernels'
      rounding, and the promise is that every drafter and width gives block 1's tokens);
    - "auto": as the services' `--device auto` picks, cuda when torch sees one, else cpu (this benchmark's stack)."""
    import torch

    from pdflash.devices import resolve_device

    device = resolve_device(device)
    if device.startswith("cuda"):
        return _verifier_block1(str(model_dir), prompt, max_tokens, device)
    if device != "cpu":
        raise ValueError(f"greedy_reference: device {device!r}: choose cpu, cuda, cuda:N or auto")
    tok, model = _hf(str(model_dir))
    ids = tok(prompt, return_tensors="pt").input_ids if isinstance(prompt, str) else torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


@functools.lru_cache(maxsize=None)
def _cuda_core(model_dir: str, device: str = "cuda"):
    from transformers import AutoTokenizer

    from verifier_svc.engine import PagedKVOptions, VerifierCore
    from verifier_svc.model import load_target

    # as the stack serves it: the paged KV forward (transformers' DynamicCache path is a different attention, whose
    # bits differ: stop 49's first GPU run compared against it and counted every request a mismatch). No graphs: a
    # replay gives the eager forward's bits (tests/test_gpu_verifier.py), and the capture would only cost time here
    target = load_target(model_dir, device, "bfloat16", kernels="auto")
    return AutoTokenizer.from_pretrained(model_dir), VerifierCore(target, paged_kv=PagedKVOptions(kv_cache_gb=1.0, graphs=False))


def _verifier_block1(model_dir: str, prompt, max_tokens: int, device: str = "cuda") -> tuple[int, ...]:
    from pdflash.types import DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PrefillInput

    tok, core = _cuda_core(model_dir, device)
    ids = tok(prompt).input_ids if isinstance(prompt, str) else list(prompt)
    step = core.prefill(PrefillInput("reference", tuple(ids), SamplingParams(), max_tokens))
    out, rnd = list(step.tokens), 0
    while step.finished is None:
        rnd += 1
        step = core.verify(DraftResult(step.session_id, rnd, (out[-1],), step.routed_union,
                                       union_bytes(step.routed_union, core.target.byte_map)))
        out += step.tokens
    return tuple(out)


def make_jobs(clients: int, requests: int, max_tokens: int, drafters: list[str]) -> list[list[Job]]:
    """Per client, its requests in order; prompts and drafter kinds rotate so clients differ."""
    return [
        [Job(PROMPTS[(c + r) % len(PROMPTS)], max_tokens, drafters[(c + r) % len(drafters)]) for r in range(requests)]
        for c in range(clients)
    ]


async def _one(stub, job: Job, timeout: float, metadata) -> Record:
    rec = Record(job)
    req = Client.request(job.prompt, max_tokens=job.max_tokens, drafter=job.drafter)
    rec.start = time.perf_counter()
    try:
        final = False
        async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            if msg.HasField("chunk"):
                rec.chunks.append((now, len(msg.chunk.token_ids)))
                rec.token_ids.extend(msg.chunk.token_ids)
            else:
                final = True
        if not final:
            rec.error = "stream ended without a final message"
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    rec.end = time.perf_counter()
    return rec


async def run_load(
    target: str,
    jobs: list[list[Job]],
    credentials: grpc.ChannelCredentials | None = None,
    metadata=(),
    request_timeout: float = 120.0,
    time_limit: float = 600.0,
) -> tuple[list[Record], float]:
    """Every client runs its jobs one after another, all clients at once. Returns (records, wall seconds)."""
    channel = (grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS) if credentials is not None
               else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
    async with channel:
        await asyncio.wait_for(channel.channel_ready(), 30)  # connecting is not part of the load
        stub = drafter_pb2_grpc.DrafterStub(channel)

        async def client(mine: list[Job]) -> list[Record]:
            return [await _one(stub, job, request_timeout, metadata) for job in mine]

        t0 = time.perf_counter()
        per_client = await asyncio.wait_for(asyncio.gather(*(client(m) for m in jobs)), time_limit)
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def in_use(scheduler: str, verifier: str, credentials: grpc.ChannelCredentials | None = None, settle_s: float = 10.0) -> dict:
    """Sessions and budget still held, polled until all are zero or settle_s passes (releases are async)."""

    def channel(t):
        return grpc.secure_channel(t, credentials, options=CHANNEL_OPTIONS) if credentials else grpc.insecure_channel(t, options=CHANNEL_OPTIONS)

    end = time.monotonic() + settle_s
    with channel(scheduler) as sch, channel(verifier) as vch:
        while True:
            st = scheduler_pb2_grpc.SchedulerStub(sch).GetStats(scheduler_pb2.StatsRequest(), timeout=10)
            vi = verifier_pb2_grpc.VerifierStub(vch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
            held = dict(sessions_alive=vi.sessions_alive, tokens_in_use=st.tokens_in_use, bytes_in_use=st.bytes_in_use,
                        in_flight=st.in_flight, waiting=st.waiting)
            if not any(held.values()) or time.monotonic() > end:
                return held
            time.sleep(0.05)


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def summarize(records: list[Record], wall_s: float, references: dict[Job, tuple[int, ...]]) -> dict:
    ttft = [r.ttft_s for r in records if r.ttft_s is not None and not r.error]
    itl = [g for r in records if not r.error for g in r.inter_token_s()]
    errors = [r for r in records if r.error]
    mismatches = [r for r in records if not r.error and tuple(r.token_ids) != references[r.job]]
    tokens = sum(len(r.token_ids) for r in records)
    ms = lambda x: None if x is None else round(x * 1e3, 2)  # noqa: E731
    return dict(
        requests=len(records),
        errors=len(errors),
        error_samples=sorted({r.error for r in errors})[:5],
        mismatches=len(mismatches),
        output_tokens=tokens,
        wall_s=round(wall_s, 3),
        output_tokens_per_s=round(tokens / wall_s, 2) if wall_s > 0 else None,
        ttft_p50_ms=ms(_pct(ttft, 50)),
        ttft_p99_ms=ms(_pct(ttft, 99)),
        itl_p50_ms=ms(_pct(itl, 50)),
        itl_p99_ms=ms(_pct(itl, 99)),
    )


COLUMNS = [("clients", "clients"), ("requests", "requests"), ("errors", "errors"), ("mismatches", "mismatch"),
           ("output_tokens", "tokens"), ("wall_s", "wall s"), ("output_tokens_per_s", "tok/s"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p50_ms", "ITL p50 ms"),
           ("itl_p99_ms", "ITL p99 ms"), ("held_afterwards", "held after")]


def table(runs: list[dict]) -> str:
    def cell(run, key):
        v = run[key]
        return "none" if key == "held_afterwards" and not any(v.values()) else str(v)

    rows = [[title for _, title in COLUMNS]] + [[cell(r, key) for key, _ in COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,32", help="concurrent streaming clients; a comma list runs each level in turn")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--drafters", default="ngram,none,hybrid", help="drafter kinds, rotated across requests")
    ap.add_argument("--model", default="", help="target checkpoint (the references come from it)")
    ap.add_argument("--drafter", default="", help="DFlash drafter directory for a started stack")
    ap.add_argument("--target", default="", help="an existing drafter HOST:PORT (else a stack is started)")
    ap.add_argument("--scheduler", default="", help="with --target: the scheduler HOST:PORT, for the leak check")
    ap.add_argument("--verifier", default="", help="with --target: the verifier HOST:PORT, for the leak check")
    ap.add_argument("--token", default=os.environ.get("PDFLASH_AUTH_TOKEN", ""), help="bearer token [env PDFLASH_AUTH_TOKEN]")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--time-limit", type=float, default=600.0, help="each concurrency level, seconds")
    ap.add_argument("--verifier-args", default="", help="more options for a started stack's verifier, as one string "
                    "(e.g. \"--max-wave-sessions 1\": the A/B of multi-session verify waves)")
    ap.add_argument("--verifier-metrics-port", type=int, default=0, help="with --target: the verifier's /metrics port "
                    "(each level's verifies and forwards; a started stack's is found by itself)")
    ap.add_argument("--profile-services", action="store_true", help="a started stack: py-spy samples each service process "
                    "during each level (py-spy on PATH; raw stacks in <out>_pyspy/)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load.json"))
    args = ap.parse_args(argv)
    try:
        levels = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        ap.error("--clients: a comma-separated list of integers")
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--clients, --requests and --max-tokens must be >= 1")
    if args.target and not (args.model and args.scheduler and args.verifier):
        ap.error("--target needs --model (for the references), --scheduler and --verifier (for the leak check)")
    if args.profile_services and args.target:
        ap.error("--profile-services samples the processes of a stack this run starts (not with --target)")
    from benchmarks import service_probe

    if args.profile_services and service_probe.Profiler.unavailable():
        ap.error(f"--profile-services: {service_probe.Profiler.unavailable()}")

    from pdflash.defaults import default_drafter_dir, default_target_dir, is_embedded_target
    from pdflash.stack import Stack, StackSpec, free_ports
    from pdflash.tls import bearer_metadata

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    model = args.model or str(default_target_dir())
    # the embedded DFlash drafter goes with the embedded target only (it was trained for it; another --model gets none
    # unless --drafter names one)
    embedded = str(default_drafter_dir() or "") if is_embedded_target(model) else ""
    drafter_dir = "" if args.target else (args.drafter or embedded)
    if not args.target and not drafter_dir:  # no DFlash drafter to start the stack with
        drafters = [d for d in drafters if d not in ("dflash", "hybrid")] or ["ngram"]
    plans = {n: make_jobs(n, args.requests, args.max_tokens, drafters) for n in levels}
    t0 = time.perf_counter()
    references = {j: greedy_reference(model, j.prompt, j.max_tokens) for jobs in plans.values() for js in jobs for j in js}
    print(f"references: {len(references)} greedy generations in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    stack = None
    metrics_port = args.verifier_metrics_port
    if args.target:
        target, scheduler, verifier = args.target, args.scheduler, args.verifier
    else:
        log_dir = ROOT / "benchmarks" / "results" / "logs" / "load"
        ports = free_ports(4)
        metrics_port = ports[3]
        spec = StackSpec(
            model=model, drafter=drafter_dir, no_dflash=not drafter_dir, drafter_port=ports[0], scheduler_port=ports[1],
            verifier_port=ports[2], metrics_ports=(-1, -1, metrics_port), log_dir=str(log_dir),
            drafter_args=["--max-concurrent", str(max(64, *levels))],
            verifier_args=["--max-sessions", str(max(64, *levels)), *shlex.split(args.verifier_args)],
        )
        stack = Stack(spec).start()
    runs = []
    try:
        if stack is not None:
            stack.wait_ready(300)  # (in the try: a stack that fails to start is stopped, not left holding the GPU)
            target, scheduler, verifier = stack.drafter, stack.scheduler, stack.verifier
        # Warm-up: first-call costs (gRPC's asyncio start-up, lazy model code paths) are not load.
        warm = [[Job(p, 4, d)] for p in PROMPTS[:2] for d in drafters]
        asyncio.run(run_load(target, warm, metadata=bearer_metadata(args.token), request_timeout=args.request_timeout))
        out_path = pathlib.Path(args.out)
        pids = service_probe.pids_of(stack.procs) if stack is not None else {}
        profiler = (service_probe.Profiler(pids, out_path.with_name(out_path.stem + "_pyspy"))
                    if args.profile_services else None)
        for n, jobs in plans.items():
            before = service_probe.scrape(metrics_port) if metrics_port else None
            cpu_before = {name: service_probe.cpu_seconds(pid) for name, pid in pids.items()}
            if profiler is not None:
                profiler.start(f"clients{n}")
            try:
                records, wall = asyncio.run(run_load(target, jobs, metadata=bearer_metadata(args.token),
                                                     request_timeout=args.request_timeout, time_limit=args.time_limit))
            finally:
                profile = profiler.stop(f"clients{n}") if profiler is not None else None
            runs.append(dict(clients=n, **summarize(records, wall, references), held_afterwards=in_use(scheduler, verifier)))
            cpu_after = {name: service_probe.cpu_seconds(pid) for name, pid in pids.items()}
            if before is not None:
                runs[-1]["verifier"] = service_probe.forwards(before, service_probe.scrape(metrics_port))
                runs[-1]["services_cpu_per_verify"] = service_probe.cpu_per_verify(cpu_before, cpu_after,
                                                                                   runs[-1]["verifier"]["verifies"])
            if profile is not None:
                runs[-1]["services_cpu"] = profile
            print(f"{n} clients: {runs[-1]['output_tokens_per_s']} tok/s", file=sys.stderr)
    finally:
        if stack is not None:
            stack.stop()
    cfg = dict(clients=levels, requests_per_client=args.requests, max_tokens=args.max_tokens, drafters=drafters,
               model=model, drafter=drafter_dir, target=args.target or "started on loopback",
               verifier_args=args.verifier_args)
    print(f"load: {args.requests} requests per client, max_tokens {args.max_tokens}, drafters {','.join(drafters)}, "
          f"model {model}")
    print(table(runs))
    for r in runs:
        if "verifier" in r:
            v = r["verifier"]
            print(f"{r['clients']} clients: {v['verifies']} verifies in {v['forwards']} forwards "
                  f"({v['verifies_per_forward']} a forward), {v['verify_server_ms_mean']} ms a verify in the verifier")
            if r.get("services_cpu_per_verify"):
                print("  CPU ms a verify (a round): " + ", ".join(
                    f"{name} {c['cpu_ms_per_verify']}" for name, c in r["services_cpu_per_verify"].items()))
        for name, p in r.get("services_cpu", {}).items():
            if "error" in p:
                print(f"  {name}: py-spy failed: {p['error']}")
                continue
            print(f"  {name}: {p['cpu_s']} s on CPU; most samples (self): "
                  + ", ".join(f"{f} {v:.0%}" for f, v in p["self"][:5]))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        config=cfg, runs=runs,
        machine=dict(platform=platform.platform(), python=platform.python_version(), cpus=os.cpu_count(),
                     load_average=os.getloadavg()),
        command=" ".join(["python", "benchmarks/load.py", *(argv if argv is not None else sys.argv[1:])]),
    ), indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    ok = all(r["errors"] == 0 and r["mismatches"] == 0 and not any(r["held_afterwards"].values()) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
