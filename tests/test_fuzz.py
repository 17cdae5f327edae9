"""Property-based fuzzing of every public and internal RPC of the running stack (hypothesis).

Each example is a random, often malformed request; an oracle says which status it must get (OK,
INVALID_ARGUMENT with field violations, NOT_FOUND, ...). Nothing may crash, and afterwards a normal
request still produces exactly the tokens it produced before fuzzing (and transformers' greedy
reference), with no session or budget left behind. Derandomized: the same examples every run.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.load import greedy_reference, in_use
from pdflash.client import Client
from pdflash.server import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from pdflash.types import union_bytes
from pdflash.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.conftest import DEVICE

pytestmark = pytest.mark.slow

PROMPT = "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self."
MAX_TOKENS = 24
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def fuzz_settings(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclasses.dataclass
class Model:
    vocab: int
    num_layers: int
    max_context: int
    max_block: int
    byte_map: dict[int, list[int]]


@pytest.fixture(scope="module")
def model(stack) -> Model:
    with grpc.insecure_channel(stack.verifier) as ch:
        vi = verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=10)
    return Model(vi.vocab_size, vi.num_layers, vi.max_context, vi.max_block_size,
                 {le.layer: list(le.expert_bytes) for le in vi.expert_bytes})


@pytest.fixture(scope="module")
def before(stack, tiny) -> list[int]:
    """A normal request's tokens before any fuzzing; they equal transformers' greedy decoding (the shared stack and
    its reference: conftest.DEVICE/DTYPE, cpu float32)."""
    with Client(stack.drafter) as c:
        got = c.generate(PROMPT, max_tokens=MAX_TOKENS, drafter="hybrid").token_ids
    assert tuple(got) == greedy_reference(str(tiny.target("qwen3_moe")), PROMPT, MAX_TOKENS, device=DEVICE)
    return got


@pytest.fixture(scope="module")
def channels(stack):
    chans = {n: grpc.insecure_channel(getattr(stack, n), options=CHANNEL_OPTIONS) for n in ("drafter", "scheduler", "verifier")}
    yield chans
    for ch in chans.values():
        ch.close()


def outcome(call):
    """(status code, error or None) of call()."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e
    return OK, None


def violations(err: grpc.RpcError) -> set[str]:
    status = rpc_status.from_call(err)
    fields = set()
    for d in status.details if status else ():
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            fields |= {v.field for v in br.field_violations}
    return fields


SEEN: collections.Counter = collections.Counter()  # (test, status) -> examples: the fuzzing reached both sides


def expect(code, err, want: grpc.StatusCode, what, tag: str = "") -> None:
    SEEN[(tag, code.name)] += 1
    assert code == want, f"{what}: got {code} ({err.details() if err else ''}), want {want}"
    if want == INVALID:
        assert violations(err), f"{what}: INVALID_ARGUMENT without BadRequest field violations"
        assert err.details(), "an error needs a message"


# -- strategies: mostly valid requests with a few fields corrupted ------------------------------------


def corrupted(draw, fields: list[str]) -> set[str]:
    """Which fields of this example to make invalid (often none: valid requests must work too)."""
    return draw(st.one_of(st.just(set()), st.sets(st.sampled_from(fields), min_size=1, max_size=2)))


def pick(draw, bad: bool, valid, invalid):
    return draw(invalid if bad else valid)


ids_text = st.one_of(st.just(""), st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
                     st.text(max_size=6), st.just("x" * 300))
valid_ids = st.one_of(st.just(""), st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=12))
invalid_ids = st.sampled_from(["x" * 300, "caf\u00e9", "a\nb", "\x00"])
SAMPLING_OK = dict(temperature=st.sampled_from([0.0, 0.0, 0.7, 1.5]), top_p=st.sampled_from([0.0, 1.0, 0.9]),
                   top_k=st.sampled_from([0, 5, 1000]), repetition_penalty=st.sampled_from([0.0, 0.0, 1.0, 1.3, 0.5]),
                   presence_penalty=st.sampled_from([0.0, 0.0, 2.0, -1.5]), frequency_penalty=st.sampled_from([0.0, 0.0, 0.6]))
