"""The drafter's Generate frees a request's slot (and lets its loop clean up: the verifier session ended, every
admission given back) before the client hears the end, final message or error: a client that sends its next request
as soon as the last one ends finds the capacity free. With max_concurrent 1, tests/test_faults.py's overload test was
refused "1 requests already running" in stop 45's CI run, the earlier request's clean-up still under way.

The servicer is driven directly (no gRPC), its loop replaced by one whose clean-up takes a while."""

from __future__ import annotations

import asyncio

import pytest

from drafter_svc import servicer as S
from drafter_svc.clients import TargetInfo
from drafter_svc.config import DrafterConfig
from drafter_svc.loop import Finished, Tokens
from pdflash.errors import ResourceExhausted
from pdflash.testing.tokenizer import ByteTokenizer
from pdflash.types import DrafterKind, FinishReason
from pdflash.v1 import drafter_pb2


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, servicer):
        self.servicer, self.running_at_abort = servicer, None

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, md):
        pass

    def time_remaining(self):
        return 30.0

    async def abort_with_status(self, status):
        self.running_at_abort = len(self.servicer._running)
        raise _Aborted(status.code)


def _servicer(monkeypatch, fail: bool, clean_up_s: float = 0.05):
    cleaned = []

    async def run_request(req, *args, usage, **kw):
        try:
            yield Tokens([7, 8], 0)
            if fail:
                raise ResourceExhausted("verifier Prefill: 1 sessions open (limit 1); retry shortly")
            yield Finished(FinishReason.LENGTH, usage)
        finally:
            await asyncio.sleep(clean_up_s)  # (ending the verifier session, releasing admissions)
            cleaned.append(True)

    monkeypatch.setattr(S, "run_request", run_request)
    info = TargetInfo("m", "qwen3_moe", 2, 8, 300, 64, {0: [10] * 4}, (), 32)
    door = S.FrontDoor(DrafterConfig(max_concurrent=1), ByteTokenizer(), {DrafterKind.NGRAM: object()}, DrafterKind.NGRAM,
                       None, None, info)
    return S.DrafterServicer(door), cleaned


async def _drive(svc, ctx):
    seen = []
    request = drafter_pb2.GenerateRequest(prompt_tokens=drafter_pb2.TokenIds(ids=[5, 6, 7]), max_tokens=2,
                                          drafter=drafter_pb2.DRAFTER_KIND_NGRAM)
    async for msg in svc.Generate(request, ctx):
        seen.append((msg.WhichOneof("kind"), len(svc._running)))
    return seen


def test_the_slot_is_free_and_the_loop_cleaned_up_when_the_final_message_goes_out(monkeypatch):
    svc, cleaned = _servicer(monkeypatch, fail=False)
    seen = asyncio.run(_drive(svc, _Context(svc)))
    assert seen[0] == ("chunk", 1)  # running while it streams
    assert seen[-1] == ("final", 0) and cleaned == [True]


def test_the_slot_is_free_and_the_loop_cleaned_up_when_the_error_goes_out(monkeypatch):
    svc, cleaned = _servicer(monkeypatch, fail=True)
    ctx = _Context(svc)
    with pytest.raises(_Aborted):
        asyncio.run(_drive(svc, ctx))
    assert ctx.running_at_abort == 0 and cleaned == [True]
