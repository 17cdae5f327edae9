"""The stub server and what client developers get with it (pdflash.testing): scripted answers, faults with
the drafter's details, stalls and deadlines, Abort and cancel, auth and TLS, record and replay, `pdflash
stub`, and imports free of torch and transformers. Real servers on free ports; no timed assertions.

The same client behaviour against the real stack is tests/test_contract.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from pdflash.client import Client
from pdflash.config import ConfigError
from pdflash.testing import StubServer
from pdflash.testing.config import Script
from pdflash.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]


def details(err: grpc.RpcError) -> dict:
    """The rich details of a status: BadRequest field violations and RetryInfo's delay."""
    out: dict = {"violations": [], "retry_after_s": None}
    status = rpc_status.from_call(err)
    for d in status.details if status is not None else ():
        br, ri = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if d.Unpack(br):
            out["violations"] += [(v.field, v.description) for v in br.field_violations]
        elif d.Unpack(ri):
            out["retry_after_s"] = ri.retry_delay.seconds + ri.retry_delay.nanos / 1e9
    return out


def chunks_and_final(messages) -> tuple[list, drafter_pb2.Final]:
    assert messages and messages[-1].HasField("final"), messages
    assert all(m.HasField("chunk") for m in messages[:-1])
    return [m.chunk for m in messages[:-1]], messages[-1].final


# -- scripted answers ------------------------------------------------------------------------------------


def test_echo_streams_the_prompt_back_in_chunks(pdflash_stub):
    call = pdflash_stub.client.stream(Client.request("héllo, wörld", max_tokens=64, request_id="r1"), timeout=10)
    msgs = list(call)
    chunks, final = chunks_and_final(msgs)
    assert "".join(c.text for c in chunks) + final.text == "héllo, wörld"
    assert [c.round for c in chunks] == list(range(len(chunks)))
    assert len(chunks[0].token_ids) == 1 and all(1 <= len(c.token_ids) <= 4 for c in chunks[1:])  # chunk_tokens 4
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    u = final.usage
    n = len("héllo, wörld".encode())
    assert u.prompt_tokens == n and u.completion_tokens == n == sum(len(c.token_ids) for c in chunks)
    assert u.rounds == len(chunks) - 1 and u.mean_acceptance_length == pytest.approx((n - 1) / u.rounds)
    assert u.accepted_draft_tokens <= u.draft_tokens
    assert {m.request_id for m in msgs} == {"r1"} and ("x-request-id", "r1") in tuple(call.trailing_metadata())


