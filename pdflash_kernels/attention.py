"""Batch-invariant causal attention over a KV cache (GQA, sliding window, gpt-oss sinks), split over the KV.

Keys are visited in chunks aligned to absolute positions (chunk c = positions [c*BN, (c+1)*BN)), and chunks are
grouped into segments of SEG_CHUNKS chunks, also at fixed absolute positions. A query's softmax state (running max,
sum, weighted values) is accumulated over each segment on its own, from empty, chunk by chunk in ascending order;
then the segments' states are merged in ascending segment order (`_merge`), and the sinks and the division come last.
A chunk or a segment that is fully masked for a query leaves its state bit for bit unchanged, so a query's result
depends only on its own position and the keys it may see: not on the number of queries sharing the call (1 token or
a 32-token block), nor on where the cache's tensor starts (a sliding-window layer keeps only the last W keys).

A program owns a tile of BLOCK_M (query, head) rows of one KV head: the GROUP query heads of that KV head for
consecutive tokens, so a key chunk is read once for all of them (GQA). How the segments are spread over programs is
free, since every segment is computed the same way and merged in the same order:
- one program per tile (`programs` 1: prefills, the non-paged path) walks the segments itself and merges each into
  its running state as it goes;
- `programs` P > 1 (paged verify forwards, T <= SPLIT_MAX_T): P programs per tile take every P-th segment and store
  each segment's state; the tile's last program to finish (an atomic counter as a semaphore, as pdflash_kernels/linear.py's
  one-launch split-K) merges all of them in segment order. A long context is then walked by P programs at once
  instead of one, with the same bits.
"""

from __future__ import annotations

import os

import torch

from pdflash_kernels import linear, runtime

triton, tl = runtime.triton, runtime.tl
to_out = runtime.to_out if triton is not None else None

BLOCK_M = 16
BLOCK_N = 64
SEG_CHUNKS = 4  # chunks per KV segment (256 positions)
SEG = SEG_CHUNKS * BLOCK_N
DIRECT_SEGS = 2  # a context of at most this many segments is walked by one program even in the split form
SPLIT_MAX_T = 32  # paged calls of at most this many tokens (the largest verify graph) spread a tile's segments over programs
# programs per tile in the split form (1 = every call walks its segments in one program: the same bits, for A/B runs)
_PROGRAMS = os.environ.get("PDFLASH_ATTENTION_PROGRAMS", "16")
if not (_PROGRAMS.isdigit() and 1 <= int(_PROGRAMS) <= 256):
    raise ValueError(f"PDFLASH_ATTENTION_PROGRAMS must be a number of programs, 1..256, got {_PROGRAMS!r}")
MAX_PROGRAMS = int(_PROGRAMS)
# the split form's per-segment states are sized for every tile of the largest call at the longest context a page table
# allows (gpt-oss-20b's 131072 positions: ~270 MB a sequence, by arithmetic); a call that would need more than this many MiB of them
# (a multi-session wave of long-context sequences) runs one program per tile instead (the same bits)
_WS_MB = os.environ.get("PDFLASH_ATTENTION_WORKSPACE_MB", "1024")
if not (_WS_MB.isdigit() and 1 <= int(_WS_MB) <= 1 << 20):
    raise ValueError(f"PDFLASH_ATTENTION_WORKSPACE_MB must be a number of MiB, 1..1048576, got {_WS_MB!r}")
WORKSPACE_MAX_BYTES = int(_WS_MB) << 20


