"""Where the MXFP4 expert GEMM's time goes (a diagnostic, GPU only): one standalone kernel shaped like pdflash_kernels.moe's K
loop (a 16-row activation tile, BN-row weight tiles of one expert per program, decode 3 + join, one dot per K step),
timed under CUDA graphs (consecutive launches read their own copy of the weights: L2-cold), with parts switched off:
  full     the loop as pdflash_kernels.moe runs it;
  noscale  the same without the scale load (every scale byte 127: wrong values, timing only);
  bytes    the packed weights read as 32-bit words and XORed (no activations, no decode, no dot): the read alone;
  bf16     bf16 weights through the same tile loop (no decode);
  split2   the full loop with K split over two programs (twice the programs, each half the K steps; the partial sums
           are stored, not added: timing only): whether the decode shapes lack warps in flight.
    python benchmarks/fp4_probe.py OUT   ->  OUT/fp4_probe.json (rows: shape, A experts, N, K, T rows, tiles, us,
                                             frac = weight bytes / time / the device-copy rate)"""
import json, os, sys, time
import torch, triton, triton.language as tl

@triton.jit
def _bf16x2(pair, e):
    return tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
        "=r,r,r", [pair, (e << 7) | (e << 23)], dtype=tl.uint32, is_pure=True, pack=1)