SAMPLING_BAD = dict(temperature=st.sampled_from([-1.0, math.nan, math.inf, 101.0]), top_p=st.sampled_from([-0.1, 1.5, math.nan]),
                    top_k=st.sampled_from([-1, -(2**31)]), repetition_penalty=st.sampled_from([-1.0, 10.5, math.nan]),
                    presence_penalty=st.sampled_from([2.5, -3.0, math.inf]), frequency_penalty=st.sampled_from([math.nan, -2.1]))


def sampling(draw, bad: bool) -> common_pb2.SamplingParams:
    broken = draw(st.sets(st.sampled_from(sorted(SAMPLING_OK)), min_size=1)) if bad else set()
    s = common_pb2.SamplingParams(**{k: draw((SAMPLING_BAD if k in broken else SAMPLING_OK)[k]) for k in SAMPLING_OK})
    seed = draw(st.none() | st.integers(0, 2**64 - 1))
    if seed is not None:
        s.seed = seed
    return s


def sampling_ok(s: common_pb2.SamplingParams) -> bool:
    t, p, r = s.temperature, s.top_p, s.repetition_penalty  # float32 on the wire
    return ((t == 0.0 or 0.0 < t <= 100.0) and (p == 0.0 or 0.0 < p <= 1.0) and s.top_k >= 0 and (r == 0.0 or 0.0 < r <= 10.0)
            and -2.0 <= s.presence_penalty <= 2.0 and -2.0 <= s.frequency_penalty <= 2.0)


def in_vocab(vocab, min_size=0, max_size=8):
    return st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size)


def with_oov(vocab, min_size=1, max_size=8):
    """Token lists holding at least one id outside [0, vocab)."""
    bad = st.one_of(st.integers(-3, -1), st.integers(vocab, vocab + 3), st.just(-(2**31)), st.just(2**31 - 1))
    return st.tuples(in_vocab(vocab, 0, max_size - 1), bad, st.integers(0, max_size)).map(
        lambda t: t[0][: t[2]] + [t[1]] + t[0][t[2]:])


def token_lists(vocab, min_size=0, max_size=8):
    return st.one_of(in_vocab(vocab, min_size, max_size), with_oov(vocab, max(1, min_size), max_size))


# -- the public API -------------------------------------------------------------------------------------


@st.composite
def generate_requests(draw, vocab: int):
    bad = corrupted(draw, ["request_id", "prompt", "max_tokens", "sampling", "stop", "block", "drafter", "stop_text",
                           "logprobs"])
    req = drafter_pb2.GenerateRequest(request_id=pick(draw, "request_id" in bad, valid_ids, invalid_ids))
    if "prompt" in bad:
        which = draw(st.sampled_from(["empty text", "empty ids", "oov ids", "none", "no messages", "no role"]))
        if which == "empty text":
            req.prompt = ""
        elif which == "empty ids":
            req.prompt_tokens.SetInParent()
        elif which == "oov ids":
            req.prompt_tokens.ids.extend(draw(with_oov(vocab, max_size=10)))
        elif which == "no messages":
            req.messages.SetInParent()
        elif which == "no role":
            req.messages.messages.add(role="", content="x")
    else:
        which = draw(st.sampled_from(["text", "ids", "messages"]))
        if which == "text":
            req.prompt = draw(st.one_of(st.text(min_size=1, max_size=30), st.just("def f(x):\n")))
        elif which == "ids":
            req.prompt_tokens.ids.extend(draw(in_vocab(vocab, 1, 10)))
        else:  # (the fuzzed stack's tiny checkpoint has a chat template)
            for role in draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=3)):
                req.messages.messages.add(role=role, content=draw(st.text(max_size=20)))
    req.stop.extend(pick(draw, "stop_text" in bad, st.lists(st.text(min_size=1, max_size=5), max_size=3),
                         st.sampled_from([[""], ["x" * 257], ["s"] * 17])))
    if "logprobs" in bad:
        req.logprobs, req.top_logprobs = draw(st.sampled_from([(False, 1), (True, 21), (False, 2**32 - 1)]))
    else:
        req.logprobs = draw(st.booleans())
        req.top_logprobs = draw(st.integers(0, 20)) if req.logprobs else 0
    req.max_tokens = pick(draw, "max_tokens" in bad, st.integers(1, 6), st.sampled_from([4097, 10**6, 2**32 - 1]))
    req.sampling.CopyFrom(sampling(draw, "sampling" in bad))
    req.stop_token_ids.extend(pick(draw, "stop" in bad, in_vocab(vocab, 0, 3), with_oov(vocab, 1, 3)))
    req.ignore_eos = draw(st.booleans())
    req.block_size = pick(draw, "block" in bad, st.sampled_from([0, 1, 4, 16, 32]), st.sampled_from([33, 1000, 2**32 - 1]))
    req.drafter = pick(draw, "drafter" in bad, st.integers(0, 4), st.sampled_from([5, 7, -1]))
    return req