if triton is not None:

    @triton.jit
    def _attn_chunk(
        c, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs, kpos0, S, last, scaling, window,
        kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
        HAS_KMASK: tl.constexpr, BLOCK_N: tl.constexpr, F32DOT: tl.constexpr, PAGED: tl.constexpr,
        DR: tl.constexpr, BLOCK_DR: tl.constexpr, V_IS_K: tl.constexpr,
    ):
        kp = c + tl.arange(0, BLOCK_N)
        j = kp - kpos0
        k_ok = (j >= 0) & (j < S)
        if PAGED:  # a chunk is one page of the pool: [pages, Hkv, BLOCK_N, D], the page from the session's table
            page = tl.load(table_ptr + b * stb + c // BLOCK_N).to(tl.int64)
            koff = page * skp + (kp - c)[:, None] * sks
            voff = page * svp + (kp - c)[:, None] * svs
        else:
            koff = j[:, None] * sks
            voff = j[:, None] * svs
        kt = tl.load(k_ptr + kbase + koff + dd[None, :], mask=k_ok[:, None], other=0.0)
        if F32DOT:
            kt = kt.to(tl.float32)
        if V_IS_K:  # multi-head latent attention: the values are the latent keys themselves
            vt = kt
        else:
            vt = tl.load(v_ptr + vbase + voff + dd[None, :], mask=k_ok[:, None], other=0.0)
            if F32DOT:
                vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt))
        if BLOCK_DR > 0:  # MLA's decoupled rotary part: its own query and key pool, added to the latent score
            drr = tl.arange(0, BLOCK_DR)
            if PAGED:
                roff = page * skrp + (kp - c)[:, None] * skrs
            else:
                roff = j[:, None] * skrs
            krt = tl.load(kr_ptr + krbase + roff + drr[None, :], mask=k_ok[:, None] & (drr < DR)[None, :], other=0.0)
            if F32DOT:
                krt = krt.to(tl.float32)
            s += tl.dot(qr, tl.trans(krt))
        s = s * scaling
        allowed = k_ok[None, :] & (kp[None, :] <= qpos[:, None])
        if window > 0:
            allowed = allowed & (kp[None, :] > qpos[:, None] - window)
        if HAS_KMASK:
            km = tl.load(kmask_ptr + b * smb + kp, mask=(kp >= 0) & (kp <= last), other=0)
            allowed = allowed & (km != 0)[None, :]
        s = tl.where(allowed, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32DOT:
            pv = tl.dot(p, vt)
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _segment(
        s, c0, hi, q, qpos, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs, kpos0, S, last, scaling, window,
        kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
        HAS_KMASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_CHUNKS: tl.constexpr,
        D: tl.constexpr, F32DOT: tl.constexpr, PAGED: tl.constexpr,
        DR: tl.constexpr, BLOCK_DR: tl.constexpr, V_IS_K: tl.constexpr,
    ):
        """Segment s's state, from empty, over its chunks in ascending order (those from c0 up to hi)."""
        # a finite "minus infinity" for the running max: exp(m - m) = 1 for a row that has seen no key yet, never NaN
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        c_lo = tl.maximum(s * (SEG_CHUNKS * BLOCK_N), c0)
        c_hi = tl.minimum((s + 1) * (SEG_CHUNKS * BLOCK_N) - 1, hi)
        if F32DOT:  # Triton's interpreter cannot run a range() whose bounds were loaded from memory
            c = c_lo
            while c <= c_hi:
                m_i, l_i, acc = _attn_chunk(c, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs,
                                            kpos0, S, last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                                            HAS_KMASK, BLOCK_N, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
                c += BLOCK_N
        else:
            for c in range(c_lo, c_hi + 1, BLOCK_N):
                m_i, l_i, acc = _attn_chunk(c, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs,
                                            kpos0, S, last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                                            HAS_KMASK, BLOCK_N, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
        return m_i, l_i, acc

    @triton.jit
    def _merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
        """Two softmax states -> one (a the earlier keys). Explicit fmas: the same rounding wherever it is compiled.
        A state that has seen no key (m = -1e30, l = 0, acc = 0) merges as an exact no-op, on either side."""
        m = tl.maximum(m_a, m_b)
        wa = tl.exp(m_a - m)
        wb = tl.exp(m_b - m)
        l_m = tl.fma(l_a, wa, l_b * wb)
        acc_m = tl.fma(acc_a, wa[:, None], acc_b * wb[:, None])
        return m, l_m, acc_m

    @triton.jit
    def _walk_step(
        c, c0, m_t, l_t, acc_t, m_i, l_i, acc, q, qpos, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs, kpos0, S, last,
        scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
        HAS_KMASK: tl.constexpr, BLOCK_N: tl.constexpr, SEG_CHUNKS: tl.constexpr, F32DOT: tl.constexpr, PAGED: tl.constexpr,
        DR: tl.constexpr, BLOCK_DR: tl.constexpr, V_IS_K: tl.constexpr,
    ):
        """Chunk c of `_walk`: at a segment's first chunk (not the walk's first) the segment so far is merged into the
        total and the segment state starts again from empty; then the chunk."""
        new = (c % (SEG_CHUNKS * BLOCK_N) == 0) & (c != c0)
        m_n, l_n, acc_n = _merge(m_t, l_t, acc_t, m_i, l_i, acc)
        m_t, l_t, acc_t = tl.where(new, m_n, m_t), tl.where(new, l_n, l_t), tl.where(new, acc_n, acc_t)
        m_i, l_i, acc = tl.where(new, -1.0e30, m_i), tl.where(new, 0.0, l_i), tl.where(new, 0.0, acc)
        m_i, l_i, acc = _attn_chunk(c, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs, kpos0, S,
                                    last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs, HAS_KMASK, BLOCK_N,
                                    F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
        return m_t, l_t, acc_t, m_i, l_i, acc

    @triton.jit
    def _walk(
        c0, hi, q, qpos, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs, kpos0, S, last, scaling, window,
        kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
        HAS_KMASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_CHUNKS: tl.constexpr,
        D: tl.constexpr, F32DOT: tl.constexpr, PAGED: tl.constexpr,
        DR: tl.constexpr, BLOCK_DR: tl.constexpr, V_IS_K: tl.constexpr,
    ):
        """Every segment from c0 to hi in one loop over the chunks (one loop the compiler can pipeline): at each
        segment's first chunk the state so far is merged into the total and starts again from empty, so the result
        is `_segment`'s of each segment, merged in order (the selects are exact)."""
        m_t = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        if F32DOT:  # Triton's interpreter cannot run a range() whose bounds were loaded from memory
            c = c0
            while c <= hi:
                m_t, l_t, acc_t, m_i, l_i, acc = _walk_step(
                    c, c0, m_t, l_t, acc_t, m_i, l_i, acc, q, qpos, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs,
                    kpos0, S, last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                    HAS_KMASK, BLOCK_N, SEG_CHUNKS, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
                c += BLOCK_N
        else:
            for c in range(c0, hi + 1, BLOCK_N):
                m_t, l_t, acc_t, m_i, l_i, acc = _walk_step(
                    c, c0, m_t, l_t, acc_t, m_i, l_i, acc, q, qpos, k_ptr, v_ptr, kbase, vbase, skp, svp, sks, svs,
                    kpos0, S, last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                    HAS_KMASK, BLOCK_N, SEG_CHUNKS, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
        return _merge(m_t, l_t, acc_t, m_i, l_i, acc)

    @triton.jit
    def _attn_kernel(
        q_ptr, sqb, sqh, sqt,
        k_ptr, skb, skh, sks,
        v_ptr, svb, svh, svs,
        o_ptr, sob, sot, soh,
        pos_ptr, spb,
        kmask_ptr, smb,
        sink_ptr,
        table_ptr, stb,
        qr_ptr, sqrb, sqrh, sqrt, kr_ptr, skrp, skrh, skrs,
        ws_ptr, ml_ptr, cnt_ptr, NSEG,
        cu_ptr,
        T, S, scaling, window,
        GROUP: tl.constexpr, D: tl.constexpr, HAS_SINK: tl.constexpr, HAS_KMASK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_CHUNKS: tl.constexpr, PROGRAMS: tl.constexpr,
        DIRECT_SEGS: tl.constexpr, F32DOT: tl.constexpr, PAGED: tl.constexpr,
        DR: tl.constexpr, BLOCK_DR: tl.constexpr, V_IS_K: tl.constexpr, RAGGED: tl.constexpr,
    ):
        runtime.pdl_begin()
        pid_m = tl.program_id(0)
        kh = tl.program_id(1)
        pid_z = tl.program_id(2)
        b = (pid_z // PROGRAMS).to(tl.int64)
        p = pid_z % PROGRAMS
        if RAGGED:  # sequence b = rows [cu[b], cu[b + 1]) of one row set (q [1, Hq, R, D], positions [1, R])
            s0 = tl.load(cu_ptr + b)
            T = tl.load(cu_ptr + b + 1) - s0  # its rows (0: an empty sequence, every row of the tile masked)
            xb = b * 0
        else:
            s0 = 0
            xb = b
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tile rows: (token, query head of this KV head), token-major
        row_ok = r < T * GROUP
        tok = r // GROUP
        h = kh * GROUP + r % GROUP
        dd = tl.arange(0, D)
        qpos = tl.load(pos_ptr + xb * spb + s0 + tok, mask=row_ok, other=0).to(tl.int64)
        last = tl.load(pos_ptr + xb * spb + s0 + T - 1, mask=T > 0, other=0).to(tl.int64)
        if PAGED:  # keys by absolute position through the page table; the last query's key is the last written
            kpos0 = last * 0
            S = last + 1
        else:
            kpos0 = last - (S - 1)  # absolute position of the cache tensor's key 0
        q = tl.load(q_ptr + xb * sqb + h[:, None] * sqh + (s0 + tok)[:, None] * sqt + dd[None, :], mask=row_ok[:, None],
                    other=0.0)
        if F32DOT:
            q = q.to(tl.float32)
        if BLOCK_DR > 0:
            drq = tl.arange(0, BLOCK_DR)
            qr = tl.load(qr_ptr + xb * sqrb + h[:, None] * sqrh + (s0 + tok)[:, None] * sqrt + drq[None, :],
                         mask=row_ok[:, None] & (drq < DR)[None, :], other=0.0)
            if F32DOT:
                qr = qr.to(tl.float32)
        else:
            qr = q
        hi = tl.max(tl.where(row_ok, qpos, -1), axis=0)
        lo = kpos0
        if window > 0:
            lo = tl.maximum(lo, tl.min(tl.where(row_ok, qpos, hi), axis=0) - window + 1)
        lo = tl.maximum(lo, 0)
        c0 = (lo // BLOCK_N) * BLOCK_N
        s_lo = c0 // (SEG_CHUNKS * BLOCK_N)
        nseg = (hi // (SEG_CHUNKS * BLOCK_N) - s_lo + 1).to(tl.int32)
        krbase = kh * skrh
        if PAGED:
            kbase = kh * skh
            vbase = kh * svh
        else:
            kbase = b * skb + kh * skh
            vbase = b * svb + kh * svh
        m_t = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
        l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        done = p < nseg  # this program has segments, and (one program per tile) holds the tile's result
        if PROGRAMS == 1:  # (a constexpr branch: the split form's semaphore is not compiled, its buffers are dummies)
            m_t, l_t, acc_t = _walk(c0, hi, q, qpos, k_ptr, v_ptr, kbase, vbase, skb, svb, sks, svs, kpos0, S, last,
                                    scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                                    HAS_KMASK, BLOCK_M, BLOCK_N, SEG_CHUNKS, D, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
        elif nseg <= DIRECT_SEGS:  # a short context: program 0 walks it (the others have none)
            done = p == 0
            if done:
                m_t, l_t, acc_t = _walk(c0, hi, q, qpos, k_ptr, v_ptr, kbase, vbase, skb, svb, sks, svs, kpos0, S, last,
                                        scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                                        HAS_KMASK, BLOCK_M, BLOCK_N, SEG_CHUNKS, D, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
        else:
            tile = (b * tl.num_programs(1) + kh) * tl.num_programs(0) + pid_m
            ws = ws_ptr + tile * NSEG * BLOCK_M * D
            ml = ml_ptr + tile * NSEG * 2 * BLOCK_M
            i = p.to(tl.int32)
            while i < nseg:  # segments p, p + PROGRAMS, ...: each state stored on its own
                m_s, l_s, acc_s = _segment(s_lo + i, c0, hi, q, qpos, k_ptr, v_ptr, kbase, vbase, skb, svb, sks, svs,
                                           kpos0, S, last, scaling, window, kmask_ptr, smb, b, dd, table_ptr, stb, qr, kr_ptr, krbase, skrp, skrs,
                                           HAS_KMASK, BLOCK_M, BLOCK_N, SEG_CHUNKS, D, F32DOT, PAGED, DR, BLOCK_DR, V_IS_K)
                tl.store(ws + (i * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * D + dd[None, :], acc_s)
                tl.store(ml + i * 2 * BLOCK_M + tl.arange(0, BLOCK_M), m_s)
                tl.store(ml + (i * 2 + 1) * BLOCK_M + tl.arange(0, BLOCK_M), l_s)
                i += PROGRAMS
            if done:
                tl.debug_barrier()  # every thread's stores issued before the count is released
                arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
                done = arrived == tl.minimum(nseg, PROGRAMS) - 1
                if done:  # the tile's last program: every segment's state, merged in segment order
                    j = nseg * 0
                    while j < nseg:
                        acc_s = tl.load(ws + (j * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * D + dd[None, :],
                                        cache_modifier=".cg")  # (from L2: other SMs wrote them)
                        m_s = tl.load(ml + j * 2 * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
                        l_s = tl.load(ml + (j * 2 + 1) * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
                        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
                        j += 1
                    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        if HAS_SINK:
            sink = tl.load(sink_ptr + h, mask=row_ok, other=0.0).to(tl.float32)
            m_f = tl.maximum(m_t, sink)
            sc = tl.exp(m_t - m_f)
            l_t = l_t * sc + tl.exp(sink - m_f)
            acc_t = acc_t * sc[:, None]
        l_safe = tl.where(l_t > 0, l_t, 1.0)
        out = acc_t / l_safe[:, None]
        tl.store(o_ptr + xb * sob + (s0 + tok)[:, None] * sot + h[:, None] * soh + dd[None, :], to_out(out, o_ptr, F32DOT),
                 mask=row_ok[:, None] & done)


_WORKSPACE: dict = {}  # device -> every (states, maxes and sums) buffer pair made, the newest (largest) last


def _workspace(device: torch.device, ws_numel: int, ml_numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The split form's per-segment states: one float32 buffer pair per device, shared by every call and every captured
    graph (a verifier runs one forward at a time), grown when a call needs more; a pair a graph captured stays alive
    (and in use by it). None inside a CUDA-graph capture that would have to grow it (the call then runs one program
    per tile: the same bits)."""
    made = _WORKSPACE.setdefault((device.type, device.index), [])
    if made and made[-1][0].numel() >= ws_numel and made[-1][1].numel() >= ml_numel:
        return made[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    have = made[-1] if made else None
    made.append((torch.empty(max(ws_numel, have[0].numel() if have else 0), dtype=torch.float32, device=device),
                 torch.empty(max(ml_numel, have[1].numel() if have else 0), dtype=torch.float32, device=device)))
    return made[-1]


def _programs(t: int, page_table, programs: int | None) -> int:
    """Programs per tile: 1 (one walks every segment) unless a paged call of few tokens has a table long enough for
    several segments. `programs` overrides (tests: any count gives the same bits)."""
    if programs is not None:
        return max(1, int(programs))
    if page_table is None or t > SPLIT_MAX_T:
        return 1
    return max(1, min(MAX_PROGRAMS, triton.cdiv(page_table.shape[-1] * BLOCK_N, SEG)))


def _launch(q, k, v, positions, scaling, sliding_window, sinks, key_mask, page_table, s, programs=None,
            seq_starts=None, max_rows=None, q_rope=None, k_rope=None) -> torch.Tensor:
    """One launcher for both layouts: k/v [B, Hkv, S, D] (page_table None) or pools [pages, Hkv, PAGE, D]; with
    `seq_starts` (paged only) q [1, Hq, R, D] holds the rows of B = len(seq_starts) - 1 sequences, at most `max_rows`
    each, and the output is [1, R, Hq, D]. Multi-head latent attention (paged only): v None (the values are the keys),
    and q_rope [.., Hq, T, DR] / k_rope [pages, Hkv, PAGE, DR] a second query/key pair whose scores add to q.k's."""
    bsz, hq, t, d = q.shape
    rows = t
    if seq_starts is not None:
        if page_table is None or bsz != 1:
            raise ValueError("ragged attention takes one row set q [1, Hq, R, D] over a page table")
        bsz = seq_starts.numel() - 1
        t = int(max_rows)
        if page_table.shape[0] != bsz:
            raise ValueError(f"page table of {page_table.shape[0]} rows for {bsz} sequences")
    hkv = k.shape[1]
    v_is_k = v is None
    if v_is_k:
        v = k
    if (q_rope is None) != (k_rope is None) or (q_rope is not None and page_table is None):
        raise ValueError("a rotary query/key pair is for paged latent attention: both q_rope and k_rope, and a page table")
    dr = q_rope.shape[-1] if q_rope is not None else 0
    if q_rope is not None and (k_rope.shape[-1] != dr or k_rope.shape[1] != hkv or q_rope.shape[:3] != q.shape[:3]):
        raise ValueError(f"rotary query {tuple(q_rope.shape)} / key pool {tuple(k_rope.shape)} do not match q "
                         f"{tuple(q.shape)} over {hkv} key heads")
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} key/value heads")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim {d} is not a power of two >= 16")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q_rope is not None and (q_rope.stride(-1) != 1 or k_rope.stride(-1) != 1):
        q_rope, k_rope = q_rope.contiguous(), k_rope.contiguous()
    if seq_starts is not None:
        out = torch.zeros((1, rows, hq, d), dtype=q.dtype, device=q.device)  # (a padded wave's tail: zeros)
        pos = positions.reshape(1, rows)
    else:
        out = torch.empty((bsz, t, hq, d), dtype=q.dtype, device=q.device)
        pos = positions.reshape(bsz, t) if positions.dim() == 2 else positions.reshape(1, t).expand(bsz, t)
    if pos.stride(-1) != 1:
        pos = pos.contiguous()
    km = key_mask if key_mask is not None else pos
    table = page_table.reshape(bsz, -1) if page_table is not None else pos
    group = hq // hkv
    m_blocks = triton.cdiv(t * group, BLOCK_M)
    nprog = _programs(t, page_table, programs)
    ws = ml = cnt = out
    nseg = 1
    if nprog > 1:
        tiles = m_blocks * hkv * bsz
        cnt = linear._counters(q.device, tiles)
        span = table.shape[-1] * BLOCK_N if page_table is not None else int(pos.max()) + 1
        nseg = max(1, triton.cdiv(span, SEG))
        most = max(tiles, triton.cdiv(SPLIT_MAX_T * group, BLOCK_M) * hkv * bsz)  # sized for the largest call at once
        fits = most * nseg * BLOCK_M * (d + 2) * 4 <= WORKSPACE_MAX_BYTES
        bufs = _workspace(q.device, most * nseg * BLOCK_M * d, most * nseg * 2 * BLOCK_M) if cnt is not None and fits else None
        if bufs is None:
            nprog = 1  # (the same bits)
        else:
            ws, ml = bufs
    grid = (m_blocks, hkv, bsz * nprog)
    _attn_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        pos, pos.stride(0),
        km, km.stride(0),
        sinks if sinks is not None else q,
        table, table.stride(0) if page_table is not None else 0,
        *((q_rope, q_rope.stride(0), q_rope.stride(1), q_rope.stride(2), k_rope, k_rope.stride(0), k_rope.stride(1),
           k_rope.stride(2)) if q_rope is not None else (q, 0, 0, 0, k, 0, 0, 0)),
        ws, ml, cnt, nseg,
        seq_starts if seq_starts is not None else pos,
        t, s, float(scaling), int(sliding_window or 0),
        GROUP=group, D=d, HAS_SINK=sinks is not None, HAS_KMASK=key_mask is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SEG_CHUNKS=SEG_CHUNKS, PROGRAMS=nprog, DIRECT_SEGS=DIRECT_SEGS, F32DOT=runtime.interpreting(),
        PAGED=page_table is not None, RAGGED=seq_starts is not None,
        DR=dr, BLOCK_DR=max(16, triton.next_power_of_2(dr)) if dr else 0, V_IS_K=v_is_k, **_launch_options(d),
        **runtime.pdl_launch(),
    )
    return out


#: pipeline stages of the key walk for wide heads (MLA's 512-wide latent: a 64-key chunk is 64 KiB of bf16, so Triton's
#: default 3 stages would not fit an SM's shared memory): 2, the next chunk loaded while one is computed (dsv3-4l on an
#: H100, stop 60: forward 2.27 ms against 2.42 with 1 stage; benchmarks/results/stop60_gpu/call1). PDFLASH_MLA_STAGES
#: sets it (the arithmetic, so the bits, are the same at any count).
_WIDE_STAGES = os.environ.get("PDFLASH_MLA_STAGES", "2")
if _WIDE_STAGES not in ("1", "2", "3"):
    raise ValueError(f"PDFLASH_MLA_STAGES must be 1, 2 or 3, got {_WIDE_STAGES!r}")


def _launch_options(d: int) -> dict:
    """num_warps / num_stages: Triton's defaults for the heads of 64-128 every GQA model has (their compiled kernels
    unchanged); 8 warps and fewer stages for heads of 256 and wider (MLA's latent)."""
    if d < 256:
        return {}
    return {"num_warps": 8, "num_stages": int(_WIDE_STAGES)}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D] (the cache's keys, the last of them at the last query's position),
    positions [B, T] (absolute, the queries'), key_mask [B, >= last position + 1] (0 = padding) or None.
    Returns [B, T, Hq, D]. A head width that is not a power of two, or values narrower than the keys (MLA's expanded
    form on transformers' cache: keys of 192, values of 128), run zero-padded to the next power of two: the zeros add
    nothing to any dot, and every call pads the same way; the output is cut back to the values' width."""
    dv = v.shape[-1]
    width = max(16, triton.next_power_of_2(max(q.shape[-1], dv)))
    if width != q.shape[-1] or dv != q.shape[-1]:
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[-1]))  # noqa: E731
        return _launch(pad(q), pad(k), pad(v), positions, scaling, sliding_window, sinks, key_mask, None, k.shape[2],
                       programs)[..., :dv]
    return _launch(q, k, v, positions, scaling, sliding_window, sinks, key_mask, None, k.shape[2], programs)


PAGE = BLOCK_N  # positions per KV page: one attention chunk reads exactly one page


def _check_paged(pools, seq_starts, max_rows) -> None:
    for pool in pools:
        if pool.shape[2] != PAGE:
            raise ValueError(f"KV pages must hold {PAGE} positions, got {pool.shape[2]}")
    if seq_starts is not None and max_rows is None:
        raise ValueError("ragged attention needs max_rows (the most rows of one sequence)")


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    programs: int | None = None,
    seq_starts: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D]; k/v pools [pages, Hkv, PAGE, D]; page_table [B, max_pages] int32 (page of positions
    [i*PAGE, (i+1)*PAGE) of sequence b); positions [B, T] (the queries' absolute positions; each sequence's keys
    are written up to its last query's position). Returns [B, T, Hq, D]. The same chunks, in the same order, as
    `attention`: results are bit-identical to it for the same keys.

    Ragged (a multi-session verify wave): `seq_starts` [B + 1] int32 on the device, q [1, Hq, R, D] and positions
    [1, R] hold the rows of B sequences one after the other, sequence b's rows [seq_starts[b], seq_starts[b + 1])
    (rows past seq_starts[B], a padded wave's tail, are left unwritten); `max_rows` (a host int) bounds every
    sequence's rows. Returns [1, R, Hq, D]. A tile holds rows of one sequence only, starting at its first row, so each
    sequence's rows get the bits of a call of that sequence alone."""
    _check_paged((k_pool, v_pool), seq_starts, max_rows)
    return _launch(q, k_pool, v_pool, positions, scaling, sliding_window, sinks, None, page_table, 0, programs,
                   seq_starts, max_rows)


def paged_latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_pool: torch.Tensor,
    rope_pool: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    programs: int | None = None,
    seq_starts: torch.Tensor | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) in its absorbed form over the paged latent
    cache: every query head attends to one shared key per position, the latent c [L] and its rotary part r [DR]; the
    score is (q_latent . c + q_rope . r) * scaling and the value is c itself. q_latent [B, H, T, L] (the no-rope query
    already multiplied by the key up-projection, `pdflash_kernels.mla`), q_rope [B, H, T, DR]; pools [pages, 1, PAGE, L]
    and [pages, 1, PAGE, DR]. Returns the latent output [B, T, H, L] (before the value up-projection). The same
    chunks, segments, merge order and ragged rows as `paged_attention`: a row's bits do not depend on the call's rows."""
    _check_paged((latent_pool, rope_pool), seq_starts, max_rows)
    return _launch(q_latent, latent_pool, None, positions, scaling, None, None, None, page_table, 0, programs,
                   seq_starts, max_rows, q_rope=q_rope, k_rope=rope_pool)


# ---- the paged KV write: a block's K and V rows into the layer's two page pools, one launch -------------------------
if triton is not None:

    @triton.jit
    def _kv_write_kernel(
        k_ptr, skh, skt, v_ptr, svh, svt,
        kp_ptr, kps_p, kps_h, kps_s, vp_ptr, vps_p, vps_h, vps_s,
        pages_ptr, offs_ptr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        runtime.pdl_begin()
        t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        page = tl.load(pages_ptr + t).to(tl.int64)
        off = tl.load(offs_ptr + t).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)
        ok = dd < D
        dv = tl.arange(0, BLOCK_DV)  # (MLA: the latent and its rotary part, of two widths)
        ok_v = dv < DV
        t = t.to(tl.int64)
        k = tl.load(k_ptr + h * skh + t * skt + dd, mask=ok)  # same element type in and out: the bits as they are
        v = tl.load(v_ptr + h * svh + t * svt + dv, mask=ok_v)
        tl.store(kp_ptr + page * kps_p + h * kps_h + off * kps_s + dd, k, mask=ok)
        tl.store(vp_ptr + page * vps_p + h * vps_h + off * vps_s + dv, v, mask=ok_v)


def paged_write_reference(k_pool, v_pool, key, value, pages, offsets) -> None:
    """The torch path (two index_put_ launches): key/value [Hkv, T, D] -> pool[pages[t], :, offsets[t]]."""
    k_pool[pages, :, offsets] = key.transpose(0, 1).to(k_pool.dtype)
    v_pool[pages, :, offsets] = value.transpose(0, 1).to(v_pool.dtype)


def paged_write(k_pool: torch.Tensor, v_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """Write a block's keys and values into a layer's page pools: key [Hkv, T, D] / value [Hkv, T, DV] (any strides;
    DV = D but for MLA's latent and rotary key), pools [pages, Hkv, PAGE, D or DV]; row t goes to page `pages[t]` at offset `offsets[t]` (pages/offsets [T] integer, on the device).
    One Triton launch for both pools (exact copies: the same bits as `paged_write_reference`); the torch path where
    Triton is not usable. Rows must go to distinct slots (a block's positions are distinct)."""
    if not runtime.triton_usable(key.device):
        return paged_write_reference(k_pool, v_pool, key, value, pages, offsets)
    if key.dtype != k_pool.dtype:
        key = key.to(k_pool.dtype)  # torch rounds as the reference path's cast does; the kernel then copies
    if value.dtype != v_pool.dtype:
        value = value.to(v_pool.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        return paged_write_reference(k_pool, v_pool, key, value, pages, offsets)
    hkv, t, d = key.shape
    dv = value.shape[-1]
    if t == 0:
        return None
    _kv_write_kernel[(t, hkv)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        k_pool, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool, v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        pages, offsets, D=d, BLOCK_D=triton.next_power_of_2(d), DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
        **runtime.pdl_launch(),
    )
    return None
