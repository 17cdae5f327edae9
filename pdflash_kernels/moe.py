"""Grouped MoE experts in Triton: every routed (token, expert) pair of one layer in three launches.

    align (torch ops, no host sync)  ->  gemm1: gather x rows, gate/up, bias, activation -> h (bf16)
                                     ->  gemm2: h @ w2^T, bias, * routing weight -> y[pair] (fp32)
                                     ->  combine: out[t] = sum over its k slots, in slot order -> bf16

Weights are bf16 or MXFP4 (`pdflash_kernels/mxfp4.py` layout), rows = output features, K contiguous, gate rows
then up rows (`UP_OFF` / `ROW_MUL` also read gpt-oss's interleaved rows in place). Experts are reached
through a slot table (expert id -> slot index into the weight tensors' first dimension), so the same
kernels run on all experts resident or on a GPU slot pool of offloaded ones.

Batch invariance: a pair's row is computed by one program whose tile sizes, K order and activation are
fixed by the layer's static shape (never by the number of tokens or by routing), and the k slots of a
token are summed in slot order by one program; no atomic adds a value (the opt-in FUSED_COMBINE counts with
one, as a semaphore). So a token's output does not depend on which other tokens share the call
(tests/test_kernels_gpu.py checks 1..256 rows bit for bit).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from pdflash_kernels import linear, runtime

triton, tl = runtime.triton, runtime.tl
to_bf16, to_out = (runtime.to_bf16, runtime.to_out) if triton is not None else (None, None)

# The combine (a token's k rows summed in slot order) in the down GEMM's launch: the last program to store one of a
# token's pairs (per n tile; an atomic counter as a semaphore, as pdflash_kernels/linear.py's one-launch split-K) sums them,
# with the separate combine's arithmetic (the same bits); one launch fewer per MoE layer. Opt-in until the H200 has
# measured it (PDFLASH_MOE_FUSED_COMBINE=1).
FUSED_COMBINE = runtime.env_flag("PDFLASH_MOE_FUSED_COMBINE")
# Split K for every MoE GEMM (MoeConfig.split_k over the defaults below): unset (the default), each shape's split as
# the sweep set it (MXFP4 pair words: 4 ranges, Qwen3-30B-A3B's shapes 1; otherwise 1); 1, 2 or 4 for every GEMM.
# Static (the same split for every token count: rows stay batch-invariant), but another value may give other last bits.
# For timing a split end to end on the GPU (PDFLASH_MOE_SPLIT_K=2 benchmarks/e2e_gpu.py ...).
_SPLIT_K = os.environ.get("PDFLASH_MOE_SPLIT_K")
if _SPLIT_K not in (None, "1", "2", "4"):
    raise ValueError(f"PDFLASH_MOE_SPLIT_K must be 1, 2 or 4 (unset: each shape's default), got {_SPLIT_K!r}")
SPLIT_K: int | None = int(_SPLIT_K) if _SPLIT_K is not None else None
# MXFP4 experts served on a GPU stored as pair words (pdflash_kernels/mxfp4.py to_pair_words; decodes 5 and 6): "1" (the
# default since stop 31: on the H200 the MoE call 1.08-1.83x faster per case, gpt-oss-24l end to end +9-11% tok/s with
# every expert cached, the same output bits) or "0" (the nibble order, decodes 3/4). The stores
# (verifier_svc.expert_store) ask `pair_words_for(device)`; a CPU verifier never uses them.
_PAIR_WORDS = os.environ.get("PDFLASH_FP4_PAIR_WORDS", "1")
if _PAIR_WORDS not in ("0", "1"):
    raise ValueError(f"PDFLASH_FP4_PAIR_WORDS must be 0 or 1, got {_PAIR_WORDS!r}")
PAIR_WORDS = _PAIR_WORDS == "1"


def pair_words_for(device) -> bool:
    """Whether MXFP4 experts served on `device` are stored as pair words: on a GPU (the Triton kernels), when enabled."""
    return PAIR_WORDS and torch.device(device).type == "cuda"


# MXFP4 experts served on a GPU as tensor-core fragment words (pdflash_kernels/fragments.py, the Gluon kernel):
# PDFLASH_FP4_FRAGMENTS "1" (the default since stop 36: on the H200 the whole MoE call 1.14-1.38x faster than pair words
# at <= 16 tokens per expert, except Qwen3-30B-A3B at 8 experts and 4-16 tokens (1.02x, 0.90x); benchmarks/results/
# kernels_h200.md against stop 35's, gpu_runs_h200.md "Stop 36") or "0" (pair words / nibbles as above). Only where the
# shape fits (hidden and expert width multiples of 64) and Gluon is installed; a store that meets a scale byte above 128
# falls back to pair words (verifier_svc.expert_store).
_FRAGMENTS = os.environ.get("PDFLASH_FP4_FRAGMENTS", "1")
if _FRAGMENTS not in ("0", "1"):
    raise ValueError(f"PDFLASH_FP4_FRAGMENTS must be 0 or 1, got {_FRAGMENTS!r}")
FRAGMENTS = _FRAGMENTS == "1"


def expert_format_for(device, layout=None) -> str:
    """The format of the MXFP4 expert stores served on `device` (verifier_svc.expert_store.FORMATS): "fragments" on a
    GPU when enabled, Gluon is there and the experts' shape (`layout`: mxfp4.ExpertLayout; None: any) fits (gated or
    up-only experts whose widths are multiples of 64: `fragments.fragments_fit` says why not); else "pair_words" on a
    GPU when enabled; else "nibbles"."""
    if torch.device(device).type != "cuda":
        return "nibbles"
    if FRAGMENTS:
        from pdflash_kernels import fragments

        if fragments.gluon is not None and (layout is None or fragments.fragments_fit(
                layout.hidden, layout.intermediate, getattr(layout, "gated", True)) is None):
            return "fragments"
    return "pair_words" if PAIR_WORDS else "nibbles"

def pair_word_decode_asm(scale_a: str = "$9", scale_b: str = "$9") -> str:
    """Decode 5 of one 32-bit pair word ($8) into its 8 bf16 values ($0..$7, pairs p0..p3 in the word's order): per
    pair a rotation, one AND (one more AND and OR for the last) and one bf16x2 multiply by the operand holding 2^(s-1)
    in both halves, `scale_a` for pairs 0 and 2, `scale_b` for pairs 1 and 3 (pdflash_kernels/fragments.py: the
    fragment's rows g and g + 8, which have their own scales)."""
    return f"""{{
            .reg .b32 r, t, u, z;
            mov.b32 z, 0x80008000;
            and.b32 r, $8, 0x81C081C0; fma.rn.bf16x2 r, r, {scale_a}, z; mov.b32 {{$0, $1}}, r;
            shf.l.wrap.b32 t, $8, $8, 4; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, {scale_b}, z; mov.b32 {{$2, $3}}, r;
            shf.l.wrap.b32 t, $8, $8, 10; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, {scale_a}, z; mov.b32 {{$4, $5}}, r;
            shf.l.wrap.b32 t, $8, $8, 6; and.b32 r, t, 0x80C080C0; shf.l.wrap.b32 u, $8, $8, 14; and.b32 u, u, 0x01000100;
            or.b32 r, r, u; fma.rn.bf16x2 r, r, {scale_b}, z; mov.b32 {{$6, $7}}, r;
            }}"""


PAIR_WORD_ASM = pair_word_decode_asm()
if runtime.triton is not None:  # (a jit function reads a global only as a constexpr)
    PAIR_WORD_ASM = runtime.triton.language.constexpr(PAIR_WORD_ASM)

ACT_SILU = 0
ACT_GPTOSS = 1  # clamp(gate, max=limit), clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)
# Up-only experts (no gate; Nemotron-H / Nemotron 3): w1 holds the I up rows alone and h = relu(up)^2. The gate/up GEMM
# then runs one row set (the down GEMM's form): half the first projection's bytes and work of a gated expert of width I.
ACT_RELU2 = 2
GATED_ACTS = (ACT_SILU, ACT_GPTOSS)


# FP4 decodes (MoeConfig.decode)
DECODE_SELECT = 0  # fp32, E2M1 magnitudes by selects; scale 2^(s-127) (scale byte 0 reads as 0)
DECODE_F32_BITS = 1  # fp32, nibble bits placed into a float32 (code 1 = a subnormal), one fp32 multiply by 2^(s-1)
DECODE_SCALED = 2  # tl.dot_scaled: Triton upcasts the packed weights itself (GPU only: not in Triton's interpreter)
DECODE_BF16_BITS = 3  # bf16, nibble bits placed into a bf16 (code 1 = a subnormal), one bf16 multiply by 2^(s-1)
DECODE_WORD = 4  # decode 3 on 32-bit words: 8 values per load element and 4 bf16x2 multiplies (weights in K order)
DECODE_PAIR_WORDS = 5  # weights stored as pair words (pdflash_kernels/mxfp4.py): 9 integer instructions + 4 multiplies a word
DECODE_PAIR_WORDS_EXACT = 6  # pair words, two multiplies a pair (2^126, then 2^(s-127)): exact for scale bytes 1..254
PAIR_DECODES = (DECODE_PAIR_WORDS, DECODE_PAIR_WORDS_EXACT)  # the decodes of pair-word weights (ExpertWeights.pair_words)
# Decodes 1, 3 and 4 multiply by 2^(s-1), a finite float only for scale bytes s <= 128 (groups with |w| <= 12): they are
# exact up to there and read a larger scale byte as 128 (wrong values). Decode 0 is exact for scale bytes 1..254.
# Decode 4 reads the packed rows as 32-bit words: row strides (bytes) and base addresses must be multiples of 4, else
# the launch uses decode 3 (`_word_ok`; a static property of the weight tensors, never of the tokens).
FAST_DECODES = (1, 3, 4, 5)
FAST_DECODE_MAX_SCALE = 128

# How the FP4 paths (decode 0, 1, 3) read the activations (MoeConfig.a_load)
A_GATHER = 0  # two stride-2 gathers per K step (the even and the odd columns), one dot per decoded half
A_SPLIT = 1  # one contiguous [BM, BK] load, split into even/odd columns in registers, one dot per decoded half
A_JOIN = 2  # one contiguous [BM, BK] load; the decoded halves interleaved back into K order: one dot over BK
# Pair-word decodes (5/6): A_JOIN with each K step's values cut into num_warps consecutive ranges, one batched 3-D dot
# ([W, BM, BK/W] x [W, BK/W, BN]; swapped: [W, BN, BK/W] x [W, BK/W, BM]) whose batch Triton gives each warp, summed over the ranges once
# after the K loop. With A_JOIN the warps split the tile's N, so each reads the whole activation tile from shared
# memory (benchmarks/results/gpu_runs_h200.md, stop 33: 32 KB of activation reads a step against 4 KB of weights);
# here each reads its own K range of both. Another reduction order (fixed by the config): other last bits.
A_WARPS_K = 3  # 4 K ranges (num_warps 4)
A_WARPS_K2 = 4  # 2 K ranges (num_warps 2)
WARPS_K_RANGES = {A_WARPS_K: 4, A_WARPS_K2: 2}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """One GEMM's static launch choice. Every field is fixed by the layer's static shape (never by the token count or
    the routing), so any config keeps the kernels batch-invariant; configs differ in their reduction order, so two
    configs may differ in the last bits."""

    block_m: int = 16  # routing block (pairs per m tile); both GEMMs of a layer share it
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    decode: int = DECODE_SELECT  # FP4 only: DECODE_*
    a_load: int = A_GATHER  # FP4 decodes 0/1/3 only: A_*
    swap_ab: bool = False  # the weight tile as the MMA's M side (acc^T = w @ a^T): wgmma-sized (M >= 64) at block_n >= 64
    raster: int = 0  # 0: a 2-D grid (m blocks, n tiles); 1: a 1-D grid, the n tiles of one m block consecutive
    persist: int = 0  # > 0: that many programs per SM, each walking tiles in raster-1 order (no empty programs)
    s_ahead: int = 0  # FP4 decodes 0/1/3/4/5/6: 1 loads the next K step's scales ahead; 2 prefetches the tile's whole scale
    # rows into L1 before the K loop, so each step's scale loads hit L1 (_gemm_rows: S_AHEAD; no value changes)
    s_words: bool = False  # FP4 decodes 0/1/3/4, block_k >= 128: scales read as 32-bit words, streamed (cp.async) like the
    # weights (_gemm_rows: S_WORDS); scale rows that are not 4-byte aligned (gpt-oss's 90 bytes) read bytes instead
    split_k: int = 1  # > 1: K cut into that many ranges (whole K steps), one program each, their float32 partial sums added
    # in range order by the tile's last program (a counter as a semaphore), or by a second launch where no counters are
    # free; the same bits either way, and for any token count (the ranges are fixed by the shape). For decode shapes,
    # whose few routing blocks leave most SMs with few warps: at one token, gpt-oss-20b's 4 experts make 360 programs.


def base_config(n: int, k: int, topk: int, fp4: bool) -> MoeConfig:
    """Tile sizes from the static shape only (never from the token count or the routing): what the first H200 sweep
    (benchmarks/results/kernels_sweep_h200.txt) chose, before the sweep winners (`FP4_DEFAULT`, `BF16_DEFAULT`,
    `SHAPE_OVERRIDES`) apply."""
    sms = runtime.sm_count()
    # Enough programs at one token (topk pairs) to keep every SM reading: smaller N tiles for narrow layers.
    # (not below 32: 16-wide tiles were slower in every case the H200 sweep timed)
    block_n = 64
    while block_n > 32 and topk * triton_cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    # FP4: decode 1 (bit placement) was the fastest variant on the H200 at decode shapes (benchmarks/kernel_bench.py --sweep)
    return MoeConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4 if fp4 else 3,
                     decode=DECODE_F32_BITS if fp4 else DECODE_SELECT)



# Named variants (fields merged over base_config): what the sweep times and the tests check. FP4 weights:
SWEEP_VARIANTS: dict[str, dict] = {
    "base": {},  # base_config as it is: decode 1 (fp32 bit placement), stride-2 activation gathers
    "join": dict(a_load=A_JOIN),  # contiguous activations, one dot over BK (decode 1)
    "split_bf16": dict(a_load=A_SPLIT, decode=DECODE_BF16_BITS),
    "join_bf16": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS),
    "join_bf16_k128": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=128),  # gpt-oss: K = 2880 (masked last step)
    "join_bf16_k256": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=256),
    "join_bf16_swap64": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=64),
    "join_bf16_swap64_k256": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=64, block_k=256),
    "join_bf16_swap128_w8": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=128, num_warps=8),
    "join_bf16_raster": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, raster=1),
    "join_bf16_persist": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, persist=4),
    "scaled_swap64": dict(decode=DECODE_SCALED, swap_ab=True, block_n=64),  # GPU only (tl.dot_scaled)
    # 32-bit word loads, 8 values per element, one PTX block per word (decode 4; always in K order, as A_JOIN). Exact, and
    # within 5% of join_bf16 on the H200 (benchmarks/results/kernels_sweep_word_h200.txt): the decode's instruction
    # count is not what holds the FP4 GEMMs at 10-40% of the copy rate.
    "word": dict(a_load=A_JOIN, decode=DECODE_WORD),
    "word_k256_raster": dict(a_load=A_JOIN, decode=DECODE_WORD, block_k=256, raster=1),
    "word_swap64_k256": dict(a_load=A_JOIN, decode=DECODE_WORD, swap_ab=True, block_n=64, block_k=256),
    # pair words (decode 5: the weights stored with each 32-bit word's bits rearranged, pdflash_kernels/mxfp4.py to_pair_words)
    "pair": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS),
    "pair_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, raster=1),
    "pair_k256_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=256, raster=1),
    "pair_swap64": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64),
    "pair_k256_n64_w2_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=256, block_n=64, num_warps=2, raster=1),
    "pair_n128_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_n=128, raster=1),
    "pair_k256_n128_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=256, block_n=128, raster=1),
    "pair_n64_w1_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_n=64, num_warps=1, raster=1),
    "pair_swap64_w2": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2),
    "join_bf16_swap64_w2": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=64, num_warps=2),
    "pair_swap64_w2_s1": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2, s_ahead=1),
    "pair_swap64_w2_sw": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2, block_k=128,
                              s_words=True, s_ahead=1),
    "pair_swap32_w1": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=32, num_warps=1),
    "pair_swap64_w2_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2, raster=1),
    # the tile's scale rows prefetched into L1 before the K loop (s_ahead=2): the loop's byte loads of the scales, which
    # a 32-byte sector serves for only 2-8 K steps, stop waiting on HBM at each new sector (stop 29's probe: the scale
    # path costs 20-25% of the FP4 GEMM); and 512-wide K steps, half the steps (and scale waits) of 256, 2-3 stages
    "pair_k256_raster_pf": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=256, raster=1, s_ahead=2),
    "pair_swap64_w2_raster_pf": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2, raster=1,
                                     s_ahead=2),
    "pair_k512_s2_raster": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=512, num_stages=2, raster=1),
    "pair_k512_s3_raster_pf": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=512, num_stages=3, raster=1, s_ahead=2),
    # stop 33: each K step split over the warps (A_WARPS_K*: every warp reads only its K range of the activations)
    "pair_k256_wk4_raster": dict(a_load=A_WARPS_K, decode=DECODE_PAIR_WORDS, block_k=256, raster=1),
    "pair_k512_wk4_raster": dict(a_load=A_WARPS_K, decode=DECODE_PAIR_WORDS, block_k=512, num_stages=3, raster=1),
    "pair_k256_n64_wk2_raster": dict(a_load=A_WARPS_K2, decode=DECODE_PAIR_WORDS, block_k=256, block_n=64, num_warps=2,
                                     raster=1),
    "pair_swap64_wk2_raster": dict(a_load=A_WARPS_K2, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2,
                                   raster=1),
    "pair_swap64_k256_wk2_raster": dict(a_load=A_WARPS_K2, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64,
                                        num_warps=2, block_k=256, raster=1),
    # the next K step's scales loaded ahead (MoeConfig.s_ahead): the same values, without an HBM round trip per K step
    # (compiled for sm_90, every variant above streams its weights and activations ahead with cp.async but waits for
    # its scales in every step: tests/test_fused_kernels.py checks both forms)
    "join_bf16_raster_s1": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, raster=1, s_ahead=1),
    "join_bf16_k128_s1": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=128, s_ahead=1),
    "join_bf16_k256_raster_s1": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=256, raster=1, s_ahead=1),
    "join_bf16_swap64_s1": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=64, s_ahead=1),
    "word_raster_s1": dict(a_load=A_JOIN, decode=DECODE_WORD, raster=1, s_ahead=1),
    "word_k256_raster_s1": dict(a_load=A_JOIN, decode=DECODE_WORD, block_k=256, raster=1, s_ahead=1),
    # the scales read as 32-bit words and streamed ahead through cp.async like the weights (MoeConfig.s_words; block_k
    # >= 128), or, where the scale rows are not 4-byte aligned (gpt-oss's 90 bytes), a step ahead (s_ahead)
    "join_bf16_k128_sw": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=128, s_words=True, s_ahead=1),
    "join_bf16_k128_raster_sw": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=128, raster=1, s_words=True, s_ahead=1),
    "join_bf16_k256_raster_sw": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=256, raster=1, s_words=True, s_ahead=1),
    "join_bf16_swap64_k128_sw": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, swap_ab=True, block_n=64, block_k=128,
                                     s_words=True, s_ahead=1),
    "word_k128_raster_sw": dict(a_load=A_JOIN, decode=DECODE_WORD, block_k=128, raster=1, s_words=True, s_ahead=1),
    "word_k256_raster_sw": dict(a_load=A_JOIN, decode=DECODE_WORD, block_k=256, raster=1, s_words=True, s_ahead=1),
    # K split over 2 or 4 programs (MoeConfig.split_k): more warps in flight where the routing blocks are few (decode:
    # top-k experts a token); the partials add up in the tile's last program
    "join_bf16_raster_split2": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, raster=1, split_k=2),
    "join_bf16_raster_split4": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, raster=1, split_k=4),
    "join_bf16_k128_split2": dict(a_load=A_JOIN, decode=DECODE_BF16_BITS, block_k=128, raster=1, split_k=2),
    # stop 34: the same K split on the pair-word defaults. The small decode calls (Qwen3 at 8 experts: 14-17% of the copy
    # rate) are latency-bound: few programs, each walking its K steps one after another; 2 or 4 ranges halve or quarter
    # that walk (the ranges are fixed by the shape: still batch-invariant, other last bits than one range)
    "pair_k256_raster_split2": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, block_k=256, raster=1, split_k=2),
    "pair_swap64_w2_raster_split2": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2,
                                         raster=1, split_k=2),
    "pair_swap64_w2_raster_split4": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64, num_warps=2,
                                         raster=1, split_k=4),
    # (untimed) deeper K steps for the split default: gpt-oss-20b's K = 2880 takes base_config's 64-wide steps (45 a
    # GEMM, ~12 a range); 128 or 256 with a masked last step, as pair_k256_raster reads it
    "pair_swap64_w2_k128_raster_split4": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64,
                                              num_warps=2, block_k=128, raster=1, split_k=4),
    "pair_swap64_w2_k256_raster_split4": dict(a_load=A_JOIN, decode=DECODE_PAIR_WORDS, swap_ab=True, block_n=64,
                                              num_warps=2, block_k=256, raster=1, split_k=4),
}
# bf16 weights (the FP4-only fields do not apply):
SWEEP_VARIANTS_BF16: dict[str, dict] = {
    "base": {},
    "k256": dict(block_k=256),
    "swap64": dict(swap_ab=True, block_n=64),
    "swap128_w8": dict(swap_ab=True, block_n=128, num_warps=8),
    "raster": dict(raster=1),
    "persist": dict(persist=4),
    "persist_split2": dict(persist=4, split_k=2),
    # stop 34 (untimed): the split that paid on the pair-word GEMMs, for the bf16 calls still under 60% of the copy
    # rate (Qwen3-30B-A3B at 8 experts: 45-50%, few programs each walking K=2048 or 768)
    "persist_split4": dict(persist=4, split_k=4),
    "swap64_split2": dict(swap_ab=True, block_n=64, split_k=2),
    "swap64_split4": dict(swap_ab=True, block_n=64, split_k=4),
}
GPU_ONLY_VARIANTS = frozenset({"scaled_swap64"})