def generate_ok(req: drafter_pb2.GenerateRequest, vocab: int) -> bool:
    rid = req.request_id
    which = req.WhichOneof("input")
    ids = list(req.prompt_tokens.ids) if which == "prompt_tokens" else []
    msgs = list(req.messages.messages) if which == "messages" else []
    return (
        len(rid) <= 256 and all(" " <= c <= "~" for c in rid)
        and (which == "prompt" and req.prompt != "" or which == "prompt_tokens" and ids and all(0 <= t < vocab for t in ids)
             or which == "messages" and msgs and all(1 <= len(m.role) <= 64 for m in msgs))
        and len(req.stop) <= 16 and all(1 <= len(t) <= 256 for t in req.stop)
        and req.top_logprobs <= 20 and (req.logprobs or not req.top_logprobs)
        and req.max_tokens <= 4096
        and all(0 <= t < vocab for t in req.stop_token_ids)
        and sampling_ok(req.sampling)
        and 0 <= req.drafter <= 4
        and req.block_size <= 32
    )


def test_fuzz_generate_and_abort(stack, model, before, channels):
    stub = drafter_pb2_grpc.DrafterStub(channels["drafter"])

    @fuzz_settings(120)
    @given(generate_requests(model.vocab))
    def generate(req):
        msgs = []
        code, err = outcome(lambda: msgs.extend(stub.Generate(req, timeout=60)))
        expect(code, err, OK if generate_ok(req, model.vocab) else INVALID, req, "generate")
        if code == OK:
            assert msgs[-1].HasField("final")
            final = msgs[-1].final
            n = sum(len(m.chunk.token_ids) for m in msgs[:-1])
            assert final.usage.completion_tokens == n >= 1
            assert n == req.max_tokens or final.finish_reason == common_pb2.FINISH_REASON_STOP
            assert all(0 <= t < model.vocab for m in msgs[:-1] for t in m.chunk.token_ids)
            assert final.stop_sequence in ("", *req.stop)
            text = "".join(m.chunk.text for m in msgs[:-1]) + final.text
            assert not any(t in text for t in req.stop)  # a stop sequence never reaches the client
            for m in msgs[:-1]:  # with logprobs: one per id (and the alternatives asked for), each <= 0
                c = m.chunk
                assert len(c.logprobs) == (len(c.token_ids) if req.logprobs else 0) and all(x <= 0 for x in c.logprobs)
                assert len(c.top_logprobs) == (len(c.token_ids) if req.top_logprobs else 0)
                assert all(len(t.token_ids) == req.top_logprobs for t in c.top_logprobs)

    @fuzz_settings(30)
    @given(ids_text)
    def abort(rid):
        code, err = outcome(lambda: stub.Abort(drafter_pb2.AbortRequest(request_id=rid), timeout=10))
        expect(code, err, OK if 0 < len(rid) <= 256 else INVALID, rid)

    generate()
    abort()
    assert SEEN[("generate", "OK")] >= 10 and SEEN[("generate", "INVALID_ARGUMENT")] >= 30, SEEN


# -- the scheduler --------------------------------------------------------------------------------------


