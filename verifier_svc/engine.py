"""The verifier core: prefill, verify one block, commit/rollback. Pure Python + torch, no grpc.

One forward per verify: the block [anchor, d1..dk] runs on top of the session's KV cache, the
acceptance rule picks the longest valid prefix, the cache is cropped back to the committed length
(anchor + accepted drafts), and the target's own next token becomes the next anchor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time

import numpy as np
import torch

from pdflash.hf_compat import STATELESS_BLOCKS, new_session_cache
from pdflash.errors import FailedPrecondition, FieldViolation, PdflashError, check
from pdflash.logging import get_logger
from pdflash.penalties import Penalties
from pdflash.sampler import target_probs
from pdflash.validation import draft_dists_violations, logprobs_violations, sampling_violations
from pdflash.types import DraftResult, ExpertUnion, FinishReason, SamplingParams, union_bytes
from verifier_svc.model import TargetModel
from pdflash_kernels.attention import PAGE
from verifier_svc.kv import SequenceKV
from verifier_svc import servable
from verifier_svc.session import Session, SessionStore
from verifier_svc.verify import accept_greedy, accept_sampled

log = get_logger("pdflash.verifier.engine")


@dataclasses.dataclass(frozen=True)
class PrefillInput:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    feature_layer_ids: tuple[int, ...] = ()
    logprobs: bool = False  # each emitted token's log-probability (StepOutput.logprobs)
    top_logprobs: int = 0  # with logprobs: the likeliest alternatives at each position


KV_FREE_SHARE = 0.9  # the most of the device's free memory (after the model) an asked --kv-cache-gb may take


@dataclasses.dataclass(frozen=True)
class PagedKVOptions:
    """The paged KV pool and CUDA graphs (used when the batch-invariant kernels are installed)."""

    mode: str = "auto"  # auto (with the kernels), on, off
    kv_cache_gb: float = 0.0  # 0 = a quarter of the device's free memory on CUDA, 0.25 GiB on a CPU
    graphs: bool = True
    capture_at_load: bool = True  # capture every bucket's graph at load, not on its first use
    prefill_graphs: bool | None = None  # prefills from CUDA graphs (runner.PREFILL_BUCKETS); None = PDFLASH_PREFILL_GRAPHS (default on)

    def enabled(self, target: TargetModel) -> bool:
        if self.mode == "off":
            return False
        if not target.batch_invariant:
            if self.mode == "on":
                raise ValueError("--paged-kv on needs the batch-invariant kernels (--kernels on)")
            return False
        return True

    def budget_bytes(self, device: torch.device) -> float:
        """The pool's bytes. On CUDA an asked size must fit the memory the device has free once the model is loaded
        (ValueError saying how much there is, rather than an out-of-memory error from the allocator)."""
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if self.kv_cache_gb <= 0:
                return free / 4
            # what torch's caching allocator holds unused counts too: the pool's allocation takes it first
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if self.kv_cache_gb * 2**30 > KV_FREE_SHARE * free:
                raise ValueError(f"--kv-cache-gb {self.kv_cache_gb:g}: {device} has {free / 2**30:.1f} GiB free after "
                                 f"loading the model, and the KV pool may take at most {KV_FREE_SHARE:.0%} of it "
                                 f"({KV_FREE_SHARE * free / 2**30:.1f} GiB; the rest holds the forward's activations and "
                                 "CUDA graphs); ask for less, or 0 for a quarter of the free memory")
            return self.kv_cache_gb * 2**30
        return self.kv_cache_gb * 2**30 if self.kv_cache_gb > 0 else 0.25 * 2**30


@dataclasses.dataclass
class StepOutput:
    session_id: str
    round: int
    tokens: list[int]  # emitted this call (prefill: the first token)
    num_accepted: int
    committed: int
    finished: FinishReason | None
    features: np.ndarray | None
    routed_union: ExpertUnion
    routed_bytes: int
    forward_ms: float
    accept_ms: float
    expert_cache: object | None = None  # verifier_svc.expert_cache.CacheStats of this call (offloaded experts)
    logprobs: list[float] | None = None  # the session's logprobs: one per emitted token
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # (ids, logprobs) likeliest first, one per token
    wave_sessions: int = 1  # sessions whose blocks shared this call's forward (verify_wave); forward_ms and expert_cache are theirs together


def _moe_gemms_info(moe) -> str:
    """Model info's `forward.moe_gemms`: how the MoE GEMMs split K (PDFLASH_MOE_SPLIT_K, else each shape's default)."""
    if moe.SPLIT_K is None:
        text = ("K split per shape as pdflash_kernels.moe's sweep defaults set it (MXFP4 pair words: 4 ranges, partials added in "
                "order; Qwen3-30B-A3B's shapes and bf16: one range)")
    elif moe.SPLIT_K > 1:
        text = f"K split {moe.SPLIT_K} ways (PDFLASH_MOE_SPLIT_K), partials added in order"
    else:
        text = "K in one range a program"
    return text + ("; combine fused into the down GEMM" if moe.FUSED_COMBINE else "")


class VerifierCore:
    def __init__(
        self,
        target: TargetModel,
        max_sessions: int = 64,
        idle_ttl_s: float = 120.0,
        max_block_size: int = 32,
        max_tokens_limit: int = 4096,
        prefill_threads: int = 0,
        paged_kv: PagedKVOptions | None = None,
        max_wave_sessions: int = 1,
        prefill_chunk: int = 0,
    ):
        self.target = target
        # prompt tokens a prefill forward takes at a time on the paged KV (0 = the whole prompt): between chunks the
        # server runs the verifies waiting for the device, so a long prompt does not stall the sessions already decoding
        self.prefill_chunk = max(0, int(prefill_chunk))
        self._prefilling = 0  # PrefillJobs started and not yet finished or closed
        # sessions whose verifies may share one forward (`verify_wave`; the servicer gathers them): 1 = one at a time
        self.max_wave_sessions = max(1, int(max_wave_sessions))
        self.sessions = SessionStore(max_sessions, idle_ttl_s)
        # The paged KV pool and the layer-by-layer forward (verifier_svc.runner) when the kernels are installed:
        # CUDA graphs replay it per block-size bucket. Otherwise transformers' DynamicCache and model forward.
        self.pool = self.runner = self.graphs = None
        self.max_block_size = max_block_size
        self.paged_off: str | None = None  # why the paged forward was wanted and does not serve this model
        if paged_kv is not None and paged_kv.enabled(target):
            self._init_paged(paged_kv)
        if self.pool is None:  # transformers' cache: it must drop a block's rejected drafts, or nothing is exact
            why = servable.rollback_error(target.model, target.cache_arg, max_block_size, target.device)
            if why is not None:
                raise ValueError(f"{target.architecture}: pdflash cannot verify drafts on this model: {why}")
        self.max_tokens_limit = max_tokens_limit
        # CPU threads for prefill forwards (0 = as verify forwards). A prompt is compute-bound and the
        # other services wait for it; a verify block is latency-bound and shares the machine with them.
        self.prefill_threads = prefill_threads
        # transformers' CausalLMs take logits_to_keep: a prompt's LM head on its last position only (for a
        # 128-token prompt of the demo target, 12.4 -> 10.9 ms at 2 threads).
        self._keeps_logits = "logits_to_keep" in inspect.signature(target.model.forward).parameters
        self.warmup_seconds = 0.0  # what the warm-up at load took (verifier_svc.warmup); 0 = none ran

    def _init_paged(self, opts: "PagedKVOptions") -> None:
        from verifier_svc.kv import KVPool, LinearStates
        from verifier_svc.runner import ForwardRunner, GraphRunner

        t = self.target
        cfg = t.model.config.get_text_config()
        linear, why = self._recurrent_layers(cfg)
        budget = int(opts.budget_bytes(t.device)) if why is None else 0
        if linear and why is None:  # a slot of recurrent state per session (and the graphs' scratch), in half the budget
            per_slot = LinearStates.slot_bytes(linear, self.max_block_size, t.dtype)
            slots = min(self.sessions.max_sessions + 2, budget // 2 // per_slot)
            if slots < 2:
                why = (f"a KV budget of {budget / 2**30:.3g} GiB holds the recurrent state of no session: half of it must "
                       f"hold 2 slots of {per_slot / 2**20:.1f} MiB (one session and the CUDA graphs' scratch); ask "
                       f"--kv-cache-gb {4 * per_slot / 2**30:.3g} or more")
        if why is not None:  # a hybrid whose recurrent layers' state the paged forward does not hold
            if opts.mode == "on":
                raise ValueError(f"--paged-kv on: the paged forward does not fit this model ({why}); use auto or off")
            log.warning("paged KV off: the model runs on transformers' cache (no CUDA graphs, no verify waves in one "
                        "forward)", reason=why)
            self.paged_off = why
            return
        kv_heads, k_dim, v_dim = KVPool.layout(cfg)  # (MLA: one latent and its rotary key a position)
        states = None
        if linear:
            states = LinearStates(linear, slots, self.max_block_size, t.dtype, t.device)
            budget -= slots * per_slot
        # keys for the attention layers: none for the recurrent ones, nor for a hybrid's blocks with no attention at all
        # (Nemotron-H's MoE and MLP blocks: most of its layers)
        types = list(getattr(cfg, "layer_types", None) or [])[: t.num_layers]
        kv_layers = set(range(t.num_layers)) - set(linear) - {i for i, k in enumerate(types) if k in STATELESS_BLOCKS}
        pages = KVPool.pages_for(kv_heads, k_dim, len(kv_layers), t.dtype, budget, v_dim)
        self.pool = KVPool(t.num_layers, kv_heads, k_dim, pages, t.dtype, t.device, v_dim, kv_layers=kv_layers,
                           linear=states)
        # every position a session can reach: SequenceKV(pool, t.max_context) reserves whole pages up to this bound
        try:
            self.runner = ForwardRunner(t.model, t.seam, self.pool, max_positions=(t.max_context + PAGE - 1) // PAGE * PAGE)
        except Exception as e:  # noqa: BLE001 - a model the runner cannot take apart (DeepSeek-V2's complex rotary)
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        else:
            why = servable.paged_error(self.runner, self.pool, t.model, t.cache_arg, t.device)
        if why is not None and opts.mode == "on":
            raise ValueError(f"--paged-kv on: the paged forward does not fit this model ({why}); use auto or off")
        if why is not None:  # e.g. multi-head latent attention, whose cache is a latent rather than keys and values
            log.warning("paged KV off: the model runs on transformers' cache (no CUDA graphs, no verify waves in one "
                        "forward)", reason=why)
            self.paged_off, self.pool, self.runner = why, None, None
            if t.device.type == "cuda":
                torch.cuda.empty_cache()  # the pool's memory
            return
        log.info("paged forward", rotary=self.runner.rotary, layers=self.runner.prenorm, attention=self.runner.attention,
                 kv_pages=pages, **({} if states is None else {"recurrent_layers": len(linear), "recurrent_slots": slots,
                                                               "mib_per_slot": round(per_slot / 2**20, 1)}))
        # offloaded experts sync once per layer (which experts to fetch): one graph per stretch between them
        if opts.graphs and t.device.type == "cuda":
            self.graphs = GraphRunner(self.runner, (t.max_context + PAGE - 1) // PAGE, wave_sessions=self.max_wave_sessions,
                                      prefill_graphs=opts.prefill_graphs)
            if opts.capture_at_load:  # the buckets of drafts without features (a drafter's feature layers: on first use)
                t0 = time.perf_counter()
                n = self.graphs.capture(max_rows=self.max_block_size)
                log.info("cuda graphs captured", graphs=n, seconds=round(time.perf_counter() - t0, 2))

    def _recurrent_layers(self, cfg) -> tuple[dict, str | None]:
        """A hybrid's recurrent layers the paged forward holds a state for ({layer index: module}: Gated DeltaNet, Kimi
        Delta Attention, Mamba-2 and LFM2 short-convolution layers on pdflash_kernels.gdn's forwards), and why it cannot
        run the model (None: it can)."""
        from pdflash_kernels import gdn

        types = list(getattr(cfg, "layer_types", None) or [])[: self.target.num_layers]
        # (Nemotron-H names a block by its one mixer: "moe" and "mlp" blocks hold no state)
        recurrent = [i for i, k in enumerate(types)
                     if k == "linear_attention" or ("attention" not in k and k not in STATELESS_BLOCKS)]
        if not recurrent:
            return {}, None
        served = {int(m.layer_idx): m for m in self.target.model.modules()
                  if gdn.layer_forward(m) is not None and "forward" in vars(m)}
        other = sorted({types[i] for i in recurrent if i not in served})
        if other:
            return {}, (f"its {', '.join(other)} layers keep a recurrent state the paged KV does not hold (only Gated "
                        "DeltaNet, Kimi Delta Attention, Mamba-2 and short-convolution layers on the kernels; such "
                        "hybrids run on transformers' cache)")
        return {i: served[i] for i in recurrent}, None

    @property
    def forward_info(self) -> dict:
        """How a verify forward runs (model info's `kernels` JSON, key "forward"): {} on transformers' own cache, else
        the paged KV, the layer chain, the attention's form and its KV split, and the CUDA graphs' buckets."""
        if self.runner is None:
            return {} if self.paged_off is None else {"kv": f"transformers' DynamicCache (the paged forward does not "
                                                            f"fit this model: {self.paged_off})"}
        from pdflash_kernels import attention, moe, runtime

        lin = self.pool.linear
        recurrent = {} if lin is None else {"recurrent_state": (
            f"{len(lin.layers)} recurrent layers (Gated DeltaNet, Kimi Delta Attention, Mamba-2, short convolutions): a "
            f"slot per session ({lin.slots - 1} slots and the graphs' scratch), the last forward's last {lin.pending} "
            "tokens pending (replayed as far as the next forward starts past them)")}
        return {**recurrent, "kv": f"paged: {self.pool.num_pages} pages of {PAGE} positions", "rotary": self.runner.rotary,
                "layers": self.runner.prenorm, "attention": self.runner.attention,
                "attention_kv_split": (f"segments of {attention.SEG} positions merged in order; verify forwards of <= "
                                       f"{attention.SPLIT_MAX_T} tokens spread them over <= {attention.MAX_PROGRAMS} "
                                       "programs per tile (the same bits)"),
                "cuda_graphs": (f"buckets {list(self.graphs.buckets)}"
                                + (f"; prefills {list(self.graphs.prefill_buckets)}" if self.graphs.prefill_buckets else
                                   "; prefills eager") if self.graphs is not None else "off"),
                "launches": (f"programmatic dependent launch (each kernel launched while the one before it finishes; "
                             f"trigger {runtime.PDL_TRIGGER})" if runtime.PDL else "plain"),
                "moe_gemms": _moe_gemms_info(moe),
                "verify_waves": (f"up to {self.max_wave_sessions} sessions' blocks in one ragged forward"
                                 + (" (wave graphs by total rows)" if self.graphs is not None else "")
                                 if self.max_wave_sessions > 1 and self.wave_forward else
                                 f"up to {self.max_wave_sessions} sessions, one forward after another (the RoPE is not a "
                                 "position table)" if self.max_wave_sessions > 1 else "off")}

    @contextlib.contextmanager
    def _prefill_threads(self):
        n = self.prefill_threads
        if n <= 0 or self.target.device.type != "cpu" or n == torch.get_num_threads():
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    # ---- validation -----------------------------------------------------------------------------
    def _check_ids(self, field: str, ids, out: list[FieldViolation]) -> None:
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            out.append(FieldViolation(field, f"token ids {bad[:5]} outside the vocabulary [0, {self.target.vocab_size})"))

    def validate_prefill(self, req: PrefillInput) -> None:
        v: list[FieldViolation] = []
        t = self.target
        if not req.prompt:
            v.append(FieldViolation("prompt_tokens", "must not be empty"))
        elif len(req.prompt) >= t.max_context:
            v.append(FieldViolation("prompt_tokens", f"{len(req.prompt)} tokens; the model's context is {t.max_context}"))
        self._check_ids("prompt_tokens", req.prompt, v)
        self._check_ids("stop_token_ids", req.stop_token_ids, v)
        if not 1 <= req.max_tokens <= self.max_tokens_limit:
            v.append(FieldViolation("max_tokens", f"must be in [1, {self.max_tokens_limit}], got {req.max_tokens}"))
        v.extend(sampling_violations(req.sampling))
        v.extend(logprobs_violations(req.logprobs, req.top_logprobs))
        bad_layers = [i for i in req.feature_layer_ids if not 0 <= i < t.num_layers]
        if bad_layers:
            v.append(FieldViolation("feature_layer_ids", f"{bad_layers} not in [0, {t.num_layers})"))
        check(v, "invalid Prefill request")

    def validate_draft(self, s: Session, d: DraftResult) -> None:
        v: list[FieldViolation] = []
        if d.round != s.round + 1:
            v.append(FieldViolation("draft.round", f"expected round {s.round + 1} for this session, got {d.round}"))
        if not d.tokens:
            v.append(FieldViolation("draft.tokens", "must hold at least the anchor"))
        else:
            if d.tokens[0] != s.anchor:
                v.append(FieldViolation("draft.tokens", f"tokens[0] must be the session's anchor {s.anchor}, got {d.tokens[0]}"))
            if len(d.tokens) > self.max_block_size:
                v.append(FieldViolation("draft.tokens", f"block of {len(d.tokens)} exceeds max_block_size {self.max_block_size}"))
            self._check_ids("draft.tokens", d.tokens, v)
            v.extend(draft_dists_violations(d.draft_dists, d.tokens[1:], self.target.vocab_size))
        bm = self.target.byte_map
        v.extend(self.union_violations("draft.expert_union", d.expert_union))
        if not v and d.expert_bytes != union_bytes(d.expert_union, bm):
            v.append(
                FieldViolation(
                    "draft.expert_bytes",
                    f"{d.expert_bytes} does not match the union's stored bytes {union_bytes(d.expert_union, bm)}",
                )
            )
        check(v, "invalid Verify request")

    def union_violations(self, field: str, union) -> list[FieldViolation]:
        """A projected union's layers must be MoE layers of this model and its expert ids in range."""
        v: list[FieldViolation] = []
        bm = self.target.byte_map
        for layer, ids in union.items():
            if layer not in bm:
                v.append(FieldViolation(field, f"layer {layer} is not an MoE layer of this model (its MoE layers: "
                                               f"{_ranges(sorted(bm))})"))
            elif any(not 0 <= e < len(bm[layer]) for e in ids):
                v.append(FieldViolation(field, f"layer {layer}: expert ids must be < {len(bm[layer])}"))
        return v

    # ---- the model --------------------------------------------------------------------------------
    def _forward(self, s: Session, ids: list[int], want_features: bool, last_logits_only: bool = False):
        """last_logits_only: the LM head on the last position alone (a prompt needs only the next token's)."""
        if s.kv is not None:
            return self._forward_paged(s, ids, want_features, last_logits_only)
        t = self.target
        inp = torch.tensor([ids], dtype=torch.long, device=t.device)
        kw = {"logits_to_keep": 1} if last_logits_only and self._keeps_logits else {}
        t0 = time.perf_counter()
        with torch.inference_mode(), t.seam.record() as rec:
            out = t.model(input_ids=inp, **{t.cache_arg: s.cache}, use_cache=True, output_hidden_states=want_features, **kw)
        logits = out.logits[0].float()
        feats = None
        if want_features:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in s.feature_layer_ids], dim=-1).float()
        union = rec.union(t.seam.num_experts)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        ms = (time.perf_counter() - t0) * 1e3
        if getattr(t.expert_cache, "device_managed", False):  # its counters live on the device until the forward is done
            t.expert_cache.collect(None if last_logits_only else ms, len(ids))
        return logits, feats, union, ms

    def _forward_paged(self, s: Session, ids: list[int], want_features: bool, last_logits_only: bool):
        t = self.target
        layers = s.feature_layer_ids if want_features else ()
        t0 = time.perf_counter()
        out = None
        if self.graphs is not None and not last_logits_only:
            out, rows = self.graphs.forward(ids, s.committed, s.kv, layers)
        elif self.graphs is not None:  # a prefill (or a chunk of one): its graph where a bucket holds it
            out, rows = self.graphs.forward_prefill(ids, s.committed, s.kv, layers), len(ids)
        replayed = last_logits_only and out is not None
        if out is None:
            out, rows = self.runner.forward(ids, s.committed, s.kv, layers, last_only=last_logits_only), len(ids)
        logits = out.logits[: (1 if last_logits_only else rows)]
        feats = out.features[:rows] if out.features is not None else None
        if replayed:  # a PrefillJob keeps these across its chunks, and the graph's output is the next replay's
            logits, feats = logits.clone(), feats.clone() if feats is not None else None
        union = out.recorder.union(t.seam.num_experts, rows=rows)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        ms = (time.perf_counter() - t0) * 1e3
        if getattr(t.expert_cache, "device_managed", False):  # its counters live on the device until the forward is done
            t.expert_cache.collect(None if last_logits_only else ms, len(ids))
        return logits, feats, union, ms

    def _logprobs(self, s: Session, logits: torch.Tensor, tokens: list[int]):
        """(each token's log-probability, its top-k (ids, logprobs) or None) for tokens[i] drawn from logits[i]: the
        target's raw distribution (temperature 1), as float32 log-softmax (the batch-invariant kernel where the forward
        runs on them: a position's values are block-1's). (None, None) when the session did not ask."""
        if s.top_logprobs is None or not tokens:
            return None, None
        rows = logits[: len(tokens)].float()
        if self.target.batch_invariant:
            from pdflash_kernels import reduce

            lp = reduce.softmax(rows.contiguous(), -1, log=True)
        else:
            lp = torch.log_softmax(rows, dim=-1)
        ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, ids[:, None])[:, 0].cpu().tolist()
        if not s.top_logprobs:
            return chosen, None
        vals, idx = torch.topk(lp, min(s.top_logprobs, lp.shape[-1]), dim=-1)
        return chosen, list(zip(idx.cpu().tolist(), vals.cpu().tolist()))

    def _emit(self, s: Session, candidates: list[int]) -> list[int]:
        emitted: list[int] = []
        for tok in candidates:
            emitted.append(tok)
            s.generated += 1
            if tok in s.stop_ids:
                s.finished = FinishReason.STOP
                break
            if s.generated >= s.max_tokens:
                s.finished = FinishReason.LENGTH
                break
        return emitted

    def _pick(self, s: Session, drafts: list[int], logits: torch.Tensor, dists=()) -> tuple[int, int]:
        """dists: the sampled drafts' distributions (DraftResult.draft_dists), or () for deterministic drafts."""
        if s.penalties is not None:  # the penalties plain decoding would apply at each row's position
            logits = s.penalties.apply(logits, drafts)
        if s.sampling.greedy:
            return accept_greedy(drafts, logits)
        return accept_sampled(drafts, target_probs(logits, s.sampling), s.generator, dists)

    # ---- API --------------------------------------------------------------------------------------
    def prefill(self, req: PrefillInput) -> StepOutput:
        """Prefill a prompt in one go (its chunks one after another, `prefill_chunk`)."""
        job = self.start_prefill(req)
        try:
            while not job.step():
                pass
            return job.finish()
        except BaseException:
            job.close()
            raise

    def start_prefill(self, req: PrefillInput) -> "PrefillJob":
        """A prefill to run chunk by chunk (`PrefillJob.step` until it returns True, then `finish`): the server gives the
        device to waiting verifies between chunks. Chunks of `prefill_chunk` tokens on the paged KV (each row's keys and
        hidden states are the same whatever rows share its forward, so the session is bit-identical to a one-go
        prefill's); one chunk otherwise."""
        self.validate_prefill(req)
        self.sessions.check_capacity(self._prefilling)
        t = self.target
        stop = set(req.stop_token_ids)
        if not req.ignore_eos:
            stop.update(t.eos_token_ids)
        gen = None
        if not req.sampling.greedy:
            gen = torch.Generator(device=t.device)  # on the logits' device: multinomial refuses another device's generator
            gen.manual_seed(req.sampling.seed if req.sampling.seed is not None else int(torch.seed()))
        cache = kv = None
        if self.pool is not None:
            kv = SequenceKV(self.pool, t.max_context)
        else:
            cache = new_session_cache(t.model.config, self.max_block_size)  # rolls back a rejected draft's tokens
        s = Session(
            session_id=self.sessions.new_id(),
            request_id=req.request_id,
            cache=cache,
            committed=0,
            anchor=-1,
            generated=0,
            max_tokens=req.max_tokens,
            stop_ids=frozenset(stop),
            sampling=req.sampling,
            generator=gen,
            feature_layer_ids=tuple(req.feature_layer_ids),
            kv=kv,
            top_logprobs=req.top_logprobs if req.logprobs else None,
        )
        chunk = self.prefill_chunk if self.chunked_prefill else len(req.prompt)
        self._prefilling += 1  # (until the job finishes or closes: it counts against max_sessions meanwhile)
        return PrefillJob(self, req, s, chunk)

    @property
    def chunked_prefill(self) -> bool:
        """Whether prompts are prefilled `prefill_chunk` tokens a forward: on the paged KV, where cos/sin are a position
        table (a RoPE that rescales with the longest position in the call, such as "longrope" past its original
        length, would give a chunk's rows other frequencies than a one-go prefill)."""
        return self.prefill_chunk > 0 and self.runner is not None and self.runner.positions_static

    def _prepare(self, draft: DraftResult, return_features: bool):
        """A verify's checks and its block: (session, block, whether it returns features), or the StepOutput of a
        session with no room left (finished CONTEXT, nothing run). Raises PdflashError for a request to refuse."""
        s = self.sessions.get(draft.session_id)
        if s.finished is not None:
            raise FailedPrecondition(f"session {s.session_id} already finished ({s.finished.name.lower()})")
        self.validate_draft(s, draft)
        room = self.target.max_context - s.committed
        if room < 1:
            s.round = draft.round
            s.finished = FinishReason.CONTEXT
            self.sessions.end(s.session_id)
            return StepOutput(s.session_id, s.round, [], 0, s.committed, s.finished, None, {}, 0, 0.0, 0.0)
        block = list(draft.tokens)[:room]
        if s.kv is not None:  # a full KV pool refuses the call before its round is used: a retry of the round can pass
            s.kv.reserve(s.committed + len(block))
        s.round = draft.round
        return s, block, return_features and bool(s.feature_layer_ids)

    def _accept(self, s: Session, draft: DraftResult, block: list[int], logits: torch.Tensor, feats, union: ExpertUnion,
                fwd_ms: float, stats) -> StepOutput:
        """After the forward: acceptance, the KV's committed length, the next anchor, the emitted tokens."""
        t0 = time.perf_counter()
        n_acc, nxt = self._pick(s, block[1:], logits, draft.draft_dists[: len(block) - 1])
        keep = n_acc + 1  # anchor + accepted drafts enter the KV cache
        if s.kv is None:
            s.cache.crop(-(len(block) - keep))  # the paged KV needs no crop: the next block overwrites from `committed`
        s.committed += keep
        s.anchor = nxt
        emitted = self._emit(s, block[1 : 1 + n_acc] + [nxt])
        if s.penalties is not None:
            s.penalties.emitted(emitted)
        lps, tops = self._logprobs(s, logits, emitted)  # (logits[i] drew the token at block position i + 1)
        acc_ms = (time.perf_counter() - t0) * 1e3
        if s.finished is not None:
            self.sessions.end(s.session_id)
        return StepOutput(
            session_id=s.session_id,
            round=s.round,
            tokens=emitted,
            num_accepted=min(n_acc, len(emitted)),
            committed=s.committed,
            finished=s.finished,
            features=feats[:keep].cpu().numpy() if feats is not None else None,
            routed_union=union,
            routed_bytes=union_bytes(union, self.target.byte_map),
            forward_ms=fwd_ms,
            accept_ms=acc_ms,
            expert_cache=stats,
            logprobs=lps,
            top_logprobs=tops,
        )

    def verify(self, draft: DraftResult, return_features: bool = True) -> StepOutput:
        prep = self._prepare(draft, return_features)
        if isinstance(prep, StepOutput):
            return prep
        s, block, want = prep
        return self._verify_prepared(s, block, draft, want)

    @property
    def max_wave_rows(self) -> int:
        """The most rows (blocks' tokens together) a wave takes: with CUDA graphs the largest wave graph's, else every
        session's widest block."""
        if self.graphs is not None:
            from verifier_svc.runner import WAVE_BUCKETS

            return WAVE_BUCKETS[-1]
        return self.max_wave_sessions * self.max_block_size

    @property
    def wave_forward(self) -> bool:
        """Whether `verify_wave` runs several sessions' blocks in one forward (the paged KV, every kernel batch-invariant,
        cos/sin a function of the position alone: a RoPE that rescales with the longest position in the call, such as
        "dynamic", would give a session other cos/sin beside a longer one), rather than one forward after another."""
        return self.runner is not None and self.runner.positions_static

    def verify_wave(self, items: "list[tuple[DraftResult, bool]]") -> "list[StepOutput | BaseException]":
        """Several sessions' verifies (draft, return_features) at once: on the paged KV one forward over all their blocks
        (`ForwardRunner.forward_wave`: each block's rows get the bits of a forward of that block alone, so each answer is
        the one `verify` would give), else one forward after another. Returns one result per item, in order: its
        StepOutput, or the error that item alone failed with (a refused request, the KV cache full for its block; a
        failing forward fails every item that was in it). Two items of one session: the second is refused. Each answer's
        `forward_ms` and `expert_cache` are the wave's (one forward, one expert-cache bracket)."""
        results: list = [None] * len(items)
        ready: list[tuple[int, DraftResult, Session, list[int], bool]] = []
        seen: set[str] = set()
        for i, (draft, return_features) in enumerate(items):
            try:
                if draft.session_id in seen:
                    raise FailedPrecondition(f"session {draft.session_id} has another verify in this wave; send a "
                                             "session's rounds one after the other")
                prep = self._prepare(draft, return_features)  # (a full KV cache refuses this item alone)
            except PdflashError as e:
                results[i] = e
                continue
            if isinstance(prep, StepOutput):
                results[i] = prep
                continue
            seen.add(draft.session_id)
            ready.append((i, draft, *prep))
        if len(ready) == 1 or not self.wave_forward:
            for i, draft, s, block, want in ready:
                try:
                    results[i] = self._verify_prepared(s, block, draft, want)
                except Exception as e:  # noqa: BLE001 - the item's own failure, as verify would raise it
                    results[i] = e
            return results
        if not ready:
            return results
        try:
            outs = self._forward_wave(ready)
        except Exception as e:  # noqa: BLE001 - one forward for all: each of its items failed with it
            for i, *_ in ready:
                results[i] = e
            return results
        for (i, draft, s, block, want), (logits, feats, union, fwd_ms, stats) in zip(ready, outs):
            try:
                results[i] = self._accept(s, draft, block, logits, feats, union, fwd_ms, stats)
                results[i].wave_sessions = len(ready)
            except Exception as e:  # noqa: BLE001
                results[i] = e
        return results

    def _verify_prepared(self, s: Session, block: list[int], draft: DraftResult, want: bool) -> StepOutput:
        """One session's forward (a verify alone) and its acceptance."""
        cache = self.target.expert_cache
        before = dataclasses.replace(cache.stats) if cache is not None else None
        if cache is not None:  # (begin/collect bracket every forward: arrivals wait for a running one)
            cache.begin(draft.expert_union if cache.prefetch_union else {})  # the projection streams in ahead of its layers
        logits, feats, union, fwd_ms = self._forward(s, block, want)
        return self._accept(s, draft, block, logits, feats, union, fwd_ms,
                            cache.stats.minus(before) if cache is not None else None)

    def _forward_wave(self, ready) -> list[tuple]:
        """One paged forward over the items' blocks -> per item (logits, features, routed union, the wave's ms, the
        wave's expert-cache stats)."""
        t = self.target
        cache = t.expert_cache
        before = dataclasses.replace(cache.stats) if cache is not None else None
        if cache is not None:  # the wave's projection: every item's
            merged: dict[int, set[int]] = {}
            if cache.prefetch_union:
                for _, draft, *_ in ready:
                    for layer, ids in draft.expert_union.items():
                        merged.setdefault(layer, set()).update(ids)
            cache.begin({layer: frozenset(ids) for layer, ids in merged.items()})
        layers = tuple(sorted({l for _, _, s, _, want in ready if want for l in s.feature_layer_ids}))
        items = [(block, s.committed, s.kv) for _, _, s, block, _ in ready]
        t0 = time.perf_counter()
        if self.graphs is not None:
            out, starts = self.graphs.forward_wave(items, layers)
        else:
            from verifier_svc.runner import wave_starts

            out, starts = self.runner.forward_wave(items, layers), wave_starts([len(b) for b, _, _ in items])
        unions = out.recorder.unions(t.seam.num_experts, starts)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        ms = (time.perf_counter() - t0) * 1e3
        if getattr(cache, "device_managed", False):
            cache.collect(ms, starts[-1])
        stats = cache.stats.minus(before) if cache is not None else None
        res = []
        for k, (_, _, s, _, want) in enumerate(ready):
            a, e = starts[k], starts[k + 1]
            feats = _item_features(out.features, layers, s.feature_layer_ids, a, e) if want else None
            res.append((out.logits[a:e], feats, unions[k], ms, stats))
        return res

    #: the most prompt tokens one prefill wave forwards (its oldest prompt's chunk goes whatever its size)
    prefill_wave_rows = 4096
    #: Prompts whose chunk would replay a prefill graph (experts resident) share an eager wave only when their rows reach
    #: this many together; fewer replay their graphs one after another. A prefill wave runs eagerly, and an eager
    #: forward's host time (a 256-row qwen3-8l chunk: 28.3 ms eager, 3.7 of it kernels; H100, stop 48) outweighs what
    #: one forward saves on the weights' reads until the wave is big: on an H100 with prefill graphs, prompts of 256 tokens one after another / in one wave took
    #: qwen3-8l 11.2 / 16.1 ms (2 prompts), 22.1 / 18.5 (4), 44.8 / 33.7 (8); gptoss-24l 25.7 / 46.1, 48.4 / 49.7,
    #: 99.7 / 82.6 (`benchmarks/waves.py --prefill-waves 2 4 8`, stop48_gpu/call2). Offloaded experts, chunks past the
    #: largest prefill bucket and prefill graphs off always share the wave (each would run eagerly anyway). A wave that a
    #: prefill-wave graph holds (on by default: runner.PREFILL_WAVE_BUCKETS) always replays it instead.
    prefill_wave_graphed_rows = 1536

    def _replays_prefill(self, job: "PrefillJob", n: int) -> bool:
        """Whether the job's next `n` rows would replay a prefill graph with every expert resident."""
        g = self.graphs
        return (g is not None and self.target.expert_cache is None
                and g.prefill_bucket(n, job.s.committed, job.s.kv) is not None)

    def prefill_wave(self, jobs: "list[PrefillJob]") -> "list[bool | BaseException]":
        """The next chunk of several prompts at once (PrefillJobs of different sessions): on the paged KV
        (`wave_forward`) one forward over all their chunks, each prompt's rows with the bits of a forward of its own (so
        each job ends as its own `step`s would leave it), else each job's `step` in turn. Returns per job whether its
        prompt is now whole, or the error it alone failed with (the KV cache full for its chunk: refused before the
        forward; a failing forward fails every job in it). Every job's forward ms and expert-cache counters are the
        wave's. Jobs whose chunks would replay prefill graphs (experts resident) replay them one after another instead,
        unless their rows together reach `prefill_wave_graphed_rows`."""
        if len({id(j.s) for j in jobs}) != len(jobs):
            raise ValueError("a prefill wave takes each prompt once")
        results: list = [None] * len(jobs)
        if len(jobs) < 2 or not self.wave_forward:
            return _step_each(list(enumerate(jobs)), results)
        ready = []
        for i, j in enumerate(jobs):
            ids = j.next_ids()
            try:
                j.s.kv.reserve(j.s.committed + len(ids))  # (a full KV pool refuses this job alone)
            except Exception as e:  # noqa: BLE001
                results[i] = e
                continue
            ready.append((i, j, ids))
        # (a prefill-wave graph that holds them all: one replay beats their graphs one after another)
        graph_wave = (self.graphs is not None and len(ready) > 1
                      and self.graphs.prefill_wave_bucket([(ids, j.s.committed, j.s.kv) for _, j, ids in ready]) is not None)
        alone = []  # one after another, each from its prefill graph (or eagerly, alone)
        if not graph_wave:
            graphed = [r for r in ready if self._replays_prefill(r[1], len(r[2]))]
            if sum(len(ids) for _, _, ids in graphed) < self.prefill_wave_graphed_rows:
                alone, ready = graphed, [r for r in ready if r not in graphed]
        if len(ready) < 2:
            alone, ready = alone + ready, []
        _step_each([(i, j) for i, j, _ in alone], results)
        if not ready:
            return results
        from verifier_svc.runner import wave_starts

        t = self.target
        cache = t.expert_cache
        before = dataclasses.replace(cache.stats) if cache is not None else None
        if cache is not None:
            cache.begin({})  # prompts have no projection
        layers = tuple(sorted({l for _, j, _ in ready if j.req.feature_layer_ids for l in j.s.feature_layer_ids}))
        items = [(ids, j.s.committed, j.s.kv) for _, j, ids in ready]
        t0 = time.perf_counter()
        replayed = False
        try:
            got = self.graphs.forward_prefill_wave(items, layers) if graph_wave else None
            if got is not None:
                (out, starts), replayed = got, True
            else:
                with self._prefill_threads():
                    out = self.runner.forward_wave(items, layers, last_rows=True)
                starts = wave_starts([len(ids) for _, _, ids in ready])
            unions = out.recorder.unions(t.seam.num_experts, starts)
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
        except Exception as e:  # noqa: BLE001 - one forward for all: each of its jobs failed with it
            for i, *_ in ready:
                results[i] = e
            return results
        ms = (time.perf_counter() - t0) * 1e3
        if getattr(cache, "device_managed", False):
            cache.collect(None, starts[-1])
        stats = cache.stats.minus(before) if cache is not None else None
        for k, (i, j, ids) in enumerate(ready):
            want = bool(j.req.feature_layer_ids)
            feats = _item_features(out.features, layers, j.s.feature_layer_ids, starts[k], starts[k + 1]) if want else None
            logits = out.logits[k : k + 1]
            if replayed:  # the graph's output is the next replay's: a job keeps its logits until it finishes
                logits = logits.clone()
            results[i] = j.took(len(ids), logits, feats, unions[k], ms, stats, wave_sessions=len(ready))
        return results

    def end(self, session_id: str) -> bool:
        return self.sessions.end(session_id)


