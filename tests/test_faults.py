"""Faults: deadlines hop by hop, cancel and disconnect, killed processes, overload.

Cancel/deadline/disconnect run on the shared stack (sessions live 120 s there, leases 30 s, so a
return to zero within a few seconds proves an immediate release, not an expiry). Killing processes
and tight limits use this module's own stack: short leases and session TTLs, one session, one request.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from benchmarks.load import in_use
from pdflash.client import Client
from pdflash.types import union_bytes
from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
from tests.conftest import start_stack

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
LONG = 300  # tokens: long enough to be mid-generation when the fault hits


def idle(stack, settle_s: float = 10.0) -> dict:
    return in_use(stack.scheduler, stack.verifier, settle_s=settle_s)


def poll(read, settle_s: float = 20.0):
    """read() until it is falsy (nothing held) or settle_s passes; returns the last value."""
    end = time.monotonic() + settle_s
    while (value := read()) and time.monotonic() < end:
        time.sleep(0.05)
    return value


def budget_held(stack) -> tuple[int, int, int]:
    from pdflash.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(stack.scheduler) as ch:
        st = scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.StatsRequest(), timeout=10)
    return (st.tokens_in_use, st.bytes_in_use, st.in_flight) if any((st.tokens_in_use, st.bytes_in_use, st.in_flight)) else ()


def sessions_alive(stack) -> int:
    with grpc.insecure_channel(stack.verifier) as ch:
        return verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10).sessions_alive


def verify_count(stack) -> float:
    """Verifies the verifier has run so far (its Prometheus counter)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.spec.metrics_ports[2]}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("pdflash_verify_latency_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("pdflash_verify_latency_seconds_count not exported")


def assert_loop_stopped(stack) -> None:
    before = verify_count(stack)
    time.sleep(0.5)
    assert verify_count(stack) == before, "verifies continued after the client left"


def retry_info(err: grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    status = rpc_status.from_call(err)
    for d in status.details if status else ():
        ri = error_details_pb2.RetryInfo()
        if d.Unpack(ri):
            return ri
    return None


# -- cancel, disconnect, deadline (shared stack) -------------------------------------------------------


def test_cancel_mid_stream_stops_the_loop_and_frees_everything_at_once(stack):
    with Client(stack.drafter) as c:
        call = c.stream(Client.request(PROMPT, max_tokens=1500, drafter="none", ignore_eos=True), timeout=120)
        for _ in range(3):
            next(call)
        call.cancel()
    held = idle(stack)
    assert not any(held.values()), held
    assert_loop_stopped(stack)


def test_client_disconnect_frees_everything(stack):
    """A client process that dies mid-stream (no cancel sent by it) is noticed like a cancel."""
    script = textwrap.dedent(f"""
        import sys, time
        from pdflash.client import Client
        c = Client({stack.drafter!r})
        call = c.stream(Client.request({PROMPT!r}, max_tokens=1500, drafter="none", ignore_eos=True), timeout=120)
        next(call); next(call)
        print("streaming", flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "streaming"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    held = idle(stack)
    assert not any(held.values()), held
    assert_loop_stopped(stack)


@pytest.mark.parametrize("timeout", [0.05, 1.0])
def test_deadline_ends_the_request_and_frees_everything(stack, timeout):
    with Client(stack.drafter) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, max_tokens=1500, drafter="none", ignore_eos=True, timeout=timeout)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    held = idle(stack)
    assert not any(held.values()), held
    assert_loop_stopped(stack)


def test_every_hop_gets_the_remaining_time():
    """The round loop passes each call the request's remaining time, never more, never 'no deadline'."""
    from drafter_svc.clients import PrefillOut, TicketInfo, VerifyOut
    from drafter_svc.drafters import make_factory
    from drafter_svc.loop import Deadline, Request, run_request
    from pdflash.types import FinishReason, SamplingParams

    seen: list[tuple[str, float | None]] = []

    class Verifier:
        async def prefill(self, request_id, prompt, sampling, max_tokens, stop_token_ids, ignore_eos, feature_layer_ids,
                          timeout, logprobs=False, top_logprobs=0):  # (VerifierClient.prefill's parameters)
            seen.append(("prefill", timeout))
            return PrefillOut("s", 7, None, None, {}, 0, 0.0)

        async def verify(self, request_id, draft, ticket, return_features, timeout):
            seen.append(("verify", timeout))
            await asyncio.sleep(0.01)
            done = FinishReason.LENGTH if draft.round == 3 else None
            return VerifyOut([7], 0, done, None, {}, 0, 0.0, 0.0)

        async def end(self, session_id):
            return True

    class Scheduler:
        async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
            seen.append(("admit", timeout))
            return TicketInfo(f"t{draft.round}", "", 0.0, 0.0, reserve_tokens or len(draft.tokens))

        async def release(self, ticket_id):
            return True

    async def main():
        req = Request("r", (1, 2, 3), 10, SamplingParams(), (), True, 1)
        async for _ in run_request(req, make_factory("none", ""), Verifier(), Scheduler(), Deadline(5.0)):
            pass

    asyncio.run(main())
    # Round 1 is admitted before its Verify; every later round's admission travels ahead, during the
    # previous Verify (the last one reserved a round that never came, and was released).
    assert [k for k, _ in seen] == ["prefill", "admit", "verify"] + ["admit", "verify"] * 2 + ["admit"]
    timeouts = [t for _, t in seen]
    assert all(t is not None and 0 < t <= 5.0 for t in timeouts)
    assert timeouts == sorted(timeouts, reverse=True)  # the time left only shrinks


class AheadScheduler:
    """A scheduler double that seats ahead admissions (or defers them) and tracks every held ticket."""

    def __init__(self, defer_rounds=()):
        self.defer_rounds = set(defer_rounds)
        self.held: dict[str, tuple] = {}
        self.calls: list[tuple[int, int]] = []  # (round, reserve_tokens)
        self.released_on_admit: list[str] = []
        self.release_calls: list[tuple[int, int, tuple[str, ...]]] = []
        self.n = 0

    async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
        from drafter_svc.clients import TicketInfo

        self.calls.append((draft.round, reserve_tokens))
        self.release_calls.append((draft.round, reserve_tokens, tuple(release)))
        for t in release:
            self.released_on_admit.append(t)
            self.held.pop(t, None)
        await asyncio.sleep(0.001)
        if reserve_tokens and draft.round in self.defer_rounds:
            return TicketInfo("", "", 0.0, 0.0, deferred=True)
        self.n += 1
        tid = f"t{self.n}"
        tokens = reserve_tokens or len(draft.tokens)
        self.held[tid] = (draft.round, tokens, draft.expert_bytes, draft.expert_union)
        return TicketInfo(tid, "", 0.0, 0.0, tokens, draft.expert_bytes)

    async def release(self, ticket_id):
        return self.held.pop(ticket_id, None) is not None


BYTE_MAP = {0: [10 * (e + 1) for e in range(64)]}  # the verifier's: its answers count a union's bytes with it


def _ahead_loop(scheduler, max_tokens=12, cancel_after=None, admit_ahead=True):
    """Run the round loop over a verifier double that routes a different union every round."""
    from drafter_svc.clients import PrefillOut, VerifyOut
    from drafter_svc.drafters import make_factory
    from drafter_svc.loop import Deadline, Finished, Request, run_request
    from pdflash.types import FinishReason, SamplingParams

    verified = []

    class Verifier:
        async def prefill(self, *args):
            return PrefillOut("s", 7, None, None, {0: frozenset({0})}, BYTE_MAP[0][0], 0.0)

        async def verify(self, request_id, draft, ticket, return_features, timeout):
            verified.append((draft, ticket))
            await asyncio.sleep(0.005)
            emitted = [7] * 2
            done = FinishReason.LENGTH if sum(len(d.tokens) for d, _ in verified) >= max_tokens else None
            return VerifyOut(emitted, 1, done, None, {0: frozenset({draft.round})}, BYTE_MAP[0][draft.round], 0.0, 0.0)

        async def end(self, session_id):
            return True

    events = []

    async def main():
        req = Request("r", (1, 7, 7), max_tokens, SamplingParams(), (), True, 4)
        gen = run_request(req, make_factory("ngram", ""), Verifier(), scheduler, Deadline(5.0), admit_ahead=admit_ahead)
        async for ev in gen:
            events.append(ev)
            if cancel_after is not None and len(events) > cancel_after:
                await gen.aclose()
                break
        from drafter_svc.loop import _background
        await asyncio.gather(*list(_background))
        await asyncio.sleep(0.05)

    asyncio.run(main())
    final = events[-1] if events and isinstance(events[-1], Finished) else None
    return verified, final


def test_admission_ahead_reserves_the_next_round_and_gives_back_what_it_did_not_use():
    sched = AheadScheduler()
    verified, final = _ahead_loop(sched)
    assert final is not None and len(verified) >= 3
    # Every round, the first too (its admission travels while the first token streams).
    assert final.usage.rounds_admitted_ahead == len(verified)
    for i, (draft, ticket) in enumerate(verified):
        assert ticket.tokens >= len(draft.tokens)  # the block fits in what was admitted
        # Admitted ahead with the projection known then (prefill's for rounds 1-2, then routed by round i-1),
        # carried by the block.
        assert draft.expert_union == {0: frozenset({i - 1 if i > 1 else 0})}
        assert draft.expert_bytes == union_bytes(draft.expert_union, BYTE_MAP)  # the verifier's count, carried along
    assert sched.held == {}  # the last round's ahead reservation was released before Finished
    # Each verified round's ticket rode on a later ahead Admit (one scheduler call per round), but the last ones.
    assert len(sched.released_on_admit) >= len(verified) - 2


def test_deferred_admission_ahead_falls_back_to_a_normal_admit():
    sched = AheadScheduler(defer_rounds={2, 3})
    verified, final = _ahead_loop(sched)
    assert final.usage.rounds_admitted_ahead == len(verified) - 2
    assert (1, 0) not in sched.calls  # round 1 was admitted ahead, during prefill's answer
    assert (2, 0) in sched.calls and (3, 0) in sched.calls  # normal admits for the deferred rounds
    # A normal Admit (which may wait) never holds a finished round's lease: it gives it back first.
    assert (2, 0, (verified[0][1].ticket_id,)) in sched.release_calls
    assert verified[1][0].expert_union == {0: frozenset({1})}  # a normal admit carries the freshest projection
    assert sched.held == {}


def test_no_admission_ahead_when_disabled_and_nothing_held_after_a_cancel():
    sched = AheadScheduler()
    verified, final = _ahead_loop(sched, admit_ahead=False)
    assert final.usage.rounds_admitted_ahead == 0 and all(r == 0 for _, r in sched.calls)
    sched = AheadScheduler()
    _ahead_loop(sched, max_tokens=40, cancel_after=2)  # the client leaves with an ahead reservation in flight
    assert any(r for _, r in sched.calls) and sched.held == {}


def test_a_ticket_lost_at_the_deadline_is_reclaimed():
    """The scheduler seated the block but its answer missed the deadline: the loop admits the same block
    again (the scheduler returns the ticket it holds) and releases it, instead of waiting for the expiry."""
    from drafter_svc.clients import TicketInfo
    from drafter_svc.loop import _admit, _background
    from pdflash.errors import DeadlineExceeded
    from pdflash.types import DraftResult

    held: dict[tuple[str, int], str] = {}

    class Scheduler:
        async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
            first = (draft.session_id, draft.round) not in held
            held.setdefault((draft.session_id, draft.round), f"t-{len(held)}")
            if first:
                raise DeadlineExceeded("scheduler Admit: Deadline Exceeded")
            return TicketInfo(held[(draft.session_id, draft.round)], "", 0.0, 0.0)

        async def release(self, ticket_id):
            held.pop(next(k for k, v in held.items() if v == ticket_id))
            return True

    async def main():
        with pytest.raises(DeadlineExceeded):
            await _admit(Scheduler(), "r", DraftResult("s", 1, (7,), {}, 0), 0.01)
        await asyncio.gather(*list(_background))

    asyncio.run(main())
    assert held == {}


# -- killed processes (own stack) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty(tiny, tmp_path_factory):
    s = start_stack(
        tiny.target("qwen3_moe"), None, tmp_path_factory.mktemp("faults-logs"),
        scheduler_args=["--lease-s", "2"],
        verifier_args=["--session-ttl-s", "2", "--max-sessions", "1"],
        drafter_args=["--max-concurrent", "1"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def clean(faulty) -> list[int]:
    """The reference output of the long request, recorded before any fault."""
    with Client(faulty.drafter) as c:
        return c.generate(PROMPT, max_tokens=LONG, drafter="ngram", ignore_eos=True, timeout=120).token_ids


def stream_until_killed(stack, name: str) -> tuple[list[int], grpc.RpcError]:
    got: list[int] = []
    with Client(stack.drafter) as c:
        call = c.stream(Client.request(PROMPT, max_tokens=LONG, drafter="ngram", ignore_eos=True), timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            for i, msg in enumerate(call):
                got += msg.chunk.token_ids
                if i == 1:
                    stack.procs[name].send_signal(signal.SIGKILL)
                    stack.procs[name].wait(10)
    return got, e.value


def generate_after_restart(stack, name: str) -> list[int]:
    """Restart `name`; the first requests may still see UNAVAILABLE until the drafter's channel reconnects."""
    stack.start_one(name)
    stack.wait_ready(timeout=120, name=name)
    end = time.monotonic() + 20
    with Client(stack.drafter) as c:
        while True:
            try:
                return c.generate(PROMPT, max_tokens=LONG, drafter="ngram", ignore_eos=True, timeout=120).token_ids
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                    raise
                time.sleep(0.2)


@pytest.mark.parametrize("name", ["verifier", "scheduler", "drafter"])
def test_killed_service_fails_fast_reclaims_and_recovers(faulty, clean, name):
    got, err = stream_until_killed(faulty, name)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    if name != "drafter":  # the drafter names the hop that failed
        assert name in err.details() and "retry" in err.details(), err.details()
    assert got and got == clean[: len(got)], "tokens streamed before the fault must be correct"
    assert len(got) < LONG
    if name != "drafter":
        assert faulty.procs["drafter"].poll() is None, "the drafter must survive an upstream failure"
    if name != "verifier":  # no verifier session left behind (the drafter ended it, or its TTL did)
        assert poll(lambda: sessions_alive(faulty)) == 0
    if name != "scheduler":  # the scheduler got its budget back (released, or the lease expired)
        assert not poll(lambda: budget_held(faulty))
    assert generate_after_restart(faulty, name) == clean
    held = idle(faulty)
    assert not any(held.values()), held


# -- overload ------------------------------------------------------------------------------------------


def test_overload_answers_resource_exhausted_with_retry_info_across_hops(faulty):
    with grpc.insecure_channel(faulty.verifier) as vch:
        verifier = verifier_pb2_grpc.VerifierStub(vch)
        # Fill the verifier's only session slot directly; the drafter's Prefill is then refused downstream.
        sid = verifier.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7], max_tokens=8), timeout=30).session_id
        try:
            with Client(faulty.drafter) as c:
                with pytest.raises(grpc.RpcError) as e:
                    c.generate(PROMPT, max_tokens=8, drafter="ngram")
            err = e.value
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "verifier Prefill" in err.details() and "sessions" in err.details()
            ri = retry_info(err)
            assert ri is not None, "the verifier's RetryInfo must survive the hop"
            assert ri.retry_delay.seconds + ri.retry_delay.nanos / 1e9 == pytest.approx(1.0)
        finally:
            verifier.EndSession(verifier_pb2.EndSessionRequest(session_id=sid), timeout=10)

    # The drafter's own bound: one request at a time in this stack.
    with Client(faulty.drafter) as c:
        call = c.stream(Client.request(PROMPT, max_tokens=LONG, drafter="none", ignore_eos=True), timeout=60)
        next(call)
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, max_tokens=4)
        call.cancel()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "already running" in e.value.details() and retry_info(e.value) is not None
    held = idle(faulty)
    assert not any(held.values()), held


def test_verifier_device_queue_is_bounded_and_never_overlaps_forwards():
    """max_pending bounds the calls waiting for the device; a caller that leaves mid-forward keeps the
    device until that forward ends, so the next one never runs alongside it."""
    from pdflash.server import ServiceHost
    from verifier_svc.engine import StepOutput
    from verifier_svc.servicer import VerifierServicer

    intervals: list[tuple[float, float]] = []

    class SlowCore:
        def validate_prefill(self, req):
            pass

        def prefill(self, req):
            t0 = time.monotonic()
            time.sleep(0.6)
            intervals.append((t0, time.monotonic()))
            return StepOutput("s", 0, [1], 0, len(req.prompt), None, None, {}, 0, 0.0, 0.0)

    async def main():
        host = ServiceHost(["pdflash.v1.Verifier"])
        verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(SlowCore(), max_pending=2), host.server)
        port = host.add_port("127.0.0.1:0")
        await host.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                req = verifier_pb2.PrefillRequest(prompt_tokens=[1, 2], max_tokens=4)
                # One call that leaves mid-forward, then a flood.
                first = asyncio.ensure_future(stub.Prefill(req, timeout=0.2))
                await asyncio.sleep(0.1)
                flood = await asyncio.gather(*(stub.Prefill(req, timeout=10) for _ in range(6)), return_exceptions=True)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await first
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                return flood
        finally:
            await host.stop(0)

    flood = asyncio.run(main())
    refused = [r for r in flood if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert all(retry_info(r) is not None for r in refused)
    assert 1 <= len(flood) - len(refused) <= 2
    spans = sorted(intervals)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
