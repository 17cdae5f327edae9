"""pdflash.v1.Drafter, the public API: validate, tokenize, run the round loop, stream tokens and text.

The checks of a request and the messages of a stream are `drafter_svc.api`'s, shared with the stub server
(`pdflash.testing`); this servicer adds the model: the tokenizer, the drafters and the round loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import structlog

from pdflash.errors import InvalidArgument, PdflashError, Unavailable, abort_with
from pdflash.logging import get_logger
from pdflash.types import DrafterKind, FinishReason
from pdflash.v1 import drafter_pb2_grpc
from drafter_svc import api
from drafter_svc.api import REQUEST_ID_KEY  # noqa: F401  (where callers have always found it)
from drafter_svc.clients import SchedulerClient, TargetInfo, VerifierClient
from drafter_svc.config import DrafterConfig
from drafter_svc.loop import Deadline, Finished, Tokens, Usage, run_request
from drafter_svc.tokens import TextStream
from drafter_svc.width import RoundCost

log = get_logger("pdflash.drafter")


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

    @functools.cached_property
    def limits(self) -> api.Limits:
        cfg = self.cfg
        return api.Limits(
            max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
            default_max_tokens=cfg.default_max_tokens, block_size=cfg.block_size,
            max_block_size=min(cfg.max_block_size, self.target.max_block_size), vocab_size=self.target.vocab_size,
            max_context=self.target.max_context,
            drafters={k: getattr(f, "max_block_size", None) for k, f in self.factories.items()},
            default_drafter=self.default_kind, fixed_width=cfg.fixed_width,
        )

    @functools.cached_property
    def round_costs(self) -> dict[DrafterKind, RoundCost]:
        """Per drafter kind, the round-time line its sessions share (drafter_svc.width: the verify width's cost cap)."""
        total = sum(sum(b) for b in self.target.byte_map.values())
        offloaded = 0 < self.target.expert_cache_bytes < total  # some expert must stream in: priced from round 1
        return {k: RoundCost(offloaded=offloaded) for k in self.factories}

    def dflash_placement(self) -> tuple[str, str]:
        """(device, dtype) of the DFlash drafter, e.g. ("cuda:0", "bfloat16"); empty strings without one."""
        f = self.factories.get(DrafterKind.DFLASH)
        if f is None:
            return "", ""
        return str(f.head.embed.device), str(f.dtype).removeprefix("torch.")

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    @functools.cached_property
    def chat(self):
        """The tokenizer's chat template applied to messages (the assistant's turn opened), then tokenized as the
        template wrote it (its own special tokens, none added); None when the tokenizer has no template."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None

        def ids(messages: list[dict]) -> list[int]:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        return ids


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, door: FrontDoor | None = None, metrics=None):
        self.door = door  # None until the upstream services answer
        self.metrics = metrics  # pdflash.metrics.DrafterMetrics or None
        self._running = api.RunningRequests()

    async def Generate(self, request, context):
        request_id = api.request_id(request, context)
        try:
            api.check_request_id(request_id)
        except InvalidArgument as e:  # never echoed: it may not even be valid metadata
            await abort_with(context, e)
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        gen = None
        registered = False
        timer = None
        outcome = "error"
        try:
            if self.door is None:
                raise Unavailable("drafter is still starting (waiting for the scheduler and verifier); retry when health is SERVING")
            req, kind = api.parse_generate(request, request_id, self.door.limits, self.door.tokenize, self.door.chat)
            abort = self._running.start(request_id, self.door.cfg.max_concurrent)
            registered = True
            if self.metrics is not None:
                timer = self.metrics.request(len(req.prompt))
                timer.started()
            text = TextStream(self.door.tokenizer, req.prompt, req.stop)
            log.info("generate", prompt_tokens=len(req.prompt), max_tokens=req.max_tokens, drafter=kind.name.lower(),
                     block_size=req.block_size, stop_sequences=len(req.stop))
            usage = Usage()
            gen = run_request(
                req, self.door.factories[kind], self.door.verifier, self.door.scheduler,
                Deadline(context.time_remaining()), abort, admit_ahead=self.door.cfg.admit_ahead,
                verify_stream=self.door.cfg.verify_stream, round_cost=self.door.round_costs[kind], usage=usage,
            )
            sent = 0  # token ids streamed
            stopped = None  # the stop sequence that ended the text
            final = False  # the final message is out
            async for ev in gen:
                if isinstance(ev, Tokens):
                    ids, piece, stopped = text.add(ev.token_ids)
                    sent += len(ids)
                    if timer is not None:
                        timer.tokens(len(ids))
                        if ev.round > 0:
                            self.metrics.record_draft(ev.drafted, ev.accepted)
                    n = len(ids)  # (a stop sequence cuts the logprobs with the ids)
                    yield api.chunk_message(request_id, ids, piece, ev.round, ev.logprobs and ev.logprobs[:n],
                                            ev.top_logprobs and ev.top_logprobs[:n])
                    if stopped is not None:
                        break
                elif isinstance(ev, Finished):
                    rest, stopped = text.finish()
                    reason = FinishReason.STOP if stopped is not None else ev.reason
                    outcome, final = self._finished(reason, ev.usage), True
                    # the loop's clean-up (verifier session ended, admissions given back) and this request's slot
                    # freed before the client hears the end: a client that sends its next request on the final
                    # message finds the capacity free (max_concurrent 1 refused it before: stop 45's CI run)
                    gen, registered = await self._release(gen, request_id, registered)
                    yield api.final_message(request_id, reason, ev.usage, rest, stopped)
                    break
            if stopped is not None and not final:  # a stop sequence mid-stream: the rounds still to come do not run
                # (the loop's clean-up: the verifier session ended, every admission released; then the slot)
                gen, registered = await self._release(gen, request_id, registered)
                usage.completion_tokens = sent
                outcome = self._finished(FinishReason.STOP, usage)
                yield api.final_message(request_id, FinishReason.STOP, usage, "", stopped)
        except PdflashError as e:
            log.info("generate failed", code=e.code.name, error=e.message)
            gen, registered = await self._release(gen, request_id, registered)  # (before the status goes out)
            await abort_with(context, e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if timer is not None:
                timer.finished(outcome)
            await self._release(gen, request_id, registered)
            structlog.contextvars.unbind_contextvars("request_id")

    async def _release(self, gen, request_id: str, registered: bool) -> tuple[None, bool]:
        """The request's loop closed (its clean-up awaited) and its slot freed -> (gen, registered) as they now stand."""
        if gen is not None:
            await gen.aclose()
        if registered:
            self._running.finish(request_id)
        return None, False

    @staticmethod
    def _finished(reason: FinishReason, u: Usage) -> str:
        log.info("finished", finish_reason=reason.name.lower(), completion_tokens=u.completion_tokens, rounds=u.rounds,
                 mean_acceptance_length=round(u.mean_acceptance_length, 3))
        return reason.name.lower()

    async def Abort(self, request, context):
        try:
            return api.abort(self._running, request)
        except InvalidArgument as e:
            await abort_with(context, e)

    async def Tokenize(self, request, context):
        try:
            d = self._ready()
            return api.tokenize_message(request, d.limits, d.tokenize, d.chat)
        except PdflashError as e:
            await abort_with(context, e)

    async def Detokenize(self, request, context):
        try:
            d = self._ready()
            return api.detokenize_message(request, d.limits, lambda ids, skip: d.tokenizer.decode(ids, skip_special_tokens=skip))
        except PdflashError as e:
            await abort_with(context, e)

    def _ready(self) -> FrontDoor:
        if self.door is None:
            raise Unavailable("drafter is still starting; retry when health is SERVING")
        return self.door

    async def ModelInfo(self, request, context):
        try:
            d = self._ready()
        except PdflashError as e:
            await abort_with(context, e)
        return api.model_info_message(d.limits, d.target.model, d.target.architecture, d.drafter_model, *d.dflash_placement(),
                                      chat_template=d.chat is not None)
