"""The round loop of one request: prefill -> (draft -> admit -> verify -> stream -> release)* -> end.

Pure asyncio over two client objects (VerifierClient, SchedulerClient or anything with the same
methods); no protobuf here. Every exit path (finish, error, client cancel, Abort) ends the verifier
session and releases every admission ticket.

Admission ahead: while round r verifies, the next round's admission is already on its way (the
scheduler seats it at once from budget nobody waits for, or defers it). Round r+1 then goes
straight from drafting to Verify; its block carries the projection it was admitted with (one round
older than the freshest). Deferred or failed ahead admissions fall back to a normal Admit.

The verifier hop: a request's rounds go over one VerifyStream when the client offers it (the verifier
ends an unfinished session when its stream closes), else one Verify call per round. A round's request
is sent before anything else of the round runs here (ahead Admit, streaming), so that work, which
competes for the same cores on a small host, happens while the verifier computes.

Streaming behind (light drafters): a round's tokens go to the client once the next round's Verify is on
its way, not before it: the client write is off the critical path; the client hears them a fraction of
a millisecond later. A heavy (model) drafter's tokens stream at once, before its next draft. Tokens
already verified always reach the client before an error, a finish or an abort.

The verify width: each round drafts what the session's `VerifyWidth` (drafter_svc.width) allows, the
whole block in round 1, then according to what the previous round emitted (unless `fixed_width`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import structlog

from drafter_svc.width import RoundCost, VerifyWidth
from pdflash import torch_thread
from pdflash.errors import DeadlineExceeded
from pdflash.logging import get_logger
from pdflash.types import DraftResult, FinishReason, SamplingParams

log = get_logger("pdflash.drafter.loop")


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    block_size: int  # anchor + drafts: the widest verify; 1 = no drafting
    fixed_width: bool = False  # every round drafts block_size - 1 (default: the width adapts, drafter_svc.width)
    stop: tuple[str, ...] = ()  # stop sequences: the servicer's (drafter_svc.tokens.TextStream); the loop sees no text
    logprobs: bool = False  # the verifier returns each emitted token's log-probability (Tokens.logprobs)
    top_logprobs: int = 0  # and this many alternatives a position


@dataclasses.dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    admit_ms: float = 0.0
    verify_ms: float = 0.0
    verify_server_ms: float = 0.0
    verify_forward_ms: float = 0.0
    rounds_admitted_ahead: int = 0
    routed_expert_bytes: int = 0  # of the experts the verify forwards routed (the verifier's byte map)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify round: accepted drafts + the target's own token."""
        return (self.accepted_draft_tokens + self.rounds) / self.rounds if self.rounds else 0.0


@dataclasses.dataclass
class Tokens:
    """New tokens to stream (round 0 = the first token, from prefill)."""

    token_ids: list[int]
    round: int
    drafted: int = 0  # draft tokens verified this round
    accepted: int = 0  # of which accepted
    logprobs: list[float] | None = None  # with Request.logprobs: one per token
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # with top_logprobs: (ids, logprobs) per token


@dataclasses.dataclass
class Finished:
    reason: FinishReason
    usage: Usage


class Deadline:
    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed before it finished")
        return left


# How long the clean-up Admit of a timed-out Admit may wait (see _reclaim).
RECLAIM_TIMEOUT_S = 2.0
_background: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


def _in_background(coro) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _reclaim(scheduler, request_id: str, draft: DraftResult, reserve_tokens: int = 0) -> None:
    """An Admit that hit its deadline may still have been seated: the ticket was lost on the way back.

    Admitting the same block again returns the ticket the scheduler holds for that (session, round)
    (or seats a fresh one); releasing it gives the budget back now instead of at the lease's expiry.
    """
    try:
        ticket = await scheduler.admit(request_id, draft, RECLAIM_TIMEOUT_S, reserve_tokens=reserve_tokens)
        if not ticket.deferred:
            await scheduler.release(ticket.ticket_id)
    except Exception as e:  # nothing was held, or the scheduler is gone: the lease expires anyway
        log.debug("reclaim after a timed-out admit", session_id=draft.session_id, round=draft.round, error=str(e))


