"""The public API's edge, without a model: request ids, the checks of Generate and Abort, the registry of
running requests, and the messages of a Generate stream.

Two servers use it: the drafter's servicer and the stub (`pdflash.testing`), so a request the stub accepts
is one the drafter accepts, refused with the same status, message and field violations, and answered with
messages of the same shape. No torch, no numpy, no tokenizer here (tests/test_testing.py checks the imports):
text is tokenized by a function the caller passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Mapping

from pdflash import convert
from pdflash.errors import FieldViolation, InvalidArgument, ResourceExhausted, check
from pdflash.types import DrafterKind, FinishReason
from pdflash.v1 import drafter_pb2
from pdflash.validation import (MAX_ID_CHARS, id_violations, logprobs_violations, messages_violations, sampling_violations,
                                stop_violations)
from drafter_svc.loop import Request, Usage

REQUEST_ID_KEY = "x-request-id"
MAX_STOP_TOKENS = 256
# Text longer than this many characters per allowed prompt token is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a Generate request is checked against: the server's options and its model's."""

    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    block_size: int  # the default verify block
    max_block_size: int  # the widest a request may ask for (the drafter's option and the verifier's, the smaller)
    vocab_size: int
    max_context: int
    # The drafter kinds served, each with the widest block it drafts (None: no cap of its own).
    drafters: Mapping[DrafterKind, int | None]
    default_drafter: DrafterKind
    fixed_width: bool = False


def request_id(request, context) -> str:
    """The request's own id, else the x-request-id metadata, else a fresh one."""
    if request.request_id:
        return request.request_id
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return value
    return uuid.uuid4().hex


def check_request_id(request_id: str) -> None:
    """InvalidArgument for an id that cannot be echoed (too long, or not printable ASCII)."""
    v: list[FieldViolation] = []
    if len(request_id) > MAX_ID_CHARS:
        v = id_violations({"request_id": request_id})
    elif not all(" " <= c <= "~" for c in request_id):
        v = [FieldViolation("request_id", "must be printable ASCII (it is echoed in the x-request-id metadata)")]
    if v:  # the first one only: the message must not repeat the id itself
        raise InvalidArgument(f"invalid Generate request: {v[0].field}: {v[0].description}", v)


def prompt_ids(request, limits: Limits, tokenize: Callable[[str], list[int]], chat: Callable[[list[dict]], list[int]] | None,
               v: list[FieldViolation], allow_empty: bool = False) -> list[int]:
    """The token ids of a request's `input` oneof (prompt text, prompt_tokens, messages), as Generate takes them; what
    is wrong goes to `v`. `chat`: the model's chat template applied to messages and tokenized (None: it has none)."""
    which = request.WhichOneof("input")
    prompt: list[int] = []
    if which == "prompt":
        if not request.prompt and not allow_empty:
            v.append(FieldViolation("prompt", "must not be empty"))
        elif len(request.prompt) > limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            v.append(FieldViolation("prompt", f"{len(request.prompt)} characters is far beyond the limit of "
                                              f"{limits.max_prompt_tokens} tokens; shorten the prompt"))
        else:
            prompt = list(tokenize(request.prompt))
    elif which == "messages":
        msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        bad = messages_violations(msgs)
        v.extend(bad)
        chars = sum(len(m["content"]) for m in msgs)
        if chat is None:
            v.append(FieldViolation("messages", "this model's tokenizer has no chat template; send prompt (text, formatted "
                                                "as the model expects) or prompt_tokens"))
        elif chars > limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            v.append(FieldViolation("messages", f"{chars} characters is far beyond the limit of {limits.max_prompt_tokens} "
                                                "tokens; shorten the conversation"))
        elif not bad:
            try:
                prompt = list(chat(msgs))
            except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja's raise_exception), in its words
                v.append(FieldViolation("messages", f"the model's chat template refused them: {e}"))
    elif which == "prompt_tokens":
        prompt = list(request.prompt_tokens.ids)
        if not prompt:
            v.append(FieldViolation("prompt_tokens.ids", "must not be empty"))
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            v.append(FieldViolation("prompt_tokens.ids", f"ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"))
    else:
        v.append(FieldViolation("prompt", "give one of prompt (text), prompt_tokens or messages"))
    return prompt


