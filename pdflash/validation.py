"""Input checks shared by the services and the clients (field violations, never exceptions of their own).

The servers answer INVALID_ARGUMENT with these words; `pdflash.client.Client.request` and the CLI check
the same fields with the same functions before a value reaches a protobuf field (protobuf itself raises
a bare ValueError/TypeError on a number its field cannot hold), so a user reads the same sentence
whichever side caught the mistake.
"""

from __future__ import annotations

import math
import operator
import struct

from pdflash.errors import FieldViolation
from pdflash.types import SamplingParams

MAX_ID_CHARS = 256  # request, session and ticket ids: logged, some echoed as metadata

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_TEMPERATURE = 100.0


def id_violations(fields: dict[str, str]) -> list[FieldViolation]:
    """Ids (by field name) longer than MAX_ID_CHARS."""
    return [FieldViolation(k, f"{len(v)} characters; at most {MAX_ID_CHARS}") for k, v in fields.items() if len(v) > MAX_ID_CHARS]


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def int_violation(field: str, value, lo: int, hi: int, note: str = "") -> FieldViolation | None:
    """`value` must be an integer in [lo, hi] (note: what special values mean, e.g. "(0 = the server's default)")."""
    note = f" {note}" if note else ""
    try:
        v = operator.index(value)  # int, bool, numpy integers; not floats or strings
    except TypeError:
        return FieldViolation(field, f"must be an integer in [{lo}, {hi}]{note}, got {_show(value)}")
    if not lo <= v <= hi:
        return FieldViolation(field, f"must be in [{lo}, {hi}]{note}, got {v}")
    return None


