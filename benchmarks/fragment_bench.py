"""The MoE call on MXFP4 fragment words (pdflash_kernels/fragments.py) against the served pair-word MoE call
(pdflash_kernels/moe.py `moe_forward`, default configs) and transformers' bf16 `grouped_mm`, on the expert shapes of
gpt-oss-20b, Qwen3-30B-A3B and Mixtral-8x7B: issue 12's benchmark rows for the fragment path.

    python benchmarks/fragment_bench.py [--out benchmarks/results] [--models gpt-oss-20b] [--tokens 1,4,16]
    python benchmarks/fragment_bench.py --sweep [--variants 4x4w4,8x4w4p]
    python benchmarks/fragment_bench.py --fused-sweep [--variants 4x4w4,8x4w4ps4] [--tokens 1,16]
    python benchmarks/fragment_bench.py --in-forward 8 [--one-launch-ab]

Default: per (model, active experts 8-128, tokens per expert), the whole call (routing, both GEMMs, combine), CUDA-graph
GPU time, each output checked against pdflash_kernels.reference.moe_reference first (2% of the largest output, as
tests/test_kernels_gpu.py); bytes: the MXFP4 weights, scales and biases the active experts read; fractions: of the
measured device-copy rate (read + write, as benchmarks/kernel_bench.py). Writes fragment_<device>.json / .md (fragment_h200.* on the H200; `kernel_bench.device_tag`).
--sweep: the two GEMMs alone (`frag_gemm`: float32 outputs, no activation) for each tile variant (`NTxKQSwW`: 16-row
tiles a program, 64-column quads a K step, warps; a trailing `p`: loads a step ahead) against moe.launch_gemm1 +
launch_gemm2 over the same routing blocks; each variant checked against `frag_gemm_reference`. Writes
fragment_sweep_h200.json / .md.
--fused-sweep: fragment_moe's own launches (gate/up with the activation, down with bias and routing weight) each alone
per tile variant (`FragTile` names; "sS": K split in S ranges), writes fragment_fused_sweep_h200.json / .md and prints
each shape's winners (the source of `fragments.FRAG_SHAPES`), then runs the default whole-call rows with them.
--in-forward N: each whole-call row also timed as a verify forward pays it (`kernel_bench.gpu_time_us_each`): N copies
of the experts (fragment words and transformers' module alike), one call on each back to back in one CUDA graph, the
time over N. The default rows replay one call's graph again and again: a graph launch per call, and weights that fit
L2 (Qwen3's 8 experts: 20 MB) read from it on every replay after the first.
--one-launch-ab: the whole call with its GEMMs and combine in one launch (`fragments.fragment_moe_one`, calls of up to 128
pairs, on every shape whatever `fragments.ONE_LAUNCH_SHAPES` says) and in four launches (routing, gate/up, down,
combine), the outputs checked bit-identical.
--size-ab: the whole call with the tiles of its call-size class (`fragments.FRAG_BY_SIZE`, PDFLASH_FP4_SIZE_TILES=1)
and with FRAG_SHAPES' alone, the outputs checked bit-identical; with --in-forward both as a forward pays them.
--routed 1,2,4,8,16,32: instead of (active experts x tokens each), calls of N tokens each routed to top-k distinct
experts at random, as a verify forward of N tokens routes (the active experts follow: the rows' active_experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_bench import MODELS, copy_rate, device_tag, gpu_time_us, routing, verify_routing  # noqa: E402

VARIANTS = ("4x4w4", "4x8w4", "8x4w4", "4x4w4p", "8x2w4p", "8x4w4p", "4x8w4p", "8x4w8")
# --fused-sweep: the gate/up GEMM (activation fused) and the down GEMM (routing weight fused) of fragment_moe, each alone
# (stop 42: the stop-36 winners and the staged tiles that won call 1's probe; the register-path tiles stop 36 swept and
# stop 42 no longer serves are in fragment_fused_sweep_h200.json's history)
FUSED_VARIANTS = ("8x2w4p", "4x4w4p", "4x4w4", "4x4w4s4", "4x4w4aa3", "4x4w4aa4", "4x2w4aa4", "8x2w4aa3", "8x2w4aa4",
                  "8x1w4aa6", "4x4w4aa3s4", "8x2w4aa3s2")


def _cases(e: int, k: int, tokens: str, active_list: str = "8,32,128"):
    """(active experts, tokens per expert) of a model with e experts, top-k: 8 / 32 / 128 experts (`active_list`) where
    they exist (at least k, at most e)."""
    for active in (int(a) for a in active_list.split(",")):
        if k <= active <= e:
            for tpe in (int(t) for t in tokens.split(",")):
                yield active, tpe


def _write(out: pathlib.Path, stem: str, res: dict, lines: list[str]) -> None:
    """OUT/stem.json (the rows) and OUT/stem.md (the table), printed."""
    stem = stem.replace("_h200", f"_{device_tag()}")  # (the stems name the H200; the file names the card that ran)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def sweep_gemms(args) -> None:
    from pdflash_kernels import fragments as F
    from pdflash_kernels import mxfp4
    from pdflash_kernels.moe import (ExpertWeights, _scale_words_ok, align_fused, default_config, launch_gemm1,
                                     launch_gemm2, resolve_decodes)

    variants = args.variants.split(",")
    rate = copy_rate()
    print(f"device copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows = []
    torch.manual_seed(0)
    for model in args.models.split(","):
        e, k, h, i = MODELS[model]
        with torch.device("cuda"):
            w1 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(e, h, i, dtype=torch.bfloat16) * 0.02
        b1, s1 = mxfp4.quantize(w1)
        b2, s2 = mxfp4.quantize(w2)
        del w1, w2
        F.check_scales(s1), F.check_scales(s2)
        fw1, fs1 = F.to_fragment_words(b1, s1)
        fw2, fs2 = F.to_fragment_words(b2, s2)
        pw = ExpertWeights(w1=mxfp4.to_pair_words(b1), w2=mxfp4.to_pair_words(b2), s1=s1, s2=s2, pair_words=True)
        per_expert = b1[0].numel() + s1[0].numel() + b2[0].numel() + s2[0].numel()
        c1 = default_config(i, h, k, True, gemm=1, pair_words=True)
        c2 = default_config(h, i, k, True, gemm=2, pair_words=True)
        c1, c2 = resolve_decodes(pw, c1, c2)
        # as moe_forward: scale rows not 4-byte aligned (gpt-oss's 90 bytes) are read a byte at a time
        c1, c2 = (dataclasses.replace(c, s_words=False) if c.s_words and not _scale_words_ok(sc) else c
                  for c, sc in ((c1, s1), (c2, s2)))
        for active, tpe in _cases(e, k, args.tokens, args.active):
            x, ids, wts = routing(e, k, h, active, tpe)
            with torch.inference_mode():
                r = align_fused(ids, e, c1.block_m)
                bm = c1.block_m
                hbuf = torch.empty((r.max_blocks * bm, i), dtype=torch.bfloat16, device="cuda")
                ybuf = torch.empty((r.num_pairs, h), dtype=torch.float32, device="cuda")
                rw = wts.reshape(-1).contiguous()
                t_moe = gpu_time_us(lambda: (launch_gemm1(x, r, pw, hbuf, c1, k), launch_gemm2(hbuf, r, pw, ybuf, rw, c2)))
                hin = (torch.randn(r.max_blocks * bm, i, device="cuda") * 0.5).bfloat16()
                y1 = torch.zeros((r.max_blocks * bm, 2 * i), dtype=torch.float32, device="cuda")
                y2 = torch.zeros((r.max_blocks * bm, h), dtype=torch.float32, device="cuda")
                ref1 = F.frag_gemm_reference(x, r, b1, s1, k, True)
                ref2 = F.frag_gemm_reference(hin, r, b2, s2, k, False)
                per_variant = {}
                for v in variants:
                    tile = F.FragTile.parse(v)
                    if tile.nt % tile.warps:
                        continue
                    y1.zero_(), y2.zero_()
                    F.frag_gemm(x, r, fw1, fs1, k, True, y1, tile)
                    F.frag_gemm(hin, r, fw2, fs2, k, False, y2, tile)
                    err = max(float((y1 - ref1).abs().max() / ref1.abs().max().clamp(min=1e-6)),
                              float((y2 - ref2).abs().max() / ref2.abs().max().clamp(min=1e-6)))
                    if err > 1e-3:
                        raise AssertionError(f"{model} A={active} T={tpe} {v}: relative error {err:.2e}")
                    per_variant[v] = gpu_time_us(lambda: (F.frag_gemm(x, r, fw1, fs1, k, True, y1, tile),
                                                          F.frag_gemm(hin, r, fw2, fs2, k, False, y2, tile)))
            best = min(per_variant, key=per_variant.get)
            nbytes = active * per_expert
            row = dict(model=model, active_experts=active, tokens_per_expert=tpe, weight_bytes=nbytes,
                       moe_us=round(t_moe, 1), moe_fraction=round(nbytes / (t_moe * 1e-6) / rate, 3),
                       frag_us=round(per_variant[best], 1), frag_variant=best,
                       frag_fraction=round(nbytes / (per_variant[best] * 1e-6) / rate, 3),
                       speedup=round(t_moe / per_variant[best], 2),
                       variants={v: round(t, 1) for v, t in per_variant.items()})
            rows.append(row)
            print(f"{model:14s} A={active:3d} T={tpe:2d}  moe {t_moe:7.1f} us {row['moe_fraction']:.2f}  "
                  f"frag {row['frag_us']:7.1f} us {row['frag_fraction']:.2f} ({best})  x{row['speedup']}  "
                  + " ".join(f"{v}:{t:.0f}" for v, t in per_variant.items()), flush=True)
        del b1, s1, b2, s2, fw1, fs1, fw2, fs2, pw
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "copy_rate_bytes_per_s": rate, "rows": rows}
    lines = [f"# Fragment-word MXFP4 GEMMs vs the served MoE GEMMs (`python benchmarks/fragment_bench.py`)", "",
             f"{res['device']}; device copy {rate / 1e12:.2f} TB/s (read + write). Both GEMMs of a layer, CUDA-graph time; "
             "fraction: weight bytes / time / copy rate.", "",
             "| model | active experts | tokens/expert | weight MB | moe us | of copy | frag us | of copy | variant | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['weight_bytes'] / 1e6:.1f} | "
                     f"{r['moe_us']} | {r['moe_fraction']:.2f} | {r['frag_us']} | {r['frag_fraction']:.2f} | "
                     f"{r['frag_variant']} | {r['speedup']}x |")
    _write(out, "fragment_sweep_h200", res, lines)


def _served(model):
    from benchmarks.kernel_bench import as_served, hf_experts
    from pdflash_kernels.installer import expert_weights

    mod = hf_experts(model)
    return mod, as_served(expert_weights(mod, "mxfp4"), pair_words=True)


def sweep_winners(sums: dict, rejected: dict) -> tuple[str, str] | None:
    """(gate/up tile, down tile) of least summed time ({1: {tile: us}, 2: {tile: us}}) among the tiles not rejected: a
    tile rejected in a later case has a partial sum, so it never wins. None where every tile was rejected."""
    ok = [{v: t for v, t in sums[g].items() if v not in rejected} for g in (1, 2)]
    if not ok[0] or not ok[1]:
        return None
    return min(ok[0], key=ok[0].get), min(ok[1], key=ok[1].get)


def fused_sweep(args) -> dict:
    """fragment_moe's two launches each alone, per tile variant: the gate/up GEMM with its activation (EPI 1) and the
    down GEMM with bias and routing weight (EPI 2), over the same routing blocks; each model's winner per GEMM is the
    least summed time over its cases. Checks the whole call with every variant pair it times against the reference
    first. Writes fragment_fused_sweep_h200.json / .md; returns {(hidden, width): (gate/up tile, down tile)}."""
    from pdflash_kernels import fragments as F
    from pdflash_kernels.moe import align_fused
    from pdflash_kernels.reference import moe_reference

    variants = [F.FragTile.parse(v) for v in args.variants.split(",")]
    rows, winners, rejected = [], {}, {}
    torch.manual_seed(0)
    for model in args.models.split(","):
        e, k, h, i = MODELS[model]
        mod, w = _served(model)
        del mod
        fw = F.FragmentExperts.from_weights(w)
        sums = {1: {}, 2: {}}
        for active, tpe in _cases(e, k, args.tokens, args.active):
            x, ids, wts = routing(e, k, h, active, tpe)
            with torch.inference_mode():
                ref = moe_reference(x, ids, wts, w, e).float()
                r = align_fused(ids, e, 16)
                hbuf = torch.empty((r.max_blocks * 16, i), dtype=torch.bfloat16, device="cuda")
                ybuf = torch.empty((r.num_pairs, h), dtype=torch.float32, device="cuda")
                rw = wts.reshape(-1).contiguous()
                times = {1: {}, 2: {}}
                for tile in variants:
                    if tile.nt % tile.warps or tile.nt % 2 or str(tile) in rejected:
                        continue
                    try:  # (a tile never run on a GPU before is reported and left out, not the whole sweep lost)
                        got = F.fragment_moe(x, ids, wts, fw, e, config=(tile, tile)).float()
                        err = float((got - ref).abs().max() / ref.abs().max())
                    except Exception as ex:  # noqa: BLE001
                        got, err = None, f"{type(ex).__name__}: {str(ex)[:160]}"
                    if got is None or err > 0.02:
                        rejected[str(tile)] = f"{model} A={active} T={tpe}: " + (
                            err if got is None else f"{err:.3g} off the reference")
                        print(f"REJECTED {tile}: {rejected[str(tile)]}", flush=True)
                        continue
                    times[1][str(tile)] = gpu_time_us(lambda: F._launch(
                        x, r, fw.w1, fw.s1, hbuf, i, k, 1, tile, 0, fw.b1, fw.act, fw.row_mul, fw.up_off,
                        alpha=fw.alpha, limit=fw.limit))
                    times[2][str(tile)] = gpu_time_us(lambda: F._launch(hbuf, r, fw.w2, fw.s2, ybuf, h, k, 2, tile, 0,
                                                                        fw.b2, rw=rw))
            if not times[1]:
                continue
            for g in (1, 2):
                for v, t in times[g].items():
                    sums[g][v] = sums[g].get(v, 0.0) + t
            b1, b2 = min(times[1], key=times[1].get), min(times[2], key=times[2].get)
            rows.append(dict(model=model, active_experts=active, tokens_per_expert=tpe, gate_up_best=b1,
                             gate_up_us=round(times[1][b1], 1), down_best=b2, down_us=round(times[2][b2], 1),
                             gate_up={v: round(t, 1) for v, t in times[1].items()},
                             down={v: round(t, 1) for v, t in times[2].items()}))
            print(f"{model:14s} A={active:3d} T={tpe:2d}  gate/up {b1} {times[1][b1]:.1f} us  down {b2} "
                  f"{times[2][b2]:.1f} us | " + " ".join(f"{v}:{times[1][v]:.0f}/{times[2][v]:.0f}" for v in times[1]),
                  flush=True)
        win = sweep_winners(sums, rejected)
        if win is None:
            continue
        winners[(h, i)] = tuple(F.FragTile.parse(v) for v in win)
        print(f"{model}: winners gate/up {win[0]} ({sums[1][win[0]]:.1f} us summed), down {win[1]} "
              f"({sums[2][win[1]]:.1f} us)", flush=True)
        del w, fw
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "rows": rows,
           "winners": {f"{hh}x{ii}": [str(t) for t in ts] for (hh, ii), ts in winners.items()}, "rejected": rejected}
    lines = ["# fragment_moe's two GEMMs, tile variants (`python benchmarks/fragment_bench.py --fused-sweep`)", "",
             f"{res['device']}. Each launch alone, CUDA-graph time: gate/up = the gate and up GEMM with the activation "
             "fused (bf16 out), down = the down GEMM with bias and routing weight (float32 out). Tile NTxKQSwW, p: loads a "
             "step ahead, sS: K split in S ranges.", "",
             "| model | active experts | tokens/expert | gate/up best | us | down best | us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['gate_up_best']} | "
                     f"{r['gate_up_us']} | {r['down_best']} | {r['down_us']} |")
    lines += ["", "Winners (least time summed over the cases): " + ", ".join(
        f"{k}: gate/up {v[0]}, down {v[1]}" for k, v in res["winners"].items())]
    lines += [f"Rejected (wrong or failed, not timed after): {v}: {why}" for v, why in rejected.items()]
    _write(out, "fragment_fused_sweep_h200", res, lines)
    print("FRAG_SHAPES = {" + ", ".join(f"({hh}, {ii}): (FragTile.parse({str(a)!r}), FragTile.parse({str(b)!r}))"
                                         for (hh, ii), (a, b) in winners.items()) + "}")
    return winners


def _ab(module, call, on: dict, off: dict, what: str) -> tuple[float, float]:
    """us of `call` with the module's settings `on`, then with `off` applied on top; the outputs' bits must be equal.
    The settings are restored after."""
    saved = {k: getattr(module, k) for k in {**on, **off}}
    try:
        for k, v in on.items():
            setattr(module, k, v)
        first = call()
        t_on = gpu_time_us(call)
        for k, v in off.items():
            setattr(module, k, v)
        if not torch.equal(call(), first):
            raise AssertionError(f"{what} changed the output bits")
        return t_on, gpu_time_us(call)
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _inputs(e: int, k: int, h: int, args, device: str = "cuda"):
    """(active experts, tokens per expert, x, ids, weights) of each case: `routing`'s (every active expert the same
    tokens), or with --routed, N tokens routed at random (tokens per expert: the mean, active: those picked)."""
    if not args.routed:
        for active, tpe in _cases(e, k, args.tokens, args.active):
            yield (active, tpe, *routing(e, k, h, active, tpe))
        return
    g = torch.Generator(device=device).manual_seed(0)
    for n in (int(t) for t in args.routed.split(",")):
        x, ids, w = verify_routing(e, k, h, n, g, device)
        active = int(ids.unique().numel())
        yield active, round(n * k / active, 2), x, ids, w


# --pdl-ab / --one-launch-ab / --size-ab: (fragments' settings on, then off on top, what the off column is, JSON tag)
AB = {"pdl_ab": (lambda F: {"PDL_MODE": F.PDL_ON}, {"PDL_MODE": 0}, "GEMMs without PDL", "pdl"),
      "one_launch_ab": (lambda F: {"ONE_LAUNCH_PAIRS": 128}, {"ONE_LAUNCH_PAIRS": 0}, "four launches", "one-launch"),
      "size_ab": (lambda F: {"SIZE_TILES": True}, {"SIZE_TILES": False}, "FRAG_SHAPES' tiles", "size-tiles")}


def whole_call(args) -> None:
    """The issue's benchmark rows for the fragment path: the whole MoE call (routing, both GEMMs, combine), CUDA-graph
    time, against the served pair-word moe_forward and transformers' grouped_mm (bf16), on the same experts."""
    import copy

    from benchmarks.kernel_bench import as_served, gpu_time_us_each, hf_experts
    from pdflash_kernels import fragments as F
    from pdflash_kernels import runtime
    from pdflash_kernels.installer import expert_weights
    from pdflash_kernels.moe import moe_forward
    from pdflash_kernels.reference import moe_reference

    rate = copy_rate()
    print(f"device copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        e, k, h, i = MODELS[model]
        mod = hf_experts(model)
        n_copies = args.in_forward
        mods = [mod] + [copy.deepcopy(mod) for _ in range(n_copies - 1)]
        cases = []
        with torch.inference_mode():
            for active, tpe, x, ids, wts in _inputs(e, k, h, args):
                t_hf_fwd = gpu_time_us_each([lambda m=m: m(x, ids, wts) for m in mods]) if n_copies else None
                cases.append((active, tpe, x, ids, wts, gpu_time_us(lambda: mod(x, ids, wts)), t_hf_fwd))
        del mods
        w = as_served(expert_weights(mod, "mxfp4"), pair_words=True)
        fw = F.FragmentExperts.from_weights(w)
        fws = [fw] + [dataclasses.replace(fw, **{n: getattr(fw, n).clone() for n in ("w1", "s1", "w2", "s2", "b1", "b2")
                                                  if getattr(fw, n) is not None}) for _ in range(n_copies - 1)]
        bias = (2 * i + h) * 2 if w.b1 is not None else 0
        per = 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32 + bias
        for active, tpe, x, ids, wts, t_hf, t_hf_fwd in cases:
            with torch.inference_mode():
                ref = moe_reference(x, ids, wts, w, e).float()
                got = F.fragment_moe(x, ids, wts, fw, e).float()
                err = float((got - ref).abs().max() / ref.abs().max())
                if err > 0.02:
                    raise AssertionError(f"{model} A={active} T={tpe}: fragment_moe is {err:.3g} off the reference")
                t_moe = gpu_time_us(lambda: moe_forward(x, ids, wts, w, e))
                t_plain = t_fwd_off = None
                call = lambda: F.fragment_moe(x, ids, wts, fw, e)  # noqa: E731
                what = f"{model} A={active} T={tpe}"
                ab = next((AB[n] for n in AB if getattr(args, n)), None)
                if ab is not None and not (ab is AB["pdl_ab"] and not runtime.PDL):  # on vs off (bits checked equal)
                    t_frag, t_plain = _ab(F, call, ab[0](F), ab[1], f"{what}: {ab[2]}")
                else:
                    ab = None
                    t_frag = gpu_time_us(call)
                fwd = [lambda f=f: F.fragment_moe(x, ids, wts, f, e) for f in fws]
                on, off = (ab[0](F), ab[1]) if ab is not None else ({}, {})
                saved = {n: getattr(F, n) for n in {**on, **off}}
                try:  # the in-forward rows: on, then off (both as a forward pays them)
                    for n, v in on.items():
                        setattr(F, n, v)
                    t_fwd = gpu_time_us_each(fwd) if n_copies else None
                    if n_copies and ab is not None:
                        for n, v in off.items():
                            setattr(F, n, v)
                        t_fwd_off = gpu_time_us_each(fwd)
                finally:
                    for n, v in saved.items():
                        setattr(F, n, v)
            nbytes = active * per
            row = dict(model=model, weights="mxfp4", tokens_per_expert=tpe, active_experts=active, weight_bytes=nbytes,
                       torch_bf16_us=round(t_hf, 1), moe_us=round(t_moe, 1), frag_us=round(t_frag, 1),
                       moe_hbm_fraction=round(nbytes / (t_moe * 1e-6) / rate, 3),
                       hbm_fraction=round(nbytes / (t_frag * 1e-6) / rate, 3),
                       speedup=round(t_hf / t_frag, 2), moe_speedup=round(t_hf / t_moe, 2), max_rel_error=round(err, 5),
                       tokens=int(x.shape[0]), config=",".join(str(v) for v in F.frag_config(h, i, int(ids.numel()))),
                       frag_pdl=int(F.PDL_MODE != 0 or bool(args.pdl_ab and runtime.PDL)),
                       frag_plain_us=None if t_plain is None else round(t_plain, 1))
            if t_fwd is not None:  # --in-forward: the same call inside a longer graph, weights not L2-hot
                row.update(in_forward_copies=n_copies, forward_us=round(t_fwd, 1), torch_bf16_forward_us=round(t_hf_fwd, 1),
                           forward_hbm_fraction=round(nbytes / (t_fwd * 1e-6) / rate, 3),
                           forward_speedup=round(t_hf_fwd / t_fwd, 2))
                if t_fwd_off is not None:
                    row.update(forward_off_us=round(t_fwd_off, 1))
            rows.append(row)
            off_name = ab[2] if ab is not None else ""
            print(f"{model:14s} A={active:3d} T={tpe:>5}  hf {t_hf:7.1f}  moe {t_moe:7.1f} ({row['moe_hbm_fraction']:.2f}, "
                  f"x{row['moe_speedup']})  frag {t_frag:7.1f} ({row['hbm_fraction']:.2f}, x{row['speedup']})"
                  + ("" if t_plain is None else f"  frag, {off_name} {t_plain:7.1f}")
                  + ("" if t_fwd is None else f"  in a forward: hf {t_hf_fwd:7.1f} frag {t_fwd:7.1f} "
                     f"({row['forward_hbm_fraction']:.2f}, x{row['forward_speedup']})")
                  + ("" if t_fwd_off is None else f", {off_name} {t_fwd_off:7.1f}"),
                  flush=True)
        del mod, w, fw, fws, cases
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = next((AB[n] for n in AB if getattr(args, n)), None)
    res = {"device": torch.cuda.get_device_name(), "copy_rate_bytes_per_s": rate, "moe": rows,
           "ab": chosen[3] if chosen else None, "routed": bool(args.routed), "in_forward_copies": args.in_forward or None}
    lines = ["# The MoE call on fragment words (`python benchmarks/fragment_bench.py`)", "",
             f"{res['device']}; device copy {rate / 1e12:.2f} TB/s (read + write). Whole call (routing, both GEMMs, "
             "combine), CUDA-graph time. frag: `pdflash_kernels.fragments.fragment_moe`; moe: the served "
             "`moe_forward` (pair words); transformers: `grouped_mm`, bf16. Fractions: MXFP4 weight bytes / time / copy rate."
             + (f" In a forward (--in-forward {args.in_forward}): one call on each of {args.in_forward} copies of the "
                "experts back to back in one graph, the time over the calls (no graph launch a call, weights not L2-hot)."
                if args.in_forward else "")
             + (f" --routed: calls of {args.routed} tokens routed at random (tokens/expert: the mean)." if args.routed else "")
             + (" --one-launch-ab: frag = the GEMMs and combine in one launch on every shape (`fragment_moe_one`, "
                "calls of up to 128 pairs), beside the four launches; bits checked equal." if args.one_launch_ab else "")
             + (" --size-ab: frag = each call-size class's tiles (`FRAG_BY_SIZE`), beside FRAG_SHAPES' alone; bits "
                "checked equal." if args.size_ab else ""), "",
             "| model | active experts | tokens/expert | weight MB | transformers us | moe us | of copy | x | frag us | of copy | x | tiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['weight_bytes'] / 1e6:.1f} | "
                     f"{r['torch_bf16_us']} | {r['moe_us']} | {r['moe_hbm_fraction']:.2f} | {r['moe_speedup']} | "
                     f"{r['frag_us']} | {r['hbm_fraction']:.2f} | {r['speedup']} | {r['config']} |"
                     + ("" if r["frag_plain_us"] is None else f" {r['frag_plain_us']} |")
                     + ("" if "forward_us" not in r else f" {r['torch_bf16_forward_us']} | {r['forward_us']} | "
                        f"{r['forward_hbm_fraction']:.2f} | {r['forward_speedup']} |")
                     + ("" if "forward_off_us" not in r else f" {r['forward_off_us']} |"))
    if any(r["frag_plain_us"] is not None for r in rows):  # an A/B: one more column
        lines[4] += f" frag us, {chosen[2]} |"
        lines[5] += "---|"
    if args.in_forward:  # four more (five with an A/B)
        lines[4] += " in a forward: transformers us | frag us | of copy | x |"
        lines[5] += "---|---|---|---|"
        if any("forward_off_us" in r for r in rows):
            lines[4] += f" in a forward: frag us, {chosen[2]} |"
            lines[5] += "---|"
    _write(out, "fragment_h200", res, lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--sweep", action="store_true", help="the GEMM variants alone (fragment_sweep_h200.*) instead")
    ap.add_argument("--fused-sweep", action="store_true",
                    help="fragment_moe's gate/up and down launches per tile variant (fragment_fused_sweep_h200.*), then "
                         "the whole call with each model's winners (fragment_h200.*)")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--active", default="8,32,128", help="active experts a call (those a model has, at least its top-k)")
    ap.add_argument("--in-forward", type=int, default=0, metavar="N",
                    help="also time each whole call as a verify forward pays it: N copies of the experts, one call on each "
                         "back to back in one CUDA graph, the time over N (8: several times L2 on every shape)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="time the whole call with the two fragment GEMMs launched with PDL and without it (bits checked "
                         "equal; where pdflash_kernels.runtime.PDL is on)")
    ap.add_argument("--one-launch-ab", action="store_true",
                    help="time the whole call in one launch (fragments.fragment_moe_one, calls of up to 128 pairs) and in "
                         "four (bits checked equal); with --in-forward, both as a forward pays them")
    ap.add_argument("--size-ab", action="store_true",
                    help="time the whole call with each call-size class's tiles (fragments.FRAG_BY_SIZE, "
                         "PDFLASH_FP4_SIZE_TILES=1) and with FRAG_SHAPES' alone; bits checked equal")
    ap.add_argument("--routed", default=None, metavar="N,..",
                    help="calls of N tokens routed at random (top-k distinct experts a token) instead of --active x --tokens")
    args = ap.parse_args()
    if args.pdl_ab + args.one_launch_ab + args.size_ab > 1:
        ap.error("--pdl-ab, --one-launch-ab, --size-ab: one A/B at a time")
    if args.size_ab and os.environ.get("PDFLASH_FP4_TILES"):
        ap.error("--size-ab compares the size classes with FRAG_SHAPES; PDFLASH_FP4_TILES overrides both")
    if args.routed and (args.sweep or args.fused_sweep):
        ap.error("--routed is for the whole-call rows")
    if args.in_forward == 1 or args.in_forward < 0:
        ap.error("--in-forward: 2 or more copies (0: off)")
    if args.sweep:
        args.variants = args.variants or ",".join(VARIANTS)
        sweep_gemms(args)
        return
    if args.fused_sweep:
        from pdflash_kernels import fragments as F

        args.variants = args.variants or ",".join(FUSED_VARIANTS)
        F.FRAG_SHAPES.update(fused_sweep(args))
    whole_call(args)


if __name__ == "__main__":
    main()