@st.composite
def drafts(draw, vocab: int):
    """DraftResults as the scheduler sees them (it does not know the model: ids and layers are free)."""
    bad = corrupted(draw, ["session", "round", "tokens", "bytes"])
    d = common_pb2.DraftResult(
        session_id=pick(draw, "session" in bad, st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
                        st.sampled_from(["", "s" * 300])),
        round=pick(draw, "round" in bad, st.sampled_from([1, 2, 7, 2**32 - 1]), st.just(0)),
    )
    d.tokens.extend(pick(draw, "tokens" in bad, token_lists(vocab, 1, 6), st.sampled_from([[], [1] * 5000])))
    if "bytes" in bad:
        d.expert_bytes = draw(st.sampled_from([1, 4096, 2**64 - 1]))  # with no experts at all
        return d
    for layer in draw(st.lists(st.integers(0, 5), max_size=3, unique=True)):
        d.expert_union.add(layer=layer, expert_ids=draw(st.lists(st.integers(0, 10), min_size=1, max_size=4, unique=True)))
    d.expert_bytes = draw(st.sampled_from([0, 1, 4096, 2**64 - 1])) if d.expert_union else 0
    return d


def test_fuzz_scheduler(stack, model, before, channels):
    stub = scheduler_pb2_grpc.SchedulerStub(channels["scheduler"])

    @fuzz_settings(80)
    @given(drafts(model.vocab), st.sampled_from(["", "r1", "caf\u00e9", "", "r" * 300]), st.sampled_from([True, True, True, False]))
    def admit(draft, request_id, with_draft):
        req = scheduler_pb2.AdmitRequest(request_id=request_id)
        if with_draft:
            req.draft.CopyFrom(draft)
        ok = (with_draft and 0 < len(draft.session_id) <= 256 and draft.round >= 1 and 1 <= len(draft.tokens) <= 4096
              and not (draft.expert_bytes and not any(le.expert_ids for le in draft.expert_union)) and len(request_id) <= 256)
        ticket = []
        code, err = outcome(lambda: ticket.append(stub.Admit(req, timeout=10)))
        expect(code, err, OK if ok else INVALID, req, "admit")
        if ticket:
            t = ticket[0]
            assert (t.session_id, t.round, t.tokens) == (draft.session_id, draft.round, len(draft.tokens))
            assert stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=t.ticket_id), timeout=10).released

    @fuzz_settings(30)
    @given(ids_text)
    def release_and_renew(ticket_id):
        ok = 0 < len(ticket_id) <= 256
        code, err = outcome(lambda: stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=ticket_id), timeout=10))
        expect(code, err, OK if ok else INVALID, ticket_id)
        code, err = outcome(lambda: stub.Renew(scheduler_pb2.RenewRequest(ticket_id=ticket_id), timeout=10))
        expect(code, err, grpc.StatusCode.NOT_FOUND if ok else INVALID, ticket_id)

    admit()
    release_and_renew()
    assert SEEN[("admit", "OK")] >= 5 and SEEN[("admit", "INVALID_ARGUMENT")] >= 20, SEEN
    st_ = stub.GetStats(scheduler_pb2.StatsRequest(), timeout=10)
    assert (st_.tokens_in_use, st_.in_flight, st_.waiting) == (0, 0, 0)


# -- the verifier ---------------------------------------------------------------------------------------


@st.composite
def prefill_requests(draw, m: Model):
    bad = corrupted(draw, ["request_id", "prompt", "max_tokens", "sampling", "stop", "features", "logprobs"])
    req = verifier_pb2.PrefillRequest(request_id=pick(draw, "request_id" in bad, st.sampled_from(["", "p"]), st.just("r" * 300)))
    req.prompt_tokens.extend(pick(draw, "prompt" in bad, in_vocab(m.vocab, 1, 8),
                                  st.one_of(st.just([]), with_oov(m.vocab), st.just([3] * m.max_context))))
    req.max_tokens = pick(draw, "max_tokens" in bad, st.sampled_from([1, 3, 4096]), st.sampled_from([0, 4097]))
    req.sampling.CopyFrom(sampling(draw, "sampling" in bad))
    req.stop_token_ids.extend(pick(draw, "stop" in bad, in_vocab(m.vocab, 0, 2), with_oov(m.vocab, 1, 2)))
    req.ignore_eos = draw(st.booleans())
    layers = st.lists(st.integers(0, m.num_layers - 1), max_size=3)
    req.feature_layer_ids.extend(pick(draw, "features" in bad, layers, st.lists(st.sampled_from([-1, m.num_layers, 99]), min_size=1, max_size=2)))
    req.logprobs, req.top_logprobs = pick(draw, "logprobs" in bad, st.sampled_from([(False, 0), (True, 0), (True, 20)]),
                                          st.sampled_from([(False, 3), (True, 21)]))
    return req