def parse_generate(request, request_id: str, limits: Limits, tokenize: Callable[[str], list[int]],
                   chat: Callable[[list[dict]], list[int]] | None = None) -> tuple[Request, DrafterKind]:
    """Check a GenerateRequest against `limits` (InvalidArgument listing every violation) and convert it. `chat`: the
    model's chat template applied to messages and tokenized (None: the model has none, messages are refused)."""
    v: list[FieldViolation] = []
    prompt = prompt_ids(request, limits, tokenize, chat, v)
    if len(prompt) > limits.max_prompt_tokens:
        v.append(FieldViolation("prompt", f"{len(prompt)} tokens exceeds the limit of {limits.max_prompt_tokens}"))
    if len(prompt) >= limits.max_context:
        v.append(FieldViolation("prompt", f"{len(prompt)} tokens does not fit the model's context of {limits.max_context}"))
    max_tokens = request.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens_limit:
        v.append(FieldViolation("max_tokens", f"must be <= {limits.max_tokens_limit}, got {max_tokens}"))
    bad_stop = [t for t in request.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad_stop:
        v.append(FieldViolation("stop_token_ids", f"ids {bad_stop[:5]} outside the vocabulary [0, {limits.vocab_size})"))
    if len(request.stop_token_ids) > MAX_STOP_TOKENS:
        v.append(FieldViolation("stop_token_ids", f"{len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKENS}"))
    stops = tuple(request.stop)
    v.extend(stop_violations(stops))
    v.extend(logprobs_violations(request.logprobs, request.top_logprobs))
    sampling = convert.sampling_from_pb(request.sampling)
    v.extend(sampling_violations(sampling))
    kind = DrafterKind(request.drafter) if request.drafter in DrafterKind._value2member_map_ else None
    if kind is None:
        v.append(FieldViolation("drafter", f"unknown drafter kind {request.drafter}; choose one of "
                                           f"{', '.join(k.name.lower() for k in DrafterKind)}"))
    elif kind == DrafterKind.UNSPECIFIED:
        kind = limits.default_drafter
    block = request.block_size or limits.block_size
    if block > limits.max_block_size:
        v.append(FieldViolation("block_size", f"must be <= {limits.max_block_size}, got {block}"))
    if kind is not None and kind != DrafterKind.UNSPECIFIED and kind not in limits.drafters:
        avail = ", ".join(k.name.lower() for k in limits.drafters)  # as the CLI, the client and the README name them
        v.append(FieldViolation("drafter", f"{kind.name.lower()} is not available on this server (no DFlash drafter loaded); "
                                           f"available: {avail}"))
    check(v, "invalid Generate request")
    if kind == DrafterKind.NONE or block == 1:
        kind, block = DrafterKind.NONE, 1
    cap = limits.drafters[kind]
    if cap:
        block = min(block, cap)
    req = Request(
        request_id=request_id,
        prompt=tuple(prompt),
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        block_size=block,
        fixed_width=request.fixed_width or limits.fixed_width,
        stop=tuple(dict.fromkeys(stops)),
        logprobs=request.logprobs,
        top_logprobs=int(request.top_logprobs),
    )
    return req, kind


def tokenize_message(request, limits: Limits, tokenize: Callable[[str], list[int]],
                     chat: Callable[[list[dict]], list[int]] | None) -> drafter_pb2.TokenizeResponse:
    """The Tokenize RPC of the drafter and the stub: the ids Generate would take for this input (InvalidArgument
    listing what is wrong), and whether they fit a prompt."""
    v: list[FieldViolation] = []
    ids = prompt_ids(request, limits, tokenize, chat, v, allow_empty=True)
    check(v, "invalid Tokenize request")
    fits = len(ids) <= limits.max_prompt_tokens and len(ids) < limits.max_context
    return drafter_pb2.TokenizeResponse(ids=ids, count=len(ids), fits_prompt=fits)


def detokenize_message(request, limits: Limits, decode: Callable[[list[int], bool], str]) -> drafter_pb2.DetokenizeResponse:
    """The Detokenize RPC: ids (in the vocabulary, at most the context's) -> the text the tokenizer decodes."""
    ids = list(request.ids)
    v = []
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        v.append(FieldViolation("ids", f"ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"))
    if len(ids) > limits.max_context:
        v.append(FieldViolation("ids", f"{len(ids)} ids; at most the model's context of {limits.max_context}"))
    check(v, "invalid Detokenize request")
    return drafter_pb2.DetokenizeResponse(text=decode(ids, request.skip_special_tokens))


def check_abort(request) -> None:
    v = id_violations({"request_id": request.request_id})
    if not request.request_id:
        v.append(FieldViolation("request_id", "required: the id of the running Generate to stop"))
    check(v, "invalid Abort request")


def abort(running: "RunningRequests", request) -> drafter_pb2.AbortResponse:
    """The Abort RPC of the drafter and the stub: checked (InvalidArgument), then the named request stopped."""
    check_abort(request)
    return drafter_pb2.AbortResponse(aborted=running.abort(request.request_id))


class RunningRequests:
    """Requests generating now, by id, each with the event that Abort sets."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._events)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._events

    def start(self, request_id: str, max_concurrent: int) -> asyncio.Event:
        """Register a request (unique id, at most max_concurrent at once); returns its abort event."""
        if request_id in self._events:
            raise InvalidArgument(f"request_id {request_id!r} is already running", [FieldViolation("request_id", "must be unique among running requests")])
        if len(self._events) >= max_concurrent:
            raise ResourceExhausted(f"{len(self._events)} requests already running (limit {max_concurrent}); retry shortly")
        event = asyncio.Event()
        self._events[request_id] = event
        return event

    def finish(self, request_id: str) -> None:
        self._events.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Set the request's abort event; False when no request of that id runs."""
        event = self._events.get(request_id)
        if event is not None:
            event.set()
        return event is not None


def chunk_message(request_id: str, token_ids: list[int], text: str, round: int, logprobs: list[float] | None = None,
                  top_logprobs=None) -> drafter_pb2.GenerateResponse:
    """A TokenChunk; `logprobs` / `top_logprobs` (one per id, or None) as the request asked for them."""
    return drafter_pb2.GenerateResponse(
        request_id=request_id, chunk=drafter_pb2.TokenChunk(
            token_ids=token_ids, text=text, round=round, logprobs=logprobs or (),
            top_logprobs=convert.top_logprobs_to_pb(top_logprobs)))


def final_message(request_id: str, reason: FinishReason, usage: Usage, text: str,
                  stop_sequence: str | None = None) -> drafter_pb2.GenerateResponse:
    u = usage
    return drafter_pb2.GenerateResponse(
        request_id=request_id,
        final=drafter_pb2.Final(
            finish_reason=int(reason),
            text=text,
            stop_sequence=stop_sequence or "",
            usage=drafter_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                rounds=u.rounds,
                mean_acceptance_length=u.mean_acceptance_length,
                draft_tokens=u.draft_tokens, rounds_admitted_ahead=u.rounds_admitted_ahead,
                accepted_draft_tokens=u.accepted_draft_tokens, routed_expert_bytes=u.routed_expert_bytes,
            ),
            timings=drafter_pb2.PhaseTimings(
                prefill_ms=u.prefill_ms, draft_ms=u.draft_ms, admit_ms=u.admit_ms, verify_ms=u.verify_ms,
                verify_server_ms=u.verify_server_ms, verify_forward_ms=u.verify_forward_ms,
            ),
        ),
    )


def model_info_message(limits: Limits, model: str, architecture: str, drafter_model: str = "", drafter_device: str = "",
                       drafter_dtype: str = "", chat_template: bool = False) -> drafter_pb2.ModelInfoResponse:
    return drafter_pb2.ModelInfoResponse(
        model=model,
        architecture=architecture,
        default_drafter=int(limits.default_drafter),
        drafters=[int(k) for k in limits.drafters],
        block_size=limits.block_size,
        max_block_size=limits.max_block_size,
        max_tokens_limit=limits.max_tokens_limit,
        max_prompt_tokens=limits.max_prompt_tokens,
        vocab_size=limits.vocab_size,
        drafter_model=drafter_model,
        drafter_device=drafter_device,
        drafter_dtype=drafter_dtype,
        chat_template=chat_template,
    )
