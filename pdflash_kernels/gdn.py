"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5-MoE) and Kimi Delta Attention (Kimi Linear:
the same rule with a decay per key channel), batch-invariant, with their own rollback; on the same two kernels the
state-space layers Mamba-2 (Granite-4.0-H, Nemotron-H: `mamba2_forward`) and Mamba v1 (Jamba: `mamba1_forward`, a decay
per state and channel, exp(dt[c] A[c, n]), with dt and D one a channel) and LFM2's short convolutions.

transformers runs these layers with a chunked algorithm for a block of tokens and a token-by-token one for a single
token, and a depthwise `conv1d` whose kernels change with the length: a token's output then depends on how many tokens
share its forward, and greedy verification at block > 1 stops equalling block 1 on the GPU. Here both steps are one
Triton kernel each that treats every token alike:

- `causal_conv`: the short causal depthwise convolution (kernel `K`, 4 in both models) over the layer's committed
  history, then SiLU: each output a float32 sum of `K` products in a fixed order, rounded to the input's dtype.
- `gated_delta`: the gated delta rule token by token (`S <- S * exp(g)`, `S <- S + k (beta (v - S^T k))^T`,
  `o = S^T q`, q and k L2-normalized in float32, q scaled by 1/sqrt(d_k)), one program per (sequence, value head,
  value-column tile), the state tile in registers; every token runs the same loop body.

**Rollback without per-token states.** A verify block's rejected tokens must leave no trace in the state. Rather than
store the state after every token of every block (Qwen3-Next: 2 MB a layer a token), a layer keeps the state *before*
its last block (`S`, committed) and that block's inputs (`pending`; a prompt's tokens but the last ROLLBACK_TOKENS
enter the state at once). `crop` records how many of them were accepted; the next forward replays those first, inside the same loop that then runs its own tokens, and writes the new committed
state at the seam. A replayed token goes through the same instructions as when it was first run, so the state, and
every later output, is bit-identical to never having run the rejected tokens. The convolution does the same with its
last `K - 1` inputs.

`GDNState` holds this per (session, layer); `pdflash_kernels.installer` puts `forward` (or `kda_forward`) under each such
module, with the
state kept on transformers' cache layer (so a session's cache, and its `crop`, carry it). Torch references
(`causal_conv_ref`, `gated_delta_ref`) compute the same in float64 for the tests and serve the CPU.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from pdflash_kernels import runtime
from pdflash_kernels.runtime import tl, triton

EPS = 1e-6  # the L2 norm's (transformers' and FLA's)
#: a forward's last tokens that stay pending (can be dropped by the next crop); its earlier ones, a prompt's, enter the
#: state at once (their inputs are not kept). Verify blocks are far shorter (max_block_size: 32 by default).
ROLLBACK_TOKENS = 256