# ==== THE ONE PLACE TO SET THE SWEEP'S WINNERS =====================================================================
# `python benchmarks/kernel_bench.py --sweep` times the variants of `SWEEP_VARIANTS` / `SWEEP_VARIANTS_BF16` (below) on the
# decode shapes (pair-word variants on pair-word weights) and ends its output with a ready-made block for these names and
# PAIR_DEFAULT / PAIR_SHAPE_OVERRIDES below, chosen by the whole MoE call's time. Fields are merged over base_config:
#   FP4_DEFAULT / BF16_DEFAULT: for every GEMM of that weight format, e.g. FP4_DEFAULT = dict(SWEEP_VARIANTS["join_bf16"]);
#   SHAPE_OVERRIDES[(gemm, n, k, fp4)]: for one GEMM of one shape, applied last (gemm 1: gate/up, n = I, k = H; gemm 2:
#     down, n = H, k = I), e.g. SHAPE_OVERRIDES[(2, 2048, 768, True)] = dict(SWEEP_VARIANTS["join_bf16_swap64"]).
# Keys are static shapes only (batch invariance); block_m must stay 16 (both GEMMs share the routing blocks).
# Set from the H200 sweep of 2026-12-01 (benchmarks/results/kernels_sweep_h200.txt: 2406 us over its cases vs 5150 for
# base_config's FP4 GEMMs; bf16 117 vs 127 us), after tests/test_kernels_gpu.py passed for every variant.
FP4_DEFAULT: dict = dict(SWEEP_VARIANTS["join_bf16_raster"])
BF16_DEFAULT: dict = dict(SWEEP_VARIANTS_BF16["persist"])
SHAPE_OVERRIDES: dict[tuple[int, int, int, bool], dict] = {
    (2, 2880, 2880, True): dict(SWEEP_VARIANTS["join_bf16_k128"]),  # gpt-oss-20b
    (1, 768, 2048, False): dict(SWEEP_VARIANTS_BF16["k256"]),  # qwen3-30b-a3b
    (2, 2048, 768, True): dict(SWEEP_VARIANTS["join_bf16_swap64"]),  # qwen3-30b-a3b
}
# MXFP4 weights stored as pair words (ExpertWeights.pair_words; decode 5): the tiles that suit that decode. The weight
# tile as the MMA's M side on 2 warps (pair_swap64_w2*: mma.sync, the decoded registers are the MMA's A operand as they
# come; 4 warps would take wgmma, whose register operand Triton converts through shared memory), or 256-deep K steps.
# Set from the H200 sweep of 2026-12-03 (benchmarks/results/kernels_sweep_pair_words_h200.txt), by the whole MoE call (the
# per-GEMM sums the sweep's summary ranks by disagreed with it: mixtral-8x7b at 2 experts ran 125.5 us with
# pair_k256_raster and 263.1 us with pair_swap64_w2_raster, whose GEMMs timed alone summed less): pair_k256_raster
# everywhere (gpt-oss-20b at 4 active experts 77.1 -> 49.3 us, mixtral-8x7b at 2: 229.9 -> 125.5), but Qwen3-30B-A3B's
# two GEMMs take the weight tile as the MMA's M side on 2 warps (at 128 experts 206.0 -> 153.6 us; at 8, the block-1
# case, 31.7 against k256's 27.7: a verify of 16 tokens routes to ~80 of its 128 experts). GPU tests passed first.
# Stop 34 (benchmarks/results/stop34_gpu/call4/sweep_split.txt): the swapped tile with K cut into 4 fixed ranges beat
# pair_k256_raster on the whole call, gpt-oss-20b 1072.5 vs 1164.9 us and mixtral-8x7b 1253.7 vs 1376.2 us over the
# sweep's cases; Qwen3 keeps its unsplit swapped tile (712.0 vs 889.2 us split). Rows bit-identical whatever the other
# rows (tests/test_kernels_gpu.py) and every drafter and width equal to block 1 on qwen3_moe / gpt_oss with these in
# place (benchmarks/with_sweep_winners.py), on the H200 before this became the default.
PAIR_DEFAULT: dict = dict(SWEEP_VARIANTS["pair_swap64_w2_raster_split4"])
PAIR_SHAPE_OVERRIDES: dict[tuple[int, int, int], dict] = {  # (gemm, n, k)
    # (block_k and split_k as the sweep ran them: an override merges over PAIR_DEFAULT, whose K split it does not take)
    (1, 768, 2048): dict(SWEEP_VARIANTS["pair_swap64_w2_raster"], block_k=128, split_k=1),  # qwen3-30b-a3b gate/up
    (2, 2048, 768): dict(SWEEP_VARIANTS["pair_swap64_w2_raster"], block_k=128, split_k=1),  # qwen3-30b-a3b down
}
# ====================================================================================================================


def variant_config(n: int, k: int, topk: int, fp4: bool, fields: dict) -> MoeConfig:
    """base_config with `fields` merged over it; block_k capped to the reduction length (>= 32)."""
    c = dataclasses.replace(base_config(n, k, topk, fp4), **fields)
    if c.block_k > max(32, triton_next_pow2(k)):
        c = dataclasses.replace(c, block_k=max(32, triton_next_pow2(k)))
    return c


def default_config(n: int, k: int, topk: int, fp4: bool, gemm: int = 1, pair_words: bool = False) -> MoeConfig:
    """The config moe_forward uses for one GEMM (`gemm` 1: gate/up, 2: down; n output features, reduction length k):
    base_config, then the sweep winners set above (PAIR_DEFAULT for weights stored as pair words). From the static
    shape and the weights' stored format only (never the token count or the routing)."""
    if fp4 and pair_words:
        fields = dict(PAIR_DEFAULT)
        fields.update(PAIR_SHAPE_OVERRIDES.get((gemm, n, k), {}))
    else:
        fields = dict(FP4_DEFAULT if fp4 else BF16_DEFAULT)
        fields.update(SHAPE_OVERRIDES.get((gemm, n, k, fp4), {}))
    if SPLIT_K is not None:
        fields["split_k"] = SPLIT_K
    return variant_config(n, k, topk, fp4, fields)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---- routing: pairs sorted by expert, padded to blocks of BLOCK_M ----------------------------------------
@dataclasses.dataclass
class Routing:
    sorted_pairs: torch.Tensor  # int32 [max_blocks * BM]: pair index (token * topk + slot), P for padding
    block_slot: torch.Tensor  # int32 [max_blocks]: weight slot of each block (-1: unused)
    num_blocks: torch.Tensor  # int32 [1]
    pair_valid: torch.Tensor  # bool [P]
    max_blocks: int
    num_pairs: int
    block_phase: torch.Tensor | None = None  # int8 [max_blocks]: the block's copy group (0: resident; moe_forward)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return min(num_pairs, num_experts) + triton_cdiv(num_pairs, block_m)


# The pairs one step of the align sorts (a compiled form each): the smallest of these that holds a call's pairs, so a
# verify is one pass; verifier_svc/warmup.py prefills prompts whose pairs reach each form before serving.
# (H200, Qwen3's 128 experts: 512 pairs take 8.05 us in 512-pair steps, 10.07 in 256, 10.58 in 1024; 2048 pairs 18.2 us in
# 1024-pair steps, 22.6 in 256: benchmarks/results/kernels_align_h200.txt)
ALIGN_CHUNKS = (64, 256, 512, 1024)
# A program a chunk (`_align_programs_kernel`, stop 56): every program counts all the pairs, then ranks and scatters its
# own chunk, so calls of several chunks sort them side by side rather than one after another. The same routing (every
# row of `kernel_bench.py --align-only` on the H100, and the GPU align tests). On the H100 (stop 56 calls 8-11,
# benchmarks/results/stop56_gpu/call8): Qwen3-30B-A3B's 512 / 2048 / 8192 pairs 7.99 / 18.4 / 59.6 us in one program,
# 5.93 / 7.83 / 12.6 a program a chunk; gpt-oss-20b's 1024 / 4096 pairs 7.2 / 25.7 against 4.77 / 7.31; Qwen3's MoE call
# at 128 experts x 16 tokens 149.9 against 159.1 us. On by default; PDFLASH_ALIGN_PROGRAMS=0: one program.
ALIGN_PROGRAMS = runtime.env_flag("PDFLASH_ALIGN_PROGRAMS", default=True)


def align_programs_chunk(pairs: int) -> int:
    """The pairs a program of the routing step ranks (`_align_programs_kernel`): 128 up to 512 pairs, 256 up to 2048,
    512 above (H100, stop 56 call 8: Qwen3's 512 pairs 5.97 us in 128-pair chunks, 7.65 in 256; 2048 pairs 8.05 in
    256, 7.89 in 512; 8192 pairs 12.76 in 512, 15.97 in 256)."""
    return 128 if pairs <= 512 else 256 if pairs <= 2048 else 512