class PrefillJob:
    """One prompt's prefill, a chunk a `step` (VerifierCore.start_prefill). Each step is one forward of the next chunk
    on top of the session's KV (its expert-cache counters its own: a verify wave may run between two steps); `finish`
    picks the first token from the last chunk's last logits and adds the session. `close` frees what an unfinished
    job holds (a caller that left between chunks)."""

    def __init__(self, core: VerifierCore, req: PrefillInput, s: Session, chunk: int):
        self.core, self.req, self.s, self.chunk = core, req, s, max(1, chunk)
        self.done = 0  # prompt tokens in the KV so far
        self.logits = None
        self.feats: list[torch.Tensor] = []
        self.unions: list[ExpertUnion] = []
        self.forward_ms = 0.0
        self.stats = None  # the steps' expert-cache counters, summed
        self.steps = -(-len(req.prompt) // self.chunk)
        self.released = False  # no longer counted in core._prefilling
        self.added = False  # the session went to the store (finish)
        self.wave_sessions = 1  # the most prompts that shared one of its forwards (VerifierCore.prefill_wave)
        self.last_stats = None  # the expert-cache counters of its last forward
        self.last_wave_sessions = 1  # the prompts its last forward held

    def next_ids(self) -> list[int]:
        """The prompt tokens the next step forwards."""
        return list(self.req.prompt[self.done : self.done + self.chunk])

    def step(self) -> bool:
        """Run the next chunk; True once the whole prompt is in the KV."""
        core, s = self.core, self.s
        cache = core.target.expert_cache
        before = dataclasses.replace(cache.stats) if cache is not None else None
        if cache is not None:
            cache.begin({})  # a prompt has no projection: forget the last verify's
        ids = self.next_ids()
        with core._prefill_threads():
            logits, feats, union, ms = core._forward(s, ids, bool(self.req.feature_layer_ids), last_logits_only=True)
        return self.took(len(ids), logits, feats, union, ms, cache.stats.minus(before) if cache is not None else None)

    def took(self, n: int, logits, feats, union: ExpertUnion, ms: float, stats, wave_sessions: int = 1) -> bool:
        """Account one forward of the next `n` prompt tokens (by `step`, or a prefill wave, VerifierCore.prefill_wave):
        its last row's logits, the rows' features, routed experts, ms and expert-cache counters. True once the whole
        prompt is in the KV."""
        s = self.s
        self.logits = logits
        if s.kv is None:
            # crop(0): sliding-window layers keep only their window. With past recording on (for rollback), a layer holds
            # every state until its next crop, and transformers 5.17 hands all of them to the next forward, past its mask
            # (verify crops after every forward; a prompt must too).
            s.cache.crop(0)
        self.done += n
        s.committed = self.done  # the next chunk's positions start here
        if feats is not None:
            self.feats.append(feats)
        self.unions.append(union)
        self.forward_ms += ms
        self.wave_sessions = max(self.wave_sessions, wave_sessions)
        self.last_wave_sessions = wave_sessions  # (this forward's prompts)
        self.last_stats = stats  # (this forward's: a wave's are shared by its jobs)
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats.plus(stats)
        return self.done >= len(self.req.prompt)

    def close(self) -> None:
        """Free what the job holds (its session's pages) and stop counting it; after `finish` added the session to the
        store, its end is the store's (a no-op here)."""
        self._release()
        if not self.added:
            self.s.close()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.core._prefilling -= 1

    def finish(self) -> StepOutput:
        core, s, req = self.core, self.s, self.req
        t = core.target
        logits = self.logits
        t0 = time.perf_counter()
        if req.sampling.penalized:
            s.penalties = Penalties(req.sampling, list(req.prompt), logits.shape[-1], logits.device)
        _, first = core._pick(s, [], logits[-1:])
        s.committed = len(req.prompt)
        s.anchor = first
        emitted = core._emit(s, [first])
        if s.penalties is not None:
            s.penalties.emitted(emitted)
        lps, tops = core._logprobs(s, logits[-1:], emitted)
        acc_ms = (time.perf_counter() - t0) * 1e3
        union: dict[int, set[int]] = {}
        for u in self.unions:
            for layer, ids in u.items():
                union.setdefault(layer, set()).update(ids)
        routed = {layer: frozenset(ids) for layer, ids in sorted(union.items())} if len(self.unions) > 1 else self.unions[0]
        feats = torch.cat(self.feats) if len(self.feats) > 1 else (self.feats[0] if self.feats else None)
        feats = feats.cpu().numpy() if feats is not None else None
        self._release()
        if s.finished is None:  # last: nothing after it can fail, so a session in the store is one its caller hears of
            try:
                core.sessions.add(s)
            except BaseException:
                s.close()
                raise
            self.added = True
        else:
            s.close()
        return StepOutput(
            session_id=s.session_id if s.finished is None else "",
            round=0,
            tokens=emitted,
            num_accepted=0,
            committed=s.committed,
            finished=s.finished,
            features=feats,
            routed_union=routed,
            routed_bytes=union_bytes(routed, t.byte_map),
            forward_ms=self.forward_ms,
            accept_ms=acc_ms,
            expert_cache=self.stats,
            logprobs=lps,
            top_logprobs=tops,
            wave_sessions=self.wave_sessions,
        )


def _step_each(jobs: "list[tuple[int, PrefillJob]]", results: list) -> list:
    """Each (index, job)'s `step` in turn into results[index]: whether its prompt is whole, or the error it failed with."""
    for i, j in jobs:
        try:
            results[i] = j.step()
        except Exception as e:  # noqa: BLE001 - the job's own failure, as its step raises it
            results[i] = e
    return results


def _item_features(features: torch.Tensor, layers: tuple[int, ...], wanted, a: int, e: int) -> torch.Tensor:
    """One wave item's features (rows [a, e)) from the wave's, whose columns are `layers`' in order: the item's own
    layers in its order (a layer named twice: once, as a solo forward gives it)."""
    per = features.shape[-1] // len(layers)
    cols = features[a:e].view(e - a, len(layers), per)
    return cols[:, [layers.index(l) for l in dict.fromkeys(wanted)]].reshape(e - a, -1)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out) or "none"
