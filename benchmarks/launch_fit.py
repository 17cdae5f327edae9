"""Each fragment GEMM launch's fixed cost and marginal rate, fitted from a fused tile sweep (CPU; no GPU needed).

    python benchmarks/launch_fit.py [--sweep benchmarks/results/stop42_gpu/call2/fragment_fused_sweep_h200.json]
        [--kernels benchmarks/results/kernels_h200.json] [--out DIR]

Per (model, tokens per expert, launch), from `fragment_bench.py --fused-sweep`'s rows (each launch alone, a CUDA graph
replayed): the best tile's time at each number of active experts, fitted by least squares as
`us = fixed + weight MB / rate`. `fixed` is what a launch costs whatever its bytes (the graph launch, the first loads,
each program's chain of K steps, the tail); `rate` the bandwidth each further MB of weights streams at, also as a share
of the device-copy rate (`--kernels`' copy_rate_bytes_per_s, the same card). Then, per issue 12 row, the least time a
call can take with those launches' fixed costs (gate/up + down + the routing launch, where the call takes it, as kernel_bench measured it) against
the time 60% of the copy rate allows for the call's bytes: where the fixed costs alone exceed it, no tile choice meets
the goal and only removing launches' fixed costs can. The `path` column says whether the call skips the routing
launch (direct, `fragments.direct_refusal`); a routed call of gpt-oss-20b's 17-128 pairs takes the one launch on the
H200 (`fragments.ONE_LAUNCH_SHAPES`), whose fixed cost is not the two GEMM launches' sum: there the fixed column is
the four-launch form's. Prints a table; writes launch_fit_<device>.json / .md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_bench import MODELS, tag_of  # noqa: E402

GOAL = 0.6  # issue 12: >= 60% of the device-copy rate


def launch_bytes(model: str) -> dict[str, int]:
    """MXFP4 bytes one expert's gate/up and down launches read (E2M1 values and E8M0 scales; biases left out)."""
    _, _, h, i = MODELS[model]
    return {"gate_up": 2 * i * h // 2 + 2 * i * h // 32, "down": h * i // 2 + h * i // 32}


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `y = a + b x` over (x, y) points (at least two distinct x) -> (a, b)."""
    n = len(points)
    if n < 2 or len({x for x, _ in points}) < 2:
        raise ValueError("a line needs two or more distinct sizes")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def fits(sweep: dict, rate: float) -> list[dict]:
    """One fit per (model, tokens per expert, launch) with two or more active-expert sizes in the sweep."""
    out = []
    for model in MODELS:
        per = launch_bytes(model)
        for tpe in sorted({r["tokens_per_expert"] for r in sweep["rows"] if r["model"] == model}):
            rows = sorted((r for r in sweep["rows"] if r["model"] == model and r["tokens_per_expert"] == tpe),
                          key=lambda r: r["active_experts"])
            for launch in ("gate_up", "down"):
                pts = [(r["active_experts"] * per[launch] / 1e6, min(r[launch].values())) for r in rows]
                if len({x for x, _ in pts}) < 2:
                    continue
                a, b = fit_line(pts)
                mbps = 1e12 / b if b > 0 else float("inf")  # (1 MB / b us)
                out.append(dict(model=model, tokens_per_expert=tpe, launch=launch, fixed_us=round(a, 2),
                                rate_tb_s=round(mbps / 1e12, 2), rate_fraction=round(mbps / rate, 3),
                                points=[dict(active_experts=r["active_experts"], mb=round(x, 1), us=y)
                                        for r, (x, y) in zip(rows, pts)]))
    return out


def routing_us(align: dict, model: str, pairs: int) -> float:
    """The routing launch's time at `pairs` pairs (`kernels['align']`, {(model, pairs): us}): at the largest measured
    pairs at or below it (the table measures 1, 4, 16, ... tokens, so a row's pairs may fall between; the launch's time
    grows with the pairs, so this never overstates it); 0 where none is measured."""
    below = [p for m, p in align if m == model and p <= pairs]
    return align[(model, max(below))] if below else 0.0


def floors(fit_rows: list[dict], kernels: dict) -> list[dict]:
    """Per issue 12 MXFP4 row (<= 16 tokens per expert) with both launches fitted: the fixed costs a call pays
    (gate/up + down + its routing launch at the call's pairs, `kernels['align']`) against the time the goal allows."""
    from pdflash_kernels import fragments as F

    rate = kernels["copy_rate_bytes_per_s"]
    align = {(a["model"], a["pairs"]): a["us"] for a in kernels.get("align", [])}
    by = {(f["model"], f["tokens_per_expert"], f["launch"]): f for f in fit_rows}
    out = []
    for r in kernels["moe"]:
        if r["weights"] != "mxfp4" or r["tokens_per_expert"] > 16:
            continue
        key = (r["model"], r["tokens_per_expert"])
        gu, dn = by.get((*key, "gate_up")), by.get((*key, "down"))
        if gu is None or dn is None:
            continue
        _, k, h, i = MODELS[r["model"]]
        pairs = r["active_experts"] * r["tokens_per_expert"]
        # (a call that skips the routing launch pays none: fragments.direct_refusal, at most DIRECT_BASE pairs, as
        # served when the table was measured, before stop 54's DIRECT_SHAPES, whatever device this runs on)
        direct = pairs <= F.DIRECT_BASE and F.direct_refusal(pairs // k, k, h, i, *F.frag_config(h, i, pairs)) is None
        route = 0.0 if direct else routing_us(align, r["model"], pairs)
        fixed = gu["fixed_us"] + dn["fixed_us"] + route
        goal_us = r["weight_bytes"] / (GOAL * rate) * 1e6
        per = launch_bytes(r["model"])  # (the streaming time at each launch's marginal rate)
        stream = sum(r["active_experts"] * per[f["launch"]] / (f["rate_tb_s"] * 1e12) * 1e6 for f in (gu, dn))
        out.append(dict(model=r["model"], active_experts=r["active_experts"], tokens_per_expert=r["tokens_per_expert"],
                        pairs=pairs, topk=k, direct=direct, weight_mb=round(r["weight_bytes"] / 1e6, 1), us=r["us"],
                        goal_us=round(goal_us, 1), stream_us=round(stream, 1), fixed_us=round(fixed, 1),
                        routing_us=route, fixed_allowed_us=round(goal_us - stream, 1)))
    return out


def table(fit_rows: list[dict], floor_rows: list[dict], device: str) -> list[str]:
    lines = [f"# Fragment GEMM launches: fixed cost and marginal rate ({device}; `python benchmarks/launch_fit.py`)", "",
             "Least squares `us = fixed + MB / rate` over the active-expert sizes of the fused sweep (best tile at each "
             "size, each launch alone, a CUDA graph replayed).", "",
             "| model | tokens/expert | launch | fixed us | rate TB/s | of copy rate | points (MB: us) |",
             "|---|---|---|---|---|---|---|"]
    for f in fit_rows:
        pts = ", ".join(f"{p['mb']}: {p['us']}" for p in f["points"])
        lines.append(f"| {f['model']} | {f['tokens_per_expert']} | {f['launch']} | {f['fixed_us']} | {f['rate_tb_s']} | "
                     f"{f['rate_fraction']:.0%} | {pts} |")
    lines += ["", f"Issue 12's MXFP4 rows: the time {GOAL:.0%} of the copy rate allows for the call's bytes (goal), the "
              "time its bytes take at the launches' fitted marginal rates (stream), so the fixed costs the goal leaves "
              "room for (allowed = goal - stream), against the fixed costs the launches pay (gate/up + down fitted "
              "above + the routing launch at the call's pairs, where the call takes it: `direct` calls skip it):", "",
              "| model | active | tokens/expert | MB | path | measured us | goal us | stream us | fixed allowed us | fixed us |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in floor_rows:
        lines.append(f"| {r['model']} | {r['active_experts']} | {r['tokens_per_expert']} | {r['weight_mb']} | "
                     f"{'direct' if r['direct'] else 'routed'} | {r['us']} | "
                     f"{r['goal_us']} | {r['stream_us']} | {r['fixed_allowed_us']} | {r['fixed_us']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", default=str(ROOT / "benchmarks/results/stop42_gpu/call2/fragment_fused_sweep_h200.json"))
    ap.add_argument("--kernels", default=str(ROOT / "benchmarks/results/kernels_h200.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()
    sweep, kernels = json.loads(pathlib.Path(args.sweep).read_text()), json.loads(pathlib.Path(args.kernels).read_text())
    if tag_of(sweep["device"]) != tag_of(kernels["device"]):
        ap.error(f"the sweep ran on {sweep['device']}, the kernels table on {kernels['device']}: use one card's files")
    fit_rows = fits(sweep, kernels["copy_rate_bytes_per_s"])
    floor_rows = floors(fit_rows, kernels)
    lines = table(fit_rows, floor_rows, sweep["device"])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"launch_fit_{tag_of(sweep['device'])}"
    (out / f"{stem}.json").write_text(json.dumps({"device": sweep["device"], "sweep": args.sweep, "kernels": args.kernels,
                                                  "fits": fit_rows, "floors": floor_rows}, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
