"""The scheduler as a real gRPC server on port 0, its asyncio core, and its configuration."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

import grpc
import pytest
import structlog
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from pdflash.config import ConfigError, describe, from_sources
from pdflash.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc import server as scheduler_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import SchedulerCore
from scheduler_svc.leases import TicketSigner
from scheduler_svc.policy import Demand

SERVICE = "pdflash.v1.Scheduler"


def admit_req(session="s1", round=1, tokens=8, nbytes=0, request_id="") -> scheduler_pb2.AdmitRequest:
    return scheduler_pb2.AdmitRequest(
        request_id=request_id or f"{session}/{round}",
        draft=common_pb2.DraftResult(
            session_id=session,
            round=round,
            tokens=list(range(tokens)),
            expert_union=[common_pb2.LayerExperts(layer=0, expert_ids=[1, 4])],
            expert_bytes=nbytes,
        ),
    )


def with_server(body, timeout=20.0, **options):
    """Start a scheduler on a free port, run body(sched, stub, channel), stop it; all in one event loop."""

    async def main():
        sched = await scheduler_server.start(SchedulerConfig(port=0, **options))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
                await ch.channel_ready()
                await body(sched, scheduler_pb2_grpc.SchedulerStub(ch), ch)
        finally:
            await sched.stop(0)

    asyncio.run(asyncio.wait_for(main(), timeout))


async def until(predicate, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def detail(err: grpc.aio.AioRpcError, kind):
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    for any_ in status.details:
        if any_.Is(kind.DESCRIPTOR):
            out = kind()
            any_.Unpack(out)
            return out
    raise AssertionError(f"no {kind.DESCRIPTOR.name} in {status}")


# -- the server -------------------------------------------------------------------------------------


def test_health_serving_and_reflection_lists_the_service():
    async def body(sched, stub, ch):
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        resp = await call.read()
        await call.done_writing()
        names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names

    with_server(body)


def test_admit_release_and_stats():
    async def body(sched, stub, ch):
        t = await stub.Admit(admit_req("s1", 1, tokens=8, nbytes=100), timeout=5)
        assert (t.session_id, t.round, t.tokens, t.expert_bytes) == ("s1", 1, 8, 100)
        assert t.ticket_id and not t.admitted_alone and t.signature == ""
        assert 0 < t.lease_s <= 30.0 and t.expires_at_unix > 0 and t.waited_ms >= 0
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.token_budget, s.byte_budget, s.tokens_in_use, s.bytes_in_use, s.in_flight) == (32, 0, 8, 100, 1)
        assert (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id))).released
        assert not (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id))).released
        assert not (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id="t-nope"))).released
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.tokens_in_use, s.in_flight, s.admitted_total, s.released_total) == (0, 0, 1, 1)

    with_server(body, token_budget=32)


def test_second_admit_waits_until_the_first_releases():
    async def body(sched, stub, ch):
        first = await stub.Admit(admit_req("a", 1, tokens=12), timeout=5)
        second = asyncio.ensure_future(stub.Admit(admit_req("b", 1, tokens=12), timeout=5))
        await until(lambda: _waiting(stub, 1))
        await asyncio.sleep(0.1)
        assert not second.done()
        await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=first.ticket_id))
        t = await second
        assert t.session_id == "b" and t.waited_ms >= 100
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.waiting, s.in_flight, s.tokens_in_use) == (0, 1, 12)

    with_server(body, token_budget=16)


def test_admit_ahead_is_seated_at_once_or_deferred_never_queued():
    def ahead(session, round, reserve, nbytes=0, tokens=0):
        req = admit_req(session, round, tokens=tokens, nbytes=nbytes)
        req.reserve_tokens = reserve
        return req

    async def body(sched, stub, ch):
        # Free budget, nobody waiting: seated for the reserved tokens, before any block exists.
        t = await stub.Admit(ahead("a", 2, 12, nbytes=100), timeout=5)
        assert t.ticket_id and not t.deferred and (t.round, t.tokens, t.expert_bytes, t.waited_ms) == (2, 12, 100, 0.0)
        # Does not fit beside it: answered at once, deferred, nothing held or queued.
        d = await stub.Admit(ahead("b", 2, 12), timeout=5)
        assert d.deferred and not d.ticket_id
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.in_flight, s.waiting, s.tokens_in_use) == (1, 0, 12)
        # A normal Admit waits for a; an ahead admission that would fit is still deferred: the budget is b's.
        waiter = asyncio.ensure_future(stub.Admit(admit_req("b", 1, tokens=8), timeout=5))
        await until(lambda: _waiting(stub, 1))
        assert (await stub.Admit(ahead("c", 2, 2), timeout=5)).deferred
        await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id))
        assert (await waiter).session_id == "b"
        # A retried ahead admission for a held round returns the same ticket.
        again = await stub.Admit(ahead("d", 5, 4), timeout=5)
        assert (await stub.Admit(ahead("d", 5, 4), timeout=5)).ticket_id == again.ticket_id
        # An Admit gives back the tickets of finished rounds first (one call instead of Admit + Release).
        nxt = ahead("d", 6, 4)
        nxt.release_ticket_ids.append(again.ticket_id)
        t6 = await stub.Admit(nxt, timeout=5)
        assert not (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=again.ticket_id))).released
        assert (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t6.ticket_id))).released
        # Validation: a block longer than the reservation, an absurd reservation.
        for bad, field in ((ahead("e", 1, 2, tokens=3), "draft.tokens"), (ahead("e", 1, 10**6), "reserve_tokens")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Admit(bad, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in {v.field for v in detail(e.value, error_details_pb2.BadRequest).field_violations}

    with_server(body, token_budget=16)


async def _waiting(stub, n) -> bool:
    return (await stub.GetStats(scheduler_pb2.StatsRequest())).waiting == n


def test_many_drafters_share_the_budget():
    # Eight sessions run admit -> verify -> release rounds concurrently; nobody waits forever and the
    # budgets hold at every instant the stats are read.
    async def body(sched, stub, ch):
        async def drafter(i):
            for r in range(1, 9):
                t = await stub.Admit(admit_req(f"s{i}", r, tokens=4 + 3 * (i % 4), nbytes=100 * (i % 3)), timeout=10)
                await asyncio.sleep(0.002 * (i % 3))
                assert (await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id))).released

        async def watch():
            while True:
                s = await stub.GetStats(scheduler_pb2.StatsRequest())
                assert s.in_flight <= 1 or (s.tokens_in_use <= 24 and s.bytes_in_use <= 300), s
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        await asyncio.gather(*(drafter(i) for i in range(8)))
        assert not watcher.done()
        watcher.cancel()
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.admitted_total, s.released_total, s.in_flight, s.waiting, s.rejected_total) == (64, 64, 0, 0, 0)

    with_server(body, token_budget=24, byte_budget=300)


def test_block_over_the_budget_is_admitted_alone():
    async def body(sched, stub, ch):
        t = await stub.Admit(admit_req("big", 1, tokens=40), timeout=5)
        assert t.admitted_alone
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(admit_req("small", 1, tokens=1), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    with_server(body, token_budget=16)


def test_cancelled_admit_gives_its_place_back():
    async def body(sched, stub, ch):
        first = await stub.Admit(admit_req("a", 1, tokens=16), timeout=5)
        call = stub.Admit(admit_req("b", 1, tokens=16), timeout=10)
        await until(lambda: _waiting(stub, 1))
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: _waiting(stub, 0))
        await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=first.ticket_id))
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.in_flight, s.tokens_in_use, s.admitted_total, s.rejected_total) == (0, 0, 1, 0)

    with_server(body, token_budget=16)


def test_full_queue_answers_resource_exhausted_with_retry_info():
    async def body(sched, stub, ch):
        await stub.Admit(admit_req("a", 1, tokens=16), timeout=5)
        waiting = asyncio.ensure_future(stub.Admit(admit_req("b", 1, tokens=16), timeout=10))
        await until(lambda: _waiting(stub, 1))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(admit_req("c", 1, tokens=16), timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting" in e.value.details()
        retry = detail(e.value, error_details_pb2.RetryInfo)
        assert retry.retry_delay.ToTimedelta().total_seconds() > 0
        assert (await stub.GetStats(scheduler_pb2.StatsRequest())).rejected_total == 1
        waiting.cancel()

    with_server(body, token_budget=16, max_waiting=1)


def test_max_wait_answers_resource_exhausted_and_call_deadline_deadline_exceeded():
    async def body(sched, stub, ch):
        await stub.Admit(admit_req("a", 1, tokens=16), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(admit_req("b", 1, tokens=16), timeout=5)  # max_wait_s (0.3) is shorter
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        detail(e.value, error_details_pb2.RetryInfo)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(admit_req("b", 1, tokens=16), timeout=0.2)  # the call's deadline is shorter
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: _waiting(stub, 0))
        assert (await stub.GetStats(scheduler_pb2.StatsRequest())).rejected_total == 1

    with_server(body, token_budget=16, max_wait_s=0.3)


def test_invalid_admit_lists_field_violations():
    async def body(sched, stub, ch):
        bad = scheduler_pb2.AdmitRequest(draft=common_pb2.DraftResult(session_id="", round=0))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(bad, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        fields = {v.field for v in detail(e.value, error_details_pb2.BadRequest).field_violations}
        assert fields == {"draft.session_id", "draft.round", "draft.tokens"}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Admit(scheduler_pb2.AdmitRequest(request_id="r"), timeout=5)
        assert {v.field for v in detail(e.value, error_details_pb2.BadRequest).field_violations} == {"draft"}
        for call in (stub.Release(scheduler_pb2.ReleaseRequest()), stub.Renew(scheduler_pb2.RenewRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with_server(body)


def test_forgotten_lease_expires_and_its_budget_goes_to_the_next():
    async def body(sched, stub, ch):
        await stub.Admit(admit_req("dead-drafter", 1, tokens=16), timeout=5)  # never released
        t = await stub.Admit(admit_req("b", 1, tokens=16), timeout=5)
        assert t.waited_ms >= 200
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.expired_total, s.in_flight, s.tokens_in_use) == (1, 1, 16)

    with_server(body, token_budget=16, lease_s=0.3)


def test_renew_extends_and_unknown_is_not_found():
    async def body(sched, stub, ch):
        t = await stub.Admit(admit_req("a", 1), timeout=5)
        await asyncio.sleep(0.2)
        r = await stub.Renew(scheduler_pb2.RenewRequest(ticket_id=t.ticket_id))
        assert r.ticket_id == t.ticket_id and r.expires_at_unix - t.expires_at_unix >= 0.15
        assert 4.9 <= r.lease_s <= 5.0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Renew(scheduler_pb2.RenewRequest(ticket_id="t-nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Renew(scheduler_pb2.RenewRequest(ticket_id=t.ticket_id))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

    with_server(body, lease_s=5.0)


def test_tickets_are_signed_when_a_secret_is_set():
    async def body(sched, stub, ch):
        t = await stub.Admit(admit_req("a", 3, tokens=5, nbytes=77), timeout=5)
        signer = TicketSigner("s3cret")
        assert signer.verify(t.signature, t.ticket_id, t.session_id, t.round, t.tokens, t.expert_bytes, t.expires_at_unix)
        assert not signer.verify(t.signature, t.ticket_id, t.session_id, t.round, t.tokens + 1, t.expert_bytes, t.expires_at_unix)

    with_server(body, ticket_secret="s3cret")


def test_retried_admit_for_a_held_round_returns_the_same_ticket():
    async def body(sched, stub, ch):
        t1 = await stub.Admit(admit_req("a", 7, tokens=8), timeout=5)
        t2 = await stub.Admit(admit_req("a", 7, tokens=8), timeout=5)
        assert t2.ticket_id == t1.ticket_id
        t3 = await stub.Admit(admit_req("a", 7, tokens=10), timeout=5)  # a different block: a new lease
        assert t3.ticket_id != t1.ticket_id
        s = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert (s.in_flight, s.tokens_in_use) == (1, 10)

    with_server(body, token_budget=32)


def test_stop_answers_waiting_admits_unavailable():
    async def main():
        sched = await scheduler_server.start(SchedulerConfig(port=0, token_budget=4))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            await stub.Admit(admit_req("a", 1, tokens=4), timeout=5)
            waiting = asyncio.ensure_future(stub.Admit(admit_req("b", 1, tokens=4), timeout=10))
            await until(lambda: _waiting(stub, 1))
            await sched.stop(1.0)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await waiting
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(asyncio.wait_for(main(), 20))


def test_serve_stops_on_its_stop_event():
    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(scheduler_server.serve(SchedulerConfig(port=0, grace_s=0.1), stop_event=stop))
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


# -- the core, without gRPC -------------------------------------------------------------------------


def test_caller_cancelled_right_after_being_seated_gives_the_lease_back():
    async def main():
        core = SchedulerCore(SchedulerConfig(token_budget=16))
        await core.start()
        first = await core.admit(Demand("a", 1, 16, 0))
        task = asyncio.ensure_future(core.admit(Demand("b", 1, 16, 0)))
        while core.stats().waiting != 1:
            await asyncio.sleep(0)
        core.release(first.ticket_id)  # seats b synchronously...
        assert core.stats().in_flight == 1
        task.cancel()  # ...but its caller leaves before it runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        s = core.stats()
        assert (s.in_flight, s.tokens_in_use, s.waiting, s.admitted_total, s.released_total) == (0, 0, 0, 2, 2)
        await core.stop()

    asyncio.run(main())


def test_newer_admit_for_the_same_waiting_round_takes_its_place():
    async def main():
        core = SchedulerCore(SchedulerConfig(token_budget=16))
        await core.start()
        first = await core.admit(Demand("a", 1, 16, 0))
        old = asyncio.ensure_future(core.admit(Demand("b", 1, 16, 0)))
        while core.stats().waiting != 1:
            await asyncio.sleep(0)
        new = asyncio.ensure_future(core.admit(Demand("b", 1, 16, 0)))
        await asyncio.sleep(0.01)
        assert old.done() and old.exception().code == grpc.StatusCode.ABORTED
        assert core.stats().waiting == 1
        core.release(first.ticket_id)
        assert (await new).session_id == "b"
        await core.stop()

    asyncio.run(main())


def test_log_lines_carry_session_round_and_ticket():
    async def main():
        core = SchedulerCore(SchedulerConfig(token_budget=16))
        t = await core.admit(Demand("sess-9", 4, 8, 0, request_id="req-1"))
        core.release(t.ticket_id)
        return t

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            t = asyncio.run(main())
    finally:
        structlog.configure(**saved)
    admitted = next(e for e in logs if e["event"] == "admitted")
    released = next(e for e in logs if e["event"] == "released")
    for e in (admitted, released):
        assert (e["session_id"], e["round"], e["ticket_id"]) == ("sess-9", 4, t.ticket_id)
    assert admitted["request_id"] == "req-1"


# -- configuration ----------------------------------------------------------------------------------


def parse(argv: list[str], env: dict[str, str] | None = None) -> SchedulerConfig:
    parser = argparse.ArgumentParser(prog="pdflash serve-scheduler")
    scheduler_server.add_arguments(parser)
    return from_sources(SchedulerConfig, parser.parse_args(argv), env=env or {})


def test_config_from_flags_env_and_file(tmp_path):
    cfg_file = tmp_path / "sched.yaml"
    cfg_file.write_text("token_budget: 64\nlease_s: 2.5\n")
    cfg = parse(["--config", str(cfg_file), "--port", "0", "--byte-budget", "1000"], env={"PDFLASH_LEASE_S": "7"})
    assert (cfg.port, cfg.token_budget, cfg.byte_budget, cfg.lease_s) == (0, 64, 1000, 7.0)
    assert describe(SchedulerConfig(ticket_secret="k"))["ticket_secret"] == "***"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--token-budget", "0"], "--token-budget"),
        (["--byte-budget", "-1"], "--byte-budget"),
        (["--lease-s", "0"], "--lease-s"),
        (["--max-wait-s", "-2"], "--max-wait-s"),
        (["--max-waiting", "0"], "--max-waiting"),
        (["--max-waiting-per-session", "0"], "--max-waiting-per-session"),
        (["--max-bypass", "-1"], "--max-bypass"),
        (["--port", "70000"], "--port"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_config_validation_names_the_option(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse(argv)


def test_main_reports_a_bad_option_and_exits_2(capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("PDFLASH_"):
            monkeypatch.delenv(name)
    assert scheduler_server.main(["--token-budget", "0"]) == 2
    assert "--token-budget" in capsys.readouterr().err
    with contextlib.suppress(SystemExit):
        scheduler_server.main(["--help"])
    assert "pdflash serve-scheduler" in capsys.readouterr().out