def as_float32(value) -> float | None:
    """`value` as a protobuf `float` field stores it (None when it is not a number at all)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the field would hold an infinity
        return math.copysign(math.inf, x)


def temperature_violation(t: float, field: str = "sampling.temperature", shown: str | None = None) -> FieldViolation | None:
    """shown: how to show the value when it is not the number t (e.g. text that is no number: t is then nan)."""
    if math.isnan(t) or not (t == 0.0 or 0.0 < t <= MAX_TEMPERATURE):
        return FieldViolation(field, f"must be 0 (greedy) or in (0, {MAX_TEMPERATURE:g}], got {shown or t}")
    return None


def top_p_violation(p: float, field: str = "sampling.top_p", shown: str | None = None) -> FieldViolation | None:
    if math.isnan(p) or not 0.0 < p <= 1.0:
        return FieldViolation(field, f"must be 0 (off) or in (0, 1], got {shown or p}")
    return None


def sampling_violations(s: SamplingParams, prefix: str = "sampling") -> list[FieldViolation]:
    v = [temperature_violation(s.temperature, f"{prefix}.temperature"), top_p_violation(s.top_p, f"{prefix}.top_p"),
         int_violation(f"{prefix}.top_k", s.top_k, 0, INT32_MAX, "(0 means off)")]
    if s.seed is not None:
        v.append(int_violation(f"{prefix}.seed", s.seed, 0, UINT64_MAX))
    v.append(repetition_penalty_violation(s.repetition_penalty, f"{prefix}.repetition_penalty"))
    for name in ("presence_penalty", "frequency_penalty"):
        v.append(penalty_violation(getattr(s, name), f"{prefix}.{name}"))
    return [x for x in v if x is not None]


MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0


def repetition_penalty_violation(r: float, field: str = "sampling.repetition_penalty", shown: str | None = None):
    if math.isnan(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
        return FieldViolation(field, f"must be 0 or 1 (off) or in (0, {MAX_REPETITION_PENALTY:g}], got {shown or r}")
    return None


def penalty_violation(x: float, field: str, shown: str | None = None):
    if math.isnan(x) or not -MAX_PENALTY <= x <= MAX_PENALTY:
        return FieldViolation(field, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {shown or x}")
    return None


def _float_field(field: str, value, check) -> FieldViolation | None:
    x = as_float32(value)
    if x is None:  # not a number at all: the range, and the value as given
        return check(math.nan, field, _show(value))
    return check(x, field)


MAX_MESSAGES = 1024
MAX_ROLE_CHARS = 64


def messages_violations(messages) -> list[FieldViolation]:
    """GenerateRequest.messages: 1 to MAX_MESSAGES turns, each a role (1 to MAX_ROLE_CHARS characters) and a content
    string (the model's chat template judges the rest)."""
    messages = list(messages)
    if not messages:
        return [FieldViolation("messages", "must hold at least one message")]
    if len(messages) > MAX_MESSAGES:
        return [FieldViolation("messages", f"{len(messages)} messages; at most {MAX_MESSAGES}")]
    v = []
    for n, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (getattr(m, "role", None), getattr(m, "content", None))
        if not isinstance(role, str) or not 1 <= len(role) <= MAX_ROLE_CHARS:
            v.append(FieldViolation(f"messages[{n}].role", f"a role of 1 to {MAX_ROLE_CHARS} characters (e.g. user), got {role!r}"))
        if not isinstance(content, str):
            v.append(FieldViolation(f"messages[{n}].content", f"a string, got {type(content).__name__}"))
    return v


MAX_TOP_LOGPROBS = 20


def logprobs_violations(logprobs: bool, top_logprobs) -> list[FieldViolation]:
    """GenerateRequest / PrefillRequest logprobs, top_logprobs: at most MAX_TOP_LOGPROBS alternatives, and only with
    logprobs on."""
    v = []
    bad = int_violation("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    if bad is not None:
        v.append(bad)
    elif top_logprobs and not logprobs:
        v.append(FieldViolation("top_logprobs", "needs logprobs on (the alternatives come with the token's own)"))
    return v


MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


def stop_violations(stops) -> list[FieldViolation]:
    """GenerateRequest.stop: at most MAX_STOP_SEQUENCES strings of 1 to MAX_STOP_CHARS characters."""
    if isinstance(stops, (str, bytes)):
        return [FieldViolation("stop", "a list of stop sequences, not one string")]
    stops = list(stops)
    v = []
    if len(stops) > MAX_STOP_SEQUENCES:
        v.append(FieldViolation("stop", f"{len(stops)} stop sequences; at most {MAX_STOP_SEQUENCES}"))
    for n, text in enumerate(stops[:MAX_STOP_SEQUENCES]):
        if not isinstance(text, str):
            v.append(FieldViolation(f"stop[{n}]", f"a stop sequence is a string, got {type(text).__name__}"))
        elif not 1 <= len(text) <= MAX_STOP_CHARS:
            v.append(FieldViolation(f"stop[{n}]", f"a stop sequence is 1 to {MAX_STOP_CHARS} characters, got {len(text)}"))
    return v


def generate_violations(
    *,
    max_tokens=0,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=None,
    block_size=0,
    stop_token_ids=(),
    prompt_tokens=(),
    request_id: str = "",
    stop=(),
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
) -> list[FieldViolation]:
    """What a GenerateRequest built from these values would be refused for, before any protobuf field sees them.

    Field names are the request's (`max_tokens`, `sampling.temperature`, ...). Limits the client cannot know
    (the server's max_tokens limit, its vocabulary) stay the server's to check; values a field cannot hold,
    and sampling values no server accepts, are refused here with the server's words.
    """
    v = [
        int_violation("max_tokens", max_tokens, 0, UINT32_MAX, "(0 = the server's default)"),
        int_violation("block_size", block_size, 0, UINT32_MAX, "(0 = the server's default, 1 = no drafting)"),
        _float_field("sampling.temperature", temperature, temperature_violation),
        # 0 means off on the wire (as the servers read it): checked as 1.
        _float_field("sampling.top_p", top_p, lambda p, f, shown=None: top_p_violation(1.0 if p == 0.0 else p, f, shown)),
        int_violation("sampling.top_k", top_k, 0, INT32_MAX, "(0 means off)"),
        # 0 means off on the wire: checked as 1.
        _float_field("sampling.repetition_penalty", repetition_penalty,
                     lambda r, f, shown=None: repetition_penalty_violation(1.0 if r == 0.0 else r, f, shown)),
        _float_field("sampling.presence_penalty", presence_penalty, penalty_violation),
        _float_field("sampling.frequency_penalty", frequency_penalty, penalty_violation),
    ]
    if seed is not None:
        v.append(int_violation("sampling.seed", seed, 0, UINT64_MAX))
    for field, ids in (("stop_token_ids", stop_token_ids), ("prompt_tokens.ids", prompt_tokens)):
        bad = [t for t in ids if int_violation(field, t, 0, INT32_MAX) is not None]
        if bad:
            v.append(FieldViolation(field, f"ids {bad[:5]} are not token ids in [0, {INT32_MAX}]"))
    v.extend(id_violations({"request_id": request_id}))
    v.extend(stop_violations(stop))
    return [x for x in v if x is not None]


# gRPC turns a deadline beyond ~1e10 s into an immediate DEADLINE_EXCEEDED; the CLI's waits share the bound.
MAX_SECONDS = 1_000_000_000


def seconds_violation(field: str, value, hi: float = MAX_SECONDS) -> FieldViolation | None:
    """A timeout or other duration: a number of seconds in (0, hi]."""
    bound = f"(0, {hi:.0f}]" if float(hi).is_integer() else f"(0, {hi}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return FieldViolation(field, f"must be a number of seconds in {bound}, got {_show(value)}")
    x = float(value)
    if math.isnan(x) or not 0.0 < x <= hi:
        return FieldViolation(field, f"must be a number of seconds in {bound}, got {value}")
    return None


MAX_DRAFT_DIST_IDS = 4096  # ids of one sampled draft's distribution (a drafter sends its top ones)


def draft_dists_violations(dists, drafts, vocab: int, field: str = "draft.draft_dists") -> list[FieldViolation]:
    """Sampled drafts' distributions (`DraftResult.draft_dists`): none, or one per draft, each a valid sparse
    distribution (unique ids within the vocabulary, finite probabilities >= 0 summing above 0) that gives its draft a
    probability above 0 (the draft was drawn from it)."""
    if not dists:
        return []
    if len(dists) != len(drafts):
        return [FieldViolation(field, f"{len(dists)} distributions for {len(drafts)} drafts: send one per draft, or none")]
    v: list[FieldViolation] = []
    for j, (q, d) in enumerate(zip(dists, drafts)):
        f = f"{field}[{j}]"
        if len(q.ids) != len(q.probs):
            v.append(FieldViolation(f, f"{len(q.ids)} ids and {len(q.probs)} probs: one probability per id"))
        elif not 0 < len(q.ids) <= MAX_DRAFT_DIST_IDS:
            v.append(FieldViolation(f, f"{len(q.ids)} ids: between 1 and {MAX_DRAFT_DIST_IDS}"))
        elif len(set(q.ids)) != len(q.ids) or any(not 0 <= i < vocab for i in q.ids):
            v.append(FieldViolation(f, f"ids must be unique and in [0, {vocab})"))
        elif any(not math.isfinite(p) or p < 0 for p in q.probs) or not sum(q.probs) > 0:
            v.append(FieldViolation(f, "probs must be finite, >= 0 and sum above 0"))
        elif d not in q.ids or q.probs[q.ids.index(d)] <= 0:
            v.append(FieldViolation(f, f"draft {d} has probability 0 in its distribution (it must be drawn from it)"))
    return v
