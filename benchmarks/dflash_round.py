"""One DFlash drafter round in process, without services: a proposal's and a commit's time as the context grows, and the
aten ops each dispatches (on a GPU about one kernel launch each, apart from views: the host-side cost of a round there).

    python benchmarks/dflash_round.py [--device cpu] [--dtype float32] [--contexts 128 512 1024] [--repeats 30]
                                      [--tree DIR] [--out FILE]

Features are random (the cost does not depend on them); proposals of 3 and 15 drafts (the adaptive width's narrowest
and the demo's widest), commits of 4 rows. Times: the minimum and the median of --repeats calls (a shared host is
noisy: the minimum is the cost, the median what a round saw). --tree DIR imports drafter_svc from another checkout
(e.g. `git worktree add /tmp/old HEAD~3`), to compare two versions with the same script.

The plain columns are the eager drafter's; the graph_* columns the same calls through drafter_svc/dflash_graphs.py:
on CUDA replayed from the graphs captured at load, on the CPU the same static-buffer code run uncaptured (meta
graph_mode says which; a context past --graph-capacity runs eagerly there too: graphed false). A tree without the
graphs gets no graph_* columns.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ops(fn) -> tuple[int, int]:
    """(aten ops, of which views) that fn() dispatches."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.views += func.is_view
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count() as c:
        fn()
    return c.ops, c.views


def _time(fn, repeats: int, sync) -> tuple[float, float]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(min(ts), 3), round(statistics.median(ts), 3)


def _graph_factory(make_factory, target, drafter, where: dict, cuda: bool, capacity: int):
    """The drafter whose sessions run the graphed path: captured at load on CUDA, the static path uncaptured elsewhere."""
    from drafter_svc.dflash_graphs import DEFAULT_CAPACITY, DFlashGraphs

    capacity = capacity or DEFAULT_CAPACITY
    if cuda:
        return make_factory("dflash", target, drafter, graph_capacity=capacity, **where)
    g = make_factory("dflash", target, drafter, **where)
    g.use_graphs(DFlashGraphs(g.model, g.head.embed, g.head.lm_head, capacity=capacity, capture=False))
    return g


def _graph_row(g, ctx: int, prompt, feats, repeats: int, sync, cuda: bool) -> dict:
    """graph_* columns: the same calls as the eager row's, through the graphs."""
    s = g.new_session()
    s.start(list(range(ctx)), prompt)
    row = {"graphed": s.graphed is not None}
    for k in (3, 15):
        s.propose(7, k)  # warm-up
        row[f"graph_propose{k}_ms_min"], row[f"graph_propose{k}_ms_p50"] = _time(lambda: s.propose(7, k), repeats, sync)
    row["graph_propose15_ops"], row["graph_propose15_views"] = _ops(lambda: s.propose(7, 15))
    if cuda and s.graphed is not None:  # host time: the inputs' copy and the replay's launch, up to the copy back
        graphs = g.graphs

        def issue():
            graphs._set_meta(s.length, 16, 7)
            return graphs._run("propose", 16)

        row["graph_propose15_host_ms_min"], row["graph_propose15_host_ms_p50"] = _time(issue, repeats, lambda: None)
        sync()

    def commit_and_back():
        s.commit([1, 2, 3, 4], feats)
        if s.graphed is not None:
            s.graphed.length -= 4
        else:
            s.cache.length -= 4
            s.cache._used = [u - 4 for u in s.cache._used]

    row["graph_commit4_ms_min"], row["graph_commit4_ms_p50"] = _time(commit_and_back, repeats, sync)
    row["graph_commit4_ops"], row["graph_commit4_views"] = _ops(commit_and_back)
    s.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the drafter's default: 1)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose drafter_svc is measured")
    ap.add_argument("--graph-capacity", type=int, default=0, help="context rows of the graphs' buffer (0 = the default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(pathlib.Path(args.tree).resolve()))
    import numpy as np
    import torch

    from drafter_svc.drafters import make_factory
    from pdflash.defaults import default_drafter_dir, default_target_dir

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    where = dict(device=args.device, dtype=args.dtype)
    try:  # the eager drafter (on CUDA the factory would capture graphs by default)
        f = make_factory("dflash", default_target_dir(), default_drafter_dir(), cuda_graphs=False, **where)
    except ValueError:  # a tree from before the graphs
        f, g = make_factory("dflash", default_target_dir(), default_drafter_dir(), **where), None
    else:
        g = _graph_factory(make_factory, default_target_dir(), default_drafter_dir(), where, cuda, args.graph_capacity)
    rng = np.random.default_rng(0)
    rows = []
    for ctx in args.contexts:
        prompt = rng.standard_normal((ctx, f.feature_dim)).astype(np.float32)
        feats = rng.standard_normal((4, f.feature_dim)).astype(np.float32)
        s = f.new_session()
        s.start(list(range(ctx)), prompt)
        row = {"context": ctx}
        for k in (3, 15):
            s.propose(7, k)  # warm-up
            row[f"propose{k}_ms_min"], row[f"propose{k}_ms_p50"] = _time(lambda: s.propose(7, k), args.repeats, sync)
        row["propose15_ops"], row["propose15_views"] = _ops(lambda: s.propose(7, 15))
        if args.device.startswith("cuda"):  # host time: queueing propose's work, up to its one copy back (the drafts)
            def issue():
                embeds = torch.cat([f.head.embed[7:8], f.mask_rows[:15]])[None]
                return (f.model.draft(embeds, s.cache)[0, 1:] @ f.head.lm_head.T).argmax(dim=-1)

            row["propose15_host_ms_min"], row["propose15_host_ms_p50"] = _time(issue, args.repeats, lambda: None)
            sync()

        def commit_and_back():  # a commit of 4 rows, its rows dropped again so that the context stays at ctx
            s.commit([1, 2, 3, 4], feats)
            s.cache.length -= 4
            s.cache._used = [u - 4 for u in s.cache._used]

        row["commit4_ms_min"], row["commit4_ms_p50"] = _time(commit_and_back, args.repeats, sync)
        row["commit4_ops"], row["commit4_views"] = _ops(commit_and_back)
        if g is not None:
            row.update(_graph_row(g, ctx, prompt, feats, args.repeats, sync, cuda))
        rows.append(row)
        print(json.dumps(row), flush=True)
    mode = None if g is None else "cuda graphs" if g.graphs.captured else "static path, uncaptured"
    out = {"meta": {"tree": args.tree, "device": args.device, "dtype": args.dtype, "threads": args.threads,
                    "torch": torch.__version__, "machine": platform.machine(), "repeats": args.repeats,
                    "graph_mode": mode, "graph_capacity": None if g is None else g.graphs.capacity}, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