def prefill_ok(req, m: Model) -> bool:
    p = list(req.prompt_tokens)
    return (0 < len(p) < m.max_context and all(0 <= t < m.vocab for t in p) and all(0 <= t < m.vocab for t in req.stop_token_ids)
            and 1 <= req.max_tokens <= 4096 and sampling_ok(req.sampling) and len(req.request_id) <= 256
            and all(0 <= i < m.num_layers for i in req.feature_layer_ids)
            and req.top_logprobs <= 20 and (req.logprobs or not req.top_logprobs))


def draft_ok(d: common_pb2.DraftResult, anchor: int, m: Model) -> bool:
    union: dict[int, set[int]] = {}
    for le in d.expert_union:
        union.setdefault(le.layer, set()).update(le.expert_ids)
    fits = all(layer in m.byte_map and all(e < len(m.byte_map[layer]) for e in ids) for layer, ids in union.items())
    return (d.round == 1 and 0 < len(d.tokens) <= m.max_block and d.tokens[0] == anchor
            and all(0 <= t < m.vocab for t in d.tokens) and fits and d.expert_bytes == union_bytes(union, m.byte_map)
            and dists_ok(d, m))


def dists_ok(d: common_pb2.DraftResult, m: Model) -> bool:
    """Sampled drafts' distributions: none, or one per draft, each a distribution over unique in-vocabulary ids with
    finite probabilities >= 0 (sum > 0) that gives its draft a probability above 0."""
    if not d.draft_dists:
        return True
    if len(d.draft_dists) != len(d.tokens) - 1:
        return False
    for q, t in zip(d.draft_dists, d.tokens[1:]):
        ids, probs = list(q.ids), list(q.probs)
        if (len(ids) != len(probs) or not ids or len(set(ids)) != len(ids) or any(not 0 <= i < m.vocab for i in ids)
                or any(not math.isfinite(p) or p < 0 for p in probs) or not sum(probs) > 0
                or t not in ids or probs[ids.index(t)] <= 0):
            return False
    return True


