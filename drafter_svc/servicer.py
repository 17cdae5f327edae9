"""pdflash.v1.Drafter, the public API: validate, tokenize, run the round loop, stream tokens and text."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import structlog

from pdflash import convert
from pdflash.errors import FieldViolation, InvalidArgument, PdflashError, ResourceExhausted, Unavailable, abort_with, check
from pdflash.logging import get_logger
from pdflash.types import DrafterKind
from pdflash.v1 import drafter_pb2, drafter_pb2_grpc
from pdflash.validation import MAX_ID_CHARS, id_violations, sampling_violations
from drafter_svc.clients import SchedulerClient, TargetInfo, VerifierClient
from drafter_svc.config import DrafterConfig
from drafter_svc.loop import Deadline, Finished, Request, Tokens, run_request
from drafter_svc.tokens import IncrementalDetokenizer

log = get_logger("pdflash.drafter")

REQUEST_ID_KEY = "x-request-id"
MAX_STOP_TOKENS = 256
# Text longer than this many characters per allowed prompt token is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 32


@dataclasses.dataclass
class FrontDoor:
    """Everything a request needs, loaded once per process."""

    cfg: DrafterConfig
    tokenizer: object
    factories: dict[DrafterKind, object]
    default_kind: DrafterKind
    verifier: VerifierClient
    scheduler: SchedulerClient
    target: TargetInfo
    drafter_model: str = ""


def _request_id(request, context) -> str:
    if request.request_id:
        return request.request_id
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return value
    return uuid.uuid4().hex


def _request_id_violations(request_id: str) -> list[FieldViolation]:
    if len(request_id) > MAX_ID_CHARS:
        return id_violations({"request_id": request_id})
    if not all(" " <= c <= "~" for c in request_id):
        return [FieldViolation("request_id", "must be printable ASCII (it is echoed in the x-request-id metadata)")]
    return []


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, door: FrontDoor | None = None, metrics=None):
        self.door = door  # None until the upstream services answer
        self.metrics = metrics  # pdflash.metrics.DrafterMetrics or None
        self._running: dict[str, asyncio.Event] = {}

    def _to_request(self, request, request_id: str) -> tuple[Request, DrafterKind]:
        door, cfg = self.door, self.door.cfg
        v: list[FieldViolation] = []
        which = request.WhichOneof("input")
        prompt: list[int] = []
        if which == "prompt":
            if not request.prompt:
                v.append(FieldViolation("prompt", "must not be empty"))
            elif len(request.prompt) > cfg.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
                v.append(FieldViolation("prompt", f"{len(request.prompt)} characters is far beyond the limit of "
                                                  f"{cfg.max_prompt_tokens} tokens; shorten the prompt"))
            else:
                prompt = list(door.tokenizer(request.prompt, add_special_tokens=True)["input_ids"])
        elif which == "prompt_tokens":
            prompt = list(request.prompt_tokens.ids)
            if not prompt:
                v.append(FieldViolation("prompt_tokens.ids", "must not be empty"))
            bad = [t for t in prompt if not 0 <= t < door.target.vocab_size]
            if bad:
                v.append(FieldViolation("prompt_tokens.ids", f"ids {bad[:5]} outside the vocabulary [0, {door.target.vocab_size})"))
        else:
            v.append(FieldViolation("prompt", "give either prompt (text) or prompt_tokens"))
        if len(prompt) > cfg.max_prompt_tokens:
            v.append(FieldViolation("prompt", f"{len(prompt)} tokens exceeds the limit of {cfg.max_prompt_tokens}"))
        if len(prompt) >= door.target.max_context:
            v.append(FieldViolation("prompt", f"{len(prompt)} tokens does not fit the model's context of {door.target.max_context}"))
        max_tokens = request.max_tokens or cfg.default_max_tokens
        if max_tokens > cfg.max_tokens_limit:
            v.append(FieldViolation("max_tokens", f"must be <= {cfg.max_tokens_limit}, got {max_tokens}"))
        bad_stop = [t for t in request.stop_token_ids if not 0 <= t < door.target.vocab_size]
        if bad_stop:
            v.append(FieldViolation("stop_token_ids", f"ids {bad_stop[:5]} outside the vocabulary [0, {door.target.vocab_size})"))
        if len(request.stop_token_ids) > MAX_STOP_TOKENS:
            v.append(FieldViolation("stop_token_ids", f"{len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKENS}"))
        sampling = convert.sampling_from_pb(request.sampling)
        v.extend(sampling_violations(sampling))
        kind = DrafterKind(request.drafter) if request.drafter in DrafterKind._value2member_map_ else None
        if kind is None:
            v.append(FieldViolation("drafter", f"unknown drafter kind {request.drafter}"))
        elif kind == DrafterKind.UNSPECIFIED:
            kind = door.default_kind
        block = request.block_size or cfg.block_size
        if block > min(cfg.max_block_size, door.target.max_block_size):
            v.append(FieldViolation("block_size", f"must be <= {min(cfg.max_block_size, door.target.max_block_size)}, got {block}"))
        if kind is not None and kind != DrafterKind.UNSPECIFIED and kind not in door.factories:
            avail = ", ".join(k.name for k in door.factories)
            v.append(FieldViolation("drafter", f"{kind.name} is not available on this server (no DFlash drafter loaded); available: {avail}"))
        check(v, "invalid Generate request")
        if kind == DrafterKind.NONE or block == 1:
            kind, block = DrafterKind.NONE, 1
        fac = door.factories[kind]
        if getattr(fac, "max_block_size", None):
            block = min(block, fac.max_block_size)
        req = Request(
            request_id=request_id,
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            block_size=block,
            fixed_width=request.fixed_width or cfg.fixed_width,
        )
        return req, kind

    async def Generate(self, request, context):
        request_id = _request_id(request, context)
        bad_id = _request_id_violations(request_id)
        if bad_id:  # never echoed: it may not even be valid metadata
            await abort_with(context, InvalidArgument(f"invalid Generate request: {bad_id[0].field}: {bad_id[0].description}", bad_id))
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        gen = None
        registered = False
        timer = None
        outcome = "error"
        try:
            if self.door is None:
                raise Unavailable("drafter is still starting (waiting for the scheduler and verifier); retry when health is SERVING")
            req, kind = self._to_request(request, request_id)
            if request_id in self._running:
                raise InvalidArgument(f"request_id {request_id!r} is already running", [FieldViolation("request_id", "must be unique among running requests")])
            if len(self._running) >= self.door.cfg.max_concurrent:
                raise ResourceExhausted(f"{len(self._running)} requests already running (limit {self.door.cfg.max_concurrent}); retry shortly")
            if self.metrics is not None:
                timer = self.metrics.request(len(req.prompt))
                timer.started()
            abort = asyncio.Event()
            self._running[request_id] = abort
            registered = True
            detok = IncrementalDetokenizer(self.door.tokenizer, req.prompt)
            log.info("generate", prompt_tokens=len(req.prompt), max_tokens=req.max_tokens, drafter=kind.name.lower(), block_size=req.block_size)
            gen = run_request(
                req, self.door.factories[kind], self.door.verifier, self.door.scheduler, self.door.target.byte_map,
                Deadline(context.time_remaining()), abort, admit_ahead=self.door.cfg.admit_ahead,
                verify_stream=self.door.cfg.verify_stream,
            )
            async for ev in gen:
                if isinstance(ev, Tokens):
                    if timer is not None:
                        timer.tokens(len(ev.token_ids))
                        if ev.round > 0:
                            self.metrics.record_draft(ev.drafted, ev.accepted)
                    yield drafter_pb2.GenerateResponse(
                        request_id=request_id,
                        chunk=drafter_pb2.TokenChunk(token_ids=ev.token_ids, text=detok.add(ev.token_ids), round=ev.round),
                    )
                elif isinstance(ev, Finished):
                    outcome = ev.reason.name.lower()
                    u = ev.usage
                    log.info("finished", finish_reason=ev.reason.name.lower(), completion_tokens=u.completion_tokens,
                             rounds=u.rounds, mean_acceptance_length=round(u.mean_acceptance_length, 3))
                    yield drafter_pb2.GenerateResponse(
                        request_id=request_id,
                        final=drafter_pb2.Final(
                            finish_reason=int(ev.reason),
                            text=detok.flush(),
                            usage=drafter_pb2.Usage(
                                prompt_tokens=u.prompt_tokens,
                                completion_tokens=u.completion_tokens,
                                rounds=u.rounds,
                                mean_acceptance_length=u.mean_acceptance_length,
                                draft_tokens=u.draft_tokens, rounds_admitted_ahead=u.rounds_admitted_ahead,
                                accepted_draft_tokens=u.accepted_draft_tokens,
                            ),
                            timings=drafter_pb2.PhaseTimings(
                                prefill_ms=u.prefill_ms, draft_ms=u.draft_ms, admit_ms=u.admit_ms, verify_ms=u.verify_ms,
                                verify_server_ms=u.verify_server_ms, verify_forward_ms=u.verify_forward_ms,
                            ),
                        ),
                    )
        except PdflashError as e:
            log.info("generate failed", code=e.code.name, error=e.message)
            await abort_with(context, e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if timer is not None:
                timer.finished(outcome)
            if gen is not None:
                await gen.aclose()
            if registered:
                self._running.pop(request_id, None)
            structlog.contextvars.unbind_contextvars("request_id")

    async def Abort(self, request, context):
        v = id_violations({"request_id": request.request_id})
        if not request.request_id:
            v.append(FieldViolation("request_id", "required: the id of the running Generate to stop"))
        try:
            check(v, "invalid Abort request")
        except InvalidArgument as e:
            await abort_with(context, e)
        ev = self._running.get(request.request_id)
        if ev is not None:
            ev.set()
        return drafter_pb2.AbortResponse(aborted=ev is not None)

    async def ModelInfo(self, request, context):
        if self.door is None:
            await abort_with(context, Unavailable("drafter is still starting; retry when health is SERVING"))
        d = self.door
        return drafter_pb2.ModelInfoResponse(
            model=d.target.model,
            architecture=d.target.architecture,
            default_drafter=int(d.default_kind),
            drafters=[int(k) for k in d.factories],
            block_size=d.cfg.block_size,
            max_block_size=min(d.cfg.max_block_size, d.target.max_block_size),
            max_tokens_limit=d.cfg.max_tokens_limit,
            max_prompt_tokens=d.cfg.max_prompt_tokens,
            vocab_size=d.target.vocab_size,
            drafter_model=d.drafter_model,
        )