def align_forms() -> list[tuple[int | None, tuple[str, int]]]:
    """The routing step's compiled forms on a GPU, ascending: (most pairs, or None above the last bound; (kind, pairs a
    step)), kind "one" (`_align_kernel`) or "programs" (`_align_programs_kernel`). verifier_svc/warmup.py prefills one
    prompt a form."""
    if ALIGN_PROGRAMS:
        return [(64, ("one", 64)), (128, ("one", 256)), (512, ("programs", 128)), (2048, ("programs", 256)),
                (None, ("programs", 512))]
    return [(c, ("one", c)) for c in ALIGN_CHUNKS[:-1]] + [(None, ("one", ALIGN_CHUNKS[-1]))]


def align_plan(pairs: int, programs: bool | None = None, chunk: int | None = None, sort: bool = True) -> tuple[str, int]:
    """(kind, pairs a step) `align_fused` runs a call of `pairs` pairs in: "programs" (a program a chunk, where `programs`
    (default ALIGN_PROGRAMS) and the call has more than one chunk) or "one" (one program). `sort` False (the
    interpreter's compare, CH x CH): steps of at most 256 pairs."""
    if programs is None:
        programs = ALIGN_PROGRAMS
    if programs:
        ch = chunk or align_programs_chunk(pairs)
        ch = ch if sort else min(ch, 256)
        if triton_cdiv(pairs, ch) > 1:
            return "programs", ch
    ch = chunk or align_chunk(pairs)
    return "one", ch if sort else min(ch, chunk or 256)


def align_form(pairs: int) -> tuple[str, int]:
    """The compiled form (`align_forms`, the table verifier_svc/warmup.py prefills by) a call of `pairs` pairs takes in
    `align_fused` on a GPU."""
    return align_plan(pairs)


def align_chunk(pairs: int) -> int:
    return next((c for c in ALIGN_CHUNKS if pairs <= c), ALIGN_CHUNKS[-1])