def test_fuzz_verifier(stack, model, before, channels):
    stub = verifier_pb2_grpc.VerifierStub(channels["verifier"])
    moe = sorted(model.byte_map)
    experts = len(model.byte_map[moe[0]])

    @fuzz_settings(80)
    @given(prefill_requests(model))
    def prefill(req):
        resp = []
        code, err = outcome(lambda: resp.append(stub.Prefill(req, timeout=60)))
        expect(code, err, OK if prefill_ok(req, model) else INVALID, req, "prefill")
        if resp and resp[0].session_id:
            assert stub.EndSession(verifier_pb2.EndSessionRequest(session_id=resp[0].session_id), timeout=10).ended

    @fuzz_settings(40)
    @given(drafts(model.vocab), st.sampled_from([True, True, True, False]))
    def verify_unknown_session(draft, with_draft):  # a session that does not exist: NOT_FOUND, whatever the block
        req = verifier_pb2.VerifyRequest()
        if with_draft:
            req.draft.CopyFrom(draft)
        ok_shape = with_draft and 0 < len(draft.session_id) <= 256
        code, err = outcome(lambda: stub.Verify(req, timeout=10))
        expect(code, err, grpc.StatusCode.NOT_FOUND if ok_shape else INVALID, req)

    @st.composite
    def session_drafts(draw):
        """A block for a live session (tokens[0] = 0 stands for its anchor): sometimes right, mostly
        wrong in one or two ways."""
        bad = corrupted(draw, ["round", "anchor", "oov", "too long", "layer", "expert", "bytes", "dists"])
        d = common_pb2.DraftResult(round=pick(draw, "round" in bad, st.just(1), st.sampled_from([0, 2, 2**32 - 1])))
        n = model.max_block + 1 if "too long" in bad else draw(st.integers(1, 4))
        d.tokens.extend([0] + draw(st.lists(st.integers(0, model.vocab - 1), min_size=n - 1, max_size=n - 1)))
        if "oov" in bad:
            d.tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, model.vocab, 2**31 - 1]))
        if n > 1 and ("dists" in bad or draw(st.booleans())):  # sampled drafts' distributions, each with its draft
            for t in d.tokens[1:]:
                others = draw(st.lists(st.integers(0, model.vocab - 1), max_size=3, unique=True))
                ids = [t] + [i for i in others if i != t]
                d.draft_dists.add(ids=ids, probs=draw(st.lists(st.floats(0.125, 4.0, width=32), min_size=len(ids), max_size=len(ids))))
            if "dists" in bad:
                q = d.draft_dists[draw(st.integers(0, n - 2))]
                how = draw(st.sampled_from(["drop", "dup", "nan", "zero", "oov", "short"]))
                if how == "drop":
                    del d.draft_dists[-1]
                elif how == "dup":
                    q.ids.append(q.ids[0])
                    q.probs.append(1.0)
                elif how == "nan":
                    q.probs[0] = float(draw(st.sampled_from(["nan", "inf", "-1"])))
                elif how == "zero":
                    q.probs[0] = 0.0
                elif how == "oov":
                    q.ids.append(model.vocab)
                    q.probs.append(1.0)
                else:
                    del q.probs[-1]
        union: dict[int, set[int]] = {}
        for layer in draw(st.lists(st.sampled_from(moe), max_size=len(moe), unique=True)):
            union[layer] = set(draw(st.lists(st.integers(0, experts - 1), min_size=1, max_size=3, unique=True)))
        if "layer" in bad:
            union[draw(st.sampled_from([model.num_layers, 1000] + [l for l in range(model.num_layers) if l not in moe]))] = {0}
        if "expert" in bad:
            union.setdefault(moe[0], set()).add(draw(st.sampled_from([experts, experts + 1, 2**32 - 1])))
        for layer, ids in sorted(union.items()):
            d.expert_union.add(layer=layer, expert_ids=sorted(ids))
        fits = "layer" not in bad and "expert" not in bad
        exact = union_bytes(union, model.byte_map) if fits else 0
        d.expert_bytes = exact + draw(st.sampled_from([1, 4096])) if "bytes" in bad else exact
        return d, "anchor" not in bad

    @fuzz_settings(50)
    @given(session_drafts())
    def verify_live_session(case):
        d, anchor_ok = case
        pre = stub.Prefill(verifier_pb2.PrefillRequest(prompt_tokens=[5, 6, 7, 8], max_tokens=16, ignore_eos=True), timeout=30)
        d.session_id = pre.session_id
        if d.tokens[0] == 0:  # the anchor slot (an out-of-vocabulary id there stays)
            d.tokens[0] = pre.first_token if anchor_ok else (pre.first_token + 1) % model.vocab
        try:
            ok = draft_ok(d, pre.first_token, model)
            code, err = outcome(lambda: stub.Verify(verifier_pb2.VerifyRequest(draft=d), timeout=30))
            expect(code, err, OK if ok else INVALID, d, "verify")
            if not ok:  # a refused block changed nothing: the right block for round 1 still verifies
                good = common_pb2.DraftResult(session_id=pre.session_id, round=1, tokens=[pre.first_token])
                assert stub.Verify(verifier_pb2.VerifyRequest(draft=good), timeout=30).round == 1
        finally:
            stub.EndSession(verifier_pb2.EndSessionRequest(session_id=pre.session_id), timeout=10)

    @fuzz_settings(30)
    @given(ids_text)
    def end_session(sid):
        resp = []
        code, err = outcome(lambda: resp.append(stub.EndSession(verifier_pb2.EndSessionRequest(session_id=sid), timeout=10)))
        expect(code, err, OK if 0 < len(sid) <= 256 else INVALID, sid)
        assert not resp or resp[0].ended is False

    prefill()
    verify_unknown_session()
    verify_live_session()
    end_session()
    assert SEEN[("prefill", "OK")] >= 3 and SEEN[("prefill", "INVALID_ARGUMENT")] >= 20, SEEN
    assert SEEN[("verify", "OK")] >= 10 and SEEN[("verify", "INVALID_ARGUMENT")] >= 10, SEEN


# -- raw bytes at every method --------------------------------------------------------------------------

