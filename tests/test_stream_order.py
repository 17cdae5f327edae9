"""The order of a round's work in the drafter's loop: the Verify leaves first, then the ahead Admit and the
previous round's tokens (streaming behind); verified tokens always reach the client, in order, before a
finish, an abort or an error."""

from __future__ import annotations

import asyncio

import pytest

from drafter_svc.clients import PrefillOut, TicketInfo, VerifyOut
from drafter_svc.drafters import make_factory
from drafter_svc.loop import Deadline, Finished, Request, Tokens, run_request
from pdflash.errors import Unavailable
from pdflash.types import FinishReason, SamplingParams

UNION = {0: frozenset({0})}


class Log(list):
    pass


class Stream:
    """A VerifyStream double: round r emits [100 + r], accepting nothing; `fail_send` fails that round's send."""

    def __init__(self, log: Log, rounds: int, fail_send: int = 0):
        self.log, self.rounds, self.fail_send = log, rounds, fail_send
        self.sent = 0
        self.cancelled = False

    async def send(self, request_id, draft, ticket, return_features):
        if draft.round == self.fail_send:
            raise Unavailable("verifier went away")
        self.log.append(f"send {draft.round}")
        self.sent = draft.round

    async def receive(self):
        await asyncio.sleep(0.001)  # the forward
        r = self.sent
        self.log.append(f"answer {r}")
        done = FinishReason.LENGTH if r == self.rounds else None
        return VerifyOut([100 + r], 0, done, None, UNION, 0, 0.0, 0.0)

    def cancel(self):
        self.cancelled = True


class Verifier:
    def __init__(self, stream: Stream):
        self.stream = stream

    async def prefill(self, *args):
        self.stream.log.append("prefill")
        return PrefillOut("s", 7, None, None, UNION, 0, 0.0)

    def open_verify_stream(self, timeout):
        self.stream.log.append("open stream")
        return self.stream

    async def end(self, session_id):
        return True


class Scheduler:
    def __init__(self, log: Log):
        self.log = log

    async def admit(self, request_id, draft, timeout, reserve_tokens=0, release=()):
        self.log.append(f"admit {draft.round}" + (" ahead" if reserve_tokens else ""))
        return TicketInfo("t", "", 0.0, 0.0, reserve_tokens or len(draft.tokens), draft.expert_bytes)

    async def release(self, ticket_id):
        return True


def _run(rounds: int, fail_send: int = 0, abort_after: int = 0, stream_behind: bool = True):
    log = Log()
    stream = Stream(log, rounds, fail_send)
    abort = asyncio.Event()

    async def main():
        req = Request("r", (7,) * 8, 1000, SamplingParams(), (), True, 8)
        async for ev in run_request(req, make_factory("ngram", ""), Verifier(stream), Scheduler(log),
                                    Deadline(5.0), abort, stream_behind=stream_behind):
            if isinstance(ev, Tokens):
                log.append(f"tokens {ev.token_ids}")
                if abort_after and ev.token_ids == [100 + abort_after]:
                    abort.set()
            elif isinstance(ev, Finished):
                log.append(f"finished {ev.reason.name.lower()}")

    return log, stream, main


def test_the_verify_leaves_first_and_a_rounds_tokens_stream_while_the_next_one_verifies():
    log, stream, main = _run(rounds=3)
    asyncio.run(main())
    assert log[:2] == ["open stream", "prefill"]  # the stream is set up while the prompt's forward runs
    del log[:2]
    at = log.index
    assert log[0] == "tokens [7]"  # the first token, from prefill, at once
    assert at("admit 1 ahead") < at("send 1")  # round 1's admission travelled while the first token streamed
    for r in (1, 2, 3):
        assert at(f"send {r}") < at(f"admit {r + 1} ahead") < at(f"answer {r}")  # the Verify leaves first
    for r in (1, 2):  # a round's tokens while the next round verifies
        assert at(f"send {r + 1}") < at(f"tokens [{100 + r}]") < at(f"answer {r + 1}")
    assert log[-2:] == ["tokens [103]", "finished length"]  # the last round's at once, before the finish
    assert stream.cancelled  # the stream is closed once the request ends


def test_without_streaming_behind_tokens_go_out_before_the_next_round():
    log, _, main = _run(rounds=2, stream_behind=False)
    asyncio.run(main())
    assert log.index("tokens [101]") < log.index("send 2")


def test_verified_tokens_reach_the_client_before_an_error():
    log, stream, main = _run(rounds=5, fail_send=3)
    with pytest.raises(Unavailable):
        asyncio.run(main())
    assert [e for e in log if e.startswith("tokens")] == ["tokens [7]", "tokens [101]", "tokens [102]"]
    assert stream.cancelled  # nothing more goes over a stream after an error


def test_verified_tokens_reach_the_client_before_an_abort_ends_the_request():
    log, _, main = _run(rounds=10, abort_after=2)
    asyncio.run(main())
    toks = [e for e in log if e.startswith("tokens")]
    # Round 2's tokens arrive while round 3 verifies (streamed behind), so the abort is seen after round 3.
    assert toks == ["tokens [7]", "tokens [101]", "tokens [102]", "tokens [103]"]
    assert log[-1] == "finished aborted"
