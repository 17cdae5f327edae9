"""Prefetch hints (issue 14): the verifier's Prefetch RPC (a projected union streams into the expert cache before its
Verify arrives), and the scheduler that sends one for each demand it admits (--verifier). Real servers on port 0,
tiny models on the CPU; the offloaded output is the same with hints on and off, through the whole stack."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdflash.client import Client
from pdflash.stack import free_ports
from pdflash.tickets import TicketSigner
from pdflash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import DEVICE, DTYPE, start_stack

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7]
QUEUED, NO_CACHE, DISABLED, STALE = (verifier_pb2.PREFETCH_OUTCOME_QUEUED, verifier_pb2.PREFETCH_OUTCOME_NO_EXPERT_CACHE,
                                     verifier_pb2.PREFETCH_OUTCOME_DISABLED, verifier_pb2.PREFETCH_OUTCOME_STALE)


class Served:
    """verifier_svc.server.start(cfg) on port 0, its event loop on a thread of its own (the tests' calls are blocking)."""

    def __init__(self, **options):
        from verifier_svc import server
        from verifier_svc.config import VerifierConfig

        fields = dict(port=0, host="127.0.0.1", device=DEVICE, dtype=DTYPE, metrics_port=-1, max_block_size=8)
        cfg = VerifierConfig(**{**fields, **options})
        cfg.validate()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(server.start(cfg), self.loop).result(timeout=300)
        self.address = f"127.0.0.1:{self.running.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    @property
    def cache(self):
        return self.running.core.target.expert_cache

    def stop(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def offloaded(tiny):
    """An offloaded verifier (MXFP4 experts in a host store, the device-managed cache on the CPU)."""
    v = Served(model=str(tiny.target("qwen3_moe")), experts="mxfp4", expert_cache_gb=1.0)
    yield v
    v.stop()


@pytest.fixture(scope="module")
def resident(tiny):
    """Every expert resident (no expert cache), tickets checked."""
    v = Served(model=str(tiny.target("qwen3_moe")), ticket_secret="s3cret")
    yield v
    v.stop()


def _prefill(stub):
    return stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=PROMPT, max_tokens=64, ignore_eos=True), timeout=30)