async def _admit(
    scheduler, request_id: str, draft: DraftResult, timeout: float | None, reserve_tokens: int = 0, release: tuple[str, ...] = ()
):
    """Admit, never stranding a lease: if we are cancelled while the answer is on its way, release the
    ticket it brings; if the Admit timed out, reclaim the ticket that may have been issued anyway.
    reserve_tokens > 0: admission ahead of drafting (may come back `deferred`, holding nothing).
    release: tickets of finished rounds that the same call gives back.
    """
    task = asyncio.ensure_future(scheduler.admit(request_id, draft, timeout, reserve_tokens=reserve_tokens, release=release))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def give_back(t: asyncio.Task) -> None:
            if t.cancelled():
                return
            if t.exception() is None:
                if not t.result().deferred:
                    _in_background(scheduler.release(t.result().ticket_id))
            elif isinstance(t.exception(), DeadlineExceeded):
                _in_background(_reclaim(scheduler, request_id, draft, reserve_tokens))

        task.add_done_callback(give_back)
        raise
    except DeadlineExceeded:
        _in_background(_reclaim(scheduler, request_id, draft, reserve_tokens))
        raise


@dataclasses.dataclass
class _Ahead:
    """The next round's admission, in flight while the current round verifies."""

    round: int
    union: object  # the ExpertUnion it was admitted with; the round's block must carry it
    union_bytes: int  # its stored bytes (the verifier's count)
    task: asyncio.Task
    released: tuple[str, ...] = ()  # tickets of finished rounds this call gives back

    async def take(self, block_len: int, releases: list[asyncio.Future], scheduler):
        """The ticket, if it was seated and the block fits in it; else None (admit normally)."""
        try:
            ticket = await asyncio.shield(self.task)
        except Exception as e:  # an ahead admission is an optimization: the normal Admit reports real errors
            log.debug("admit ahead failed", round=self.round, error=str(e))
            self._release_carried(releases, scheduler)
            return None
        if ticket.deferred:
            return None
        if block_len > ticket.tokens:  # cannot happen (the reservation is an upper bound); never verify outside it
            releases.append(asyncio.ensure_future(_release(scheduler, ticket.ticket_id)))
            return None
        return ticket

    def drop(self, releases: list[asyncio.Future], scheduler) -> None:
        """Not needed after all: give back whatever it holds or will hold."""
        if not self.task.done():
            self.task.cancel()  # _admit releases a ticket that arrives after this
            self._release_carried(releases, scheduler)  # the call may not have reached the scheduler
        elif self.task.cancelled() or self.task.exception() is not None:
            self._release_carried(releases, scheduler)
        elif not self.task.result().deferred:
            releases.append(asyncio.ensure_future(_release(scheduler, self.task.result().ticket_id)))

    def _release_carried(self, releases: list[asyncio.Future], scheduler) -> None:
        releases.extend(asyncio.ensure_future(_release(scheduler, t)) for t in self.released)
        self.released = ()


def _flush(to_release: list[str], releases: list[asyncio.Future], scheduler) -> None:
    """Release now what was waiting to ride on a next Admit."""
    releases.extend(asyncio.ensure_future(_release(scheduler, t)) for t in to_release)
    to_release.clear()


async def _release(scheduler, ticket_id: str) -> None:
    try:
        await scheduler.release(ticket_id)
    except Exception as e:  # the lease expires anyway; never mask the real outcome
        log.warning("release failed", ticket_id=ticket_id, error=str(e))


async def _drain(releases: list[asyncio.Future], usage: Usage) -> None:
    pending = [f for f in releases if not f.done()]
    releases.clear()
    if pending:
        t0 = time.perf_counter()
        await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
        usage.admit_ms += (time.perf_counter() - t0) * 1e3


async def _clean_up(verifier, session_id: str, releases: list[asyncio.Future], usage: Usage) -> None:
    await _drain(releases, usage)
    if session_id:
        # Cancelled, aborted or failed mid-way: free the verifier's KV now, not at its idle timeout.
        try:
            await verifier.end(session_id)
        except Exception as e:
            log.warning("end session failed", session_id=session_id, error=str(e))


