"""Verifier.VerifyStream: one stream per session, Verify's answers and errors, KV freed when cancelled."""

from __future__ import annotations

import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdflash.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7]


def _prefill(stub, max_tokens=64):
    return stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=PROMPT, max_tokens=max_tokens, ignore_eos=True), timeout=30)


def _alive(stub) -> int:
    return stub.GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10).sessions_alive


def _round(session_id, rnd, anchor, drafts=(11, 12)):
    return verifier_pb2.VerifyRequest(draft=common_pb2.DraftResult(session_id=session_id, round=rnd, tokens=[anchor, *drafts]))


def test_stream_answers_each_round_like_verify(stack):
    with grpc.insecure_channel(stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        a, b = _prefill(stub), _prefill(stub)
        assert a.first_token == b.first_token
        # Session a over one stream, session b with one Verify call per round: the same answers.
        anchor_a = anchor_b = a.first_token
        requests, answers = [], []

        def feed():
            for rnd in range(1, 4):
                req = _round(a.session_id, rnd, anchor_a)
                requests.append(req)
                yield req
                while len(answers) < rnd:
                    time.sleep(0.001)

        for rnd, res in enumerate(stub.VerifyStream(feed(), timeout=30), start=1):
            anchor_a = res.accepted_tokens[-1]  # before the answer counts: feed() reads it for the next round
            answers.append(res)
            unary = stub.Verify(_round(b.session_id, rnd, anchor_b), timeout=30)
            anchor_b = unary.accepted_tokens[-1]
            assert (res.round, list(res.accepted_tokens), res.num_accepted_drafts, res.committed_tokens) == (
                unary.round, list(unary.accepted_tokens), unary.num_accepted_drafts, unary.committed_tokens)
        assert len(answers) == 3
        # The stream ended (half-closed) with session a unfinished: it ended a; b is ours to end.
        assert not stub.EndSession(verifier_pb2.EndSessionRequest(session_id=a.session_id), timeout=10).ended
        assert stub.EndSession(verifier_pb2.EndSessionRequest(session_id=b.session_id), timeout=10).ended


def test_an_invalid_round_ends_the_stream_with_verifys_status(stack):
    with grpc.insecure_channel(stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        pre = _prefill(stub)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.VerifyStream(iter([_round(pre.session_id, 2, pre.first_token)]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(e.value)
        fields = set()
        for d in status.details:
            br = error_details_pb2.BadRequest()
            if d.Unpack(br):
                fields |= {v.field for v in br.field_violations}
        assert "draft.round" in fields
        assert stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10).ended


def test_a_stream_that_ends_ends_its_unfinished_session(stack):
    with grpc.insecure_channel(stack.verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        before = _alive(stub)
        pre = _prefill(stub)
        assert _alive(stub) == before + 1
        hold = []

        def feed():
            yield _round(pre.session_id, 1, pre.first_token)
            while not hold:  # keep the stream open until the client cancels it
                time.sleep(0.01)

        call = stub.VerifyStream(feed(), timeout=30)
        first = next(call)
        assert first.round == 1 and not first.finished
        call.cancel()
        hold.append(True)
        end = time.monotonic() + 10
        while _alive(stub) != before and time.monotonic() < end:
            time.sleep(0.05)
        assert _alive(stub) == before  # the KV cache was freed without an EndSession
        assert not stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10).ended