METHODS = {
    "drafter": [("/pdflash.v1.Drafter/Generate", drafter_pb2.GenerateRequest, True),
                ("/pdflash.v1.Drafter/Abort", drafter_pb2.AbortRequest, False),
                ("/pdflash.v1.Drafter/ModelInfo", drafter_pb2.ModelInfoRequest, False)],
    "scheduler": [(f"/pdflash.v1.Scheduler/{m}", t, False) for m, t in (
        ("Admit", scheduler_pb2.AdmitRequest), ("Release", scheduler_pb2.ReleaseRequest),
        ("Renew", scheduler_pb2.RenewRequest), ("GetStats", scheduler_pb2.StatsRequest))],
    "verifier": [(f"/pdflash.v1.Verifier/{m}", t, False) for m, t in (
        ("GetModelInfo", verifier_pb2.VerifierModelInfoRequest), ("Prefill", verifier_pb2.PrefillRequest),
        ("Verify", verifier_pb2.VerifyRequest), ("EndSession", verifier_pb2.EndSessionRequest),
        ("Prefetch", verifier_pb2.PrefetchRequest))]
    + [("/pdflash.v1.Verifier/VerifyStream", verifier_pb2.VerifyRequest, "bidi")],
}
ALL_METHODS = [(svc, *m) for svc, ms in METHODS.items() for m in ms]


def test_fuzz_raw_bytes_at_every_method(stack, before, channels):
    """Undecodable messages get INVALID_ARGUMENT naming the message; anything that decodes is an
    ordinary request and gets an ordinary answer. No method may hang or crash."""
    allowed = {OK, INVALID, grpc.StatusCode.NOT_FOUND}

    @fuzz_settings(120)
    @given(st.sampled_from(ALL_METHODS), st.binary(max_size=48))
    def raw(method, payload):
        svc, path, msg_type, streaming = method
        ch = channels[svc]
        try:
            msg = msg_type.FromString(payload)
            decodes = True
        except DecodeError:
            decodes = False
        if decodes and msg_type is drafter_pb2.GenerateRequest and (msg.max_tokens == 0 or msg.max_tokens > 8):
            return  # a valid long generation is not what this test is about
        if streaming == "bidi":
            code, err = outcome(lambda: list(ch.stream_stream(path)(iter([payload]), timeout=30)))
        elif streaming:
            code, err = outcome(lambda: list(ch.unary_stream(path)(payload, timeout=30)))
        else:
            code, err = outcome(lambda: ch.unary_unary(path)(payload, timeout=30))
        if decodes:
            assert code in allowed, (path, payload, code, err and err.details())
        else:
            expect(code, err, INVALID, (path, payload), "raw")
            assert "(message)" in violations(err)

    raw()
    assert SEEN[("raw", "INVALID_ARGUMENT")] >= 10, SEEN


def test_oversized_messages_are_refused_clearly(stack, model, channels):
    # Far beyond any prompt but under the message limit: refused before tokenizing, with a field violation.
    with Client(stack.drafter) as c:
        with pytest.raises(grpc.RpcError) as e:
            list(c.stream(Client.request("x" * (8 << 20), max_tokens=4), timeout=60))
    expect(e.value.code(), e.value, INVALID, "8 MiB prompt")
    assert "prompt" in violations(e.value)
    # Over the message limit: gRPC refuses it on arrival, naming both sizes. (A client without its own
    # send limit, so the server's receive limit is what answers.)
    for name, path in (("drafter", "/pdflash.v1.Drafter/ModelInfo"), ("verifier", "/pdflash.v1.Verifier/EndSession"),
                       ("scheduler", "/pdflash.v1.Scheduler/Release")):
        payload = b"\x0a" + _varint(MAX_MESSAGE_BYTES + 16) + b"a" * (MAX_MESSAGE_BYTES + 16)
        with grpc.insecure_channel(getattr(stack, name)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(path)(payload, timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, e.value.code())
        assert "larger than max" in e.value.details(), e.value.details()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# -- afterwards -----------------------------------------------------------------------------------------


def test_after_fuzzing_a_normal_request_is_still_exact_and_nothing_leaked(stack, tiny, before):
    with Client(stack.drafter) as c:
        for drafter in ("hybrid", "ngram", "none"):
            assert c.generate(PROMPT, max_tokens=MAX_TOKENS, drafter=drafter).token_ids == before, drafter
    held = in_use(stack.scheduler, stack.verifier)
    assert not any(held.values()), held
    for name in ("drafter", "scheduler", "verifier"):
        assert stack.procs[name].poll() is None, f"{name} died"