async def run_request(
    req: Request,
    drafter_factory,
    verifier,
    scheduler,
    deadline: Deadline,
    abort: asyncio.Event | None = None,
    admit_ahead: bool = True,
    verify_stream: bool = True,
    stream_behind: bool = True,
    round_cost: RoundCost | None = None,
    usage: Usage | None = None,
) -> AsyncIterator[Tokens | Finished]:
    """`usage`: filled in as the rounds go (one made here when None): a caller that closes the generator early (a stop
    sequence) still has the request's usage so far."""
    usage = usage if usage is not None else Usage()
    usage.prompt_tokens = len(req.prompt)
    drafter = drafter_factory.new_session(req.sampling)
    width = VerifyWidth(req.block_size, adaptive=not req.fixed_width, cost=round_cost)
    heavy = bool(drafter_factory.feature_layer_ids)
    releases: list[asyncio.Future] = []
    session_id = ""
    finished: FinishReason | None = None
    verifier_done = False  # the verifier ended the session itself (finished there)
    ahead: _Ahead | None = None  # the next round's admission, sent while this round verifies
    to_release: list[str] = []  # tickets of verified rounds: they ride on the next ahead Admit
    behind: Tokens | None = None  # a round's tokens not yet streamed (stream_behind)
    stream = None  # the session's VerifyStream, when the verifier client offers one
    try:
        if verify_stream and hasattr(verifier, "open_verify_stream"):
            # Opened now: the call is set up while the prompt's forward runs, not on round 1's path.
            stream = verifier.open_verify_stream(deadline.remaining())  # this session's rounds, one call
        t0 = time.perf_counter()
        pre = await verifier.prefill(
            req.request_id,
            list(req.prompt),
            req.sampling,
            req.max_tokens,
            list(req.stop_token_ids),
            req.ignore_eos,
            list(drafter_factory.feature_layer_ids),
            deadline.remaining(),
            req.logprobs,
            req.top_logprobs,
        )
        usage.prefill_ms = (time.perf_counter() - t0) * 1e3
        session_id = pre.session_id
        structlog.contextvars.bind_contextvars(session_id=session_id)  # every later log line of this request
        finished = pre.finished
        verifier_done = finished is not None
        usage.completion_tokens = 1
        anchor = pre.first_token
        union = pre.routed_union  # best projection for round 1: what the prompt routed
        # Its stored bytes as the verifier counted them (with the byte map it gave us; it checks them on each Verify):
        # the drafter never reads a union, it sends it on (pdflash.convert keeps it as the messages it came in).
        union_b = pre.routed_bytes
        if finished is None and admit_ahead and req.max_tokens - 1 >= 1:
            # Round 1's admission, ahead: it travels while the first token streams and the drafter reads the prompt.
            reserve = min(1 + width.drafts(), req.max_tokens - 1)
            first = DraftResult(session_id, 1, (), union, union_b)
            ahead = _Ahead(1, union, union_b, asyncio.ensure_future(_admit(
                scheduler, req.request_id, first, deadline.remaining(), reserve_tokens=reserve)))
        yield Tokens([pre.first_token], 0, logprobs=pre.logprobs, top_logprobs=pre.top_logprobs)
        if finished is not None:
            yield Finished(finished, usage)
            return
        if heavy:  # torch work: on the process's torch thread (pdflash.torch_thread says why)
            await torch_thread.run(drafter.start, list(req.prompt), pre.features)
        else:
            drafter.start(list(req.prompt), pre.features)
        rnd = 0
        while finished is None:
            if abort is not None and abort.is_set():
                finished = FinishReason.ABORTED
                break
            rnd += 1
            remaining = req.max_tokens - usage.completion_tokens  # a verify emits at most drafts + 1
            k = max(0, min(width.drafts(), remaining - 1))
            t0 = t_round = time.perf_counter()
            if k <= 0:
                proposal = []
            elif heavy:  # a model forward: keep the event loop free for other streams and health
                proposal = await torch_thread.run(drafter.propose, anchor, k)
            else:
                proposal = drafter.propose(anchor, k)
            drafts = list(proposal)[:k]
            dists = tuple(getattr(proposal, "dists", ()))[: len(drafts)]  # sampled drafts' distributions
            usage.draft_ms += (time.perf_counter() - t0) * 1e3
            tokens = (anchor, *drafts)
            t0 = time.perf_counter()
            ticket = None
            if ahead is not None:
                ticket = await ahead.take(len(tokens), releases, scheduler)
                taken, ahead = ahead, None  # only now: a cancel while waiting must still drop it
            if ticket is not None:
                draft = DraftResult(session_id, rnd, tokens, taken.union, taken.union_bytes, dists)
                usage.rounds_admitted_ahead += 1
            else:
                draft = DraftResult(session_id, rnd, tokens, union, union_b, dists)
                # Finished rounds' tickets ride on this Admit: never hold a lease while waiting for the next
                # (sessions holding budget while queueing for more would starve each other until expiry).
                carried = tuple(to_release)
                to_release.clear()
                try:
                    ticket = await _admit(scheduler, req.request_id, draft, deadline.remaining(), release=carried)
                except BaseException:
                    to_release.extend(carried)  # perhaps not released: the clean-up releases them (idempotent)
                    raise
            t1 = time.perf_counter()
            usage.admit_ms += (t1 - t0) * 1e3
            verify = None
            try:
                if stream is not None:
                    # On its way before anything else of this round runs here (the ahead Admit, the previous
                    # round's tokens to the client): on a small host that work would delay the request itself.
                    await stream.send(req.request_id, draft, ticket, drafter.needs_features)
                    verify = asyncio.ensure_future(stream.receive())
                else:
                    verify = asyncio.ensure_future(
                        verifier.verify(req.request_id, draft, ticket, drafter.needs_features, deadline.remaining()))
                    # The Verify leaves first (two loop turns: our task, then the call's own).
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                # This round emits at least one token: the next one has at most remaining - 1 to go.
                if admit_ahead and remaining - 1 >= 1:
                    reserve = min(1 + width.bound_after(len(drafts)), remaining - 1)  # the next block can't be wider
                    nxt = DraftResult(session_id, rnd + 1, (), union, union_b)
                    timeout = deadline.remaining()  # may raise: before the tickets move from to_release
                    carried = tuple(to_release)
                    ahead = _Ahead(rnd + 1, union, union_b, asyncio.ensure_future(_admit(
                        scheduler, req.request_id, nxt, timeout, reserve_tokens=reserve, release=carried)), carried)
                    to_release.clear()
                if behind is not None:  # the previous round's tokens, while this round verifies
                    ev, behind = behind, None
                    yield ev
                res = await verify
            finally:
                answered = verify is not None and verify.done() and not verify.cancelled() and verify.exception() is None
                if verify is not None and not verify.done():
                    verify.cancel()
                t2 = time.perf_counter()
                # Given back on the next round's ahead Admit (now, when there will be none); awaited at the end.
                releases[:] = [f for f in releases if not f.done()]
                to_release.append(ticket.ticket_id)
                if not (admit_ahead and answered):
                    _flush(to_release, releases, scheduler)
            usage.verify_ms += (t2 - t1) * 1e3
            usage.verify_server_ms += res.server_ms
            usage.verify_forward_ms += res.forward_ms
            usage.routed_expert_bytes += res.routed_bytes
            usage.rounds += 1
            usage.draft_tokens += len(drafts)
            usage.accepted_draft_tokens += res.num_accepted
            if len(usage.accepted_per_position) < len(drafts):
                usage.accepted_per_position += [0] * (len(drafts) - len(usage.accepted_per_position))
            for i in range(res.num_accepted):
                usage.accepted_per_position[i] += 1
            usage.completion_tokens += len(res.tokens)
            width.observe(res.num_accepted, len(drafts), (t2 - t_round) * 1e3, res.offloaded)
            finished = res.finished
            verifier_done = finished is not None
            if finished is None:
                committed = [anchor, *drafts[: res.num_accepted]]
                if heavy:
                    await torch_thread.run(drafter.commit, committed, res.features)
                else:
                    drafter.commit(committed, res.features)
                anchor = res.tokens[-1]
                union = res.routed_union
                union_b = res.routed_bytes
            ev = Tokens(res.tokens, rnd, len(drafts), res.num_accepted, res.logprobs, res.top_logprobs)
            if stream_behind and not heavy and finished is None:
                behind = ev  # streamed once the next round's Verify is on its way
            else:
                yield ev
        if behind is not None:  # aborted between rounds
            ev, behind = behind, None
            yield ev
        if ahead is not None:  # reserved for a round that will not come
            try:
                await asyncio.shield(ahead.task)
            except Exception:
                pass
            ahead.drop(releases, scheduler)
            ahead = None
        _flush(to_release, releases, scheduler)
        await _drain(releases, usage)  # budget is back before the client hears "finished"
        yield Finished(finished, usage)
    except Exception:
        if behind is not None:  # tokens the target already emitted: the client hears them before the error
            ev, behind = behind, None
            yield ev
        raise
    finally:
        if stream is not None:  # finished, failed or cancelled: nothing more goes over it
            stream.cancel()
        if ahead is not None:
            ahead.drop(releases, scheduler)
        _flush(to_release, releases, scheduler)
        drafter.close()
        structlog.contextvars.unbind_contextvars("session_id")
        # One shielded task for all of the clean-up: a second cancel (the client's deadline firing while
        # we clean up after a hop's own deadline) must not skip ending the session.
        await asyncio.shield(asyncio.ensure_future(
            _clean_up(verifier, session_id if session_id and not verifier_done else "", releases, usage)))