@triton.jit
def probe(a_ptr, w_ptr, s_ptr, y_ptr, T, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, MODE: tl.constexpr):
    SPLIT: tl.constexpr = 2 if MODE == 5 else 1
    pid = tl.program_id(0) // SPLIT
    half = tl.program_id(0) % SPLIT
    tiles: tl.constexpr = N // BN
    e = pid // tiles
    rows = (pid % tiles) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    tot = tl.zeros((BN, BK // 8), tl.int32)
    wbase = w_ptr + e.to(tl.int64) * N * (K // 2)
    sbase = s_ptr + e.to(tl.int64) * N * (K // 32)
    KS: tl.constexpr = (K // BK) // SPLIT * BK  # the first program's K steps (the second takes the rest)
    for k0 in range(half * KS, K if SPLIT == 1 else KS + half * (K - KS), BK):
        if MODE == 4:  # bytes only, as 32-bit words
            kw = k0 // 8 + tl.arange(0, BK // 8)
            tot ^= tl.load(wbase.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + kw[None, :])
        else:
            kh = k0 // 2 + tl.arange(0, BK // 2)
            p = tl.load(wbase + rows[:, None] * (K // 2) + kh[None, :]).to(tl.uint32)
            kk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + m[:, None] * K + kk[None, :], mask=(m < T)[:, None], other=0.0)
            kg = k0 // 32 + tl.arange(0, BK // 32)
            if MODE == 1:  # no scale load
                s = tl.full((BN, BK // 32), 127, tl.uint32)
            else:
                s = tl.load(sbase + rows[:, None] * (K // 32) + kg[None, :]).to(tl.uint32)
            pair = ((p * 0x00040040) & 0x01C001C0) | ((p * 0x01001000) & 0x80008000)
            ee = tl.minimum(s, 128) + 126
            pair = _bf16x2(pair, tl.reshape(tl.broadcast_to(ee[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2)))
            wlo = pair.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            whi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            w = tl.reshape(tl.join(wlo, whi), (BN, BK))
            acc += tl.dot(a, tl.trans(w))
    if MODE == 4:
        tl.store(y_ptr + pid * BN + tl.arange(0, BN), tl.sum(tot, 1).to(tl.float32))
    else:
        tl.store(y_ptr + (e * SPLIT + half) * BM * N + m[:, None] * N + rows[None, :], acc)

@triton.jit
def bf16probe(a_ptr, w_ptr, y_ptr, T, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    tiles: tl.constexpr = N // BN
    e = pid // tiles
    rows = (pid % tiles) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    wbase = w_ptr + e.to(tl.int64) * N * K
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + m[:, None] * K + kk[None, :], mask=(m < T)[:, None], other=0.0)
        w = tl.load(wbase + rows[:, None] * K + kk[None, :])
        acc += tl.dot(a, tl.trans(w))
    tl.store(y_ptr + e * BM * N + m[:, None] * N + rows[None, :], acc)

def bench(fns, iters=50):
    """GPU us per launch: a CUDA graph of 10 launches (fns[i % len(fns)]: each its own copy of the weights, so a launch
    finds none of them in L2 where they fit), replayed after a flush of the L2, best of iters / 10 replays."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(10):
            fns[i % len(fns)]()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(iters // 10):
        flush.zero_()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record(); g.replay(); en.record(); torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) * 1000 / 10)
    return min(ts)


def copies(t, nbytes):
    """Enough copies of t that consecutive launches read 120 MB (more than the H200's 50 MB L2) before one repeats."""
    return [t] + [t.clone() for _ in range(min(9, -(-120_000_000 // max(1, nbytes)) - 1))]


def main(out):
    dev = "cuda"
    x = torch.empty(1 << 28, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    y.copy_(x); st.record(); y.copy_(x); en.record(); torch.cuda.synchronize()
    copy = 2 * x.numel() / (st.elapsed_time(en) / 1e3)
    rows = []
    shapes = [("gptoss gemm2", 8, 2880, 2880), ("gptoss gemm1(one set)", 8, 2880 * 2, 2880), ("gptoss gemm2", 32, 2880, 2880),
              ("qwen3 gemm1", 32, 1536, 2048), ("qwen3 gemm2", 32, 2048, 768), ("mixtral gemm2", 8, 4096, 14336)]
    for name, A, N, K in shapes:
        w = torch.randint(0, 256, (A, N, K // 2), dtype=torch.uint8, device=dev)
        s = torch.randint(118, 128, (A, N, K // 32), dtype=torch.uint8, device=dev)
        a = torch.randn(16, K, dtype=torch.bfloat16, device=dev)
        yb = torch.empty(2 * A, 16, N, dtype=torch.float32, device=dev)
        wbytes = w.numel() + s.numel()
        ws, ss = copies(w, wbytes), copies(s, wbytes)
        for T in (1, 16):
            for BN, BK, warps, stages in ((32, 64, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4)):
                if K % BK:
                    continue
                for mode in ((0, 1, 4, 5) if T == 1 else (0,)):
                    grid = (A * N // BN * (2 if mode == 5 else 1),)
                    fns = [lambda w=w, s=s: probe[grid](a, w, s, yb, T, K=K, N=N, BM=16, BN=BN, BK=BK, MODE=mode,
                                                        num_warps=warps, num_stages=stages) for w, s in zip(ws, ss)]
                    try:
                        us = bench(fns)
                    except Exception as ex:
                        print("FAIL", name, BN, BK, mode, str(ex)[:100]); continue
                    read = w.numel() if mode == 4 else wbytes  # (the bytes mode reads no scales)
                    r = dict(shape=name, A=A, N=N, K=K, T=T, BN=BN, BK=BK, warps=warps, stages=stages, mode=["full", "noscale", "", "", "bytes", "split2"][mode],
                             us=round(us, 2), frac=round(read / (us * 1e-6) / copy, 3))
                    rows.append(r); print(r, flush=True)
            wbs = copies(torch.randn(A, N, K, dtype=torch.bfloat16, device=dev), A * N * K * 2)
            for BN, BK in ((32, 64),):
                us = bench([lambda wb=wb: bf16probe[(A * N // BN,)](a, wb, yb, T, K=K, N=N, BM=16, BN=BN, BK=BK, num_warps=4,
                                                                  num_stages=4) for wb in wbs])
                r = dict(shape=name, A=A, N=N, K=K, T=T, BN=BN, BK=BK, mode="bf16", us=round(us, 2),
                         frac=round(A * N * K * 2 / (us * 1e-6) / copy, 3))
                rows.append(r); print(r, flush=True)
            del wbs
    json.dump(dict(copy=copy, rows=rows), open(os.path.join(out, "fp4_probe.json"), "w"), indent=1)

if __name__ == "__main__":
    main(sys.argv[1])
