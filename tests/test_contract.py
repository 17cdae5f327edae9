"""One client test suite, run against the stub and against the real stack: a client sees the same behaviour.

Statuses and their details, the shape of a stream, request-id echo, Abort, cancel, deadlines, health and
reflection. The stub is made like the stack (`StubServer.like` its ModelInfo, the stack's tokenizer file, its
context) and paced like it (a few milliseconds a chunk), as a client developer would configure it to stand
in for their server. Then refusals are compared field for field, and a transcript recorded from the stack
replays as the stack answered.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdflash.client import Client
from pdflash.testing import StubServer
from pdflash.v1 import common_pb2, drafter_pb2
from tests.test_services import reflection_services
from tests.test_testing import chunks_and_final, details, outcome

pytestmark = pytest.mark.slow

TINY_CONTEXT = 2048  # pdflash.tiny's max_position_embeddings
# A request that runs for seconds on either: 2000 plain-decoding rounds on the stack, 2000 chunks 5 ms apart on the stub.
LONG = dict(max_tokens=2000, ignore_eos=True, drafter="none")


@pytest.fixture(scope="module")
def stub_like_stack(pdflash_stack):
    with StubServer.like(pdflash_stack.client.model_info(), tokenizer=pdflash_stack.stack.spec.model,
                         max_context=TINY_CONTEXT, delay_ms=5) as stub:
        yield stub


@pytest.fixture(params=["stub", "stack"])
def api(request):
    """The server under test, with .address and .client: the stub or the real stack."""
    return request.getfixturevalue("stub_like_stack" if request.param == "stub" else "pdflash_stack")


def test_stream_shape(api):
    prompt = [5, 6, 7, 8, 9, 10]
    call = api.client.stream(Client.request(prompt, max_tokens=12, ignore_eos=True, drafter="ngram", request_id="shape"), timeout=60)
    msgs = list(call)
    chunks, final = chunks_and_final(msgs)
    assert {m.request_id for m in msgs} == {"shape"} and ("x-request-id", "shape") in tuple(call.trailing_metadata())
    assert len(chunks[0].token_ids) == 1 and chunks[0].round == 0
    assert [c.round for c in chunks] == sorted({c.round for c in chunks}) and all(c.token_ids for c in chunks)
    u = final.usage
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert u.prompt_tokens == len(prompt) and u.completion_tokens == 12 == sum(len(c.token_ids) for c in chunks)
    assert u.rounds == len(chunks) - 1 and u.mean_acceptance_length == pytest.approx(11 / u.rounds)
    assert u.accepted_draft_tokens <= u.draft_tokens
    assert isinstance(final.text, str) and final.timings.ByteSize() >= 0


def test_request_id_echo(api):
    c = api.client
    via_md = list(c.stub.Generate(Client.request("x = 1", max_tokens=2), metadata=(("x-request-id", "md-id"),), timeout=60))
    assert {m.request_id for m in via_md} == {"md-id"}
    generated = {m.request_id for m in c.stream(Client.request("x = 1", max_tokens=2), timeout=60)}
    assert len(generated) == 1 and len(next(iter(generated))) == 32


# Built by hand: Client.request itself refuses out-of-range numbers before they reach a proto (tests/test_cli_ranges.py)
_G = drafter_pb2.GenerateRequest
BAD_REQUESTS = {
    "empty prompt": (_G(prompt="", max_tokens=4), {"prompt"}),
    "beyond the limits": (_G(prompt="x", max_tokens=10**6, sampling=common_pb2.SamplingParams(temperature=-2.0, top_k=-1)),
                          {"max_tokens", "sampling.temperature", "sampling.top_k"}),
    "ids outside the vocabulary": (_G(prompt_tokens=drafter_pb2.TokenIds(ids=[1, 10**6]), stop_token_ids=[-1]), {"prompt_tokens.ids", "stop_token_ids"}),
    "block too wide": (_G(prompt="x", block_size=10**4), {"block_size"}),
    "unknown drafter": (_G(prompt="x", drafter=42), {"drafter"}),
    "no input": (_G(max_tokens=3), {"prompt"}),
    "prompt beyond the context": (_G(prompt="def f(x):\n    return x\n" * 400), {"prompt"}),
    "request id too long": (_G(prompt="x", request_id="r" * 300), {"request_id"}),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_refusals(api, case):
    request, fields = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as e:
        list(api.client.stream(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {f for f, _ in details(e.value)["violations"]} == fields


def test_the_stub_refuses_as_the_stack_does(stub_like_stack, pdflash_stack):
    """Field for field: code, message, violations, for every bad request above, Abort's and an undecodable one."""

    def refusal(target, request):
        with pytest.raises(grpc.RpcError) as e:
            list(target.client.stream(request, timeout=60))
        return e.value.code(), e.value.details(), details(e.value)

    for case, (request, _) in sorted(BAD_REQUESTS.items()):
        assert refusal(stub_like_stack, request) == refusal(pdflash_stack, request), case
    for target in (stub_like_stack, pdflash_stack):
        with pytest.raises(grpc.RpcError) as e:
            target.client.abort("")
        assert (e.value.code(), details(e.value)["violations"]) == (
            grpc.StatusCode.INVALID_ARGUMENT, [("request_id", "required: the id of the running Generate to stop")])
        with grpc.insecure_channel(target.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(ch.unary_stream("/pdflash.v1.Drafter/Generate", request_serializer=lambda b: b)(b"\xff\xff", timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details(e.value)["violations"][0][0] == "(message)"


def test_abort(api):
    c = api.client
    call = c.stream(Client.request("def f():", request_id="abort-me", **LONG), timeout=120)
    first = next(call)
    assert c.abort("abort-me") is True
    chunks, final = chunks_and_final([first, *call])
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert final.usage.completion_tokens == sum(len(ch.token_ids) for ch in chunks) < LONG["max_tokens"]
    assert c.abort("abort-me") is False


def test_deadline(api):
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for msg in api.client.stream(Client.request("def g():", **LONG), timeout=0.5):
            got.append(msg)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(m.HasField("chunk") for m in got)


def wait_until_accepted(client: Client, request_id: str) -> None:
    """A request id is free again once the server has let the request go: it learns of a cancel a moment
    after the client, so retry while it still answers 'already running'."""
    for _ in range(300):
        try:
            list(client.stream(Client.request("x", max_tokens=1, request_id=request_id), timeout=60))
            return
        except grpc.RpcError as e:
            if "already running" not in (e.details() or ""):
                raise
        threading.Event().wait(0.02)
    raise AssertionError(f"{request_id} never released")


def test_cancel_and_duplicate_ids(api):
    c = api.client
    call = c.stream(Client.request("class A:", request_id="dup", **LONG), timeout=120)
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stream(Client.request("class B:", request_id="dup"), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "request_id 'dup' is already running"
    assert details(e.value)["violations"] == [("request_id", "must be unique among running requests")]
    call.cancel()
    wait_until_accepted(c, "dup")


def test_model_info_health_and_reflection(api):
    info = api.client.model_info()
    assert info.vocab_size > 0 and info.default_drafter in info.drafters and info.block_size <= info.max_block_size
    with grpc.insecure_channel(api.address) as ch:
        for service in ("", "pdflash.v1.Drafter"):
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    assert {"pdflash.v1.Drafter", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= reflection_services(api.address)


def test_text_prompts_count_the_same_tokens(stub_like_stack, pdflash_stack):
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    counts = [t.client.generate(prompt, max_tokens=1).usage.prompt_tokens for t in (stub_like_stack, pdflash_stack)]
    assert counts[0] == counts[1] > 0


def test_record_from_the_stack_then_replay(pdflash_stack, tmp_path):
    path = tmp_path / "stack.jsonl"
    asks = [Client.request([11, 12, 13, 11, 12], max_tokens=16, ignore_eos=True),
            Client.request("def add(a, b):", max_tokens=8, temperature=0.8, seed=5),
            Client.request("x", max_tokens=10**6)]
    with StubServer(record=str(path), upstream=pdflash_stack.address) as recorder:
        recorded = [outcome(recorder.client, r) for r in asks]
    with StubServer(replay=str(path), max_context=TINY_CONTEXT) as replay:
        assert replay.client.model_info() == pdflash_stack.client.model_info()
        assert [outcome(replay.client, r) for r in asks] == recorded
        greedy = replay.client.generate([11, 12, 13, 11, 12], max_tokens=16, ignore_eos=True)
    live = pdflash_stack.client.generate([11, 12, 13, 11, 12], max_tokens=16, ignore_eos=True)
    assert (greedy.token_ids, greedy.text, greedy.finish_reason) == (live.token_ids, live.text, live.finish_reason)
    assert recorded[2][0] == "INVALID_ARGUMENT" and recorded[0][0] == recorded[1][0] == "OK"