def _status(call):
    """(code, the BadRequest's field violations as (field, description), the message) of a call that failed."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    err = e.value
    fields = []
    status = rpc_status.from_call(err)
    for any_ in status.details if status is not None else ():
        if any_.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            any_.Unpack(br)
            fields = [(f.field, f.description) for f in br.field_violations]
    return err.code(), fields, err.details()


def test_prefetch_queues_the_union_and_validates_its_input(offloaded):
    stub, cache = offloaded.stub, offloaded.cache
    pre = _prefill(stub)
    union = list(pre.routed_union)
    assert union and cache.prefetch_union

    def prefetch(**kw):
        fields = dict(session_id=pre.session_id, round=1, expert_union=union)
        fields.update(kw)
        return stub.Prefetch(verifier_pb2.PrefetchRequest(**fields), timeout=10)

    first = prefetch()
    assert first.outcome == QUEUED and first.experts_queued > 0
    assert first.bytes_queued == first.experts_queued * cache.store.slice_bytes
    assert prefetch() == first  # idempotent: the same answer, nothing copied twice
    assert prefetch(expert_union=[]).outcome == QUEUED and prefetch(expert_union=[]).experts_queued == 0

    code, _, msg = _status(lambda: prefetch(session_id="no-such-session"))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown or expired session 'no-such-session'" in msg
    code, fields, _ = _status(lambda: prefetch(expert_union=[common_pb2.LayerExperts(layer=99, expert_ids=[0])]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fields == [("expert_union", "layer 99 is not an MoE layer of this model (its MoE layers: 0-1)")]
    code, fields, _ = _status(lambda: prefetch(expert_union=[common_pb2.LayerExperts(layer=0, expert_ids=[1, 1000])]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fields == [("expert_union", "layer 0: expert ids must be < 8")]
    code, fields, _ = _status(lambda: prefetch(session_id="", round=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and [f for f, _ in fields] == ["session_id", "round"]

    res = stub.Verify(verifier_pb2.VerifyRequest(draft=common_pb2.DraftResult(
        session_id=pre.session_id, round=1, tokens=[pre.first_token], expert_union=union, expert_bytes=pre.routed_bytes)),
        timeout=30)
    assert prefetch().outcome == STALE  # round 1 verified already
    assert prefetch(round=2, expert_union=list(res.routed_union)).outcome == QUEUED
    cache.arrival_share = 0.0
    try:
        assert prefetch(round=2).outcome == DISABLED
    finally:
        cache.arrival_share = 0.5
    assert stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10).ended


def test_prefetch_without_an_expert_cache_says_so_and_needs_a_ticket_when_they_are_checked(resident):
    stub = resident.stub
    assert resident.cache is None
    signer = TicketSigner("s3cret")
    expires = time.time() + 30
    pre = stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=PROMPT, max_tokens=8, ignore_eos=True), timeout=30)
    union = list(pre.routed_union)
    req = verifier_pb2.PrefetchRequest(session_id=pre.session_id, round=1, expert_union=union)
    code, _, msg = _status(lambda: stub.Prefetch(req, timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and msg.startswith("Prefetch needs an admission ticket")
    ticket = dict(ticket_id="t1", ticket_expires_at_unix=expires, ticket_tokens=4, ticket_expert_bytes=pre.routed_bytes,
                  ticket_signature=signer.sign("t1", pre.session_id, 1, 4, pre.routed_bytes, expires))
    got = stub.Prefetch(verifier_pb2.PrefetchRequest(session_id=pre.session_id, round=1, expert_union=union, **ticket), timeout=10)
    assert (got.outcome, got.experts_queued, got.bytes_queued) == (NO_CACHE, 0, 0)
    code, _, _ = _status(lambda: stub.Prefetch(verifier_pb2.PrefetchRequest(  # signed for another session
        session_id="other", round=1, expert_union=union, **ticket), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10)


# ---- the scheduler's hints -----------------------------------------------------------------------------------------
def _admit(session: str, round: int, union, nbytes: int, reserve: int = 0) -> scheduler_pb2.AdmitRequest:
    return scheduler_pb2.AdmitRequest(request_id=f"r{round}", reserve_tokens=reserve, draft=common_pb2.DraftResult(
        session_id=session, round=round, tokens=[] if reserve else [1, 2], expert_union=union, expert_bytes=nbytes))


def _hints(sched, outcome: str) -> float:
    return sched.core.metrics.registry.get_sample_value("pdflash_prefetch_hints_total", {"outcome": outcome}) or 0.0


async def _with_scheduler(body, **options):
    from scheduler_svc import server as scheduler_server
    from scheduler_svc.config import SchedulerConfig

    sched = await scheduler_server.start(SchedulerConfig(port=0, metrics_port=-1, **options))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            await body(sched, scheduler_pb2_grpc.SchedulerStub(ch))
    finally:
        await sched.stop(0)


async def _until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "not reached in time"
        await asyncio.sleep(0.02)


def test_the_scheduler_hints_each_admitted_demand_to_the_verifier(offloaded):
    pre = _prefill(offloaded.stub)
    union = list(pre.routed_union)
    seen = []
    cache = offloaded.cache
    real = cache.arriving
    cache.arriving = lambda projection: seen.append({l: set(e) for l, e in projection.items()}) or real(projection)
    want = {le.layer: set(le.expert_ids) for le in union}

    async def body(sched, stub):
        t0 = time.perf_counter()
        ticket = await stub.Admit(_admit(pre.session_id, 1, union, pre.routed_bytes), timeout=10)
        assert ticket.ticket_id and not ticket.deferred
        await _until(lambda: _hints(sched, "queued") == 1)
        assert seen == [want]
        ahead = await stub.Admit(_admit(pre.session_id, 2, union, pre.routed_bytes, reserve=4), timeout=10)  # ahead
        assert ahead.ticket_id and not ahead.deferred
        await _until(lambda: _hints(sched, "queued") == 2)
        assert seen == [want, want] and time.perf_counter() - t0 < 10
        await stub.Admit(_admit(pre.session_id, 3, [], 0), timeout=10)  # no union: nothing to hint
        await stub.Admit(_admit("no-such-session", 1, union, pre.routed_bytes), timeout=10)  # admitted all the same
        await _until(lambda: _hints(sched, "failed") == 1)  # the verifier said NOT_FOUND
        assert sched.hints.sent == 3 and len(seen) == 2

    try:
        asyncio.run(asyncio.wait_for(_with_scheduler(body, verifier=offloaded.address), 60))
    finally:
        cache.arriving = real
        offloaded.stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10)


def test_admission_never_waits_for_an_unreachable_verifier_or_one_without_a_cache(resident):
    union = [common_pb2.LayerExperts(layer=0, expert_ids=[1, 4])]

    async def unreachable(sched, stub):
        for rnd in (1, 2, 3):
            t0 = time.perf_counter()
            ticket = await stub.Admit(_admit("s1", rnd, union, 0), timeout=10)
            assert ticket.ticket_id and time.perf_counter() - t0 < 0.5
            await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=ticket.ticket_id), timeout=10)
        await _until(lambda: _hints(sched, "failed") == 3)

    asyncio.run(asyncio.wait_for(_with_scheduler(unreachable, verifier=f"127.0.0.1:{free_ports(1)[0]}"), 60))

    pre = resident.stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=PROMPT, max_tokens=8, ignore_eos=True), timeout=30)

    async def no_cache(sched, stub):  # tickets signed with the verifier's secret: it answers NO_EXPERT_CACHE, then quiet
        await stub.Admit(_admit(pre.session_id, 1, list(pre.routed_union), pre.routed_bytes), timeout=10)
        await _until(lambda: _hints(sched, "no_expert_cache") == 1)
        await stub.Admit(_admit(pre.session_id, 2, list(pre.routed_union), pre.routed_bytes, reserve=4), timeout=10)
        assert sched.hints.sent == 1  # paused: no second hint

    asyncio.run(asyncio.wait_for(_with_scheduler(no_cache, verifier=resident.address, ticket_secret="s3cret"), 60))
    resident.stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10)


def test_options_and_pdflash_up_wire_the_verifier():
    from pdflash.config import ConfigError, from_sources
    from pdflash.stack import Stack, StackSpec
    from scheduler_svc.config import SchedulerConfig
    from verifier_svc.config import VerifierConfig

    assert SchedulerConfig().verifier == ""
    assert from_sources(SchedulerConfig, env={"PDFLASH_VERIFIER": "verifier:50053"}).verifier == "verifier:50053"
    with pytest.raises(ConfigError, match="--verifier 'verifier': expected host:port"):
        SchedulerConfig(verifier="verifier").validate()
    assert VerifierConfig().expert_arrival_share == 0.5
    with pytest.raises(ConfigError, match=r"--expert-arrival-share 1.5: must be in \[0, 1\]"):
        VerifierConfig(expert_arrival_share=1.5).validate()
    cmd = Stack(StackSpec(scheduler_port=7001, verifier_port=7002))._cmd("scheduler")
    assert cmd[cmd.index("--verifier") + 1] == "127.0.0.1:7002"
    off = Stack(StackSpec(scheduler_args=["--verifier", ""]))._cmd("scheduler")
    assert off[len(off) - 1 - off[::-1].index("--verifier") + 1] == ""  # the last one wins: no hints
    tls = Stack(StackSpec(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem"))._cmd("scheduler")
    assert tls[tls.index("--upstream-tls-ca") + 1] == "ca.pem" and tls[tls.index("--upstream-tls-cert") + 1] == "c.pem"


# ---- output identity -----------------------------------------------------------------------------------------------
def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _total(text: str, name: str) -> float:
    """A counter summed over its labels (0 when it has no sample yet)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_offloaded_greedy_output_is_the_same_with_hints_on_and_off(tiny, tmp_path):
    """Through the whole stack (pdflash up's wiring: the scheduler hints the verifier), an offloaded model with a cache
    that evicts every round: the same tokens with the scheduler's hints and without them."""
    from tests.test_offload import _core, tiny_cache_gb

    gb = tiny_cache_gb(_core(tiny, "gpt_oss", 1.0), "device")
    outs, hinted = {}, {}
    for hints in (True, False):
        stack = start_stack(tiny.target("gpt_oss"), None, tmp_path / f"logs-{hints}",
                            verifier_args=["--experts", "mxfp4", "--expert-cache-gb", str(gb)],
                            scheduler_args=[] if hints else ["--verifier", ""])
        try:
            with Client(stack.drafter) as c:
                outs[hints] = [c.generate("def f(x):\n", max_tokens=24, drafter=d, ignore_eos=True).token_ids
                               for d in ("none", "ngram")]
            # hints counted on both sides, whatever their outcome: the scheduler sends them without waiting and the
            # drafter's Verify can overtake one (then "stale"), so the outcome depends on timing (stop 45's CI run,
            # two workers: not one "queued")
            hinted[hints] = (_total(_scrape(stack.spec.metrics_ports[1]), "pdflash_prefetch_hints_total"),
                             _total(_scrape(stack.spec.metrics_ports[2]), "pdflash_prefetch_requests_total"))
        finally:
            stack.stop()
    assert outs[True] == outs[False] and outs[True][0] == outs[True][1] and len(outs[True][0]) == 24
    assert hinted[True][0] > 0 and hinted[False] == (0, 0), hinted