def align_fused(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    phase_of_expert: torch.Tensor | None = None,
    chunk: int | None = None,
    sort: bool | None = None,
    programs: bool | None = None,
) -> Routing:
    """`align` as one Triton launch (the torch version below is ~28 small kernels: ~85 us of a decode layer). `chunk`:
    the pairs one step sorts (a power of two, 64-1024; default `align_chunk`), for benchmarks/kernel_bench.py. `sort`:
    rank a chunk's pairs by tl.sort (default on a GPU) or by a pairwise compare (default under the interpreter).
    `programs`: a program a chunk of `chunk` pairs (default `align_programs_chunk`) where the call has more than one
    chunk (`_align_programs_kernel`; default ALIGN_PROGRAMS, PDFLASH_ALIGN_PROGRAMS; `align_plan`): the same routing."""
    t, topk = topk_ids.shape
    p = t * topk
    dev = topk_ids.device
    mb = max_blocks(p, num_experts, block_m)
    sorted_pairs = torch.empty(mb * block_m, dtype=torch.int32, device=dev)
    block_slot = torch.empty(mb, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    valid = torch.empty(p, dtype=torch.bool, device=dev)
    block_phase = torch.empty(mb, dtype=torch.int8, device=dev) if phase_of_expert is not None else None
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    # NB histogram bins: the experts (a dropped pair, key E, is masked out of the counts). CH pairs a step (ALIGN_CHUNKS);
    # C blocks a step of the block -> expert search; the padding stores PAD_C entries at a time
    nb = triton.next_power_of_2(num_experts)
    if sort is None:
        sort = not runtime.interpreting()
    kind, ch = align_plan(p, programs, chunk, sort)
    if kind == "programs":
        grid = triton.cdiv(p, ch)
        _align_programs_kernel[(grid,)](
            ids, n_valid if n_valid is not None else ids, slot_of_expert if slot_of_expert is not None else ids,
            sorted_pairs, block_slot, num_blocks, valid, p, mb, triton.cdiv(mb, grid),
            phase_of_expert if phase_of_expert is not None else ids, block_phase if block_phase is not None else block_slot,
            E=num_experts, NB=nb, TOPK=topk, BM=block_m, HAS_NVALID=n_valid is not None,
            HAS_SLOT=slot_of_expert is not None, HAS_PHASE=phase_of_expert is not None, CH=ch, C=64 if nb <= 128 else 32,
            SORT=sort, num_warps=8 if ch >= 512 else 4, **runtime.pdl_launch(),
        )
        return Routing(sorted_pairs, block_slot, num_blocks, valid, mb, p, block_phase)
    _align_kernel[(1,)](
        ids, n_valid if n_valid is not None else ids, slot_of_expert if slot_of_expert is not None else ids,
        sorted_pairs, block_slot, num_blocks, valid, p, mb,
        phase_of_expert if phase_of_expert is not None else ids, block_phase if block_phase is not None else block_slot,
        E=num_experts, NB=nb, TOPK=topk, BM=block_m, HAS_NVALID=n_valid is not None,
        HAS_SLOT=slot_of_expert is not None, HAS_PHASE=phase_of_expert is not None, CH=ch, C=64 if nb <= 128 else 32,
        PAD_C=1024, SORT=sort, num_warps=8 if ch >= 512 else 4, **runtime.pdl_launch(),
    )
    return Routing(sorted_pairs, block_slot, num_blocks, valid, mb, p, block_phase)


def align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    phase_of_expert: torch.Tensor | None = None,
) -> Routing:
    """Group the pairs by expert without a host sync (CUDA-graph safe: every shape is static). Torch ops: the
    reference of `align_fused`.

    Pairs of rows >= n_valid (padding rows of a bucketed forward) and ids outside [0, num_experts) are
    dropped: they compute nothing and the combine step gives their rows zeros. `phase_of_expert` (int8 [E]: 0 resident,
    g >= 1 copy group g, < 0 group 1; `moe_forward`): each block's group in `block_phase` (unused blocks 0).
    """
    t, topk = topk_ids.shape
    p = t * topk
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    if n_valid is not None:
        row = torch.arange(p, device=dev) // topk
        valid = valid & (row < n_valid.reshape(()).to(torch.int64))
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    pair_start = torch.cumsum(counts, 0) - counts
    sorted_key, order = torch.sort(key, stable=True)
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(p, device=dev) - pair_start[e]
    mb = max_blocks(p, num_experts, block_m)
    dest = torch.where(sorted_key < num_experts, block_start[e] * block_m + rank, torch.full_like(rank, mb * block_m))
    sorted_pairs = torch.full((mb * block_m + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    b = torch.arange(mb, device=dev)
    block_expert = torch.searchsorted(block_end, b, right=True)
    num_blocks = block_end[-1:]
    used = b < num_blocks
    block_expert = block_expert.clamp(max=num_experts - 1)
    slot = block_expert if slot_of_expert is None else slot_of_expert.to(torch.int64)[block_expert]
    block_slot = torch.where(used, slot, torch.full_like(slot, -1)).to(torch.int32)
    phase = None
    if phase_of_expert is not None:
        ph = phase_of_expert.to(dev).to(torch.int64)[block_expert]
        phase = torch.where(used, torch.where(ph < 0, torch.ones_like(ph), ph), torch.zeros_like(ph)).to(torch.int8)
    return Routing(sorted_pairs[:-1], block_slot, num_blocks.to(torch.int32), valid, mb, p, phase)


# ---- the kernels ----------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _fp4_scales(s_ptr, rows, row_ok, stride_sn, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
        """The E8M0 scale bytes [BN, BK/32] of the K step at k0 (masked past K: a load ahead of the last step reads
        nothing). WORDS: read as 32-bit words, 4 scale bytes each (BLOCK_K >= 128, rows 4-byte aligned: the launcher
        checks), which Triton can stream ahead through cp.async as it does the weights (a byte a thread is too narrow
        for it); a row's last word may run past its K // 32 bytes, and those bytes read as 0."""
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        if WORDS:
            BN: tl.constexpr = rows.shape[0]
            kw = k0 // 128 + tl.arange(0, BLOCK_K // 128)
            q = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_sn // 4) + kw[None, :],
                        mask=row_ok[:, None] & (kw < (K // 32 + 3) // 4)[None, :], other=0)
            b = tl.reshape((q[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF, (BN, BLOCK_K // 32))
            return tl.where((kg < K // 32)[None, :], b, 0).to(tl.uint8)
        return tl.load(s_ptr + rows[:, None] * stride_sn + kg[None, :], mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0)

    @triton.jit
    def _fp4_tiles(w_ptr, s_raw, rows, row_ok, stride_wn, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                   DECODE: tl.constexpr, EMULATE: tl.constexpr, A_LOAD: tl.constexpr):
        """Packed rows [BN, BK/2] -> (even-K, odd-K) bf16 tiles [BN, BK/2] (low nibble = even index), scaled, or (JOIN)
        one [BN, BK] tile in K order (returned twice). One load of the packed bytes; s_raw: the step's scale bytes
        (`_fp4_scales`, one per 32 values).
        Every decode gives exact bf16 values (an E2M1 value times a power of two; decodes 1 and 3 for scale bytes
        <= FAST_DECODE_MAX_SCALE)."""
        BN: tl.constexpr = rows.shape[0]
        JOIN: tl.constexpr = A_LOAD >= 2  # (A_WARPS_K*: the K-order tile too)
        if DECODE == 4:
            w = _fp4_words(w_ptr, s_raw, rows, row_ok, stride_wn, k0, K, BLOCK_K, EMULATE)
            return w, w
        if DECODE == 5 or DECODE == 6:
            w = _fp4_pair_words(w_ptr, s_raw, rows, row_ok, stride_wn, k0, K, BLOCK_K, EMULATE, DECODE == 6)
            return w, w
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ok = row_ok[:, None] & (kh < K // 2)[None, :]
        p = tl.load(w_ptr + rows[:, None] * stride_wn + kh[None, :], mask=ok, other=0).to(tl.int32)
        s = s_raw.to(tl.int32)
        if DECODE == 3:
            # bf16 bits straight from the byte, both nibbles at once, in one 32-bit word (odd-K value << 16 | even-K
            # value): each nibble's magnitude bits go under the bf16 exponent's two low bits + the top mantissa bit (code
            # 1 becomes the bf16 subnormal 2^-127), its sign to bit 15 of its half. p * (2^6 + 2^18) places both
            # magnitudes, p * (2^12 + 2^24) both signs (the shifted copies share no bits: no carries). Then one bf16x2
            # multiply of the word by 2^(s-1) (a power of two: the products are exact, nothing rounds).
            q = p.to(tl.uint32)
            pair = ((q * 0x00040040) & 0x01C001C0) | ((q * 0x01001000) & 0x80008000)
            e = (tl.minimum(s, 128) + 126).to(tl.uint32)  # 128: FAST_DECODE_MAX_SCALE
            pair = _bf16x2_scale(pair, tl.reshape(tl.broadcast_to(e[:, :, None], (BN, BLOCK_K // 32, 16)), (BN, BLOCK_K // 2)), EMULATE)
            wlo = pair.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            whi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            if JOIN:
                w = tl.reshape(tl.join(wlo, whi), (BN, BLOCK_K))
                return w, w
            else:
                return wlo, whi
        else:
            if DECODE == 0:
                # exact: E2M1 magnitude from its bits, code 1 (0.5) by a select; scale 2^(s-127) (s = 0 reads as 0)
                scale = (s << 23).to(tl.float32, bitcast=True)
                lo = p & 15
                hi = p >> 4
                ulo = lo & 7
                uhi = hi & 7
                mlo = tl.where(ulo < 2, ulo.to(tl.float32) * 0.5, ((ulo << 22) + (126 << 23)).to(tl.float32, bitcast=True))
                mhi = tl.where(uhi < 2, uhi.to(tl.float32) * 0.5, ((uhi << 22) + (126 << 23)).to(tl.float32, bitcast=True))
                vlo = tl.where(lo >= 8, -mlo, mlo)
                vhi = tl.where(hi >= 8, -mhi, mhi)
            else:
                # E2M1 bits placed straight into a float32 (code 1 becomes the subnormal 2^-127), rescaled by 2^(s-1)
                scale = ((tl.minimum(s, 128) + 126) << 23).to(tl.float32, bitcast=True)  # 128: FAST_DECODE_MAX_SCALE
                vlo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True)
                vhi = (((p & 0x70) << 18) | ((p & 0x80) << 24)).to(tl.float32, bitcast=True)
            # exact: E2M1 values times powers of two
            if JOIN:  # interleaved into K order first, then scaled: the MMA's (k, k+1) register pairs stay together
                sc = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BLOCK_K // 32, 32)), (BN, BLOCK_K))
                w = (tl.reshape(tl.join(vlo, vhi), (BN, BLOCK_K)) * sc).to(tl.bfloat16)
                return w, w
            else:
                sc = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BLOCK_K // 32, 16)), (BN, BLOCK_K // 2))
                return (vlo * sc).to(tl.bfloat16), (vhi * sc).to(tl.bfloat16)

    @triton.jit
    def _fp4_words(w_ptr, s_raw, rows, row_ok, stride_wn, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                   EMULATE: tl.constexpr):
        """Decode 4: packed rows read as 32-bit words (8 values, value j of the word in nibble j) -> one [BN, BK] bf16
        tile in K order. Per word: 4 bf16x2 pairs (nibble j, nibble j + 4), each from two shifts and two masks
        (magnitude bits under the bf16 exponent's two low bits + the top mantissa bit, sign to bit 15 of its half)
        and one bf16x2 multiply by 2^(s-1); the 8 halves come out as separate bf16 values, joined back in K order.
        Exact like decode 3 (scale bytes <= FAST_DECODE_MAX_SCALE); the launcher checks the 4-byte alignment."""
        BN: tl.constexpr = rows.shape[0]
        BW: tl.constexpr = BLOCK_K // 8
        kw = k0 // 8 + tl.arange(0, BW)
        words = w_ptr.to(tl.pointer_type(tl.uint32))
        q = tl.load(words + rows[:, None] * (stride_wn // 4) + kw[None, :], mask=row_ok[:, None] & (kw < K // 8)[None, :], other=0)
        s = s_raw.to(tl.int32)
        e = (tl.minimum(s, 128) + 126).to(tl.uint32)  # 2^(s-1) as a biased exponent; 128: FAST_DECODE_MAX_SCALE
        e = tl.reshape(tl.broadcast_to(e[:, :, None], (BN, BLOCK_K // 32, 4)), (BN, BW))  # 4 words per scale group
        if EMULATE:  # Triton's interpreter cannot run PTX: the same pair words, scaled by decode 3's exact emulation
            p0 = _bf16x2_scale(((q << 6) & 0x01C001C0) | ((q << 12) & 0x80008000), e, True)
            p1 = _bf16x2_scale(((q << 2) & 0x01C001C0) | ((q << 8) & 0x80008000), e, True)
            p2 = _bf16x2_scale(((q >> 2) & 0x01C001C0) | ((q << 4) & 0x80008000), e, True)
            p3 = _bf16x2_scale(((q >> 6) & 0x01C001C0) | (q & 0x80008000), e, True)
            v0, v4 = _bf16_halves(p0)
            v1, v5 = _bf16_halves(p1)
            v2, v6 = _bf16_halves(p2)
            v3, v7 = _bf16_halves(p3)
        else:
            # pair j = (nibble j, nibble j + 4): magnitudes to bits 6-8 / 22-24, signs to bits 15 / 31 of one word
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                """{
                .reg .b32 m, g, p, z, c;
                mov.b32 z, 0x80008000;
                shl.b32 c, $9, 16;
                or.b32 c, c, $9;
                shl.b32 c, c, 7;
                shl.b32 m, $8, 6; and.b32 m, m, 0x01C001C0; shl.b32 g, $8, 12; and.b32 g, g, 0x80008000;
                or.b32 p, m, g; fma.rn.bf16x2 p, p, c, z; mov.b32 {$0, $4}, p;
                shl.b32 m, $8, 2; and.b32 m, m, 0x01C001C0; shl.b32 g, $8, 8; and.b32 g, g, 0x80008000;
                or.b32 p, m, g; fma.rn.bf16x2 p, p, c, z; mov.b32 {$1, $5}, p;
                shr.b32 m, $8, 2; and.b32 m, m, 0x01C001C0; shl.b32 g, $8, 4; and.b32 g, g, 0x80008000;
                or.b32 p, m, g; fma.rn.bf16x2 p, p, c, z; mov.b32 {$2, $6}, p;
                shr.b32 m, $8, 6; and.b32 m, m, 0x01C001C0; and.b32 g, $8, 0x80008000;
                or.b32 p, m, g; fma.rn.bf16x2 p, p, c, z; mov.b32 {$3, $7}, p;
                }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [q, e],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
            )
        return _k_order(v0, v1, v2, v3, v4, v5, v6, v7, BN, BLOCK_K)

    @triton.jit
    def _fp4_pair_words(w_ptr, s_raw, rows, row_ok, stride_wn, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                        EMULATE: tl.constexpr, EXACT: tl.constexpr):
        """Decode 5: weights stored as pair words (pdflash_kernels/mxfp4.py `to_pair_words`), read as 32-bit words (8 values
        each) -> one [BN, BK] bf16 tile in K order. Per word: pair j = (values 2j, 2j + 1) is one rotation and one AND of
        the word (two of each for the last pair), then one bf16x2 multiply by 2^(s-1): 9 integer instructions and 4
        multiplies for 8 values, and each result register is already an MMA register pair (k, k + 1). Exact for scale
        bytes <= FAST_DECODE_MAX_SCALE, and it does not clamp larger ones (they give garbage: moe_forward runs decode 6 on
        weights that have any, `resolve_decodes`); the launcher checks the 4-byte alignment.
        EXACT (decode 6): two multiplies a pair, by 2^126 (the E2M1 values) and then by 2^(s-127) (a bf16 power of two
        for scale bytes 1..254; 0 reads as 0, as decode 0): exact for every scale the weights may have."""
        BN: tl.constexpr = rows.shape[0]
        BW: tl.constexpr = BLOCK_K // 8
        kw = k0 // 8 + tl.arange(0, BW)
        words = w_ptr.to(tl.pointer_type(tl.uint32))
        q = tl.load(words + rows[:, None] * (stride_wn // 4) + kw[None, :], mask=row_ok[:, None] & (kw < K // 8)[None, :], other=0)
        if EXACT:
            e = s_raw.to(tl.uint32)  # 2^(s-127): the scale byte is the biased exponent
        else:  # 2^(s-1) as a biased exponent; no clamp: resolve_decodes gives weights with scale bytes > 128 decode 6
            e = s_raw.to(tl.uint32) + 126
        if EMULATE:  # Triton's interpreter cannot run PTX: the same rotations and masks, scaled by the exact emulation
            e = tl.reshape(tl.broadcast_to(e[:, :, None], (BN, BLOCK_K // 32, 4)), (BN, BW))
            p0 = q & 0x81C081C0
            p1 = ((q << 4) | (q >> 28)) & 0x81C081C0
            p2 = ((q << 10) | (q >> 22)) & 0x81C081C0
            p3 = (((q << 6) | (q >> 26)) & 0x80C080C0) | (((q << 14) | (q >> 18)) & 0x01000100)
            if EXACT:
                p0 = _bf16x2_scale(p0, tl.full(p0.shape, 253, tl.uint32), True)
                p1 = _bf16x2_scale(p1, tl.full(p1.shape, 253, tl.uint32), True)
                p2 = _bf16x2_scale(p2, tl.full(p2.shape, 253, tl.uint32), True)
                p3 = _bf16x2_scale(p3, tl.full(p3.shape, 253, tl.uint32), True)
            p0 = _bf16x2_scale(p0, e, True)
            p1 = _bf16x2_scale(p1, e, True)
            p2 = _bf16x2_scale(p2, e, True)
            p3 = _bf16x2_scale(p3, e, True)
            v0, v1 = _bf16_halves(p0)
            v2, v3 = _bf16_halves(p1)
            v4, v5 = _bf16_halves(p2)
            v6, v7 = _bf16_halves(p3)
        elif EXACT:
            c = e * 0x00800080  # the bf16x2 multiplier 2^(s-127) in both halves, once per scale group
            c = tl.reshape(tl.broadcast_to(c[:, :, None], (BN, BLOCK_K // 32, 4)), (BN, BW))
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                """{
                .reg .b32 r, t, u, z, h;
                mov.b32 z, 0x80008000;
                mov.b32 h, 0x7E807E80;
                and.b32 r, $8, 0x81C081C0; fma.rn.bf16x2 r, r, h, z; fma.rn.bf16x2 r, r, $9, z; mov.b32 {$0, $1}, r;
                shf.l.wrap.b32 t, $8, $8, 4; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, h, z; fma.rn.bf16x2 r, r, $9, z;
                mov.b32 {$2, $3}, r;
                shf.l.wrap.b32 t, $8, $8, 10; and.b32 r, t, 0x81C081C0; fma.rn.bf16x2 r, r, h, z; fma.rn.bf16x2 r, r, $9, z;
                mov.b32 {$4, $5}, r;
                shf.l.wrap.b32 t, $8, $8, 6; and.b32 r, t, 0x80C080C0; shf.l.wrap.b32 u, $8, $8, 14; and.b32 u, u, 0x01000100;
                or.b32 r, r, u; fma.rn.bf16x2 r, r, h, z; fma.rn.bf16x2 r, r, $9, z; mov.b32 {$6, $7}, r;
                }""",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [q, c],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
            )
        else:
            c = e * 0x00800080  # the bf16x2 multiplier 2^(s-1) in both halves, once per scale group
            c = tl.reshape(tl.broadcast_to(c[:, :, None], (BN, BLOCK_K // 32, 4)), (BN, BW))
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                PAIR_WORD_ASM,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [q, c],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
            )
        return _k_order(v0, v1, v2, v3, v4, v5, v6, v7, BN, BLOCK_K)

    @triton.jit
    def _k_order(v0, v1, v2, v3, v4, v5, v6, v7, BN: tl.constexpr, BLOCK_K: tl.constexpr):
        """Eight [BN, BK/8] tiles (value j of each 32-bit word) -> one [BN, BK] tile in K order."""
        # join puts its operands on a new LAST dimension: the innermost join picks the highest bit of the K offset
        w = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        return tl.reshape(w, (BN, BLOCK_K))

    @triton.jit
    def _bf16_halves(pair):
        """A 32-bit word of two bf16 values (hi << 16 | lo) -> (lo, hi) as bf16 tensors."""
        return pair.to(tl.uint16).to(tl.bfloat16, bitcast=True), (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _bf16x2_scale(pair, e, EMULATE: tl.constexpr):
        """Two bf16 values in one 32-bit word (hi << 16 | lo) times 2^(e-127) each (e: a biased exponent, 1..254), as
        one bf16x2 multiply (an fma with a -0 addend: x * y exactly, signs and subnormals kept). EMULATE: the same
        products in fp32 (exact) for Triton's interpreter, which cannot run PTX."""
        if EMULATE:
            sc = (e << 23).to(tl.float32, bitcast=True)
            lo = ((pair << 16).to(tl.float32, bitcast=True) * sc).to(tl.uint32, bitcast=True) >> 16
            hi = ((pair & 0xFFFF0000).to(tl.float32, bitcast=True) * sc).to(tl.uint32, bitcast=True) & 0xFFFF0000
            return hi | lo
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
                "=r,r,r", [pair, (e << 7) | (e << 23)], dtype=tl.uint32, is_pure=True, pack=1,
            )

    @triton.jit
    def _prefetch_scale_rows(s_ptr, rows, row_ok, stride_sn, K_LO, SPAN: tl.constexpr, K: tl.constexpr):
        """prefetch.global.L1 of the scale bytes rows x [K_LO / 32, (K_LO + SPAN) / 32): one per 128-byte line and the
        range's last byte. The K loop's scale loads (a byte or a word a thread, too narrow for cp.async) then hit L1
        instead of waiting on HBM at each new sector; the weights and activations stream through cp.async past L1."""
        NBYTES: tl.constexpr = (SPAN if SPAN < K else K) // 32
        LINES: tl.constexpr = NBYTES // 128 + 2
        NL: tl.constexpr = 2 if LINES <= 2 else 4 if LINES <= 4 else 8 if LINES <= 8 else 16 if LINES <= 16 else 32
        off = tl.minimum(tl.arange(0, NL) * 128, NBYTES - 1)
        safe = tl.where(row_ok, rows, 0)  # (a masked row's address may lie past the tensor)
        ptrs = s_ptr + safe[:, None].to(tl.int64) * stride_sn + (K_LO // 32 + off)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _gemm_rows(
        acc0, acc1,
        a_ptr, a_rows, a_ok, stride_am,
        w_ptr, s_ptr, stride_wn, stride_sn,
        rows0, rows1, n_ok,
        K: tl.constexpr, K_LO, SPAN: tl.constexpr,
        FP4: tl.constexpr, TWO: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
        A_LOAD: tl.constexpr, SWAP: tl.constexpr, S_AHEAD: tl.constexpr, S_WORDS: tl.constexpr, LOOP_STAGES: tl.constexpr,
    ):
        """acc += a[a_rows, k] @ w[rows, k]^T over k in [K_LO, K_LO + SPAN) (clipped to K: one split of K, `split_k`;
        one split: K_LO 0, SPAN K) for one (TWO: two) weight row sets, K in fixed order. SWAP: the weight tile is the
        MMA's M side, acc^T += w @ a^T (accumulators [BN, BM]).
        S_AHEAD (FP4 decodes 0/1/3/4): the next K step's scale bytes are loaded at the top of each step, into registers
        carried by the loop. Triton's pipeliner streams the packed weights and the activations into shared memory
        ahead (cp.async), but not the scales (BK/32 bytes a row: too narrow for cp.async), so without S_AHEAD every K
        step waits for one HBM round trip of its scales. The values are the same either way: only when the load is
        issued changes. (Two steps ahead, carried through two registers sets, made Triton 3.6 drop its cp.async
        pipeline for the whole loop on sm_90: not offered.) S_WORDS (FP4, BLOCK_K >= 128): the scales read as 32-bit
        words, and the loop pipelined with LOOP_STAGES stages for every load (`tl.range(num_stages=)`, which also
        streams loads that feed no dot): the scales then stream ahead through cp.async as deep as the weights.
        LOOP_STAGES None: the launch's num_stages, for the loads that feed the dots.
        (Written out dot by dot: every nested jit call costs milliseconds under Triton's interpreter.)"""
        BM: tl.constexpr = a_rows.shape[0]
        BN: tl.constexpr = rows0.shape[0]
        AHEAD: tl.constexpr = S_AHEAD == 1 and FP4 and DECODE != 2
        WORDS: tl.constexpr = S_WORDS and FP4 and DECODE != 2
        # A_WARPS_K / A_WARPS_K2: each step's K cut into WK ranges, a batched dot per step into [WK, BM, BN]
        # accumulators ([WK, BN, BM] with SWAP), summed over the ranges after the loop
        WK: tl.constexpr = 4 if A_LOAD == 3 else 2 if A_LOAD == 4 else 1
        if WK > 1:
            if SWAP:
                acc3 = tl.zeros((WK, BN, BM), dtype=tl.float32)
                acc3b = tl.zeros((WK, BN, BM), dtype=tl.float32)
            else:
                acc3 = tl.zeros((WK, BM, BN), dtype=tl.float32)
                acc3b = tl.zeros((WK, BM, BN), dtype=tl.float32)
        if S_AHEAD == 2 and FP4 and DECODE != 2 and not F32DOT:  # (a hint: the interpreter, which runs no PTX, skips it)
            _prefetch_scale_rows(s_ptr, rows0, n_ok, stride_sn, K_LO, SPAN, K)
            if TWO:
                _prefetch_scale_rows(s_ptr, rows1, n_ok, stride_sn, K_LO, SPAN, K)
        if AHEAD:
            sa_next = _fp4_scales(s_ptr, rows0, n_ok, stride_sn, K_LO, K, BLOCK_K, WORDS)
            if TWO:
                sb_next = _fp4_scales(s_ptr, rows1, n_ok, stride_sn, K_LO, K, BLOCK_K, WORDS)
        for k_in in tl.range(0, SPAN, BLOCK_K, num_stages=LOOP_STAGES):  # (a fixed trip count: SPAN / BLOCK_K steps)
            k0 = K_LO + k_in
            if FP4 and DECODE != 2:
                if AHEAD:
                    sa = sa_next
                    sa_next = _fp4_scales(s_ptr, rows0, n_ok, stride_sn, k0 + BLOCK_K, K, BLOCK_K, WORDS)
                    if TWO:
                        sb = sb_next
                        sb_next = _fp4_scales(s_ptr, rows1, n_ok, stride_sn, k0 + BLOCK_K, K, BLOCK_K, WORDS)
                else:
                    sa = _fp4_scales(s_ptr, rows0, n_ok, stride_sn, k0, K, BLOCK_K, WORDS)
                    if TWO:
                        sb = _fp4_scales(s_ptr, rows1, n_ok, stride_sn, k0, K, BLOCK_K, WORDS)
                if A_LOAD == 0:
                    # two stride-2 gathers: the even and the odd K columns of the activations
                    kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    kh_ok = kh < K // 2
                    ke = 2 * kh
                    a0 = tl.load(a_ptr + a_rows[:, None] * stride_am + ke[None, :], mask=a_ok[:, None] & kh_ok[None, :], other=0.0)
                    a1 = tl.load(a_ptr + a_rows[:, None] * stride_am + (ke + 1)[None, :], mask=a_ok[:, None] & kh_ok[None, :], other=0.0)
                else:
                    # one contiguous [BM, BK] tile
                    kk = k0 + tl.arange(0, BLOCK_K)
                    a0 = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=a_ok[:, None] & (kk < K)[None, :], other=0.0)
                    a1 = a0
                    if A_LOAD == 1:  # split into its even and odd columns in registers
                        a0, a1 = tl.split(tl.reshape(a0, (BM, BLOCK_K // 2, 2)))
                if F32DOT:  # Triton's interpreter: its bf16 dot is unreliable; the operands are exact in fp32
                    a0 = a0.to(tl.float32)
                    a1 = a1.to(tl.float32)
                if SWAP:
                    a0 = tl.trans(a0)
                    a1 = tl.trans(a1)
                # A_JOIN: the decoded halves come interleaved back into K order, one [BN, BK] tile (w0 = w1): one dot
                w0, w1 = _fp4_tiles(w_ptr, sa, rows0, n_ok, stride_wn, k0, K, BLOCK_K, DECODE, F32DOT, A_LOAD)
                if F32DOT:
                    w0 = w0.to(tl.float32)
                    w1 = w1.to(tl.float32)
                if WK > 1 and SWAP:  # [WK, BN, BK/WK] x [WK, BK/WK, BM] (a0 is [BK, BM] here)
                    a3 = tl.reshape(a0, (WK, BLOCK_K // WK, BM))
                    acc3 += tl.dot(tl.permute(tl.reshape(w0, (BN, WK, BLOCK_K // WK)), (1, 0, 2)), a3)
                elif WK > 1:  # [WK, BM, BK/WK] x [WK, BK/WK, BN]: range r of the step's K, batch r
                    a3 = tl.permute(tl.reshape(a0, (BM, WK, BLOCK_K // WK)), (1, 0, 2))
                    acc3 += tl.dot(a3, tl.permute(tl.reshape(w0, (BN, WK, BLOCK_K // WK)), (1, 2, 0)))
                elif SWAP:
                    acc0 += tl.dot(w0, a0)
                    if A_LOAD < 2:
                        acc0 += tl.dot(w1, a1)
                else:
                    acc0 += tl.dot(a0, tl.trans(w0))
                    if A_LOAD < 2:
                        acc0 += tl.dot(a1, tl.trans(w1))
                if TWO:
                    v0, v1 = _fp4_tiles(w_ptr, sb, rows1, n_ok, stride_wn, k0, K, BLOCK_K, DECODE, F32DOT, A_LOAD)
                    if F32DOT:
                        v0 = v0.to(tl.float32)
                        v1 = v1.to(tl.float32)
                    if WK > 1 and SWAP:
                        acc3b += tl.dot(tl.permute(tl.reshape(v0, (BN, WK, BLOCK_K // WK)), (1, 0, 2)), a3)
                    elif WK > 1:
                        acc3b += tl.dot(a3, tl.permute(tl.reshape(v0, (BN, WK, BLOCK_K // WK)), (1, 2, 0)))
                    elif SWAP:
                        acc1 += tl.dot(v0, a0)
                        if A_LOAD < 2:
                            acc1 += tl.dot(v1, a1)
                    else:
                        acc1 += tl.dot(a0, tl.trans(v0))
                        if A_LOAD < 2:
                            acc1 += tl.dot(a1, tl.trans(v1))
            elif FP4:
                # Triton's own MXFP4 path (GPU only): it upcasts the packed weights itself
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                p0 = tl.load(w_ptr + rows0[:, None] * stride_wn + kh[None, :], mask=n_ok[:, None] & (kh < K // 2)[None, :], other=0)
                s0 = tl.load(s_ptr + rows0[:, None] * stride_sn + kg[None, :], mask=n_ok[:, None] & (kg < K // 32)[None, :], other=0)
                if SWAP:
                    acc0 += tl.dot_scaled(p0, s0, "e2m1", tl.trans(a), None, "bf16")
                else:
                    acc0 += tl.dot_scaled(a, None, "bf16", tl.trans(p0), s0, "e2m1")
                if TWO:
                    p1 = tl.load(w_ptr + rows1[:, None] * stride_wn + kh[None, :], mask=n_ok[:, None] & (kh < K // 2)[None, :], other=0)
                    s1 = tl.load(s_ptr + rows1[:, None] * stride_sn + kg[None, :], mask=n_ok[:, None] & (kg < K // 32)[None, :], other=0)
                    if SWAP:
                        acc1 += tl.dot_scaled(p1, s1, "e2m1", tl.trans(a), None, "bf16")
                    else:
                        acc1 += tl.dot_scaled(a, None, "bf16", tl.trans(p1), s1, "e2m1")
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
                w0 = tl.load(w_ptr + rows0[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if F32DOT:
                    a = a.to(tl.float32)
                    w0 = w0.to(tl.float32)
                if SWAP:
                    acc0 += tl.dot(w0, tl.trans(a))
                else:
                    acc0 += tl.dot(a, tl.trans(w0))
                if TWO:
                    w1 = tl.load(w_ptr + rows1[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    if F32DOT:
                        w1 = w1.to(tl.float32)
                    if SWAP:
                        acc1 += tl.dot(w1, tl.trans(a))
                    else:
                        acc1 += tl.dot(a, tl.trans(w1))
        if WK > 1:  # the K ranges' sums (tl.sum: an order fixed by the shapes and layout, the same for every call)
            acc0 += tl.sum(acc3, axis=0)
            if TWO:
                acc1 += tl.sum(acc3b, axis=0)
        return acc0, acc1

    @triton.jit
    def _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M: tl.constexpr):
        """The routing block a program computes: its expert's slot, its rows of the sorted pairs, which are real."""
        slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs_ptr + rm)
        return slot, rm, pairs, pairs < P

    @triton.jit
    def _block_live(block_phase_ptr, pid_m, nb, PHASE: tl.constexpr):
        """Whether routing block pid_m runs in this launch: a routed block (< nb) of the launch's phase (0: every block;
        p >= 1: the blocks of copy group p - 1, group 0 the experts resident before the call, `moe_forward`)."""
        live = pid_m < nb
        if PHASE != 0:
            live = live & (tl.load(block_phase_ptr + pid_m) == PHASE - 1)
        return live

    @triton.jit
    def _sum_splits(ws_ptr, R, rm, cols, C: tl.constexpr, mask, SPLIT: tl.constexpr):
        """The split partials of rows rm (of R), columns cols (of C) in `ws` [SPLIT, R, C] summed in split order from
        zero: the same bits whichever program (or the reduce launch) adds them."""
        total = tl.zeros((rm.shape[0], cols.shape[0]), dtype=tl.float32)
        for s in range(SPLIT):
            total += tl.load(ws_ptr + (s * R + rm)[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg")  # (from L2: other SMs wrote them)
        return total

    @triton.jit
    def _split_store(ws_ptr, R, pid_s, rm, cols, C: tl.constexpr, mask, acc):
        tl.store(ws_ptr + (pid_s * R + rm)[:, None].to(tl.int64) * C + cols[None, :], acc, mask=mask)

    @triton.jit
    def _split_arrive(cnt_ptr, tile, SPLIT: tl.constexpr):
        """Counts a split program in on its tile's counter (a semaphore, never a sum): True for the last one, which then
        adds the partials (and resets the counter for the next launch)."""
        tl.debug_barrier()  # every thread's partial stored before the count is released
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        return arrived == SPLIT - 1

    @triton.jit
    def _gemm1_epilogue(acc_g, acc_u, slot, rm, p_ok, j, j_ok, gate_rows, up_rows, h_ptr, stride_hm, b_ptr, stride_be,
                        alpha, limit, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, F32DOT: tl.constexpr):
        # the weights' dtype is bf16 (or decoded to bf16): round the projections as a bf16 matmul would
        g = to_bf16(acc_g, F32DOT).to(tl.float32)
        u = to_bf16(acc_u, F32DOT).to(tl.float32)
        if HAS_BIAS:
            bg = tl.load(b_ptr + slot * stride_be + gate_rows, mask=j_ok, other=0.0).to(tl.float32)
            bu = tl.load(b_ptr + slot * stride_be + up_rows, mask=j_ok, other=0.0).to(tl.float32)
            g = to_bf16(g + bg[None, :], F32DOT).to(tl.float32)
            u = to_bf16(u + bu[None, :], F32DOT).to(tl.float32)
        if ACT == 0:
            h = g / (1.0 + tl.exp(-g)) * u
        elif ACT == 2:  # up-only: relu(up)^2 (acc_g is the same row set's sums: unused)
            r = tl.maximum(u, 0.0)
            h = r * r
        else:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        tl.store(h_ptr + rm[:, None] * stride_hm + j[None, :], to_bf16(h, F32DOT), mask=p_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _gemm1_tile(
        pid_m, pid_n, pid_s,
        x_ptr, stride_xm, h_ptr, stride_hm, sorted_pairs_ptr, block_slot_ptr,
        w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be,
        P, alpha, limit, ws_ptr, cnt_ptr, R,
        I: tl.constexpr, K: tl.constexpr, UP_OFF: tl.constexpr, ROW_MUL: tl.constexpr,
        TOPK: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
        A_LOAD: tl.constexpr, SWAP: tl.constexpr, S_AHEAD: tl.constexpr, S_WORDS: tl.constexpr, LOOP_STAGES: tl.constexpr,
        SPLIT: tl.constexpr, SPAN: tl.constexpr, FIXUP: tl.constexpr,
    ):
        slot, rm, pairs, p_ok = _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M)
        tok = pairs // TOPK
        j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < I
        gate_rows = j * ROW_MUL
        up_rows = j * ROW_MUL + UP_OFF
        w_base = w_ptr + slot * stride_we
        s_base = s_ptr + slot * stride_se
        if SWAP:  # the weight tile is the MMA's M side: accumulators [BN, BM]
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ACT == 2:  # up-only experts: one row set (w1's I rows), as the down GEMM runs it
            acc_u, acc_g = _gemm_rows(
                acc_u, acc_g, x_ptr, tok, p_ok, stride_xm, w_base, s_base, stride_wn, stride_sn,
                up_rows, up_rows, j_ok, K, pid_s * SPAN, SPAN, FP4, False, BLOCK_K, DECODE, F32DOT, A_LOAD, SWAP, S_AHEAD,
                S_WORDS, LOOP_STAGES,
            )
        else:
            acc_g, acc_u = _gemm_rows(
                acc_g, acc_u, x_ptr, tok, p_ok, stride_xm, w_base, s_base, stride_wn, stride_sn,
                gate_rows, up_rows, j_ok, K, pid_s * SPAN, SPAN, FP4, True, BLOCK_K, DECODE, F32DOT, A_LOAD, SWAP, S_AHEAD,
                S_WORDS, LOOP_STAGES,
            )
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        if SPLIT == 1:
            _gemm1_epilogue(acc_g, acc_u, slot, rm, p_ok, j, j_ok, gate_rows, up_rows, h_ptr, stride_hm, b_ptr, stride_be,
                            alpha, limit, HAS_BIAS, ACT, F32DOT)
        else:  # this split's partial sums (gate columns j, up columns I + j) into ws; the tile's last program adds them
            mask = p_ok[:, None] & j_ok[None, :]
            _split_store(ws_ptr, R, pid_s, rm, j, 2 * I, mask, acc_g)
            _split_store(ws_ptr, R, pid_s, rm, I + j, 2 * I, mask, acc_u)
            if FIXUP:
                tile = pid_m * ((I + BLOCK_N - 1) // BLOCK_N) + pid_n
                if _split_arrive(cnt_ptr, tile, SPLIT):
                    g = _sum_splits(ws_ptr, R, rm, j, 2 * I, mask, SPLIT)
                    u = _sum_splits(ws_ptr, R, rm, I + j, 2 * I, mask, SPLIT)
                    _gemm1_epilogue(g, u, slot, rm, p_ok, j, j_ok, gate_rows, up_rows, h_ptr, stride_hm, b_ptr, stride_be,
                                    alpha, limit, HAS_BIAS, ACT, F32DOT)
                    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch

    @triton.jit
    def _split_tile(tile, N_TILES: tl.constexpr, SPLIT: tl.constexpr):
        """A flat tile index -> (m block, n tile, split): the splits of one (m, n) tile consecutive, then its n tiles."""
        if SPLIT == 1:
            return tile // N_TILES, tile % N_TILES, 0
        else:
            return tile // (N_TILES * SPLIT), (tile // SPLIT) % N_TILES, tile % SPLIT

    @triton.jit
    def _grid_tile(N_TILES: tl.constexpr, SPLIT: tl.constexpr, RASTER: tl.constexpr):
        """This program's (m block, n tile, split) on a launch grid of one program a tile: RASTER 0, a 2-D grid (m
        blocks, n tiles) with the splits on a third axis; else a 1-D grid in `_split_tile`'s order."""
        if RASTER == 0:
            return tl.program_id(0), tl.program_id(1), tl.program_id(2) if SPLIT > 1 else 0
        else:
            return _split_tile(tl.program_id(0), N_TILES, SPLIT)

    @triton.jit(do_not_specialize=["P", "R"])
    def _moe_gemm1(
        x_ptr, stride_xm,
        h_ptr, stride_hm,
        sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn,
        b_ptr, stride_be,
        P, alpha, limit,
        I: tl.constexpr, K: tl.constexpr, UP_OFF: tl.constexpr, ROW_MUL: tl.constexpr,
        TOPK: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
        A_LOAD: tl.constexpr, SWAP: tl.constexpr, RASTER: tl.constexpr, PERSIST: tl.constexpr, S_AHEAD: tl.constexpr = 0,
        S_WORDS: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None,
        ws_ptr=None, cnt_ptr=None, R=0, SPLIT: tl.constexpr = 1, SPAN: tl.constexpr = None, FIXUP: tl.constexpr = False,
        block_phase_ptr=None, PHASE: tl.constexpr = 0,
    ):
        """SPLIT > 1: each program sums one of SPLIT ranges of SPAN K values into ws [SPLIT, R, 2 I] (R: the routing
        blocks' rows); FIXUP: the tile's last program adds them in split order and runs the epilogue, else a second launch
        (`_moe_gemm1_reduce`) does, with the same bits."""
        runtime.pdl_begin()
        N_TILES: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
        KSPAN: tl.constexpr = K if SPLIT == 1 else SPAN
        nb = tl.load(num_blocks_ptr)
        if PERSIST:  # a fixed number of programs, each walking tiles (n tiles of one block consecutively)
            tile = tl.program_id(0)
            while tile < nb * N_TILES * SPLIT:
                pid_m, pid_n, pid_s = _split_tile(tile, N_TILES, SPLIT)
                if _block_live(block_phase_ptr, pid_m, nb, PHASE):
                    _gemm1_tile(
                        pid_m, pid_n, pid_s,
                        x_ptr, stride_xm, h_ptr, stride_hm, sorted_pairs_ptr, block_slot_ptr,
                        w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be, P, alpha, limit,
                        ws_ptr, cnt_ptr, R,
                        I, K, UP_OFF, ROW_MUL, TOPK, FP4, HAS_BIAS, ACT, BLOCK_M, BLOCK_N, BLOCK_K, DECODE, F32DOT, A_LOAD,
                        SWAP, S_AHEAD, S_WORDS, LOOP_STAGES, SPLIT, KSPAN, FIXUP,
                    )
                tile += tl.num_programs(0)
        else:
            pid_m, pid_n, pid_s = _grid_tile(N_TILES, SPLIT, RASTER)
            if _block_live(block_phase_ptr, pid_m, nb, PHASE):
                _gemm1_tile(
                    pid_m, pid_n, pid_s,
                    x_ptr, stride_xm, h_ptr, stride_hm, sorted_pairs_ptr, block_slot_ptr,
                    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be, P, alpha, limit,
                    ws_ptr, cnt_ptr, R,
                    I, K, UP_OFF, ROW_MUL, TOPK, FP4, HAS_BIAS, ACT, BLOCK_M, BLOCK_N, BLOCK_K, DECODE, F32DOT, A_LOAD, SWAP,
                    S_AHEAD, S_WORDS, LOOP_STAGES, SPLIT, KSPAN, FIXUP,
                )

    @triton.jit
    def _reduce_tile(sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, P, N: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, block_phase_ptr, PHASE: tl.constexpr):
        """A split GEMM's second launch, program (m block, n tile): whether the block is routed, its slot and rows, and
        the tile's columns of N."""
        pid_m = tl.program_id(0)
        slot, rm, pairs, p_ok = _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return _block_live(block_phase_ptr, pid_m, tl.load(num_blocks_ptr), PHASE), slot, rm, pairs, p_ok, cols, cols < N

    @triton.jit(do_not_specialize=["P", "R"])
    def _moe_gemm1_reduce(
        h_ptr, stride_hm, sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, b_ptr, stride_be, P, alpha, limit, ws_ptr, R,
        I: tl.constexpr, UP_OFF: tl.constexpr, ROW_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32DOT: tl.constexpr, SPLIT: tl.constexpr,
        block_phase_ptr=None, PHASE: tl.constexpr = 0,
    ):
        """The split gate/up GEMM's second launch: each (m block, n tile) adds its partials in split order and runs the
        epilogue (`_gemm1_tile`'s FIXUP arithmetic)."""
        runtime.pdl_begin()
        live, slot, rm, pairs, p_ok, j, j_ok = _reduce_tile(sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, P, I, BLOCK_M,
                                                            BLOCK_N, block_phase_ptr, PHASE)
        if live:
            mask = p_ok[:, None] & j_ok[None, :]
            g = _sum_splits(ws_ptr, R, rm, j, 2 * I, mask, SPLIT)
            u = _sum_splits(ws_ptr, R, rm, I + j, 2 * I, mask, SPLIT)
            _gemm1_epilogue(g, u, slot, rm, p_ok, j, j_ok, j * ROW_MUL, j * ROW_MUL + UP_OFF, h_ptr, stride_hm, b_ptr,
                            stride_be, alpha, limit, HAS_BIAS, ACT, F32DOT)

    @triton.jit
    def _combine_rows(y_ptr, stride_ym, valid_ptr, out_ptr, stride_om, tok, fin, n, n_ok, TOPK: tl.constexpr,
                      F32DOT: tl.constexpr):
        """out[tok] = its pairs' rows summed in slot order from zero (`_moe_combine`'s arithmetic), rows where `fin`."""
        acc = tl.zeros((tok.shape[0], n.shape[0]), dtype=tl.float32)
        for s in range(TOPK):
            pair = tok * TOPK + s
            v = tl.load(valid_ptr + pair, mask=fin, other=0)
            ok = fin & (v != 0)
            acc += tl.load(y_ptr + pair[:, None].to(tl.int64) * stride_ym + n[None, :], mask=ok[:, None] & n_ok[None, :],
                           other=0.0, cache_modifier=".cg")  # (from L2: other SMs wrote them)
        tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_om + n[None, :], to_out(acc, out_ptr, F32DOT),
                 mask=fin[:, None] & n_ok[None, :])

    @triton.jit
    def _zero_rows(valid_ptr, out_ptr, stride_om, pid_n, T, N: tl.constexpr, BLOCK_N: tl.constexpr, TOPK: tl.constexpr,
                   TOPK_PAD: tl.constexpr, F32DOT: tl.constexpr):
        """Zeros in n tile pid_n of the rows of tokens with no valid pair (no GEMM program finishes them), as the
        separate combine gives them."""
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, TOPK_PAD)
        t0 = T * 0
        while t0 < T:
            tok = t0 + tl.arange(0, 32)
            t_ok = tok < T
            vk = tl.load(valid_ptr + tok[:, None] * TOPK + ks[None, :], mask=t_ok[:, None] & (ks[None, :] < TOPK), other=0)
            none = t_ok & (tl.sum((vk != 0).to(tl.int32), axis=1) == 0)
            tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_om + n[None, :],
                     to_out(tl.zeros((32, BLOCK_N), dtype=tl.float32), out_ptr, F32DOT), mask=none[:, None] & (n < N)[None, :])
            t0 += 32

    @triton.jit
    def _gemm2_epilogue(acc, slot, pairs, p_ok, n, n_ok, y_ptr, stride_ym, rw_ptr, b_ptr, stride_be,
                        HAS_BIAS: tl.constexpr, F32DOT: tl.constexpr):
        y = to_bf16(acc, F32DOT).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + slot * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
            y = to_bf16(y + b[None, :], F32DOT).to(tl.float32)
        rw = tl.load(rw_ptr + pairs, mask=p_ok, other=0.0).to(tl.float32)
        y = y * rw[:, None]
        tl.store(y_ptr + pairs[:, None].to(tl.int64) * stride_ym + n[None, :], y, mask=p_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gemm2_tile(
        pid_m, pid_n, pid_s,
        h_ptr, stride_hm, y_ptr, stride_ym, sorted_pairs_ptr, block_slot_ptr, rw_ptr,
        w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be,
        P, out_ptr, cnt_ptr, valid_ptr, ws_ptr, scnt_ptr, R,
        N: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
        A_LOAD: tl.constexpr, SWAP: tl.constexpr, COMBINE: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
        S_AHEAD: tl.constexpr, S_WORDS: tl.constexpr, LOOP_STAGES: tl.constexpr,
        SPLIT: tl.constexpr, SPAN: tl.constexpr, FIXUP: tl.constexpr,
    ):
        # (COMBINE with SPLIT > 1: refused by launch_gemm2)
        slot, rm, pairs, p_ok = _block_pairs(sorted_pairs_ptr, block_slot_ptr, pid_m, P, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc, _unused = _gemm_rows(
            acc, acc, h_ptr, rm, p_ok, stride_hm, w_ptr + slot * stride_we, s_ptr + slot * stride_se,
            stride_wn, stride_sn, n, n, n_ok, K, pid_s * SPAN, SPAN, FP4, False, BLOCK_K, DECODE, F32DOT, A_LOAD, SWAP,
            S_AHEAD, S_WORDS, LOOP_STAGES,
        )
        if SWAP:
            acc = tl.trans(acc)
        if SPLIT == 1:
            _gemm2_epilogue(acc, slot, pairs, p_ok, n, n_ok, y_ptr, stride_ym, rw_ptr, b_ptr, stride_be, HAS_BIAS, F32DOT)
        else:  # this split's partial sums into ws (rows: the routing blocks' rows); the tile's last program adds them
            mask = p_ok[:, None] & n_ok[None, :]
            _split_store(ws_ptr, R, pid_s, rm, n, N, mask, acc)
            if FIXUP:
                tile = pid_m * ((N + BLOCK_N - 1) // BLOCK_N) + pid_n
                if _split_arrive(scnt_ptr, tile, SPLIT):
                    total = _sum_splits(ws_ptr, R, rm, n, N, mask, SPLIT)
                    _gemm2_epilogue(total, slot, pairs, p_ok, n, n_ok, y_ptr, stride_ym, rw_ptr, b_ptr, stride_be, HAS_BIAS,
                                    F32DOT)
                    tl.atomic_xchg(scnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        if COMBINE:  # the last program to store a pair of a token (in this n tile) sums the token's rows
            tok = pairs // TOPK
            ks = tl.arange(0, TOPK_PAD)
            vk = tl.load(valid_ptr + tok[:, None] * TOPK + ks[None, :], mask=p_ok[:, None] & (ks[None, :] < TOPK), other=0)
            need = tl.sum((vk != 0).to(tl.int32), axis=1)
            ctr = cnt_ptr + tok * ((N + BLOCK_N - 1) // BLOCK_N) + pid_n
            tl.debug_barrier()  # every thread's rows stored before the counts are released
            arrived = tl.atomic_add(ctr, 1, mask=p_ok, sem="acq_rel", scope="gpu")
            fin = p_ok & (arrived == need - 1)
            tl.debug_barrier()
            _combine_rows(y_ptr, stride_ym, valid_ptr, out_ptr, N, tok, fin, n, n_ok, TOPK, F32DOT)
            tl.atomic_xchg(ctr, 0, mask=fin, sem="relaxed", scope="gpu")  # ready for the next launch

    @triton.jit(do_not_specialize=["P", "R"])
    def _moe_gemm2(
        h_ptr, stride_hm,
        y_ptr, stride_ym,
        sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, rw_ptr,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn,
        b_ptr, stride_be,
        P, out_ptr, cnt_ptr, valid_ptr,
        N: tl.constexpr, K: tl.constexpr,
        FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, F32DOT: tl.constexpr,
        A_LOAD: tl.constexpr, SWAP: tl.constexpr, RASTER: tl.constexpr, PERSIST: tl.constexpr,
        COMBINE: tl.constexpr = False, TOPK: tl.constexpr = 1, TOPK_PAD: tl.constexpr = 1, S_AHEAD: tl.constexpr = 0,
        S_WORDS: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None,
        ws_ptr=None, scnt_ptr=None, R=0, SPLIT: tl.constexpr = 1, SPAN: tl.constexpr = None, FIXUP: tl.constexpr = False,
        block_phase_ptr=None, PHASE: tl.constexpr = 0,
    ):
        """SPLIT > 1: as `_moe_gemm1`'s (ws [SPLIT, R, N]; the second launch: `_moe_gemm2_reduce`)."""
        runtime.pdl_begin()
        N_TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        KSPAN: tl.constexpr = K if SPLIT == 1 else SPAN
        nb = tl.load(num_blocks_ptr)
        if PERSIST:
            tile = tl.program_id(0)
            while tile < nb * N_TILES * SPLIT:
                pid_m, pid_n, pid_s = _split_tile(tile, N_TILES, SPLIT)
                if _block_live(block_phase_ptr, pid_m, nb, PHASE):
                    _gemm2_tile(
                        pid_m, pid_n, pid_s,
                        h_ptr, stride_hm, y_ptr, stride_ym, sorted_pairs_ptr, block_slot_ptr, rw_ptr,
                        w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be, P, out_ptr, cnt_ptr,
                        valid_ptr, ws_ptr, scnt_ptr, R, N, K, FP4, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DECODE, F32DOT,
                        A_LOAD, SWAP, COMBINE, TOPK, TOPK_PAD, S_AHEAD, S_WORDS, LOOP_STAGES, SPLIT, KSPAN, FIXUP,
                    )
                tile += tl.num_programs(0)
            if COMBINE and PHASE <= 1:  # (the rows without a routed pair: once, in the first phase)
                zt = tl.program_id(0)
                while zt < N_TILES:
                    _zero_rows(valid_ptr, out_ptr, N, zt, P // TOPK, N, BLOCK_N, TOPK, TOPK_PAD, F32DOT)
                    zt += tl.num_programs(0)
        else:
            pid_m, pid_n, pid_s = _grid_tile(N_TILES, SPLIT, RASTER)
            if _block_live(block_phase_ptr, pid_m, nb, PHASE):
                _gemm2_tile(
                    pid_m, pid_n, pid_s,
                    h_ptr, stride_hm, y_ptr, stride_ym, sorted_pairs_ptr, block_slot_ptr, rw_ptr,
                    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr, stride_be, P, out_ptr, cnt_ptr,
                    valid_ptr, ws_ptr, scnt_ptr, R, N, K, FP4, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DECODE, F32DOT, A_LOAD,
                    SWAP, COMBINE, TOPK, TOPK_PAD, S_AHEAD, S_WORDS, LOOP_STAGES, SPLIT, KSPAN, FIXUP,
                )
            if COMBINE and PHASE <= 1:
                if pid_m == 0:  # (every grid has m block 0 of each n tile, routed pairs or not; once, in the first phase)
                    _zero_rows(valid_ptr, out_ptr, N, pid_n, P // TOPK, N, BLOCK_N, TOPK, TOPK_PAD, F32DOT)

    @triton.jit(do_not_specialize=["P", "R"])
    def _moe_gemm2_reduce(
        y_ptr, stride_ym, sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, rw_ptr, b_ptr, stride_be, P, ws_ptr, R,
        N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32DOT: tl.constexpr,
        SPLIT: tl.constexpr, block_phase_ptr=None, PHASE: tl.constexpr = 0,
    ):
        """The split down GEMM's second launch: each (m block, n tile) adds its partials in split order and runs the
        epilogue (`_gemm2_tile`'s FIXUP arithmetic)."""
        runtime.pdl_begin()
        live, slot, rm, pairs, p_ok, n, n_ok = _reduce_tile(sorted_pairs_ptr, block_slot_ptr, num_blocks_ptr, P, N, BLOCK_M,
                                                            BLOCK_N, block_phase_ptr, PHASE)
        if live:
            total = _sum_splits(ws_ptr, R, rm, n, N, p_ok[:, None] & n_ok[None, :], SPLIT)
            _gemm2_epilogue(total, slot, pairs, p_ok, n, n_ok, y_ptr, stride_ym, rw_ptr, b_ptr, stride_be, HAS_BIAS, F32DOT)

    @triton.jit
    def _fp4_decode_kernel(w_ptr, s_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, EMULATE: tl.constexpr,
                           A_LOAD: tl.constexpr):
        """The GEMMs' weight decode alone: packed rows -> bf16 rows (tests hold every decode to mxfp4.dequantize)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        k0 = tl.program_id(1) * BLOCK_K
        w_lo, w_hi = _fp4_tiles(w_ptr, _fp4_scales(s_ptr, rows, row_ok, stride_sn, k0, K, BLOCK_K, False), rows, row_ok, stride_wn, k0, K,
                                BLOCK_K, DECODE, EMULATE, A_LOAD)
        if A_LOAD == 2 or DECODE >= 4:
            kk = k0 + tl.arange(0, BLOCK_K)
            tl.store(out_ptr + rows[:, None] * stride_on + kk[None, :], w_lo, mask=row_ok[:, None] & (kk < K)[None, :])
        else:
            ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            ok = row_ok[:, None] & (ke < K)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_on + ke[None, :], w_lo, mask=ok)
            tl.store(out_ptr + rows[:, None] * stride_on + (ke + 1)[None, :], w_hi, mask=ok)

    @triton.jit
    def _moe_combine(y_ptr, valid_ptr, out_ptr, N: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        runtime.pdl_begin()
        tok = tl.program_id(0) + tl.zeros((1,), dtype=tl.int32)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        _combine_rows(y_ptr, N, valid_ptr, out_ptr, N, tok, tok >= 0, cols, cols < N, TOPK, EMULATE)


    @triton.jit
    def _pair_keys(ids_ptr, offs, P, nv, E: tl.constexpr, TOPK: tl.constexpr):
        """Pairs `offs`: in range, kept (an expert id of a real row), and the sort key (E for dropped pairs)."""
        ok = offs < P
        key = tl.load(ids_ptr + offs, mask=ok, other=E).to(tl.int32)
        valid = ok & (key >= 0) & (key < E) & (offs // TOPK < nv)
        return ok, valid, tl.where(valid, key, E)

    @triton.jit(do_not_specialize=["P", "MB"])  # one compiled form whatever the pair count (ALIGN_CHUNKS aside)
    def _align_kernel(
        ids_ptr, nvalid_ptr, slot_ptr, sorted_ptr, block_slot_ptr, num_blocks_ptr, valid_ptr,
        P, MB, phase_ptr, block_phase_ptr,
        E: tl.constexpr, NB: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
        HAS_NVALID: tl.constexpr, HAS_SLOT: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, PAD_C: tl.constexpr,
        HAS_PHASE: tl.constexpr = False, SORT: tl.constexpr = True,
    ):
        """`align` in one program: a stable counting sort of the pairs by expert into blocks of BM.

        CH pairs at a time. The counts are a histogram of the pairs' experts; a pair's row is its place in the chunk
        sorted by (expert, pair index), shifted by its expert's offset (the expert's next free row less the chunk's pairs
        of lower experts), so nothing here grows as pairs x experts. Up to CH pairs (a verify) take one pass over their
        ids; the expert -> slot and phase tables are read at the start, not after the counts (one memory round trip
        fewer on the program's path)."""
        runtime.pdl_begin()
        ci = tl.arange(0, CH)
        e_ok, slot_of, phase_of, nv = _align_tables(slot_ptr, phase_ptr, nvalid_ptr, P, E, NB, TOPK, HAS_SLOT, HAS_PHASE,
                                                    HAS_NVALID)
        # while-loops with runtime bounds: P varies with the token count (a range() over it would not run under
        # Triton's interpreter, and a constexpr P would compile once per prompt length)
        start = P * 0
        pi = tl.arange(0, PAD_C)
        while start < MB * BM:  # padding everywhere first
            offs = start + pi
            tl.store(sorted_ptr + offs, tl.zeros((PAD_C,), tl.int32) + P, mask=offs < MB * BM)
            start += PAD_C
        if P <= CH:  # one chunk: its keys stay in registers
            ok, valid, key = _pair_keys(ids_ptr, ci, P, nv, E, TOPK)
            tl.store(valid_ptr + ci, valid, mask=ok)
            counts = tl.histogram(tl.minimum(key, E - 1), NB, mask=valid)
            block_end, num_blocks, first_row = _align_blocks(counts, e_ok, num_blocks_ptr, BM)
            _align_scatter(sorted_ptr, key, ci, first_row, tl.cumsum(counts, axis=0) - counts, 0, E, CH, SORT)
        else:
            counts = tl.zeros((NB,), tl.int32)
            start = P * 0
            while start < P:
                offs = start + ci
                ok, valid, key = _pair_keys(ids_ptr, offs, P, nv, E, TOPK)
                tl.store(valid_ptr + offs, valid, mask=ok)
                counts += tl.histogram(tl.minimum(key, E - 1), NB, mask=valid)
                start += CH
            block_end, num_blocks, running = _align_blocks(counts, e_ok, num_blocks_ptr, BM)  # running: next free rows
            start = P * 0
            while start < P:
                ok, valid, key = _pair_keys(ids_ptr, start + ci, P, nv, E, TOPK)
                hist = tl.histogram(tl.minimum(key, E - 1), NB, mask=valid)
                _align_scatter(sorted_ptr, key, ci, running, tl.cumsum(hist, axis=0) - hist, start, E, CH, SORT)
                running += hist
                start += CH
        bstart = P * 0
        bi = tl.arange(0, C)
        while bstart < MB:
            b = bstart + bi
            _align_block_slots(b, b < MB, block_end, e_ok, num_blocks, slot_of, phase_of, block_slot_ptr,
                               block_phase_ptr, E, HAS_PHASE)
            bstart += C

    @triton.jit(do_not_specialize=["P", "MB", "BPP"])
    def _align_programs_kernel(
        ids_ptr, nvalid_ptr, slot_ptr, sorted_ptr, block_slot_ptr, num_blocks_ptr, valid_ptr,
        P, MB, BPP, phase_ptr, block_phase_ptr,
        E: tl.constexpr, NB: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
        HAS_NVALID: tl.constexpr, HAS_SLOT: tl.constexpr, CH: tl.constexpr, C: tl.constexpr,
        HAS_PHASE: tl.constexpr = False, SORT: tl.constexpr = True,
    ):
        """`_align_kernel`'s routing with a program a chunk of CH pairs (`align_fused(programs=True)`): the same rows.

        Every program counts all the pairs' experts (a histogram a chunk, as the one program's first pass) and so knows
        every expert's blocks and the pairs of its expert in the chunks before its own; it ranks and scatters only its
        own chunk (one sort of CH pairs, in parallel with the other programs' instead of one after another), writes its
        chunk's keep flags, and for its BPP blocks the block slots (phases) and the padding rows: a block's rows past
        its expert's count, every row of an unused block. No row is written by two programs and no program waits for
        another, so the output is `_align_kernel`'s whatever the programs' order."""
        runtime.pdl_begin()
        pid = tl.program_id(0)
        ci = tl.arange(0, CH)
        e_ok, slot_of, phase_of, nv = _align_tables(slot_ptr, phase_ptr, nvalid_ptr, P, E, NB, TOPK, HAS_SLOT, HAS_PHASE,
                                                    HAS_NVALID)
        mine = pid * CH
        counts = tl.zeros((NB,), tl.int32)
        earlier = tl.zeros((NB,), tl.int32)  # the pairs of each expert in the chunks before this program's
        start = P * 0
        while start < P:
            ok, valid, key = _pair_keys(ids_ptr, start + ci, P, nv, E, TOPK)
            hist = tl.histogram(tl.minimum(key, E - 1), NB, mask=valid)
            counts += hist
            earlier += hist * (start < mine).to(tl.int32)
            start += CH
        block_end, num_blocks, first_row = _align_blocks(counts, e_ok, num_blocks_ptr, BM, pid == 0)
        ok, valid, key = _pair_keys(ids_ptr, mine + ci, P, nv, E, TOPK)
        tl.store(valid_ptr + mine + ci, valid, mask=ok)
        hist = tl.histogram(tl.minimum(key, E - 1), NB, mask=valid)
        _align_scatter(sorted_ptr, key, ci, first_row + earlier, tl.cumsum(hist, axis=0) - hist, mine, E, CH, SORT)
        bi = tl.arange(0, C)
        mi = tl.arange(0, BM)
        b_hi = tl.minimum(pid * BPP + BPP, MB)
        bstart = pid * BPP
        while bstart < b_hi:
            b = bstart + bi
            inb = b < b_hi
            e_b, used = _align_block_slots(b, inb, block_end, e_ok, num_blocks, slot_of, phase_of, block_slot_ptr,
                                           block_phase_ptr, E, HAS_PHASE)
            rows = b[:, None] * BM + mi[None, :]
            fill = rows - tl.gather(first_row, e_b, 0)[:, None] < tl.gather(counts, e_b, 0)[:, None]  # a pair's row
            tl.store(sorted_ptr + rows, tl.zeros((C, BM), tl.int32) + P, mask=inb[:, None] & ~(used[:, None] & fill))
            bstart += C

    @triton.jit
    def _align_tables(slot_ptr, phase_ptr, nvalid_ptr, P, E: tl.constexpr, NB: tl.constexpr, TOPK: tl.constexpr,
                      HAS_SLOT: tl.constexpr, HAS_PHASE: tl.constexpr, HAS_NVALID: tl.constexpr):
        """What both align kernels read first: the experts in range [NB], their slots and copy groups (identity / 0 when
        not given), and the tokens kept (n_valid, else every token)."""
        ev = tl.arange(0, NB)
        e_ok = ev < E
        slot_of = ev
        if HAS_SLOT:
            slot_of = tl.load(slot_ptr + ev, mask=e_ok, other=0)
        phase_of = tl.zeros((NB,), tl.int8)
        if HAS_PHASE:
            phase_of = tl.load(phase_ptr + ev, mask=e_ok, other=0)
        nv = P // TOPK
        if HAS_NVALID:
            nv = tl.load(nvalid_ptr)
        return e_ok, slot_of, phase_of, nv

    @triton.jit
    def _align_block_slots(b, inb, block_end, e_ok, num_blocks, slot_of, phase_of, block_slot_ptr, block_phase_ptr,
                           E: tl.constexpr, HAS_PHASE: tl.constexpr):
        """Blocks b (where inb): each one's expert (the experts' cumulative block ends searched), its slot (-1 past the
        block count) and copy group stored; returns (expert, used)."""
        e_b = tl.sum(((block_end[None, :] <= b[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        used = b < num_blocks
        e_b = tl.minimum(e_b, E - 1)
        if HAS_PHASE:
            ph = tl.gather(phase_of, e_b, 0)
            ph = tl.where(ph < 0, 1, ph)  # (an expert in flight from a prefetch: the first copy group)
            tl.store(block_phase_ptr + b, tl.where(used, ph, 0).to(tl.int8), mask=inb)
        tl.store(block_slot_ptr + b, tl.where(used, tl.gather(slot_of, e_b, 0), -1), mask=inb)
        return e_b, used

    @triton.jit
    def _align_blocks(counts, e_ok, num_blocks_ptr, BM: tl.constexpr, store=True):
        """Each expert's pair count [NB] -> its blocks' end (cumulative), the block count (stored where `store`) and its
        first row."""
        blocks = tl.where(e_ok, (counts + BM - 1) // BM, 0)
        block_end = tl.cumsum(blocks, axis=0)
        num_blocks = tl.sum(blocks, axis=0)
        tl.store(num_blocks_ptr, num_blocks, mask=store)
        tl.debug_barrier()  # the padding stores land before the scatter that follows
        return block_end, num_blocks, (block_end - blocks) * BM

    @triton.jit
    def _align_scatter(sorted_ptr, key, ci, running, before, start, E: tl.constexpr, CH: tl.constexpr, SORT: tl.constexpr):
        """One chunk's pairs to their rows. `running` [NB]: each expert's next free row; `before` [NB]: the chunk's pairs
        of lower experts. SORT (the GPU's form): a pair's row is its place in the chunk sorted by (expert, pair) plus
        running - before of its expert. Else (the interpreter's, which runs tl.sort's network one op at a time, 0.1-3 s a
        chunk): running of its expert plus the chunk's earlier pairs of that expert, counted by a CH x CH compare. The
        same rows either way."""
        if SORT:
            ranked = tl.sort(key * CH + ci)  # stable within an expert; dropped pairs (key E) last
            key_s = ranked // CH
            dest = ci + tl.gather(running - before, tl.minimum(key_s, E - 1), 0)
            tl.store(sorted_ptr + dest, start + ranked % CH, mask=key_s < E)
        else:
            earlier = tl.sum(((key[:, None] == key[None, :]) & (ci[None, :] < ci[:, None])).to(tl.int32), axis=1)
            dest = tl.gather(running, tl.minimum(key, E - 1), 0) + earlier
            tl.store(sorted_ptr + dest, start + ci, mask=key < E)


# ---- the launcher ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ExpertWeights:
    """One layer's expert weights as the kernels read them; first dimension = slot.

    bf16: w1 [S, R1, H] (R1 = 2I rows; I for up-only experts, act ACT_RELU2), w2 [S, H, I]. MXFP4: w1 [S, R1, H/2] u8 + s1 [S, R1, H/32] u8, w2
    [S, H, I/2] + s2 [S, H, I/32]. Row r of w1 is gate row j at r = j * row_mul, up row j at j * row_mul + up_off
    (concatenated: row_mul 1, up_off I; gpt-oss interleaved: row_mul 2, up_off 1).
    """

    w1: torch.Tensor
    w2: torch.Tensor
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    b1: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    row_mul: int = 1
    up_off: int | None = None
    act: int = ACT_SILU
    alpha: float = 1.702
    limit: float = 7.0
    # MXFP4 only: some scale byte is above 128 (a block with |w| > 12). The bit-placing decoders (1, 3) fold the
    # scale into one power of two that cannot go that high, so these weights are decoded by exact selects (0).
    big_scales: bool = False
    # MXFP4 only: w1/w2 hold pair words (pdflash_kernels/mxfp4.py to_pair_words), which only decodes 5 and 6 read; moe_forward
    # then runs every FP4 GEMM with decode 5 (6 where big_scales), whatever the config says (the stored format decides)
    pair_words: bool = False

    @property
    def fp4(self) -> bool:
        return self.s1 is not None

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def gated(self) -> bool:
        """Whether w1 holds gate and up rows (2I); False for up-only experts (ACT_RELU2: I up rows)."""
        return self.act in GATED_ACTS

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // (2 if self.gated else 1)

    @property
    def up_offset(self) -> int:
        if not self.gated:
            return 0
        return self.intermediate if self.up_off is None else self.up_off


def _scale_words_ok(scales: torch.Tensor) -> bool:
    """Scale rows readable as 32-bit words (MoeConfig.s_words): 4-byte aligned base, row and slot strides."""
    return scales.data_ptr() % 4 == 0 and scales.stride(-1) == 1 and all(st % 4 == 0 for st in scales.stride()[:-1])


def _word_ok(blocks: torch.Tensor) -> bool:
    """Packed rows readable as 32-bit words (decode 4): 4-byte aligned base, row and slot strides, contiguous rows."""
    return (blocks.data_ptr() % 4 == 0 and blocks.stride(-1) == 1 and blocks.shape[-1] % 4 == 0
            and all(st % 4 == 0 for st in blocks.stride()[:-1]))


def _grid(c: MoeConfig, max_blocks: int, n_tiles: int, split: int = 1) -> tuple[int, ...]:
    if c.persist:
        return (max(1, min(max_blocks * n_tiles * split, c.persist * runtime.sm_count())),)
    if c.raster:
        return (max_blocks * n_tiles * split,)
    return (max_blocks, n_tiles, split)


def split_span(k: int, c: MoeConfig) -> tuple[int, int]:
    """(splits, K values each) of a GEMM with reduction length k: `c.split_k` ranges of whole K steps (fewer where k has
    fewer steps; the last range may be shorter). From the static shape only."""
    steps = triton_cdiv(k, c.block_k)
    span = triton_cdiv(steps, max(1, min(c.split_k, steps))) * c.block_k
    return triton_cdiv(k, span), span


def _split_args(c: MoeConfig, k: int, rows: int, cols: int, tiles: int, unused: torch.Tensor
                ) -> tuple[dict, torch.Tensor | None, torch.Tensor]:
    """One GEMM launch's split-K kernel arguments, the workspace a second launch must add up (None: one launch does it,
    or one split) and the counters of the tiles' last programs. `unused`: any tensor of the call, passed where a pointer
    is not read (nothing is allocated for one split, in or out of a CUDA-graph capture)."""
    split, span = split_span(k, c)
    if split == 1:
        return dict(ws_ptr=unused, R=0, SPLIT=1, SPAN=k, FIXUP=False), None, unused
    dev = unused.device
    ws = torch.empty((split, rows, cols), dtype=torch.float32, device=dev)
    cnt = linear._counters(dev, tiles)  # None: more tiles than a counter region (or none made yet in a capture)
    fixup = cnt is not None
    return dict(ws_ptr=ws, R=rows, SPLIT=split, SPAN=span, FIXUP=fixup), None if fixup else ws, cnt if fixup else unused


def _run(kernel, grid, args, kwargs, warmup: bool):
    """Launch, or (warmup) only compile: inside `triton.AsyncCompileMode` the compiles of many configs overlap."""
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def _flags(c: MoeConfig, fp4: bool) -> dict:
    """The kernels' constexprs of a config (fields a path does not read are normalized: no duplicate compiles)."""
    if c.decode not in (DECODE_SELECT, DECODE_F32_BITS, DECODE_SCALED, DECODE_BF16_BITS, DECODE_WORD, *PAIR_DECODES) or c.a_load not in (A_GATHER, A_SPLIT, A_JOIN, *WARPS_K_RANGES):
        raise ValueError(f"unknown decode {c.decode} or a_load {c.a_load}")
    if c.a_load in WARPS_K_RANGES and (c.decode not in PAIR_DECODES or c.num_warps != WARPS_K_RANGES[c.a_load]
                                       or c.block_k // c.num_warps < 16):
        raise ValueError(f"a_load {c.a_load} (K over the warps) takes a pair-word decode, num_warps "
                         f"{WARPS_K_RANGES[c.a_load]} and >= 16 K values a warp: {c}")
    if c.block_k < 32 or c.block_k & (c.block_k - 1) or c.block_m < 16 or c.block_n < 16:
        raise ValueError(f"block_k must be a power of two >= 32 and block_m, block_n >= 16: {c}")
    if c.s_ahead not in (0, 1, 2):
        raise ValueError(f"s_ahead must be 0, 1 or 2: {c}")
    if c.split_k < 1:
        raise ValueError(f"split_k must be >= 1: {c}")
    if c.s_words and c.block_k < 128:
        raise ValueError(f"s_words reads 4 scale bytes a word: block_k must be >= 128: {c}")
    if fp4 and c.decode == DECODE_SCALED and runtime.interpreting():
        raise ValueError("decode 2 (tl.dot_scaled) does not run under Triton's interpreter")
    decode = c.decode if fp4 else DECODE_SELECT
    a_load = c.a_load if fp4 and decode != DECODE_SCALED else A_GATHER
    if decode in (DECODE_WORD, *PAIR_DECODES) and not (a_load in WARPS_K_RANGES and fp4):
        a_load = A_JOIN  # decodes 4-6 always give the tile in K order
    return dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DECODE=decode, F32DOT=runtime.interpreting(),
                A_LOAD=a_load, SWAP=c.swap_ab, RASTER=c.raster, PERSIST=c.persist > 0,
                S_AHEAD=c.s_ahead if fp4 and decode != DECODE_SCALED and not c.s_words else 0,  # (streamed words need none)
                S_WORDS=bool(c.s_words and fp4 and decode != DECODE_SCALED),
                LOOP_STAGES=c.num_stages if c.s_words and fp4 and decode != DECODE_SCALED else None,
                num_warps=c.num_warps, num_stages=c.num_stages, **runtime.pdl_launch())


def _phase_args(r: Routing, phase: int) -> dict:
    """A launch's phase arguments: 0 every routing block; p >= 1 only the blocks of copy group p - 1
    (`Routing.block_phase`)."""
    if not 0 <= phase <= 127 or (phase and r.block_phase is None):
        raise ValueError(f"phase {phase}: 0, or 1..127 with a routing made with phase_of_expert")
    return dict(block_phase_ptr=r.block_phase if phase else r.block_slot, PHASE=phase)


def launch_gemm1(x: torch.Tensor, r: Routing, w: ExpertWeights, h: torch.Tensor, c: MoeConfig, topk: int, warmup: bool = False,
                 phase: int = 0):
    """h[block rows] = act(x[token of each pair] @ w1[slot]^T (+ b1)): the gate/up GEMM over the routing blocks (all, or
    those of `phase`; split K: `MoeConfig.split_k`)."""
    inter, hdim = w.intermediate, x.shape[1]
    s1 = w.s1 if w.fp4 else w.w1
    b1 = w.b1 if w.b1 is not None else w.w1
    n_tiles = triton_cdiv(inter, c.block_n)
    rows = r.max_blocks * c.block_m
    split, ws2, cnt = _split_args(c, hdim, rows, 2 * inter, r.max_blocks * n_tiles, r.num_blocks)
    args = (x, x.stride(0), h, h.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks,
            w.w1, w.w1.stride(0), w.w1.stride(1), s1, s1.stride(0), s1.stride(1), b1, b1.stride(0),
            r.num_pairs, float(w.alpha), float(w.limit))
    kwargs = dict(I=inter, K=hdim, UP_OFF=w.up_offset, ROW_MUL=w.row_mul, TOPK=topk, FP4=w.fp4, HAS_BIAS=w.b1 is not None, ACT=w.act,
                  cnt_ptr=cnt, **split, **_flags(c, w.fp4), **_phase_args(r, phase))
    out = _run(_moe_gemm1, _grid(c, r.max_blocks, n_tiles, split["SPLIT"]), args, kwargs, warmup)
    if ws2 is not None:  # the two-launch path: the partials added by their own launch
        _run(_moe_gemm1_reduce, (r.max_blocks, n_tiles),
             (h, h.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, b1, b1.stride(0), r.num_pairs, float(w.alpha),
              float(w.limit), ws2, rows),
             dict(I=inter, UP_OFF=w.up_offset, ROW_MUL=w.row_mul, HAS_BIAS=w.b1 is not None, ACT=w.act, BLOCK_M=c.block_m,
                  BLOCK_N=c.block_n, F32DOT=runtime.interpreting(), SPLIT=split["SPLIT"], num_warps=4,
                  **_phase_args(r, phase), **runtime.pdl_launch()), warmup)
    return out


def launch_gemm2(h: torch.Tensor, r: Routing, w: ExpertWeights, y: torch.Tensor, rw: torch.Tensor, c: MoeConfig, warmup: bool = False,
                 combine: tuple | None = None, phase: int = 0):
    """y[pair] = (h[block row] @ w2[slot]^T (+ b2)) * routing weight: the down GEMM over all routing blocks. `combine`
    (out [T, H], zeroed int32 counters [T x n tiles], top-k): the combine in the same launch (`FUSED_COMBINE`; one
    split of K only)."""
    inter, hdim = w.intermediate, w.hidden
    s2 = w.s2 if w.fp4 else w.w2
    b2 = w.b2 if w.b2 is not None else w.w2
    n_tiles = triton_cdiv(hdim, c.block_n)
    rows = r.max_blocks * c.block_m
    split, ws2, scnt = _split_args(c, inter, rows, hdim, r.max_blocks * n_tiles, r.num_blocks)
    if combine is not None and split["SPLIT"] > 1:
        raise ValueError("the fused combine takes one split of K: pass combine=None with split_k > 1")
    out, cnt, topk = combine if combine is not None else (y, r.pair_valid, 1)
    args = (h, h.stride(0), y, y.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, rw,
            w.w2, w.w2.stride(0), w.w2.stride(1), s2, s2.stride(0), s2.stride(1), b2, b2.stride(0), r.num_pairs,
            out, cnt, r.pair_valid)
    kwargs = dict(N=hdim, K=inter, FP4=w.fp4, HAS_BIAS=w.b2 is not None, COMBINE=combine is not None, TOPK=topk,
                  TOPK_PAD=triton.next_power_of_2(topk), scnt_ptr=scnt, **split, **_flags(c, w.fp4), **_phase_args(r, phase))
    res = _run(_moe_gemm2, _grid(c, r.max_blocks, n_tiles, split["SPLIT"]), args, kwargs, warmup)
    if ws2 is not None:  # the two-launch path: the partials added by their own launch
        _run(_moe_gemm2_reduce, (r.max_blocks, n_tiles),
             (y, y.stride(0), r.sorted_pairs, r.block_slot, r.num_blocks, rw, b2, b2.stride(0), r.num_pairs, ws2, rows),
             dict(N=hdim, HAS_BIAS=w.b2 is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, F32DOT=runtime.interpreting(),
                  SPLIT=split["SPLIT"], num_warps=4, **_phase_args(r, phase), **runtime.pdl_launch()), warmup)
    return res


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: ExpertWeights,
    num_experts: int,
    slot_of_expert: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    config2: MoeConfig | None = None,
    warmup: bool = False,
    phase_of_expert: torch.Tensor | None = None,
    between=None,
    groups: int = 1,
) -> torch.Tensor | None:
    """x [T, H] bf16, topk_ids/weights [T, k] -> [T, H] in x's dtype. Triton on CUDA (or under TRITON_INTERPRET).
    `warmup`: compile both GEMMs' kernels for these configs without running them (returns None).

    `phase_of_expert` (int8 [num_experts], a device tensor, no host sync): phases, for an expert cache that is still
    copying some experts in, in `groups` copy groups (flag 0: resident; g in 1..groups: copy group g; < 0: group 1).
    Both GEMMs run first over the blocks of the resident experts, then for each group g `between(g)` is called (the
    caller makes the stream wait for that group's copies) and both GEMMs run over its experts' blocks. A pair's rows
    are computed by the same program form either way and every token's output is summed in slot order by whichever
    program stores its last pair (or by the combine launch), so the output is bit-identical to one phase; each group's
    copies overlap the GEMMs of the experts before it.

    `w` may be pdflash_kernels.fragments.FragmentExperts (the fragments format): the call is then `fragment_moe`'s,
    with its own tiles (config / config2 do not apply; `warmup` returns None at once)."""
    if getattr(w, "fragments", False):
        if warmup:
            return None
        from pdflash_kernels.fragments import fragment_moe

        return fragment_moe(x, topk_ids, topk_weights, w, num_experts, slot_of_expert, n_valid, phase_of_expert, between,
                            groups)
    t, hdim = x.shape
    topk = topk_ids.shape[1]
    inter = w.intermediate
    if config is None:
        config = default_config(inter, hdim, topk, w.fp4, gemm=1, pair_words=w.fp4 and w.pair_words)
    if config2 is None:
        config2 = default_config(hdim, inter, topk, w.fp4, gemm=2, pair_words=w.fp4 and w.pair_words)
    config, config2 = resolve_decodes(w, config, config2)
    if w.fp4:  # decode 4 reads 32-bit words: weights not 4-byte aligned get decode 3 (static: the tensors, not the tokens)
        config, config2 = (dataclasses.replace(c, decode=DECODE_BF16_BITS) if c.decode == DECODE_WORD and not _word_ok(b) else c
                           for c, b in ((config, w.w1), (config2, w.w2)))
        # s_words reads 4 scale bytes a word: scale rows not 4-byte aligned are read a byte at a time (the same values)
        config, config2 = (dataclasses.replace(c, s_words=False) if c.s_words and not _scale_words_ok(sc) else c
                           for c, sc in ((config, w.s1), (config2, w.s2)))
    bm = config.block_m
    if config2.block_m != bm:
        raise ValueError("both GEMMs share the routing blocks: block_m must match")
    chunk = token_chunk(topk, inter, hdim, config, config2)
    if t > chunk and not warmup:
        # a split-K workspace grows with the call's rows: a long prompt runs in token chunks instead. Every token's
        # output is bit-identical whatever the other tokens of its call (batch invariance), so the chunks give the
        # one call's bits; the first chunk waits for every copy group, the rest find them in.
        outs = []
        for s0 in range(0, t, chunk):
            nv = None if n_valid is None else n_valid - s0
            outs.append(moe_forward(x[s0 : s0 + chunk], topk_ids[s0 : s0 + chunk], topk_weights[s0 : s0 + chunk], w,
                                    num_experts, slot_of_expert, nv, config, config2, False, phase_of_expert,
                                    between if s0 == 0 else None, groups))
        return torch.cat(outs)
    x = x.contiguous()
    r = align_fused(topk_ids, num_experts, bm, slot_of_expert, n_valid, phase_of_expert)
    phases = tuple(range(1, groups + 2)) if phase_of_expert is not None else (0,)
    dev = x.device
    h = torch.empty((r.max_blocks * bm, inter), dtype=torch.bfloat16, device=dev)
    y = torch.empty((r.num_pairs, hdim), dtype=torch.float32, device=dev)
    rw = topk_weights.reshape(-1).contiguous()
    out = torch.empty((t, hdim), dtype=x.dtype, device=dev)
    cnt = None
    if FUSED_COMBINE and split_span(inter, config2)[0] == 1:
        cnt = linear._counters(dev, t * triton_cdiv(hdim, config2.block_n))  # None: the separate combine (too many tiles)
    combine = (out, cnt, topk) if cnt is not None else None
    if warmup:
        for ph in phases:
            launch_gemm1(x, r, w, h, config, topk, warmup=True, phase=ph)
            launch_gemm2(h, r, w, y, rw, config2, warmup=True, combine=combine, phase=ph)
        return None
    for ph in phases:
        if ph >= 2 and between is not None:
            between(ph - 1)
        launch_gemm1(x, r, w, h, config, topk, phase=ph)
        launch_gemm2(h, r, w, y, rw, config2, combine=combine, phase=ph)
    if combine is None:
        f32dot = runtime.interpreting()
        block = min(1024, triton.next_power_of_2(hdim))
        _moe_combine[(t, triton_cdiv(hdim, block))](y, r.pair_valid, out, hdim, TOPK=topk, BLOCK=block, EMULATE=f32dot,
                                                       **runtime.pdl_launch())
    return out


# The most bytes a call's split-K workspaces may take (float32 partials of every row, per range): longer calls run in
# token chunks (`token_chunk`). 256 MB: Mixtral-8x7B's gate/up GEMM split in 4 takes ~0.9 MB a token.
_WS_MB = os.environ.get("PDFLASH_MOE_SPLIT_WORKSPACE_MB", "256")
if not _WS_MB.isdigit() or int(_WS_MB) < 1:
    raise ValueError(f"PDFLASH_MOE_SPLIT_WORKSPACE_MB must be a whole number of MB >= 1, got {_WS_MB!r}")
SPLIT_WORKSPACE_BYTES = int(_WS_MB) << 20


def token_chunk(topk: int, inter: int, hdim: int, config: MoeConfig, config2: MoeConfig) -> int:
    """The most tokens one launch sequence takes: unbounded without a K split; with one, as many as keep both GEMMs'
    workspaces (splits x rows x columns x 4 bytes, a token bringing topk rows) under SPLIT_WORKSPACE_BYTES, at least 16.
    From the static shape only: the chunks change no bit (batch invariance)."""
    s1, s2 = split_span(hdim, config)[0], split_span(inter, config2)[0]
    per_token = topk * 4 * max(s1 * 2 * inter if s1 > 1 else 0, s2 * hdim if s2 > 1 else 0)
    return max(16, SPLIT_WORKSPACE_BYTES // per_token) if per_token else 1 << 62


def resolve_decodes(w: ExpertWeights, config: MoeConfig, config2: MoeConfig) -> tuple[MoeConfig, MoeConfig]:
    """The decodes the weights' stored format allows (static: the weight tensors, never the tokens). Pair words: decode 5
    for every FP4 GEMM (6, exact, where some scale byte is above 128), whatever the configs ask (no other decode reads
    them), with the one-dot K order (A_JOIN) unless a config splits K over the warps; they must be 4-byte aligned. The nibble order: decodes 5/6 become 4 (3 where the rows are not 4-byte aligned,
    below), and the fast decodes become exact selects (0) where some scale byte is above 128."""
    if not w.fp4:
        return config, config2
    if w.pair_words:
        if not (_word_ok(w.w1) and _word_ok(w.w2)):
            raise ValueError("pair-word weights are read as 32-bit words: their rows must be 4-byte aligned")
        dec = DECODE_PAIR_WORDS_EXACT if w.big_scales else DECODE_PAIR_WORDS
        return tuple(dataclasses.replace(c, decode=dec, a_load=c.a_load if c.a_load in WARPS_K_RANGES else A_JOIN)
                     for c in (config, config2))
    out = []
    for c in (config, config2):
        if c.decode in PAIR_DECODES:  # (the warps' K split reads pair words only: the one-dot form instead)
            c = dataclasses.replace(c, decode=DECODE_WORD, a_load=A_JOIN if c.a_load in WARPS_K_RANGES else c.a_load)
        if w.big_scales and c.decode in FAST_DECODES:
            c = dataclasses.replace(c, decode=DECODE_SELECT)
        out.append(c)
    return out[0], out[1]


def decode_fp4(blocks: torch.Tensor, scales: torch.Tensor, decode: int, a_load: int = A_JOIN, block_k: int = 64) -> torch.Tensor:
    """MXFP4 rows (blocks [N, K/2], scales [N, K/32]) -> bf16 [N, K] through the GEMMs' own weight decode (`decode`, and
    the K-order join of A_JOIN or the even/odd halves otherwise): what the kernels multiply by. For tests."""
    if decode == DECODE_SCALED:
        raise ValueError("decode 2 (tl.dot_scaled) decodes inside the dot: there are no decoded weights to return")
    if decode in (DECODE_WORD, *PAIR_DECODES):
        if not _word_ok(blocks):
            raise ValueError(f"decode {decode} reads 32-bit words: the packed rows must be 4-byte aligned")
        a_load = A_JOIN
    n, k = blocks.shape[0], blocks.shape[1] * 2
    out = torch.empty((n, k), dtype=torch.bfloat16, device=blocks.device)
    grid = (triton_cdiv(n, 16), triton_cdiv(k, block_k))
    _fp4_decode_kernel[grid](blocks, scales, out, n, blocks.stride(0), scales.stride(0), out.stride(0), K=k, BLOCK_N=16,
                             BLOCK_K=block_k, DECODE=decode, EMULATE=runtime.interpreting(), A_LOAD=a_load)
    return out
