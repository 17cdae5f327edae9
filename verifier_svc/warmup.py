"""Warm a loaded verifier before it serves, so the first request pays no first-use costs.

Measured on the H200 (gpt-oss shapes, offloaded experts): a fresh verifier's first request took ~2.0 s to its first
token, a warm one ~200 ms. The first uses: Triton compiles (and autotunes) a kernel at its first launch, the CUDA graph
of a block-size bucket with the drafter's feature layers is captured on its first verify (those without features are
captured at load), cuBLAS and the caching allocator set up, the expert cache fills.

`warm(core, feature_layers)` runs what requests run: a prefill of a short prompt, then one verify per bucket the graph
runner replays (verifier_svc.runner.BUCKETS up to --max-block-size), each carrying the previous call's routed union as
its projection, without features and again with the drafter's feature layers (and, with multi-session waves on the
paged KV, one wave per wave-graph bucket: `wave_blocks`); before those, for a MoE target on CUDA, prefills
whose pairs reach each compiled form of the MoE align (`align_lengths`: up to 513 tokens at one expert a token), and with
CUDA graphs one prompt per prefill-graph bucket (verifier_svc.runner.PREFILL_BUCKETS), without and with the feature
layers, and with prefill-wave graphs (multi-session waves on the paged KV) one prefill wave per prefill-wave bucket
(`prefill_wave_rows`: else a server's first burst of new prompts would pay those captures). Then it gives everything
back: its
sessions end (their KV pages return to the pool), the expert cache's counters are zeroed (its contents stay: they
are the warm part), so the first request's counters are its own. It calls the core, not the servicer: the metrics
never see it. verifier_svc/server.py runs it before health turns SERVING.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pdflash.errors import ResourceExhausted
from pdflash.logging import get_logger
from pdflash.types import DraftResult, SamplingParams
from verifier_svc.engine import PrefillInput, VerifierCore
from verifier_svc.runner import BUCKETS, PREFILL_BUCKETS, WAVE_BUCKETS

log = get_logger("pdflash.verifier.warmup")

# Two prompt lengths: Triton specializes a kernel on whether an integer argument is a multiple of 16.
PROMPT_LENGTHS = (16, 13)


def align_lengths(experts_per_token: int, max_context: int) -> list[int]:
    """Prompt lengths whose (token, expert) pairs reach each compiled form of the MoE align (pdflash_kernels.moe.align_forms:
    one program or a program a chunk, and the pairs a step; the pair count itself is not specialized on), so no prompt's
    prefill compiles one at serve time: one length a form, its pairs within the form's bounds."""
    if experts_per_token <= 0:
        return []
    from pdflash_kernels.moe import align_forms

    k = experts_per_token
    bounds = [most for most, _ in align_forms()[:-1]]
    lengths = [max(1, bounds[0] // k)] + [b // k + 1 for b in bounds]
    return [n for n in lengths if n <= max_context // 2]


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    seconds: float
    prefills: int
    verifies: int
    feature_layers: tuple[int, ...]
    expert_cache: object | None  # the warm-up's own CacheStats (offloaded experts), before the counters were zeroed
    reserved_mb: float = 0.0  # what the CUDA allocator's reserve grew by (the graphs' pools, Triton's and the forward's buffers); 0 on CPU


def feature_layers(layer_ids: tuple[int, ...] | None, model: str) -> tuple[int, ...]:
    """--warmup-feature-layers resolved (VerifierConfig.warmup_layer_ids; None = auto): auto is the layers the default
    DFlash drafter of `model` (empty = the embedded demo target) reads, () when it has none."""
    if layer_ids is not None:
        return layer_ids
    from drafter_svc.compat import target_layers
    from pdflash.defaults import default_drafter_for

    drafter, _ = default_drafter_for(model)
    return target_layers(drafter) if drafter is not None else ()


def block_sizes(max_block_size: int) -> list[int]:
    """One verify block per bucket a verify can land in (a block wider than the last bucket it fits runs in the next)."""
    return sorted({min(b, max_block_size) for b in BUCKETS})


def wave_blocks(max_wave_sessions: int, max_block_size: int) -> list[list[int]]:
    """One multi-session wave per wave-graph bucket a wave can land in (verifier_svc.runner.WAVE_BUCKETS: by its rows in
    all): each as its sessions' block sizes, at least two sessions (one alone is a plain verify), each block at most
    `max_block_size` and the largest single bucket, the rows filling the bucket."""
    widest = min(max_block_size, BUCKETS[-1])
    out = []
    for rows in WAVE_BUCKETS:
        n = max(2, -(-rows // widest))
        if n > max_wave_sessions or n > rows:
            continue
        out.append([rows // n + (1 if i < rows % n else 0) for i in range(n)])
    return out


def prefill_wave_rows(buckets: tuple[int, ...], max_wave_sessions: int, max_context: int) -> list[list[int]]:
    """One prefill wave per prefill-wave graph bucket (verifier_svc.runner.PREFILL_WAVE_BUCKETS, by its rows in all):
    each as its prompts' lengths, at least two prompts, each at most the largest prefill bucket (what a prefill-wave
    graph holds an item) and half the context, the rows filling the bucket; a bucket that needs more prompts than a
    wave holds is left out."""
    out = []
    for rows in buckets:
        n = max(2, -(-rows // PREFILL_BUCKETS[-1]))
        each = rows // n
        if n > max_wave_sessions or each * n != rows or each > max_context // 2:
            continue
        out.append([each] * n)
    return out


class _Request:
    """One warm-up session driven as the drafter's loop drives one (anchor + drafts, the last routed union projected)."""

    def __init__(self, core: VerifierCore, prompt: tuple[int, ...], layers: tuple[int, ...]):
        self.core = core
        out = core.prefill(PrefillInput("warmup", prompt, SamplingParams(), core.max_tokens_limit, ignore_eos=True,
                                        feature_layer_ids=layers))
        self.prompt, self.sid, self.round, self.committed = prompt, out.session_id, 0, out.committed
        self._next(out)

    def _next(self, out) -> None:
        self.anchor = out.tokens[-1] if out.tokens else None
        self.union, self.bytes, self.finished = out.routed_union, out.routed_bytes, out.finished is not None

    def fits(self, n: int) -> bool:
        """A block of n tokens (its bucket's rows written) fits in the context and the session still runs."""
        rows = next((b for b in BUCKETS if b >= n), n)
        return not self.finished and self.committed + rows <= self.core.target.max_context

    def verify(self, n: int) -> None:
        self.take(self.core.verify(self.draft(n)))

    def draft(self, n: int) -> DraftResult:
        """The next block of n tokens (the projection streaming in as the servicer starts it when a Verify arrives)."""
        cache = self.core.target.expert_cache
        if cache is not None and cache.prefetch_union and self.union:
            cache.arriving(self.union)
        self.round += 1
        drafts = tuple(self.prompt[i % len(self.prompt)] for i in range(n - 1))
        return DraftResult(self.sid, self.round, (self.anchor, *drafts), self.union, self.bytes)

    def take(self, out) -> None:
        if isinstance(out, BaseException):
            raise out
        self.committed = out.committed
        self._next(out)

    def end(self) -> None:
        self.core.end(self.sid)  # a no-op once the core ended it (finished)


def warm(core: VerifierCore, feature_layers: tuple[int, ...] = ()) -> WarmupReport:
    """Run the warm-up on a loaded core nobody else uses yet (the server runs it before it serves), then release what
    it held. Sets core.warmup_seconds."""
    t = core.target
    bad = [i for i in feature_layers if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(f"--warmup-feature-layers {','.join(map(str, feature_layers))}: layers {bad} are not layers "
                         f"of {t.name} (0..{t.num_layers - 1})")
    t0 = time.perf_counter()
    cuda = t.device.type == "cuda"
    reserved = torch.cuda.memory_reserved(t.device) if cuda else 0
    cache = t.expert_cache
    lengths = [max(1, min(n, t.max_context // 4)) for n in PROMPT_LENGTHS]
    prefills = verifies = 0
    held: list[_Request] = []
    try:
        # prefill only: each form of the MoE align, compiled on first use on CUDA (on a CPU nothing compiles: torch's
        # CPU ops, or the kernels under Triton's interpreter, where these prompts took minutes and warmed nothing)
        for n in align_lengths(t.experts_per_token, t.max_context) if cuda else ():
            _Request(core, tuple(3 + i % (t.vocab_size - 3) for i in range(n)), ()).end()  # its KV back at once
            prefills += 1
        # each prefill graph's bucket (verifier_svc.runner.PREFILL_BUCKETS), without and with the drafter's features: a
        # prompt of exactly the bucket's rows (a longer prompt's chunks, --prefill-chunk, land in these buckets too)
        buckets = core.graphs.prefill_buckets if core.graphs is not None else ()
        for layers in dict.fromkeys([(), tuple(feature_layers)]):
            for b in (b for b in buckets if b <= t.max_context // 2):
                _Request(core, tuple(3 + i % (t.vocab_size - 3) for i in range(b)), layers).end()
                prefills += 1
        # each prefill-wave graph's bucket: prompts of a wave prefilled together (VerifierCore.prefill_wave), their
        # sessions given back at once (the graphs are the warm part)
        # (a wave that does not fit this verifier's sessions or KV pages is left to its first use, said in the log)
        pw = core.graphs.prefill_wave_buckets if core.graphs is not None and core.wave_forward else ()
        for layers in dict.fromkeys([(), tuple(feature_layers)]) if pw else ():
            most = min(core.max_wave_sessions, core.sessions.max_sessions - 1)
            for lengths_ in prefill_wave_rows(pw, most, t.max_context):
                jobs = []
                try:
                    for i, n in enumerate(lengths_):
                        prompt = tuple(3 + (i + j) % (t.vocab_size - 3) for j in range(n))
                        jobs.append(core.start_prefill(PrefillInput("warmup", prompt, SamplingParams(), 1, ignore_eos=True,
                                                                    feature_layer_ids=layers)))
                    left = list(jobs)
                    while left:  # (chunk by chunk where --prefill-chunk cuts the prompts)
                        done = core.prefill_wave(left)
                        for r in done:
                            if isinstance(r, BaseException):
                                raise r
                        left = [j for j, whole in zip(left, done) if not whole]
                    prefills += len(lengths_)
                except ResourceExhausted as e:
                    log.warning("prefill-wave bucket not warmed", rows=sum(lengths_), prompts=len(lengths_), why=str(e))
                finally:
                    for j in jobs:
                        j.close()
        extra = prefills
        for layers in dict.fromkeys([(), tuple(feature_layers)]):  # without features, then with the drafter's
            req = None
            for n in block_sizes(core.max_block_size):
                if req is None or not req.fits(n):
                    prompt = tuple(3 + i % (t.vocab_size - 3) for i in range(lengths[(prefills - extra) % len(lengths)]))
                    req = _Request(core, prompt, layers)
                    held.append(req)
                    prefills += 1
                if req.fits(n):
                    req.verify(n)
                    verifies += 1
            if core.max_wave_sessions > 1 and core.wave_forward:  # each wave graph's bucket (captured on first use)
                crew: list[_Request] = []
                for blocks in wave_blocks(core.max_wave_sessions, core.max_block_size):
                    crew = [r for r in crew if r.fits(max(blocks))]
                    while len(crew) < len(blocks):
                        prompt = tuple(3 + i % (t.vocab_size - 3) for i in range(lengths[0]))
                        crew.append(_Request(core, prompt, layers))
                        held.append(crew[-1])
                        prefills += 1
                    wave = list(zip(crew, blocks))
                    outs = core.verify_wave([(r.draft(n), True) for r, n in wave])
                    for (r, _), o in zip(wave, outs):
                        r.take(o)
                    verifies += len(wave)
    finally:
        for req in held:
            req.end()
    spent = dataclasses.replace(cache.stats) if cache is not None else None
    if cache is not None:
        cache.reset_stats()
    core.warmup_seconds = time.perf_counter() - t0
    grown = (torch.cuda.memory_reserved(t.device) - reserved) / 2**20 if cuda else 0.0
    log.info("warm-up done", seconds=round(core.warmup_seconds, 2), prefills=prefills, verifies=verifies,
             feature_layers=list(feature_layers), expert_bytes_moved=spent.bytes_moved if spent is not None else 0,
             cuda_reserved_grew_mb=round(grown, 1))
    return WarmupReport(core.warmup_seconds, prefills, verifies, tuple(feature_layers), spent, grown)