def is_gated_delta_net(module) -> bool:
    """A Gated DeltaNet layer of the form these kernels serve (Qwen3-Next's fused q/k/v/z and b/a projections, or
    Qwen3.5's separate ones), by its parts rather than its class name."""
    parts = ("A_log", "dt_bias", "conv1d", "norm", "out_proj", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads")
    if not all(hasattr(module, p) for p in parts):
        return False
    fused = hasattr(module, "in_proj_qkvz") and hasattr(module, "in_proj_ba")
    split = all(hasattr(module, p) for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    return (fused or split) and getattr(module, "activation", "silu") in ("silu", "swish")


# ---- the state ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GDNState:
    """One layer's recurrent state for a batch of sequences: `S` [B, Hv, dk, dv] float32 and the convolution's last
    `K - 1` inputs `hist` [B, K - 1, C], both as of the tokens before `pending`; `pending` = the last forward's
    (conv inputs [B, T, C], conv outputs [B, T, C], g [B, T, Hv] float32, beta [B, T, Hv]) and `accepted` how many of
    its T tokens the next forward replays (all of them unless `crop` said otherwise)."""

    S: torch.Tensor
    hist: torch.Tensor
    pending: tuple | None = None
    accepted: int = 0

    @classmethod
    def zeros(cls, batch: int, hv: int, dk: int, dv: int, k: int, channels: int, dtype, device) -> "GDNState":
        return cls(torch.zeros(batch, hv, dk, dv, dtype=torch.float32, device=device),
                   torch.zeros(batch, k - 1, channels, dtype=dtype, device=device))

    @property
    def pending_tokens(self) -> int:
        return 0 if self.pending is None else int(self.pending[0].shape[1])

    def drop(self, n: int) -> None:
        """n more of the last forward's tokens are rejected, from its end (transformers' `crop(-n)`; `crop(0)` keeps
        them all). Only its last ROLLBACK_TOKENS tokens can be dropped: the others are already in the state."""
        if n < 0 or n > self.accepted:
            raise ValueError(f"cannot drop {n} tokens of a Gated DeltaNet layer: {self.accepted} of the last forward's "
                             f"tokens can still be dropped (its last {ROLLBACK_TOKENS} at most, gdn.ROLLBACK_TOKENS)")
        self.accepted -= n


# ---- torch references (float64: the tests' oracle; any device) ---------------------------------------------------
def causal_conv_ref(x: torch.Tensor, hist: torch.Tensor, pend: torch.Tensor | None, accepted: int,
                    weight: torch.Tensor, bias: torch.Tensor | None = None,
                    commit: int = 0, act: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(SiLU(conv) (`act`; else the conv) of x's T tokens in x's dtype, the new history [B, K - 1, C]: the last K - 1
    inputs up to x's first `commit`). x [B, T, C], hist [B, K - 1, C], pend [B, Tp, C] of which the first `accepted`
    precede x; weight [C, K]."""
    k = weight.shape[-1]
    parts = [hist] + ([pend[:, :accepted]] if accepted else [])
    seq = torch.cat(parts + [x], dim=1).double()
    t = x.shape[1]
    w = weight.double()
    out = torch.zeros(x.shape[0], t, x.shape[2], dtype=torch.float64, device=x.device)
    base = seq.shape[1] - t - (k - 1)
    for j in range(k):
        out += w[:, j] * seq[:, base + j: base + j + t]
    if bias is not None:
        out += bias.double()
    out = F.silu(out.to(x.dtype).double()).to(x.dtype) if act else out.to(x.dtype)
    committed = torch.cat(parts + [x[:, :commit]], dim=1)
    return out, committed[:, committed.shape[1] - (k - 1):].clone()


@dataclasses.dataclass
class Rule:
    """What differs between the recurrences the kernels run. Gated DeltaNet and Kimi Delta Attention (the default):
    q | k | v columns, q and k L2-normalized (q scaled by 1/sqrt(dk)), the delta rule's correction. Mamba-2 (`MAMBA2`,
    with its D): x | B | C columns (v | k | q), the plain outer-product update `S <- S + B (dt x)^T` (beta = dt), the
    output `S^T C + D x`."""

    delta: bool = True
    qk_norm: bool = True
    layout: str = "qkv"  # or "xbc"
    D: torch.Tensor | None = None  # [Hv] (Mamba-2's skip; Mamba v1's: [Hv * dv], one a value column; read as float32)
    #: Mamba v1 (Jamba): A [Hv, dk, dv] float32 (-exp(A_log), transposed: state n, channel c); then beta is dt, one a
    #: value column ([.., Hv * dv]), and the decay is exp(dt[c] A[n, c]) per state element (g is not read)
    A: torch.Tensor | None = None

    @property
    def per_column(self) -> bool:
        """beta (and D) one a value column, the decay from A (Mamba v1), rather than one a value head."""
        return self.A is not None


GDN_RULE = Rule()


def gated_delta_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, rule: Rule = GDN_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, T, Hv, dv] in v's dtype, the state after the T tokens, float32). q, k [B, T, Hk, dk], v [B, T, Hv,
    dv], g [B, T, Hv] (or [B, T, Hv, dk]: a decay per key channel, Kimi Delta Attention), beta [B, T, Hv], state [B, Hv,
    dk, dv]; value head h reads key head h // (Hv / Hk). `rule`: Mamba-2's form (no normalization, no correction, D)."""
    b, t, hk, dk = k.shape
    hv = v.shape[2]
    rep = hv // hk
    q, k = (x.double().repeat_interleave(rep, dim=2) for x in (q, k))
    if rule.qk_norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + EPS) / math.sqrt(dk)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + EPS)
    s = state.double().clone()
    out = torch.empty(b, t, hv, v.shape[-1], dtype=torch.float64, device=v.device)
    for i in range(t):
        bv = beta[:, i].double().view(b, hv, -1)  # [B, Hv, 1], or Mamba v1's dt [B, Hv, dv]
        if rule.per_column:  # Mamba v1: exp(dt[c] A[n, c]) per state element
            s = s * torch.exp(bv[:, :, None, :] * rule.A.double())
        else:
            decay = g[:, i].double().exp()  # [B, Hv] (a gated DeltaNet's) or [B, Hv, dk] (Kimi Delta Attention's)
            s = s * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        kv = (s * k[:, i, :, :, None]).sum(-2) if rule.delta else 0.0
        delta = (v[:, i].double() - kv) * bv
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = (s * q[:, i, :, :, None]).sum(-2)
        if rule.D is not None:
            out[:, i] += rule.D.double().view(hv, -1) * v[:, i].double()
    return out.to(torch.float32 if rule.per_column else v.dtype), s.float()


# ---- Triton kernels ------------------------------------------------------------------------------------------------
# Both kernels read a row of int32 `meta` per sequence (`META` fields): its state slot, how many pending tokens it
# replays (A), how many of its own tokens it commits (CT), which half of a paged state's pending buffers it reads (the
# other is written), its first row in the flattened rows and its row count (T). The transformers-cache path (GDNState)
# passes one row per batch sequence (slot b, rows b * T ..) and keeps its pending inputs itself; the paged path
# (PagedGDN: one slot per session, CUDA-graph friendly: every count is read from device memory) has the kernels write
# the tokens they leave pending into the other half.
META = ("slot", "replay", "commit", "half", "row0", "rows")

if triton is not None:

    @triton.jit
    def _meta(meta_ptr, b):
        m = meta_ptr + b * 6
        return (tl.load(m).to(tl.int64), tl.load(m + 1), tl.load(m + 2), tl.load(m + 3).to(tl.int64),
                tl.load(m + 4).to(tl.int64), tl.load(m + 5))

    @triton.jit
    def _conv_token(t, A, c, cm, bias, x_row, hist_s, pend_s, w_ptr, out_row, sxt, sht, spt, sot, K: tl.constexpr,
                    ACT: tl.constexpr):
        """Token t's output: the rounded float32 sum over j of w[j] * seq[A + t + j] (seq = hist ++ pend[:A] ++ x), then
        SiLU (ACT; LFM2's short convolution has none)."""
        acc = tl.zeros(c.shape, dtype=tl.float32)
        for j in tl.static_range(K):
            u = A + t + j
            in_h = u < K - 1
            in_p = (u >= K - 1) & (u < K - 1 + A)
            in_x = u >= K - 1 + A
            xv = tl.load(hist_s + u * sht + c, mask=cm & in_h, other=0.0).to(tl.float32)
            xv += tl.load(pend_s + (u - (K - 1)) * spt + c, mask=cm & in_p, other=0.0).to(tl.float32)
            xv += tl.load(x_row + (u - (K - 1) - A) * sxt + c, mask=cm & in_x, other=0.0).to(tl.float32)
            acc = tl.fma(tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32), xv, acc)
        acc += bias
        y = acc.to(out_row.dtype.element_ty)
        if ACT:
            y = y.to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(out_row.dtype.element_ty)
        tl.store(out_row + t * sot + c, y, mask=cm)
        return y

    @triton.jit
    def _conv_pend(t, CT, c, cm, y, x_row, px_w, pc_w, sxt, spt):
        """A paged state's pending copies of token t (>= CT: not committed): its input and its output."""
        keep = cm & (t >= CT)
        tl.store(px_w + (t - CT) * spt + c, tl.load(x_row + t * sxt + c, mask=keep, other=0.0), mask=keep)
        tl.store(pc_w + (t - CT) * spt + c, y, mask=keep)

    @triton.jit
    def _conv_kernel(x_ptr, meta_ptr, hist_ptr, pend_ptr, pc_ptr, w_ptr, b_ptr, out_ptr, C,
                     sxt, shs, sht, sps, sph, spt, sot,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                     INTERP: tl.constexpr, WRITE_PEND: tl.constexpr, ACT: tl.constexpr):
        """One program: one sequence's BLOCK_C channels, every token. The sequence it convolves is hist (K - 1) ++
        pend[:A] ++ x (T); afterwards hist becomes the last K - 1 entries of hist ++ pend[:A] ++ x[:CT] (committed).
        A program reads and writes only its own channels, all reads before the barrier."""
        slot, A, CT, half, row0, T = _meta(meta_ptr, tl.program_id(0))
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        bias = tl.load(b_ptr + c, mask=cm & HAS_BIAS, other=0.0).to(tl.float32)
        x_row = x_ptr + row0 * sxt
        out_row = out_ptr + row0 * sot
        hist_s = hist_ptr + slot * shs
        pend_s = pend_ptr + slot * sps + half * sph
        px_w = pend_ptr + slot * sps + (1 - half) * sph  # (WRITE_PEND: the half this forward leaves pending in)
        pc_w = pc_ptr + slot * sps + (1 - half) * sph
        if INTERP:  # Triton's interpreter cannot run a range() over a kernel argument
            t = 0
            while t < T:
                y = _conv_token(t, A, c, cm, bias, x_row, hist_s, pend_s, w_ptr, out_row, sxt, sht, spt, sot, K, ACT)
                if WRITE_PEND:
                    _conv_pend(t, CT, c, cm, y, x_row, px_w, pc_w, sxt, spt)
                t += 1
        else:
            for t in range(T):
                y = _conv_token(t, A, c, cm, bias, x_row, hist_s, pend_s, w_ptr, out_row, sxt, sht, spt, sot, K, ACT)
                if WRITE_PEND:
                    _conv_pend(t, CT, c, cm, y, x_row, px_w, pc_w, sxt, spt)
        # the committed history: entries A + CT .. A + CT + K - 2 of hist ++ pend[:A] ++ x[:CT], all read before any is
        # written (an empty sequence, T = 0, writes nothing: a wave's unused sequence slots share one scratch slot)
        r = tl.arange(0, BLOCK_H)
        u = (A + CT + r)[:, None]
        rm = (r < K - 1)[:, None] & cm[None, :]
        in_h = u < K - 1
        in_p = (u >= K - 1) & (u < K - 1 + A)
        hv = tl.load(hist_s + u * sht + c[None, :], mask=rm & in_h, other=0.0)
        pv = tl.load(pend_s + (u - (K - 1)) * spt + c[None, :], mask=rm & in_p, other=0.0)
        xv = tl.load(x_row + (u - (K - 1) - A) * sxt + c[None, :], mask=rm & (u >= K - 1 + A), other=0.0)
        news = tl.where(in_h, hv, tl.where(in_p, pv, xv.to(pv.dtype)))
        tl.debug_barrier()
        tl.store(hist_s + r[:, None] * sht + c[None, :], news, mask=rm & (T > 0))

    @triton.jit
    def _delta_token(S, i, A, AC, h, kh, kk, vv, km, vm, sm, s_ptrs, new_row, pend_s, gn_row, gp_s, bn_row, bp_s,
                     out_row, gw, bw, pw, wtile, a_t, snt, spt, sgnt, sgpt, sbnt, sbpt, sot, soh,
                     d_skip, DK: tl.constexpr, DV: tl.constexpr, Q_OFF: tl.constexpr, K_OFF: tl.constexpr,
                     V_OFF: tl.constexpr, SCALE: tl.constexpr, G_VEC: tl.constexpr, WRITE_PEND: tl.constexpr,
                     DELTA: tl.constexpr, QK_NORM: tl.constexpr, HAS_D: tl.constexpr, PER_COL: tl.constexpr):
        """Token i of the loop (i < A: a replayed one, from pend; else this forward's i - A): the state after it, and its
        output stored for this forward's tokens; the state after token AC - 1 (the replayed ones and this forward's
        first CT = AC - A) is written back. WRITE_PEND: the programs of `wtile` copy this forward's pending g and beta
        (its tokens from CT on) to `gw`/`bw` (PER_COL, Mamba v1: every program its own columns' dt, and the programs of
        `wtile` the B and C columns of the pending rows to `pw`, which the convolution does not write)."""
        replay = i < A
        t = tl.where(replay, i, i - A)
        row = tl.where(replay, pend_s + t * spt, new_row + t * snt)
        g_row = tl.where(replay, gp_s + t * sgpt, gn_row + t * sgnt)
        b_row = tl.where(replay, bp_s + t * sbpt, bn_row + t * sbnt)
        if PER_COL:  # Mamba v1: dt, one a value column
            beta = tl.load(b_row + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
        else:
            beta = tl.load(b_row + h).to(tl.float32)
        k = tl.load(row + K_OFF + kh * DK + kk, mask=km, other=0.0).to(tl.float32)
        if QK_NORM:
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        v = tl.load(row + V_OFF + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
        keep = (i >= AC) & wtile  # (WRITE_PEND) this forward's token left pending: its g and beta copied
        if PER_COL:  # Mamba v1: exp(dt[c] A[n, c]) per state element
            S = S * tl.exp(beta[None, :] * a_t)
            if WRITE_PEND:
                tl.store(bw + (i - AC) * sbpt + h * DV + vv, beta, mask=vm & (i >= AC))
                tl.store(pw + (i - AC) * spt + K_OFF + kh * DK + kk, k.to(pw.dtype.element_ty), mask=km & keep)
        elif G_VEC:  # Kimi Delta Attention: a decay per key channel
            gv = tl.load(g_row + h * DK + kk, mask=km, other=0.0)
            S = S * tl.exp(gv)[:, None]
            if WRITE_PEND:
                tl.store(gw + (i - AC) * sgpt + h * DK + kk, gv, mask=km & keep)
        else:
            gv = tl.load(g_row + h)
            S = S * tl.exp(gv)
            if WRITE_PEND:
                tl.store(gw + (i - AC) * sgpt + h, gv, mask=keep)
        if WRITE_PEND and not PER_COL:
            tl.store(bw + (i - AC) * sbpt + h, beta.to(bw.dtype.element_ty), mask=keep)
        if DELTA:
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
        else:  # Mamba: S <- S + B (dt x)^T
            delta = v * beta
        S = tl.fma(k[:, None], delta[None, :], S)
        tl.store(s_ptrs, S, mask=sm & (i == AC - 1))
        q = tl.load(row + Q_OFF + kh * DK + kk, mask=km & (i >= A), other=0.0).to(tl.float32)
        if PER_COL and WRITE_PEND:
            tl.store(pw + (i - AC) * spt + Q_OFF + kh * DK + kk, q.to(pw.dtype.element_ty), mask=km & keep)
        if QK_NORM:
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * SCALE
        o = tl.sum(S * q[:, None], axis=0)
        if HAS_D:  # Mamba's skip
            o = tl.fma(d_skip, v, o)
        tl.store(out_row + t * sot + h * soh + vv, o.to(out_row.dtype.element_ty), mask=vm & (i >= A))
        return S

    @triton.jit
    def _delta_kernel(new_ptr, meta_ptr, pend_ptr, gn_ptr, gp_ptr, bn_ptr, bp_ptr, s_ptr, out_ptr, d_ptr, a_ptr,
                      snt, sps, sph, spt, sgnt, sgps, sgph, sgpt, sbnt, sbps, sbph, sbpt, sss, ssh, sot, soh,
                      HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      Q_OFF: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, INTERP: tl.constexpr, G_VEC: tl.constexpr,
                      WRITE_PEND: tl.constexpr, DELTA: tl.constexpr, QK_NORM: tl.constexpr, HAS_D: tl.constexpr,
                      PER_COL: tl.constexpr):
        """One program: value head h of sequence b, value columns [v0, v0 + BLOCK_V). Tokens 0 .. A - 1 are the last
        forward's accepted ones (from pend/gp/bp: replayed, no output), A .. A + T - 1 this forward's; the state after
        the replayed ones and this forward's first CT is written back (the new committed state). q, k, v are columns of
        the conv output rows. WRITE_PEND: the programs of the first value-column tile copy this forward's pending g and
        beta of their head into the other half (the conv kernel copied its pending rows). PER_COL (Mamba v1): beta and
        D one a value column, the decay exp(beta A) from the A tile [dk, dv] of head h, loaded once."""
        b = tl.program_id(0) // HV
        h = tl.program_id(0) % HV
        slot, A, CT, half, row0, T = _meta(meta_ptr, b)
        kh = h // REP
        kk = tl.arange(0, BLOCK_K)
        vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        km = kk < DK
        vm = vv < DV
        sm = km[:, None] & vm[None, :]
        s_ptrs = s_ptr + slot * sss + h * ssh + kk[:, None] * DV + vv[None, :]
        new_row = new_ptr + row0 * snt
        gn_row = gn_ptr + row0 * sgnt
        bn_row = bn_ptr + row0 * sbnt
        out_row = out_ptr + row0 * sot
        pend_s = pend_ptr + slot * sps + half * sph
        gp_s = gp_ptr + slot * sgps + half * sgph
        bp_s = bp_ptr + slot * sbps + half * sbph
        gw = gp_ptr + slot * sgps + (1 - half) * sgph
        bw = bp_ptr + slot * sbps + (1 - half) * sbph
        pw = pend_ptr + slot * sps + (1 - half) * sph
        wtile = tl.program_id(1) == 0
        AC = A + CT
        if PER_COL:
            d_skip = tl.load(d_ptr + h * DV + vv, mask=vm & HAS_D, other=0.0).to(tl.float32)
            a_t = tl.load(a_ptr + h * DK * DV + kk[:, None] * DV + vv[None, :], mask=sm, other=0.0)
        else:
            d_skip = tl.load(d_ptr + h).to(tl.float32) if HAS_D else 0.0
            a_t = 0.0
        S = tl.load(s_ptrs, mask=sm, other=0.0)
        if INTERP:  # Triton's interpreter cannot run a range() over a kernel argument
            i = 0
            while i < A + T:
                S = _delta_token(S, i, A, AC, h, kh, kk, vv, km, vm, sm, s_ptrs, new_row, pend_s, gn_row, gp_s, bn_row,
                                 bp_s, out_row, gw, bw, pw, wtile, a_t, snt, spt, sgnt, sgpt, sbnt, sbpt, sot, soh,
                                 d_skip, DK, DV, Q_OFF, K_OFF, V_OFF, SCALE, G_VEC, WRITE_PEND, DELTA, QK_NORM, HAS_D,
                                 PER_COL)
                i += 1
        else:
            for i in range(A + T):
                S = _delta_token(S, i, A, AC, h, kh, kk, vv, km, vm, sm, s_ptrs, new_row, pend_s, gn_row, gp_s, bn_row,
                                 bp_s, out_row, gw, bw, pw, wtile, a_t, snt, spt, sgnt, sgpt, sbnt, sbpt, sot, soh,
                                 d_skip, DK, DV, Q_OFF, K_OFF, V_OFF, SCALE, G_VEC, WRITE_PEND, DELTA, QK_NORM, HAS_D,
                                 PER_COL)

def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and runtime.triton_usable(x.device)


_META_CACHE: dict = {}


def _dense_meta(batch: int, t: int, a: int, commit: int, device) -> torch.Tensor:
    """The kernels' per-sequence rows for a [B, T, ...] batch on GDNState (slot b, rows b * T ..; cached: a forward's
    layers share it, and a verify loop repeats a few shapes)."""
    key = (batch, t, a, commit, str(device))
    m = _META_CACHE.get(key)
    if m is None:
        if len(_META_CACHE) > 256:
            _META_CACHE.clear()
        m = _META_CACHE[key] = torch.tensor([[b, a, commit, 0, b * t, t] for b in range(batch)], dtype=torch.int32,
                                            device=device)
    return m


def _launch_conv(x2: torch.Tensor, meta: torch.Tensor, sequences: int, hist: torch.Tensor, pend: torch.Tensor,
                 pend_out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out2: torch.Tensor,
                 write_pend: bool, act: bool = True) -> None:
    """x2/out2 [rows, C]; hist [slots, K - 1, C]; pend / pend_out [slots, halves, P, C] (4-D) or [slots, P, C]."""
    c = x2.shape[-1]
    k = weight.shape[-1]
    half_stride = pend.stride(1) if pend.dim() == 4 else 0
    block_c = 256
    _conv_kernel[(sequences, triton.cdiv(c, block_c))](
        x2, meta, hist, pend, pend_out, weight.contiguous(), bias if bias is not None else weight, out2, c,
        x2.stride(0), hist.stride(0), hist.stride(1), pend.stride(0), half_stride, pend.stride(-2), out2.stride(0),
        K=k, HAS_BIAS=bias is not None, BLOCK_C=block_c, BLOCK_H=max(2, triton.next_power_of_2(k - 1)),
        INTERP=runtime.interpreting(), WRITE_PEND=write_pend, ACT=act)


def _launch_delta(mixed2, g2, beta2, meta, sequences: int, pend, pg, pb, S, out3, hk: int, hv: int, dk: int, dv: int,
                  write_pend: bool, rule: Rule = GDN_RULE) -> None:
    """mixed2 [rows, C], g2 [rows, Hv(*dk)], beta2 [rows, Hv] (Mamba v1: [rows, Hv * dv], and g2 is not read), out3
    [rows, Hv, dv]; pend/pg/pb per slot (and half)."""
    half = lambda x: x.stride(1) if x.dim() == 4 else 0  # noqa: E731
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(32, max(16, triton.next_power_of_2(dv)))
    q_off, k_off, v_off = _offsets(rule, hk, hv, dk, dv)
    _delta_kernel[(sequences * hv, triton.cdiv(dv, block_v))](
        mixed2, meta, pend, g2, pg, beta2, pb, S, out3, rule.D if rule.D is not None else S,
        rule.A if rule.A is not None else S,
        mixed2.stride(0), pend.stride(0), half(pend), pend.stride(-2), g2.stride(0), pg.stride(0), half(pg),
        pg.stride(-2), beta2.stride(0), pb.stride(0), half(pb), pb.stride(-2), S.stride(0), S.stride(1),
        out3.stride(0), out3.stride(1),
        HV=hv, REP=hv // hk, DK=dk, DV=dv, Q_OFF=q_off, K_OFF=k_off, V_OFF=v_off, SCALE=1.0 / math.sqrt(dk),
        BLOCK_K=block_k, BLOCK_V=block_v, INTERP=runtime.interpreting(), G_VEC=g2.dim() == 3, WRITE_PEND=write_pend,
        DELTA=rule.delta, QK_NORM=rule.qk_norm, HAS_D=rule.D is not None, PER_COL=rule.per_column, num_warps=4)


def _offsets(rule: Rule, hk: int, hv: int, dk: int, dv: int) -> tuple[int, int, int]:
    """(q, k, v) column offsets in a conv output row: q | k | v, or Mamba-2's x | B | C."""
    if rule.layout == "xbc":
        return hv * dv + hk * dk, hv * dv, 0
    return 0, hk * dk, 2 * hk * dk


def causal_conv(x: torch.Tensor, state: GDNState, weight: torch.Tensor, bias: torch.Tensor | None = None,
                commit: int = 0, act: bool = True) -> torch.Tensor:
    """SiLU(causal depthwise conv) (`act`; else the conv) of x [B, T, C] after the state's committed inputs and its
    pending accepted ones; updates `state.hist` to the committed inputs, those and x's first `commit` tokens included (the kernel, or the
    reference off Triton). weight [C, K]."""
    pend = state.pending[0] if state.pending is not None else None
    a = state.accepted if pend is not None else 0
    if not _use_triton(x):
        out, state.hist = causal_conv_ref(x, state.hist, pend, a, weight, bias, commit, act)
        return out
    b, t, c = x.shape
    x = x.contiguous()
    p = pend if pend is not None else x
    out = torch.empty_like(x)
    _launch_conv(x.view(b * t, c), _dense_meta(b, t, a, commit, x.device), b, state.hist, p, p, weight, bias,
                 out.view(b * t, c), False, act)
    return out


def gated_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: GDNState, hk: int, hv: int, dk: int,
                dv: int, commit: int = 0, rule: Rule = GDN_RULE) -> torch.Tensor:
    """The gated delta rule over this forward's tokens after replaying the pending accepted ones: mixed [B, T, C] the
    conv outputs (q | k | v columns), g [B, T, Hv] float32, beta [B, T, Hv]; returns [B, T, Hv, dv] in mixed's dtype
    (Mamba v1's: float32) and leaves `state.S` the committed state: after the replayed tokens and this forward's first
    `commit`. `rule`: another recurrence on the same loop (Mamba-2's, Mamba v1's)."""
    b, t, _ = mixed.shape
    pend = state.pending
    a = state.accepted if pend is not None else 0
    if not _use_triton(mixed):
        if a:
            pm, pg, pb = pend[1][:, :a], pend[2][:, :a], pend[3][:, :a]
            _, state.S = gated_delta_ref(*_split(pm, hk, hv, dk, dv, rule), pg, pb, state.S, rule)
        out, _ = gated_delta_ref(*_split(mixed, hk, hv, dk, dv, rule), g, beta, state.S, rule)
        if commit:
            _, state.S = gated_delta_ref(*_split(mixed[:, :commit], hk, hv, dk, dv, rule), g[:, :commit],
                                         beta[:, :commit], state.S, rule)
        return out
    out = torch.empty(b, t, hv, dv, dtype=torch.float32 if rule.per_column else mixed.dtype, device=mixed.device)
    pm, pg, pb = (pend[1], pend[2], pend[3]) if pend is not None else (mixed, g, beta)
    rows = b * t
    _launch_delta(mixed.reshape(rows, -1), g.reshape(rows, *g.shape[2:]), beta.reshape(rows, -1),
                  _dense_meta(b, t, a, commit, mixed.device), b, pm, pg.flatten(2) if pg.dim() == 4 else pg, pb,
                  state.S, out.view(rows, hv, dv), hk, hv, dk, dv, False, rule)
    return out


def _split(mixed: torch.Tensor, hk: int, hv: int, dk: int, dv: int, rule: Rule = GDN_RULE):
    b, t, _ = mixed.shape
    qo, ko, vo = _offsets(rule, hk, hv, dk, dv)
    q = mixed[..., qo: qo + hk * dk].reshape(b, t, hk, dk)
    k = mixed[..., ko: ko + hk * dk].reshape(b, t, hk, dk)
    v = mixed[..., vo: vo + hv * dv].reshape(b, t, hv, dv)
    return q, k, v


# ---- the layer's forward -------------------------------------------------------------------------------------------
def _dims(module) -> tuple[int, int, int, int]:
    """(key heads, value heads, key width, value width) of a Gated DeltaNet or Kimi Delta Attention module; Mamba-2's
    (groups, heads, state size, head width); a short convolution has no recurrence: zeros."""
    if is_short_conv(module):
        return 0, 0, 0, 0
    if is_mamba2(module):
        return module.n_groups, module.num_heads, module.ssm_state_size, module.head_dim
    if is_mamba1(module):
        return 1, 1, module.ssm_state_size, module.intermediate_size
    if is_kimi_delta(module):
        return module.num_heads, module.num_heads, module.head_dim, module.head_dim
    return module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim


def _layer_state(module, cache, batch: int, channels: int, dtype, device) -> GDNState:
    """The layer's GDNState in `cache` (made on the first forward, with the cache layer's `crop` routed to it); a fresh
    one without a cache."""
    _, hv, dk, dv = _dims(module)
    fresh = lambda: GDNState.zeros(batch, hv, dk, dv, _conv(module).kernel_size[0], channels, dtype, device)
    if cache is None:
        return fresh()
    layer = cache.layers[module.layer_idx]
    st = getattr(layer, "_pdflash_gdn", None)
    if st is None or st.S.shape[0] != batch:
        st = layer._pdflash_gdn = fresh()
        layer.crop = lambda n, layer=layer: _crop(layer, n)
    return st


def _crop(layer, n: int) -> None:
    """transformers' `crop` of a cache layer this module's state lives on: `n` <= 0 tokens to drop from the last
    forward (0: none; the count of a positive legacy length is not known here and is refused)."""
    if n > 0:
        raise RuntimeError("a Gated DeltaNet layer's cache is cropped by a negative count of tokens to drop")
    layer._pdflash_gdn.drop(-n)
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor) and n:
        count.sub_(-n)


