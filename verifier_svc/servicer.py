"""pdflash.v1.Verifier: validate, convert, call the core (on the torch thread, or inline for one-thread CPU verify
forwards), convert back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time


from pdflash import convert, torch_thread
from pdflash.errors import DeadlineExceeded, FieldViolation, PdflashError, ResourceExhausted, Unavailable, abort_with, check
from pdflash.logging import get_logger
from pdflash.tickets import TicketSigner
from pdflash.types import DraftResult, FinishReason, union_bytes
from pdflash.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from pdflash.validation import id_violations, logprobs_violations
from verifier_svc.engine import PrefillInput, PrefillJob, StepOutput, VerifierCore
from verifier_svc.waves import take_wave

log = get_logger("pdflash.verifier")

MAX_LIST_ITEMS = 1024  # stop ids, feature layers: far more than any model needs
MAX_UNION_LAYERS = 4096  # LayerExperts entries of a Prefetch hint (as the scheduler bounds a demand's)

_OUTCOME_NAMES = {
    verifier_pb2.PREFETCH_OUTCOME_QUEUED: "queued",
    verifier_pb2.PREFETCH_OUTCOME_NO_EXPERT_CACHE: "no_expert_cache",
    verifier_pb2.PREFETCH_OUTCOME_DISABLED: "disabled",
    verifier_pb2.PREFETCH_OUTCOME_STALE: "stale",
}


def _finish_pb(f: FinishReason | None) -> int:
    return int(f) if f is not None else 0



def cache_bytes(cache) -> int:
    """The bytes of experts an expert cache can keep resident (0: no cache, every expert resident in the weights)."""
    return 0 if cache is None else int(cache.kept_bytes)


def model_kernels_json(kernels: dict, forward: dict) -> str:
    """VerifierModelInfo.kernels: the installed kernels (pdflash_kernels.install's summary) and, with the paged forward, how a
    verify forward runs (VerifierCore.forward_info) under "forward"; "" when neither applies (transformers' own path)."""
    info = {**kernels, **({"forward": forward} if forward else {})}
    return json.dumps(info, sort_keys=True) if info else ""

def _prefill_step(job):
    """A prefill's next chunk on the torch thread; its answer once that was the last chunk, else None."""
    return job.finish() if job.step() else None


def observe_cache(m, st) -> None:
    """One forward's expert-cache counters (CacheStats) into the pdflash_expert_cache_* series."""
    m.expert_cache_hits.inc(st.hits)
    m.expert_cache_misses.inc(st.misses)
    m.expert_bytes_moved.inc(st.bytes_moved)
    m.expert_cache_evictions.inc(st.evictions)
    m.expert_cache_prefetched.inc(st.prefetched)
    m.expert_cache_prefetch_used.inc(st.prefetch_used)
    m.expert_cache_wasted_bytes.inc(st.wasted_bytes)
    m.expert_cache_prefetch_aborted.inc(st.prefetch_aborted)


@dataclasses.dataclass(eq=False)
class _Waiting:
    """A Verify call waiting for a wave (`_verify_in_wave`)."""

    draft: DraftResult
    return_features: bool
    future: asyncio.Future
    since: float  # perf_counter at arrival
    running: bool = False  # taken into a wave
    left: bool = False  # its caller left while its wave ran (it still counts as pending until the wave ends)


@dataclasses.dataclass(eq=False)
class _WaitingPrefill:
    """A prompt's next chunk waiting for a prefill wave (`_prefill_in_wave`)."""

    job: PrefillJob
    future: asyncio.Future
    since: float
    running: bool = False
    left: bool = False  # its caller left while its wave ran: the wave ends its session or closes its job afterwards


def _prefill_wave_step(core: VerifierCore, jobs: list) -> tuple[list, list, int]:
    """A prefill wave on the torch thread: each job's next chunk in one forward (VerifierCore.prefill_wave). Returns the
    answer of each job whose prompt is whole (None: more chunks to go; an exception: that job's failure), the
    expert-cache counters of each forward that ran (one for a wave; a job's own where it ran alone), and the most
    prompts one of those forwards held."""
    out, forwards, shared = [], {}, 1
    for job, r in zip(jobs, core.prefill_wave(jobs)):
        if not isinstance(r, BaseException):
            shared = max(shared, job.last_wave_sessions)
            if job.last_stats is not None:
                forwards[id(job.last_stats)] = job.last_stats
        if r is True:
            try:
                r = job.finish()
            except Exception as e:  # noqa: BLE001 - this job's own failure
                r = e
        out.append(None if r is False else r)
    return out, list(forwards.values()), shared


def _take(queue: list, wave: list, session_of, rows_of, max_sessions: int, max_rows: int) -> None:
    """Move the next wave's calls (`take_wave`) from `queue` into `wave`, those whose callers are still there, each
    marked running."""
    picked = [queue[i] for i in take_wave(queue, session_of, rows_of, max_sessions, max_rows)]
    for w in picked:
        queue.remove(w)
    wave.extend(w for w in picked if not w.future.done())
    for w in wave:
        w.running = True


async def _to_the_end(work):
    """The torch thread's result of `work`: a forward cannot be interrupted, so the device stays held until it ends,
    whatever cancels the waiting task meanwhile."""
    while not work.done():
        try:
            await asyncio.wait([work])
        except asyncio.CancelledError:
            pass
    return work.result()


def _log_failure(task: asyncio.Task) -> None:
    """A wave task that died (its calls were answered UNAVAILABLE): say why, once."""
    if not task.cancelled() and task.exception() is not None:
        log.error("wave task failed", task=task.get_name(), error=repr(task.exception()))


def _running(task: asyncio.Task | None, run) -> asyncio.Task:
    """`task` while it runs, else a new task of `run()` (a wave loop: verify or prefill waves) whose failure is logged."""
    if task is None or task.done():
        task = asyncio.get_running_loop().create_task(run(), name=run.__name__)
        task.add_done_callback(_log_failure)
    return task


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, core: VerifierCore | None = None, metrics=None, signer: TicketSigner | None = None, max_pending: int = 128,
                 inline_verify: bool = False):
        self.metrics = metrics  # pdflash.metrics.VerifierMetrics or None
        # Verify forwards on the event-loop thread itself (VerifierConfig.inline_verify says when): no hand-off
        # to the torch thread and back, two thread wake-ups per round.
        self.inline_verify = inline_verify
        self.core = core  # None while the model loads: RPCs answer UNAVAILABLE
        self.signer = signer or TicketSigner("")  # no secret: tickets are not checked
        # One device: forwards run one at a time on the process's torch thread, so health keeps answering
        # (an inline verify forward holds the loop for its few milliseconds; prefill never runs inline).
        self._device = asyncio.Lock()
        # Calls waiting for (or holding) the device; bounded so a flood cannot queue without limit.
        self.max_pending = max_pending
        self._pending = 0
        # Verify calls waiting for a multi-session wave (core.max_wave_sessions > 1), oldest first, and the task that
        # runs waves while any wait (`_run_waves`)
        self._waiting: list[_Waiting] = []
        self._waves: asyncio.Task | None = None
        self._prefill_gate = asyncio.Lock()  # one chunked prefill at a time (`_prefill`)
        # Prompts' next chunks waiting for a prefill wave (several prompts in one forward, `_prefill_in_wave`) and its task
        self._prefills_waiting: list[_WaitingPrefill] = []
        self._prefill_wave_task: asyncio.Task | None = None

    async def _ready(self, context) -> VerifierCore:
        if self.core is None:
            await abort_with(context, Unavailable("verifier is still loading its model; retry when health is SERVING"))
        return self.core

    async def _run(self, fn, *args, on_abandoned=None, inline: bool = False, admitted: bool = False):
        """fn(*args) on a worker thread, one at a time. on_abandoned(result): called when the caller left
        while fn ran (cancel, deadline) and fn still succeeded, to undo what nobody will hear about.
        inline: call fn on this (the event loop's) thread instead, still one at a time; nothing can
        interrupt it there, so nobody leaves while it runs. admitted: a call already under way (a prefill's next
        chunk) is not refused for the queue's length."""
        if not admitted:
            self._admit_pending()
        self._pending += 1
        try:
            t0 = time.perf_counter()
            async with self._device:
                queued = (time.perf_counter() - t0) * 1e3
                if inline:
                    return fn(*args), queued
                work = torch_thread.submit(fn, *args)  # see pdflash.torch_thread
                try:
                    return await asyncio.shield(work), queued
                except asyncio.CancelledError:
                    # The caller left (cancel, deadline). A forward cannot be interrupted: keep the device
                    # until it ends so the next forward never overlaps it, then give up.
                    while not work.done():
                        try:
                            await asyncio.wait([work])
                        except asyncio.CancelledError:
                            pass
                    if on_abandoned is not None and not work.cancelled() and work.exception() is None:
                        on_abandoned(work.result())
                    raise
        finally:
            self._pending -= 1

    def _admit_pending(self) -> None:
        if self._pending >= self.max_pending:
            raise ResourceExhausted(
                f"verifier has {self._pending} calls waiting for the device (limit {self.max_pending}); retry shortly",
                retry_after_s=0.1,
            )

    async def _verify_in_wave(self, draft: DraftResult, return_features: bool) -> tuple[StepOutput, float]:
        """A verify that may share its forward with other sessions' (verifier_svc.waves): it waits with the others for
        the device; each time the device frees, the calls waiting then form the next wave (`take_wave`). Returns
        (its answer, ms it waited). A caller that leaves before its wave starts is dropped from the queue; one that
        leaves during its wave's forward is answered to nobody (as a lone verify whose caller left) and counts as
        pending until that forward ends."""
        self._admit_pending()
        self._pending += 1
        item = _Waiting(draft, return_features, asyncio.get_running_loop().create_future(), time.perf_counter())
        try:
            self._waiting.append(item)
            self._waves = _running(self._waves, self._run_waves)
            try:
                # (not shielded: the wave's answer wakes this caller in the loop's next round, before the next wave)
                return await item.future
            except asyncio.CancelledError:
                if item in self._waiting:  # not started: nothing to undo
                    self._waiting.remove(item)
                elif item.running and item.future.cancelled():
                    item.left = True  # its wave is running: _one_wave drops the pending count when it ends
                item.future.cancel()  # (its wave answers nobody)
                raise
        finally:
            if not item.left:
                self._pending -= 1

    async def _run_waves(self) -> None:
        """Run waves while calls wait. However it ends (a failure of its own, the server stopping), no call it took or
        left waiting is left without an answer."""
        wave: list[_Waiting] = []  # the wave in hand (taken from the queue, not yet answered)
        try:
            while self._waiting:
                await self._one_wave(wave)
                wave.clear()
                await asyncio.sleep(0)  # the answered callers resume before the next wave (inline verify holds the loop)
        finally:
            for w in wave + self._waiting:
                if w.left:
                    self._pending -= 1
                if not w.future.done():
                    w.future.set_exception(Unavailable("the verifier stopped its verify waves; retry the call"))
            self._waiting.clear()

    async def _one_wave(self, wave: list[_Waiting]) -> None:
        """The next wave: taken from the queue into `wave` once the device is free, run, answered."""
        core = self.core
        async with self._device:  # behind any forward already running (a prefill, a lone call)
            _take(self._waiting, wave, lambda w: w.draft.session_id, lambda w: len(w.draft.tokens),
                  core.max_wave_sessions, core.max_wave_rows)
            if not wave:
                return
            started = time.perf_counter()
            args = [(w.draft, w.return_features) for w in wave]
            try:
                if self.inline_verify:
                    results = core.verify_wave(args)
                else:
                    results = await _to_the_end(torch_thread.submit(core.verify_wave, args))
            except Exception as e:  # noqa: BLE001 - the wave failed as a whole: each of its calls fails with it
                results = [e] * len(wave)
        answered = [r for r in results if isinstance(r, StepOutput)]
        log.debug("verify wave", calls=len(wave), answered=len(answered), rows=sum(len(w.draft.tokens) for w in wave),
                  forward_ms=round(answered[0].forward_ms, 2) if answered else None)
        if self.metrics is not None and answered:
            self.metrics.verify_wave_sessions.observe(len(answered))
            shared = next((r for r in answered if r.wave_sessions > 1), None)
            if shared is not None and shared.expert_cache is not None:
                observe_cache(self.metrics, shared.expert_cache)  # one forward's counters, once
        for w, r in zip(wave, results):
            if w.left:
                self._pending -= 1
                w.left = False
            if w.future.done():
                continue
            if isinstance(r, BaseException):
                w.future.set_exception(r)
            else:
                w.future.set_result((r, (started - w.since) * 1e3))

    def _timings(self, out: StepOutput, t_start: float, queued: float) -> common_pb2.Timings:
        return common_pb2.Timings(
            total_ms=(time.perf_counter() - t_start) * 1e3, forward_ms=out.forward_ms, accept_ms=out.accept_ms, queue_ms=queued
        )

    def _observe(self, out: StepOutput, t_start: float, prefill: bool, cache_counted: bool = False) -> None:
        """Latency and expert-cache metrics of one answer. cache_counted: its forwards' cache counters were counted by
        the wave that ran them (a prefill through prefill waves)."""
        m = self.metrics
        if m is None:
            return
        (m.prefill_latency if prefill else m.verify_latency).observe(time.perf_counter() - t_start)
        st = out.expert_cache
        if st is None:  # every expert resident: each routed expert is a hit
            m.expert_cache_hits.inc(sum(len(ids) for ids in out.routed_union.values()))
            return
        if out.wave_sessions > 1 or cache_counted:  # the wave's counters, shared by its answers: counted once, by the wave
            return
        observe_cache(m, st)

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        t = self.core.target
        return verifier_pb2.VerifierModelInfo(
            model=t.name,
            architecture=t.architecture,
            num_layers=t.num_layers,
            hidden_size=t.hidden_size,
            vocab_size=t.vocab_size,
            max_context=t.max_context,
            moe_layers=t.moe_layers,
            experts_per_layer=t.experts_per_layer,
            experts_per_token=t.experts_per_token,
            expert_bytes=[verifier_pb2.LayerExpertBytes(layer=l, expert_bytes=b) for l, b in sorted(t.byte_map.items())],
            total_expert_bytes=t.total_expert_bytes,
            eos_token_ids=list(t.eos_token_ids),
            dtype=str(t.dtype).removeprefix("torch."),
            device=str(t.device),
            max_block_size=self.core.max_block_size,
            sessions_alive=len(self.core.sessions),
            max_sessions=self.core.sessions.max_sessions,
            batch_invariant=t.batch_invariant,
            kernels=model_kernels_json(t.kernels, self.core.forward_info),
            experts_format=t.experts_format,
            warmup_seconds=self.core.warmup_seconds,
            expert_cache_bytes=cache_bytes(t.expert_cache),
        )

    async def Prefill(self, request, context):
        t_start = time.perf_counter()
        await self._ready(context)
        try:
            v = id_violations({"request_id": request.request_id})
            if len(request.stop_token_ids) > MAX_LIST_ITEMS:
                v.append(FieldViolation("stop_token_ids", f"{len(request.stop_token_ids)} ids; at most {MAX_LIST_ITEMS}"))
            if len(request.feature_layer_ids) > MAX_LIST_ITEMS:
                v.append(FieldViolation("feature_layer_ids", f"{len(request.feature_layer_ids)} ids; at most {MAX_LIST_ITEMS}"))
            v.extend(logprobs_violations(request.logprobs, request.top_logprobs))
            check(v, "invalid Prefill request")
            req = PrefillInput(
                request_id=request.request_id,
                prompt=tuple(request.prompt_tokens),
                sampling=convert.sampling_from_pb(request.sampling),
                max_tokens=int(request.max_tokens),
                stop_token_ids=tuple(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
                feature_layer_ids=tuple(request.feature_layer_ids),
                logprobs=request.logprobs,
                top_logprobs=int(request.top_logprobs),
            )
            self.core.validate_prefill(req)
            # A session whose id never reached the caller would hold its KV until the idle timeout.
            out, queued = await self._prefill(req)
            left = context.time_remaining()
            if left is not None and left <= 0 and out.session_id:  # the caller has given up: nobody would end it
                self.core.end(out.session_id)
                raise DeadlineExceeded("prefill finished after the call's deadline; the session was ended")
        except PdflashError as e:
            await abort_with(context, e)
        self._observe(out, t_start, prefill=True, cache_counted=self.prefill_waves)
        log.info("prefill", request_id=request.request_id, session_id=out.session_id, prompt_tokens=len(req.prompt),
                 forward_ms=round(out.forward_ms, 2))
        return verifier_pb2.PrefillResponse(
            session_id=out.session_id,
            first_token=out.tokens[0],
            finished=out.finished is not None,
            finish_reason=_finish_pb(out.finished),
            features=convert.array_to_pb(out.features),
            routed_union=convert.union_to_pb(out.routed_union),
            routed_bytes=out.routed_bytes,
            timings=self._timings(out, t_start, queued),
            committed_tokens=out.committed,
            logprobs=out.logprobs or (),
            top_logprobs=convert.top_logprobs_to_pb(out.top_logprobs),
            wave_sessions=out.wave_sessions,
        )

    @property
    def prefill_waves(self) -> bool:
        """Whether prompts waiting for the device share their forwards (`VerifierCore.prefill_wave`): with verify waves
        on the paged KV."""
        core = self.core
        return getattr(core, "max_wave_sessions", 1) > 1 and getattr(core, "wave_forward", False)

    async def _prefill(self, req: PrefillInput) -> tuple[StepOutput, float]:
        """The prompt's forwards, a device turn a chunk (VerifierCore.start_prefill): verifies waiting for the device run
        between two chunks. With prefill waves, the prompts (or chunks) waiting for the device together go in one
        forward. A caller that leaves between chunks frees the session's pages; one that leaves during the last chunk
        gets its session ended. Returns (the answer, ms spent waiting for the device)."""
        core = self.core
        chunked = getattr(core, "chunked_prefill", False)
        if not chunked and not self.prefill_waves:  # the whole prompt in one device turn
            return await self._run(core.prefill, req, on_abandoned=lambda o: core.end(o.session_id))
        t0 = time.perf_counter()
        # Prompts take turns with verifies, not with each other: one prompt of several chunks at a time, so two long
        # prompts do not each hold half their pages (and their first tokens) until both are done. (A prompt of one
        # chunk need not wait: a prefill wave takes it beside the long one's chunk.)
        long = chunked and len(req.prompt) > core.prefill_chunk
        async with self._prefill_gate if long else contextlib.nullcontext():
            waited = (time.perf_counter() - t0) * 1e3
            made = torch_thread.submit(core.start_prefill, req)  # (its checks, the session's device state)
            try:
                job = await asyncio.shield(made)
            except asyncio.CancelledError:
                made.add_done_callback(lambda f: f.exception() is None and f.result().close())  # (whenever it is made)
                raise
            if self.prefill_waves:
                for i in range(job.steps):  # (a job left by its caller is closed or ended by _prefill_in_wave / its wave)
                    out, queued = await self._prefill_in_wave(job, admitted=i > 0)
                    waited += queued
                    if out is not None:
                        return out, waited
                raise RuntimeError("prefill ended before its last chunk")  # (steps counts the chunks: unreachable)
            try:
                for i in range(job.steps):
                    out, queued = await self._run(_prefill_step, job, on_abandoned=self._end_prefilled, admitted=i > 0)
                    waited += queued
                    if out is not None:
                        return out, waited
                raise RuntimeError("prefill ended before its last chunk")  # (steps counts the chunks: unreachable)
            except BaseException:
                job.close()  # (after its last chunk the session is the store's: its end is on_abandoned's)
                raise

    async def _prefill_in_wave(self, job: PrefillJob, admitted: bool) -> tuple[StepOutput | None, float]:
        """The job's next chunk in the next prefill wave: (its answer once the prompt is whole, else None; ms waited). A
        failure closes the job. A caller that leaves before its wave starts has its job closed here; one that leaves
        during the wave's forward, by the wave when it ends (its session ended if the prompt was whole)."""
        if not admitted:
            self._admit_pending()
        self._pending += 1
        item = _WaitingPrefill(job, asyncio.get_running_loop().create_future(), time.perf_counter())
        try:
            self._prefills_waiting.append(item)
            self._prefill_wave_task = _running(self._prefill_wave_task, self._run_prefill_waves)
            try:
                out, queued = await item.future
            except asyncio.CancelledError:
                if item in self._prefills_waiting:  # not started: nothing runs on its job
                    self._prefills_waiting.remove(item)
                    job.close()
                elif item.running and item.future.cancelled():
                    item.left = True  # its wave is running: the wave closes the job (or ends its session) when it ends
                else:  # (answered, but the caller is gone before it heard: as on_abandoned)
                    self._abandon(job, item.future.result()[0] if item.future.done() and not item.future.cancelled()
                                  and item.future.exception() is None else None)
                item.future.cancel()
                raise
            except BaseException:
                job.close()
                raise
            return out, queued
        finally:
            if not item.left:
                self._pending -= 1

    def _abandon(self, job: PrefillJob, out) -> None:
        """A prompt whose caller left: its session ended if the prompt was whole (in the store), else its job closed."""
        if isinstance(out, StepOutput) and out.session_id:
            self.core.end(out.session_id)
        else:
            job.close()

    async def _run_prefill_waves(self) -> None:
        """Run prefill waves while prompts wait; however it ends, no prompt it took or left waiting goes unanswered."""
        wave: list[_WaitingPrefill] = []
        try:
            while self._prefills_waiting:
                await self._one_prefill_wave(wave)
                wave.clear()
                await asyncio.sleep(0)
        finally:
            for w in wave + self._prefills_waiting:
                if w.left:
                    self._pending -= 1
                    w.job.close()
                if not w.future.done():
                    w.future.set_exception(Unavailable("the verifier stopped its prefill waves; retry the call"))
            self._prefills_waiting.clear()

    async def _one_prefill_wave(self, wave: list[_WaitingPrefill]) -> None:
        """The next prefill wave: the prompts waiting once the device is free (up to max_wave_sessions of them and
        `prefill_wave_rows` tokens; the oldest always goes), one forward, answered."""
        core = self.core
        async with self._device:
            _take(self._prefills_waiting, wave, lambda w: w.job.s.session_id, lambda w: len(w.job.next_ids()),
                  core.max_wave_sessions, core.prefill_wave_rows)
            if not wave:
                return
            started = time.perf_counter()
            rows = sum(len(w.job.next_ids()) for w in wave)
            forwards, shared = [], 1
            try:
                results, forwards, shared = await _to_the_end(torch_thread.submit(_prefill_wave_step, core, [w.job for w in wave]))
            except Exception as e:  # noqa: BLE001 - the wave failed as a whole: each of its prompts fails with it
                results = [e] * len(wave)
        log.debug("prefill wave", prompts=len(wave), rows=rows, shared=shared)
        if self.metrics is not None:
            if shared > 1:  # (prompts taken together that each replayed their prefill graph shared no forward)
                self.metrics.prefill_wave_sessions.observe(shared)
            for st in forwards:  # each forward's expert-cache counters once (Prefill's _observe leaves them to this)
                observe_cache(self.metrics, st)
        for w, r in zip(wave, results):
            if w.left:  # nobody hears this answer
                self._pending -= 1
                w.left = False
                self._abandon(w.job, r)
                continue
            if w.future.done():
                continue
            if isinstance(r, BaseException):
                w.future.set_exception(r)
            else:
                w.future.set_result((r, (started - w.since) * 1e3))

    def _end_prefilled(self, out) -> None:
        if out is not None:
            self.core.end(out.session_id)

    async def _verify(self, request) -> verifier_pb2.VerifyResult:
        """One VerifyRequest -> its VerifyResult (Verify and VerifyStream); raises PdflashError."""
        t_start = time.perf_counter()
        v = id_violations({"request_id": request.request_id, "draft.session_id": request.draft.session_id,
                            "ticket_id": request.ticket_id})
        if not request.HasField("draft"):
            v.append(FieldViolation("draft", "required: the DraftResult to verify"))
        elif not request.draft.session_id:
            v.append(FieldViolation("draft.session_id", "required: the session id Prefill returned"))
        check(v, "invalid Verify request")
        draft = convert.draft_from_pb(request.draft)
        # Before the session lookup: without a ticket a caller learns nothing, not even whether a session exists.
        # A ticket admitted ahead of drafting names the demand it reserved; the block must fit in it.
        self.signer.require(
            time.time(), request.ticket_signature, request.ticket_id, draft.session_id, draft.round,
            request.ticket_tokens or len(draft.tokens), request.ticket_expert_bytes or draft.expert_bytes,
            request.ticket_expires_at_unix, block_tokens=len(draft.tokens), block_bytes=draft.expert_bytes,
        )
        cache = self.core.target.expert_cache
        if cache is not None and cache.prefetch_union and draft.expert_union:
            # stream the projection in now, while the verify before this one may still hold the device (the cache's
            # lock is held by a forward only while it books a layer's experts: a short wait at most)
            cache.arriving(draft.expert_union)
        if self.core.max_wave_sessions > 1:
            out, queued = await self._verify_in_wave(draft, request.return_features)
        else:
            out, queued = await self._run(self.core.verify, draft, request.return_features, inline=self.inline_verify)
        self._observe(out, t_start, prefill=False)
        log.debug("verify", request_id=request.request_id, session_id=draft.session_id, round=draft.round,
                  ticket_id=request.ticket_id, block=len(draft.tokens), accepted=out.num_accepted)
        return verifier_pb2.VerifyResult(
            session_id=out.session_id,
            round=out.round,
            accepted_tokens=out.tokens,
            num_accepted_drafts=out.num_accepted,
            committed_tokens=out.committed,
            finished=out.finished is not None,
            finish_reason=_finish_pb(out.finished),
            features=convert.array_to_pb(out.features),
            routed_union=convert.union_to_pb(out.routed_union),
            routed_bytes=out.routed_bytes,
            timings=self._timings(out, t_start, queued),
            expert_cache=verifier_pb2.ExpertCacheRound(**out.expert_cache.as_dict()) if out.expert_cache is not None else None,
            logprobs=out.logprobs or (),
            top_logprobs=convert.top_logprobs_to_pb(out.top_logprobs),
            wave_sessions=out.wave_sessions,
        )

    async def Verify(self, request, context):
        await self._ready(context)
        try:
            return await self._verify(request)
        except PdflashError as e:
            await abort_with(context, e)

    async def VerifyStream(self, request_iterator, context):
        await self._ready(context)
        unfinished: set[str] = set()  # sessions this stream verified that have not finished
        try:
            async for request in request_iterator:
                try:
                    result = await self._verify(request)
                except PdflashError as e:
                    await abort_with(context, e)
                (unfinished.discard if result.finished else unfinished.add)(result.session_id)
                yield result
        finally:
            # The stream owns the sessions it verified: however it ends (half-close, cancel, deadline, a
            # vanished caller, an error), their KV is freed now instead of at the idle timeout. (gRPC ends
            # the request iterator the same way for a cancel as for a half-close.)
            for sid in unfinished:
                if self.core.end(sid):
                    log.info("session ended with its verify stream", session_id=sid)

    async def Prefetch(self, request, context):
        await self._ready(context)
        try:
            out = self._prefetch(request)
        except PdflashError as e:
            await abort_with(context, e)
        if self.metrics is not None:
            self.metrics.prefetch_requests.labels(_OUTCOME_NAMES[out.outcome]).inc()
            self.metrics.prefetch_experts_queued.inc(out.experts_queued)
        log.debug("prefetch", request_id=request.request_id, session_id=request.session_id, round=request.round,
                  outcome=_OUTCOME_NAMES[out.outcome], experts_queued=out.experts_queued)
        return out

    def _prefetch(self, request) -> verifier_pb2.PrefetchResponse:
        """A hint: the projected union of a verify still to come streams in as that Verify's would on arrival
        (cache.arriving, on this thread: the cache orders it against a running forward)."""
        v = id_violations({"request_id": request.request_id, "session_id": request.session_id, "ticket_id": request.ticket_id})
        if not request.session_id:
            v.append(FieldViolation("session_id", "required: the session id Prefill returned"))
        if request.round < 1:
            v.append(FieldViolation("round", "must be >= 1: the round the demand was admitted for (rounds are 1-based)"))
        if len(request.expert_union) > MAX_UNION_LAYERS:
            v.append(FieldViolation("expert_union", f"{len(request.expert_union)} entries; at most {MAX_UNION_LAYERS}"))
        check(v, "invalid Prefetch request")
        union = convert.union_from_pb(request.expert_union)
        core = self.core
        check(core.union_violations("expert_union", union), "invalid Prefetch request")
        nbytes = union_bytes(union, core.target.byte_map)
        # Before the session lookup, as for Verify: without a ticket a caller learns nothing about sessions.
        self.signer.require(time.time(), request.ticket_signature, request.ticket_id, request.session_id, request.round,
                            request.ticket_tokens, request.ticket_expert_bytes, request.ticket_expires_at_unix,
                            block_bytes=nbytes, call="Prefetch")
        s = core.sessions.peek(request.session_id)
        cache = core.target.expert_cache
        if cache is None:
            return verifier_pb2.PrefetchResponse(outcome=verifier_pb2.PREFETCH_OUTCOME_NO_EXPERT_CACHE)
        if not cache.prefetch_union or cache.arrival_share <= 0:
            return verifier_pb2.PrefetchResponse(outcome=verifier_pb2.PREFETCH_OUTCOME_DISABLED)
        if request.round <= s.round:
            return verifier_pb2.PrefetchResponse(outcome=verifier_pb2.PREFETCH_OUTCOME_STALE)
        n = cache.arriving(union) if union else 0
        return verifier_pb2.PrefetchResponse(outcome=verifier_pb2.PREFETCH_OUTCOME_QUEUED, experts_queued=n,
                                             bytes_queued=n * cache.store.slice_bytes)

    async def EndSession(self, request, context):
        await self._ready(context)
        try:
            v = id_violations({"session_id": request.session_id})
            if not request.session_id:
                v.append(FieldViolation("session_id", "required: the session id Prefill returned"))
            check(v, "invalid EndSession request")
        except PdflashError as e:
            await abort_with(context, e)
        return verifier_pb2.EndSessionResponse(ended=self.core.end(request.session_id))