@pytest.mark.pdflash_stub(text="The quick brown fox. ", chunk_tokens=3)
def test_text_repeats_with_ignore_eos_to_max_tokens(pdflash_stub):
    out = pdflash_stub.client.generate("anything", max_tokens=30, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 30
    assert out.text == ("The quick brown fox. " * 2)[:30]
    assert out.chunks == 1 + 10  # the first token alone, then 29 in threes
    short = pdflash_stub.client.generate("anything", max_tokens=100)
    assert short.finish_reason == "stop" and short.text == "The quick brown fox. "


def test_stop_tokens_block_size_and_context(pdflash_stub):
    c = pdflash_stub.client
    out = c.generate([5, 6, 7, 8, 9], max_tokens=10, stop_token_ids=[7])
    assert out.token_ids == [5, 6, 7] and out.finish_reason == "stop"
    one = c.generate("abcdef", max_tokens=6, drafter="none")  # block 1: a token per chunk, as plain decoding streams
    assert one.chunks == 6
    with StubServer(max_context=8) as small:
        out = small.client.generate([1, 2, 3, 4, 5], max_tokens=10, ignore_eos=True)
    assert out.finish_reason == "context" and len(out.token_ids) == 3


def test_ids_of_a_real_vocabulary_echo_as_placeholders(pdflash_stub):
    out = pdflash_stub.client.generate([104, 105, 3000], max_tokens=3)
    assert out.text == "hi<3000>"


def test_model_info_reports_the_limits_it_checks(pdflash_stub):
    info = pdflash_stub.client.model_info()
    assert (info.model, info.vocab_size, info.max_tokens_limit, info.max_prompt_tokens) == ("pdflash-stub", 4096, 4096, 8192)
    assert info.default_drafter == drafter_pb2.DRAFTER_KIND_HYBRID and len(info.drafters) == 4
    with StubServer(drafters="none,ngram", max_tokens_limit=100, default_max_tokens=50, tokenizer=str(ROOT / "pdflash/assets/demo/target")) as s:
        info = s.client.model_info()
        assert info.default_drafter == drafter_pb2.DRAFTER_KIND_NGRAM and info.vocab_size == 4096
        with pytest.raises(grpc.RpcError) as e:
            s.client.generate("x", max_tokens=101, drafter="dflash")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(e.value)["violations"] == [
        ("max_tokens", "must be <= 100, got 101"),
        ("drafter", "dflash is not available on this server (no DFlash drafter loaded); available: none, ngram"),
    ]



def test_an_unknown_drafter_kind_on_the_wire_lists_the_kinds(pdflash_stub):
    """A drafter number no enum value has (grpcurl '"drafter": 17'): the violation names the kinds to choose from,
    lower-case as `pdflash generate --drafter` and the README write them."""
    request = drafter_pb2.GenerateRequest(prompt="x", max_tokens=4, drafter=17)
    with pytest.raises(grpc.RpcError) as e:
        list(pdflash_stub.client.stream(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(e.value)["violations"] == [
        ("drafter", "unknown drafter kind 17; choose one of unspecified, none, ngram, dflash, hybrid")]

def test_a_tokenizer_file_tokenizes_as_the_model_does(tiny):
    from transformers import AutoTokenizer

    target = tiny.target("qwen3_moe")
    hf = AutoTokenizer.from_pretrained(str(target))
    prompt = "def fibonacci(n):\n    return n"
    with StubServer(tokenizer=str(target)) as s:
        out = s.client.generate(prompt, max_tokens=64)
        assert s.client.model_info().vocab_size == len(hf)
    assert out.token_ids == hf(prompt)["input_ids"] and out.text == prompt and out.usage.prompt_tokens == len(out.token_ids)


# -- faults, stalls, deadlines -------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "PERMISSION_DENIED", "INTERNAL", "DATA_LOSS"])
def test_any_status_at_once_with_the_drafters_details(pdflash_stub, code):
    pdflash_stub.configure(fault=code, fault_message="scripted", fault_field="prompt", retry_after_s=0.25)
    with pytest.raises(grpc.RpcError) as e:
        list(pdflash_stub.client.stream(Client.request("x"), timeout=10))
    assert e.value.code() == grpc.StatusCode[code] and e.value.details() == "scripted"
    d = details(e.value)
    assert d["violations"] == ([("prompt", "scripted")] if code == "INVALID_ARGUMENT" else [])
    assert d["retry_after_s"] == (0.25 if code == "RESOURCE_EXHAUSTED" else None)


@pytest.mark.pdflash_stub(fault="UNAVAILABLE", fault_after=3)
def test_fault_after_n_chunks(pdflash_stub):
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for msg in pdflash_stub.client.stream(Client.request("a long enough prompt", max_tokens=64), timeout=10):
            got.append(msg)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "stub fault: UNAVAILABLE"
    assert len(got) == 3 and all(m.HasField("chunk") for m in got)
    short = []  # a fault scripted beyond the last chunk comes in place of `final`
    with pytest.raises(grpc.RpcError):
        for msg in pdflash_stub.client.stream(Client.request("ab", max_tokens=64), timeout=10):
            short.append(msg)
    assert len(short) == 2 and all(m.HasField("chunk") for m in short)


@pytest.mark.pdflash_stub(stall_after=2)
def test_a_stalled_stream_ends_at_the_clients_deadline(pdflash_stub):
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for msg in pdflash_stub.client.stream(Client.request("a prompt of some length", max_tokens=64), timeout=0.5):
            got.append(msg)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(got) == 2 and all(m.HasField("chunk") for m in got)
    wait_until_released(pdflash_stub, got[0].request_id)


def test_metadata_scripts_one_request(pdflash_stub):
    c = pdflash_stub.client
    md = (("pdflash-stub-fault", "resource_exhausted"), ("pdflash-stub-retry-after-s", "2.5"))
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(Client.request("x"), metadata=md, timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and details(e.value)["retry_after_s"] == 2.5
    out = list(c.stub.Generate(Client.request("x", max_tokens=4), metadata=(("pdflash-stub-text", "abcdef"),), timeout=10))
    assert "".join(m.chunk.text for m in out[:-1]) == "abcd"
    assert c.generate("x", max_tokens=4).text == "x"  # the next request has the plain script again
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(Client.request("x"), metadata=(("pdflash-stub-chunk-tokens", "zero"),), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pdflash-stub-chunk-tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(Client.request("x"), metadata=(("pdflash-stub-colour", "red"),), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pdflash-stub-text" in e.value.details()


# -- Abort, cancel, concurrency --------------------------------------------------------------------------------


def wait_until_released(stub: StubServer, request_id: str) -> None:
    """The server learns of a client's cancel or deadline a moment after the client: poll its registry."""
    for _ in range(500):
        if request_id not in stub.servicer.running:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"{request_id} still running")


@pytest.mark.pdflash_stub(delay_ms=20, chunk_tokens=1)
def test_abort_ends_the_stream_with_aborted(pdflash_stub):
    c = pdflash_stub.client
    call = c.stream(Client.request("x" * 500, max_tokens=500, request_id="to-abort"), timeout=30)
    first = next(call)
    assert first.HasField("chunk")
    assert c.abort("to-abort") is True
    rest = list(call)
    chunks, final = chunks_and_final([first, *rest])
    assert final.finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert final.usage.completion_tokens == sum(len(ch.token_ids) for ch in chunks) < 500
    assert c.abort("to-abort") is False and c.abort("never-ran") is False
    with pytest.raises(grpc.RpcError) as e:
        c.abort("")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details(e.value)["violations"] == [("request_id", "required: the id of the running Generate to stop")]


@pytest.mark.pdflash_stub(stall_after=1, max_concurrent=2)
def test_cancel_duplicate_ids_and_concurrency_limit(pdflash_stub):
    c = pdflash_stub.client
    a = c.stream(Client.request("x", request_id="a"), timeout=30)
    next(a)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stream(Client.request("y", request_id="a"), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "request_id 'a' is already running"
    b = c.stream(Client.request("x", request_id="b"), timeout=30)
    next(b)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stream(Client.request("z", request_id="c"), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == "2 requests already running (limit 2); retry shortly" and details(e.value)["retry_after_s"] == 1.0
    a.cancel()
    wait_until_released(pdflash_stub, "a")
    assert c.abort("b") is True
    assert list(b)[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORTED


# -- what the drafter shares with it -------------------------------------------------------------------------


def test_health_reflection_and_undecodable_requests(pdflash_stub):
    from tests.test_services import reflection_services

    with grpc.insecure_channel(pdflash_stub.address) as ch:
        for service in ("", "pdflash.v1.Drafter"):
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        garbage = ch.unary_stream("/pdflash.v1.Drafter/Generate", request_serializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(garbage(b"\xff\xff\xff", timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and details(e.value)["violations"][0][0] == "(message)"
    assert {"pdflash.v1.Drafter", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= reflection_services(pdflash_stub.address)


def test_pdflash_health_says_what_it_found(pdflash_stub):
    """`pdflash health`: SERVING (exit 0); a service name the server does not know, or nothing listening, is said as
    such (exit 1, why on stderr) rather than as NOT_SERVING."""
    from pdflash.stack import free_ports, health_status

    assert health_status(pdflash_stub.address, "pdflash.v1.Drafter") == ("SERVING", "")
    status, why = health_status(pdflash_stub.address, "bogus.Service")
    assert status == "UNKNOWN_SERVICE" and why.startswith(f"{pdflash_stub.address} does not serve 'bogus.Service'"), why
    cli = [sys.executable, "-m", "pdflash.cli", "health"]
    ok = subprocess.run([*cli, pdflash_stub.address], capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "SERVING\n", "")
    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    r = subprocess.run([*cli, nobody, "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, "UNREACHABLE\n")
    assert r.stderr.startswith(f"pdflash health: {nobody}: UNAVAILABLE: ") and "Connection refused" in r.stderr, r.stderr


def test_request_ids_are_checked_and_echoed_as_the_drafter_does(pdflash_stub):
    c = pdflash_stub.client
    via_metadata = c.stub.Generate(Client.request("x", max_tokens=2), metadata=(("x-request-id", "from-md"),), timeout=10)
    assert {m.request_id for m in via_metadata} == {"from-md"}
    generated = {m.request_id for m in c.stream(Client.request("x", max_tokens=2), timeout=10)}
    assert len(generated) == 1 and len(generated.pop()) == 32
    with pytest.raises(grpc.RpcError) as e:
        # built by hand: Client.request refuses it before it is sent (tests/test_cli_ranges.py)
        list(c.stream(drafter_pb2.GenerateRequest(prompt="x", request_id="x" * 300), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "invalid Generate request: request_id: 300 characters; at most 256"


def test_bearer_token_and_mutual_tls(tmp_path):
    from pdflash.tls import _deny_message
    from tests.test_security import make_pki

    with StubServer(auth_token="s3cret") as stub:
        with Client(stub.address) as anonymous:
            with pytest.raises(grpc.RpcError) as e:
                anonymous.generate("x")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and e.value.details() == _deny_message()
        assert stub.client.generate("ok", max_tokens=2).text == "ok"  # the fixture's client carries the token
    pki = make_pki(tmp_path / "pki")
    with StubServer(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca) as stub:
        with Client(stub.address, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as c:
            assert c.generate("over mTLS", max_tokens=9).text == "over mTLS"
        with Client(stub.address, tls_ca=pki.ca, tls_cert=pki.rogue_client_cert, tls_key=pki.rogue_client_key) as rogue:
            with pytest.raises(grpc.RpcError) as e:
                rogue.generate("x", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_options_are_checked():
    with pytest.raises(ConfigError, match="--record needs --upstream"):
        StubServer(record="x.jsonl")
    with pytest.raises(ConfigError, match="a status code name"):
        StubServer(fault="NOPE")
    with pytest.raises(ConfigError, match="--drafters"):
        StubServer(drafters="ngram,magic")
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        StubServer(tls_cert=__file__)
    with pytest.raises(ConfigError, match="whitespace"):
        StubServer(auth_token="a b")
    with pytest.raises(ConfigError, match="--chunk-tokens"):
        Script(chunk_tokens=0).validate_script()


@pytest.mark.parametrize("pdflash_stub", [{"text": "one"}, {"text": "two"}], indirect=True)
def test_indirect_parametrization_configures_the_stub(pdflash_stub):
    assert pdflash_stub.client.generate("x").text == pdflash_stub.config.text


def test_received_lists_what_the_client_sent(pdflash_stub):
    pdflash_stub.client.generate("look", max_tokens=3, temperature=0.5, seed=7)
    (r,) = pdflash_stub.received
    assert r.request.prompt == "look" and r.request.sampling.seed == 7 and r.request.max_tokens == 3


def test_an_asyncio_client_works_beside_the_stub_thread(pdflash_stub):
    import asyncio

    async def main():
        async with grpc.aio.insecure_channel(pdflash_stub.address) as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            return [m async for m in stub.Generate(Client.request("aio", max_tokens=3), timeout=10)]

    msgs = asyncio.run(main())
    assert "".join(m.chunk.text for m in msgs[:-1]) == "aio"


# -- record and replay ------------------------------------------------------------------------------------------


def test_record_then_replay(tmp_path):
    """Recorded through the recording proxy (a scripted stub stands in for the real stack here; the real stack's
    turn is in tests/test_contract.py), then answered from the transcript: same messages, same statuses."""
    path = tmp_path / "t.jsonl"
    asks = [Client.request("first prompt", max_tokens=8), Client.request([1, 2, 3], max_tokens=2, temperature=0.5, seed=3),
            Client.request("bad", max_tokens=10**6)]
    with StubServer(text="recorded text", chunk_tokens=2) as upstream:
        with StubServer(record=str(path), upstream=upstream.address) as recorder:
            live = [outcome(recorder.client, r) for r in asks]
            assert recorder.client.model_info() == upstream.client.model_info()
            assert recorder.client.abort("nothing") is False
        upstream.configure(fault="UNAVAILABLE", fault_after=2)
        with StubServer(record=str(tmp_path / "faults.jsonl"), upstream=upstream.address) as recorder:
            failed = outcome(recorder.client, asks[0])
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert lines[0]["pdflash_transcript"] == 1 and lines[0]["model_info"]["model"] == "pdflash-stub" and len(lines) == 4
    assert "request_id" not in lines[1]["request"] and lines[3]["code"] == "INVALID_ARGUMENT"
    with StubServer(replay=str(path), max_tokens_limit=10**7) as replay:  # checks as the recorded server's ModelInfo says
        assert [outcome(replay.client, r) for r in asks] == live
        assert replay.client.model_info().max_tokens_limit == 4096
        with pytest.raises(grpc.RpcError) as e:
            replay.client.generate("first prompt", max_tokens=9)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "the closest is call #1, which differs in max_tokens: 9 here, 8 recorded" in e.value.details()
    with StubServer(replay=str(tmp_path / "faults.jsonl")) as replay:
        assert outcome(replay.client, asks[0]) == failed
    assert failed[0] == "UNAVAILABLE" and len(failed[3]) == 2


def outcome(client: Client, request) -> tuple:
    """What a client sees of one Generate: the status, its message and details, and the messages (ids aside)."""
    msgs = []
    try:
        for m in client.stream(request, timeout=10):
            m.request_id = ""
            msgs.append(m.SerializeToString())
        return ("OK", "", None, msgs)
    except grpc.RpcError as e:
        return (e.code().name, e.details(), details(e), msgs)


def test_replay_gives_several_recorded_answers_in_turn(tmp_path):
    from pdflash.testing.transcript import Call, Writer

    req = Client.request("retry me", max_tokens=2)
    ok = [drafter_pb2.GenerateResponse(chunk=drafter_pb2.TokenChunk(token_ids=[1], text="A")),
          drafter_pb2.GenerateResponse(final=drafter_pb2.Final(finish_reason=1))]
    w = Writer(str(tmp_path / "t.jsonl"), "nowhere:1", drafter_pb2.ModelInfoResponse(
        vocab_size=10, drafters=[2], default_drafter=2, block_size=4, max_block_size=4, max_tokens_limit=8, max_prompt_tokens=16))
    w.write(Call(req, [], "UNAVAILABLE", "starting"))
    w.write(Call(req, ok))
    w.close()
    with StubServer(replay=str(tmp_path / "t.jsonl")) as replay:
        assert outcome(replay.client, req)[:2] == ("UNAVAILABLE", "starting")
        for _ in range(2):
            assert replay.client.generate("retry me", max_tokens=2).text == "A"
        with pytest.raises(grpc.RpcError) as e:  # the recorded server's limits: max_tokens <= 8
            replay.client.generate("retry me", max_tokens=9)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- the command and the imports ----------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This checkout first on the path of child processes (the installed pdflash may be another tree)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def test_pdflash_stub_command(tmp_path):
    """`pdflash stub --port 0` prints its address, serves, and stops on SIGTERM with exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "pdflash.cli", "stub", "--port", "0", "--text", "from the CLI",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pdflash stub listening on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[-1]
        with Client(address) as c:
            assert c.generate("x", max_tokens=64).text == "from the CLI"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
    bad = subprocess.run([sys.executable, "-m", "pdflash.cli", "stub", "--replay", str(tmp_path / "none.jsonl")],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert bad.returncode == 2 and "--replay" in bad.stderr and "no such file" in bad.stderr
    from pdflash.stack import free_ports

    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    gone = subprocess.run([sys.executable, "-m", "pdflash.cli", "stub", "--port", "0", "--record", str(tmp_path / "r.jsonl"),
                           "--upstream", nobody, "--upstream-wait-s", "0.5"], capture_output=True, text=True, env=child_env(), timeout=60)
    # one line with the reason, as every service's start-up failure (pdflash.server.run_service)
    assert gone.returncode == 1 and f"--upstream {nobody}: no ModelInfo" in gone.stderr, gone.stderr
    assert "Traceback" not in gone.stderr


def test_a_failed_start_raises_and_leaves_nothing_running():
    with StubServer() as first:
        taken = StubServer(port=first.port)
        with pytest.raises(OSError, match="could not bind"):
            taken.start()
        taken.stop()  # harmless after a failed start
        assert first.client.generate("still here", max_tokens=16).text == "still here"


IMPORT_CHECK = """
import sys
import pdflash.testing, pdflash.client, pdflash.v1.drafter_pb2_grpc, pdflash.cli
from pdflash.testing import StubServer
with StubServer(text="light") as stub:
    assert stub.client.generate("x").text == "light"
import pytest, pdflash.testing.plugin
pdflash.cli.build_parser().parse_args(["stub", "--port", "0"])
heavy = sorted(m for m in ("torch", "transformers", "numpy", "tokenizers", "safetensors", "prometheus_client") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_client_stub_and_plugin_import_without_torch_or_transformers():
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