def _conv(module) -> torch.nn.Conv1d:
    """The layer's depthwise convolution (`conv1d`; LFM2's short convolution: `conv`)."""
    return module.conv if is_short_conv(module) else module.conv1d


def _conv_params(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    conv = _conv(module)
    return conv.weight.squeeze(1), conv.bias


def _cache_of(cache, kwargs):
    return cache if cache is not None else (kwargs.pop("cache_params", None) or kwargs.pop("past_key_values", None))


def _masked(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' apply_mask_to_padding_states: padded rows of a batch zeroed."""
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[0] > 1 and attention_mask.shape[1] > 1:
        return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return hidden_states


def _mix(module, cache, mixed: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
         after_conv=None) -> torch.Tensor:
    """The convolution and the delta rule of one layer's forward over its session state in `cache`; [B, T, Hv, dv] (a
    short convolution, g and beta None: the convolution's output [B, T, C]). `after_conv` (Mamba v1, g and beta None):
    the convolution's output -> (the delta rule's rows x | B | C, g, beta), computed between the two kernels."""
    step = getattr(cache, "linear_step", None)  # the paged forward (verifier_svc.runner): a slot per session
    if step is not None:
        return paged_mix(module, step.states.layers[module.layer_idx], step.meta, step.rows, mixed, g, beta, after_conv)
    bsz, t, _ = mixed.shape
    hk, hv, dk, dv = _dims(module)
    short = g is None and after_conv is None
    mixed = mixed.contiguous()
    st = _layer_state(module, cache, bsz, mixed.shape[-1], mixed.dtype, mixed.device)
    commit = max(0, t - ROLLBACK_TOKENS) if cache is not None else 0
    conv = causal_conv(mixed, st, *_conv_params(module), commit, act=not short)
    rows = conv
    if after_conv is not None:
        rows, g, beta = after_conv(conv)
        rows = rows.contiguous()
    if not short:
        g, beta = g.contiguous(), beta.contiguous()
    core = conv if short else gated_delta(rows, g, beta, st, hk, hv, dk, dv, commit, _rule(module))
    if cache is not None:
        pending = (mixed, rows, g, beta)
        if commit:  # (copies: the slices would keep the whole prompt's tensors alive)
            pending = tuple(x[:, commit:].clone() if x is not None else None for x in pending)
        st.pending, st.accepted = pending, t - commit
        count = getattr(cache.layers[module.layer_idx], "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.add_(t)
    return core


def forward(module, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """A Gated DeltaNet layer's forward on these kernels (the module's own projections, norm and output projection;
    under the installer's dispatch mode its linears are the batch-invariant ones)."""
    cache = _cache_of(cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    bsz, t, _ = hidden_states.shape
    _, hv, _, dv = _dims(module)
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                               module.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(bsz, t, -1) for x in (q, k, v)], dim=-1)
    else:
        mixed = module.in_proj_qkv(hidden_states)
        z = module.in_proj_z(hidden_states).reshape(bsz, t, -1, dv)
        b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
    beta = b.reshape(bsz, t, hv).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.reshape(bsz, t, hv).float() + module.dt_bias)
    core = _mix(module, cache, mixed, g, beta)
    out = module.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(bsz, t, -1)
    return module.out_proj(out)


def is_short_conv(module) -> bool:
    """LFM2's short convolution layer (lfm2, lfm2_moe): in_proj to B, C, x; B * x through a depthwise causal convolution
    (no activation); C times it; out_proj."""
    conv = getattr(module, "conv", None)
    return (isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
            and all(hasattr(module, p) for p in ("in_proj", "out_proj", "layer_idx", "conv_kernel_size")))


def short_conv_forward(module, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                       **kwargs):
    """LFM2's short convolution layer on the convolution kernel (its projections are the module's own)."""
    cache = _cache_of(cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    b, c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    conv = _mix(module, cache, b * x, None, None)
    return module.out_proj(c * conv)


def layer_forward(module):
    """The forward these kernels give `module` (Gated DeltaNet, Kimi Delta Attention, Mamba-2, Mamba v1, LFM2's short
    convolution), or None for any other module."""
    if is_gated_delta_net(module):
        return forward
    if is_kimi_delta(module):
        return kda_forward
    if is_mamba2(module):
        return mamba2_forward
    if is_mamba1(module):
        return mamba1_forward
    return short_conv_forward if is_short_conv(module) else None


def is_mamba2(module) -> bool:
    """A Mamba-2 mixer (granitemoehybrid; bamba, nemotron_h, falcon_h1 name the same parts): in_proj to gate | x B C |
    dt, a SiLU causal convolution over x B C, the selective state space scan (`A_log`, `dt_bias`, `D`), a gated norm,
    out_proj."""
    parts = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "n_groups", "ssm_state_size", "head_dim",
             "num_heads", "intermediate_size", "conv_dim", "time_step_limit", "layer_idx")
    return all(hasattr(module, p) for p in parts) and getattr(module, "activation", "silu") in ("silu", "swish")


def mamba2_forward(module, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """A Mamba-2 mixer's forward on these kernels: the token-by-token scan `S <- exp(dt A) S + B (dt x)^T`,
    `y = S^T C + D x` (the delta kernel without normalization or correction), dt = softplus(dt + dt_bias) within
    time_step_limit; the module's own projections and gated norm."""
    cache = _cache_of(cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    bsz, t, _ = hidden_states.shape
    gate, xbc, dt = module.in_proj(hidden_states).split([module.intermediate_size, module.conv_dim, module.num_heads],
                                                        dim=-1)
    dt = F.softplus(dt.float() + module.dt_bias.float())
    lo, hi = module.time_step_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(lo, hi)
    g = dt * -torch.exp(module.A_log.float())
    core = _mix(module, cache, xbc, g, dt)
    out = module.norm(core.reshape(bsz, t, -1), gate)
    return module.out_proj(out.to(hidden_states.dtype))


def is_mamba1(module) -> bool:
    """A Mamba (v1) mixer of Jamba's form: in_proj to x | gate, a SiLU causal convolution over x, x_proj to dt | B | C
    (each through its RMSNorm: dt_layernorm, b_layernorm, c_layernorm), dt_proj, the selective scan with A [channels,
    state] (`A_log`) and D, out_proj."""
    parts = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "dt_layernorm", "b_layernorm",
             "c_layernorm", "ssm_state_size", "intermediate_size", "time_step_rank", "layer_idx")
    return (all(hasattr(module, p) for p in parts) and not hasattr(module, "n_groups")
            and getattr(module, "activation", "silu") in ("silu", "swish"))


def _mamba1_a(module) -> torch.Tensor:
    """Mamba v1's A as the kernel reads it: -exp(A_log) [channels, state] float32, transposed to [1, state, channels]
    (made once per A_log version and device, so a forward and a CUDA graph launch nothing for it)."""
    key = (module.A_log.data_ptr(), module.A_log._version, module.A_log.device)
    got = getattr(module, "_pdflash_a", None)
    if got is None or got[0] != key:
        a = (-torch.exp(module.A_log.detach().float())).t().contiguous()[None]
        got = module._pdflash_a = (key, a)
    return got[1]


def mamba1_forward(module, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """A Mamba v1 mixer's forward (Jamba) on these kernels: the convolution kernel over x, then x_proj, the dt / B / C
    norms and dt_proj (the module's own, on the invariant linears), then the delta kernel's Mamba v1 rule token by token:
    `S <- exp(dt A) * S + B (dt x)^T` per (state, channel) element, `y = S^T C + D x`, dt = softplus(dt_proj(dt) +
    bias) in float32; y * SiLU(gate) in float32, then out_proj."""
    cache = _cache_of(cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    bsz, t, _ = hidden_states.shape
    x, gate = module.in_proj(hidden_states).chunk(2, dim=-1)
    ds = module.ssm_state_size

    def ssm_inputs(conv: torch.Tensor):
        conv = _masked(conv, attention_mask)
        ts, b, c = module.x_proj(conv).split([module.time_step_rank, ds, ds], dim=-1)
        ts, b, c = module.dt_layernorm(ts), module.b_layernorm(b), module.c_layernorm(c)
        dt = F.softplus(F.linear(ts, module.dt_proj.weight).float() + module.dt_proj.bias.float())
        return torch.cat([conv, b.to(conv.dtype), c.to(conv.dtype)], dim=-1), dt, dt

    core = _mix(module, cache, x, None, None, ssm_inputs)  # [B, T, 1, channels] float32
    y = core.reshape(bsz, t, -1) * F.silu(gate.float())
    return module.out_proj(y.to(hidden_states.dtype))


def is_kimi_delta(module) -> bool:
    """A Kimi Delta Attention layer (Kimi Linear): the gated delta rule with a decay per key channel."""
    parts = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj",
             "num_heads", "head_dim")
    return all(hasattr(module, p) for p in parts) and getattr(module, "activation", "silu") in ("silu", "swish")


def kda_forward(module, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """A Kimi Delta Attention layer's forward on these kernels (its projections, forget gate, gated norm and output
    projection are the module's own)."""
    cache = _cache_of(cache, kwargs)
    hidden_states = _masked(hidden_states, attention_mask)
    bsz, t, _ = hidden_states.shape
    shape = (bsz, t, -1, module.head_dim)
    mixed = torch.cat([module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)], dim=-1)
    g = module.forget_gate(hidden_states).float()  # [B, T, H, dk]
    beta = torch.sigmoid(module.b_proj(hidden_states))
    core = _mix(module, cache, mixed, g, beta)
    gate = module.g_b_proj(module.g_a_proj(hidden_states)).view(shape)
    return module.o_proj(module.o_norm(core, gate).reshape(bsz, t, -1))


# ---- the paged state: one slot per session ------------------------------------------------------------------------
class PagedGDN:
    """One Gated DeltaNet / Kimi Delta Attention layer's state for every session slot of a paged verifier (what
    verifier_svc.kv's LinearStates holds per layer): `S` [slots, Hv, dk, dv] float32 and `hist` [slots, K - 1, C] as of
    the slot's committed tokens, and its pending tokens (up to `pending` of them, the last forward's, which the next
    forward replays as far as it starts past them) in two halves that forwards alternate between: conv inputs `px`,
    conv outputs `pc` [slots, 2, P, W] (W = C; Mamba v1's rows are x | B | C, W = C + 2 dk, the convolution writing x
    and the delta kernel B and C; px as wide, so both share a row stride), g `pg` [slots, 2, P, Hv or Hv * dk] float32,
    beta `pb` [slots, 2, P, Hv] (Mamba v1's dt: Hv * dv). A forward reads one half and the kernels write the tokens it
    leaves pending into the other, so no program overwrites what another still replays."""

    def __init__(self, slots: int, hv: int, dk: int, dv: int, k: int, channels: int, per_channel: bool, pending: int,
                 dtype, device, beta_dtype=None, per_column: bool = False):
        width = channels + (2 * dk if per_column else 0)
        self.S = torch.zeros(slots, hv, dk, dv, dtype=torch.float32, device=device)
        self.hist = torch.zeros(slots, k - 1, channels, dtype=dtype, device=device)
        self.px = torch.zeros(slots, 2, pending, width, dtype=dtype, device=device)
        self.pc = torch.zeros_like(self.px)
        self.pg = torch.zeros(slots, 2, pending, hv * (dk if per_channel else 1), dtype=torch.float32, device=device)
        self.pb = torch.zeros(slots, 2, pending, hv * (dv if per_column else 1), dtype=beta_dtype or dtype,
                              device=device)

    @classmethod
    def for_module(cls, module, slots: int, pending: int, dtype, device) -> "PagedGDN":
        hk, hv, dk, dv = _dims(module)
        return cls(slots, hv, dk, dv, _conv(module).kernel_size[0], _channels(module), is_kimi_delta(module), pending,
                   dtype, device, _beta_dtype(module, dtype), is_mamba1(module))

    @staticmethod
    def slot_bytes(module, pending: int, dtype) -> int:
        """Device bytes of one slot of `module`'s state."""
        hk, hv, dk, dv = _dims(module)
        c, e = _channels(module), torch.empty((), dtype=dtype).element_size()
        w = c + (2 * dk if is_mamba1(module) else 0)
        g = hv * (dk if is_kimi_delta(module) else 1)
        eb = torch.empty((), dtype=_beta_dtype(module, dtype)).element_size() * (dv if is_mamba1(module) else 1)
        return 4 * hv * dk * dv + (_conv(module).kernel_size[0] - 1) * c * e + 2 * pending * (2 * w * e + 4 * g + hv * eb)

    def reset(self, slot: int) -> None:
        """A new session's slot: no tokens yet (its pending halves are never read before being written)."""
        self.S[slot].zero_()
        self.hist[slot].zero_()


def _channels(module) -> int:
    """The convolution's channels: q | k | v of a delta-rule layer, LFM2's hidden size."""
    hk, hv, dk, dv = _dims(module)
    if is_short_conv(module) or is_mamba1(module):  # (Mamba v1: x alone; B and C come after it, from x_proj)
        return _conv(module).in_channels
    return 2 * hk * dk + hv * dv  # (Mamba-2: x | B | C)


def _beta_dtype(module, dtype):
    """beta's dtype: the model's (a sigmoid of a projection), or Mamba's dt, float32."""
    return torch.float32 if is_mamba2(module) or is_mamba1(module) else dtype


def _rule(module) -> Rule:
    if is_mamba1(module):
        return Rule(delta=False, qk_norm=False, layout="xbc", D=module.D, A=_mamba1_a(module))
    return Rule(delta=False, qk_norm=False, layout="xbc", D=module.D) if is_mamba2(module) else GDN_RULE


def paged_mix(module, states: PagedGDN, meta: torch.Tensor, meta_rows: list | None, mixed: torch.Tensor,
              g: torch.Tensor | None, beta: torch.Tensor | None, after_conv=None) -> torch.Tensor:
    """The convolution and the delta rule of one layer over a paged forward's rows ([1, R, ...]: one or several
    sessions' rows one after the other, `meta` [S, 6] int32 on the device, the same rows on the host in `meta_rows`);
    [1, R, Hv, dv] (a short convolution, g None: [1, R, C]), zero in rows no sequence holds (a CUDA graph's padding).
    `after_conv` (Mamba v1): as `_mix`'s, on the convolution's [1, R, C] output."""
    hk, hv, dk, dv = _dims(module)
    short = g is None and after_conv is None
    x2 = mixed[0].contiguous()
    c = x2.shape[-1]
    conv = torch.zeros_like(x2)
    rule = _rule(module)
    out = conv if short else torch.zeros(x2.shape[0], hv, dv, dtype=torch.float32 if rule.per_column else x2.dtype,
                                         device=x2.device)
    w, bias = _conv_params(module)
    if _use_triton(x2):
        _launch_conv(x2, meta, meta.shape[0], states.hist, states.px, states.pc, w, bias, conv, True, act=not short)
        if short:
            return out[None]
        rows, g, beta = after_conv(conv[None]) if after_conv is not None else (conv[None], g, beta)
        _launch_delta(rows[0].contiguous(), g[0].contiguous(), beta[0].contiguous(), meta, meta.shape[0], states.pc,
                      states.pg, states.pb, states.S, out, hk, hv, dk, dv, True, rule)
        return out[None]
    seqs = [r for r in (meta_rows if meta_rows is not None else meta.tolist()) if r[5]]  # the references (CPU)
    for slot, a, ct, half, row0, t in seqs:
        x = x2[row0: row0 + t][None]
        y, hist = causal_conv_ref(x, states.hist[slot: slot + 1], states.px[slot: slot + 1, half, :, :c], a, w, bias,
                                  ct, act=not short)
        states.hist[slot] = hist[0]
        conv[row0: row0 + t] = y[0]
        states.px[slot, 1 - half, :t - ct, :c] = x[0, ct:]
        states.pc[slot, 1 - half, :t - ct, :c] = y[0, ct:]
    if short:
        return out[None]
    rows, g, beta = after_conv(conv[None]) if after_conv is not None else (conv[None], g, beta)
    for slot, a, ct, half, row0, t in seqs:
        keep, w_half = t - ct, 1 - half
        y = rows[:, row0: row0 + t]
        gs, bs = g[0, row0: row0 + t][None], beta[0, row0: row0 + t][None]
        S = states.S[slot: slot + 1]
        if a:
            pb = states.pb[slot: slot + 1, half, :a]
            pg = pb if rule.per_column else states.pg[slot: slot + 1, half, :a].view(1, a, *gs.shape[2:])
            _, S = gated_delta_ref(*_split(states.pc[slot: slot + 1, half, :a], hk, hv, dk, dv, rule), pg, pb, S, rule)
        o, _ = gated_delta_ref(*_split(y, hk, hv, dk, dv, rule), gs, bs, S, rule)
        if ct:
            _, S = gated_delta_ref(*_split(y[:, :ct], hk, hv, dk, dv, rule), gs[:, :ct], bs[:, :ct], S, rule)
        states.S[slot] = S[0]
        out[row0: row0 + t] = o[0]
        states.pc[slot, w_half, :keep] = y[0, ct:]
        if not rule.per_column:  # (Mamba v1's g is its dt, kept in pb)
            states.pg[slot, w_half, :keep] = gs[0, ct:].reshape(keep, -1)
        states.pb[slot, w_half, :keep] = bs[0, ct:]
    return out[None]
