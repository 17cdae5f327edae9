"""The DFlash drafter's kernel count: the aten ops a proposal and a commit dispatch that launch a kernel on a GPU.

    python benchmarks/drafter_ops.py [--dtypes float32 bfloat16] [--context 64] [--tree DIR --label before]

On the H200 a proposal replayed from its CUDA graph takes ~0.84 ms and a commit ~0.24 ms, nearly all of it the GPU time
of hundreds of tiny kernels (one per aten op, ~1.7 us each): the drafter's kernel count is the figure to cut, and it
can be counted without a GPU. A TorchDispatchMode sees every aten op a call dispatches below autograd; the ops that
launch nothing on a GPU are set apart (`NO_KERNEL`: views, metadata-only ops, allocations), the rest are counted as one
kernel each. Counted on the demo drafter (pdflash/assets/demo/drafter, 5 layers), on the CPU, in each --dtypes:

- static: what one CUDA graph holds, drafter_svc/dflash_graphs.py's forward run uncaptured (`DFlashGraphs(...,
  capture=False)`, the path the CPU tests check): `_forward("propose", t)` for each proposal bucket t (a block of
  t rows: anchor + t-1 drafts, argmax included) and `_forward("commit", t)` for each commit bucket (t feature rows);
  the context holds --context rows;
- eager: the same calls on the eager path (`DFlashDrafter.propose` = block embeddings, `DFlashDraftModel.draft`, LM head,
  argmax; `DFlashDrafter.commit` = `extend_context`), with t-1 drafts and t committed rows.

Two kernel columns. `kernels` is what the CPU dispatches. `cuda` corrects it where torch runs one kernel on CUDA for
what it decomposes on the CPU: `F.rms_norm` dispatches `aten::_fused_rms_norm`, which has a CUDA kernel
(`_fused_rms_norm_cuda` in native_functions.yaml, from pytorch#153666, torch >= 2.8; it reuses the layer-norm kernel:
one launch for a contiguous row-aligned input) and on the CPU a composite of 5-8 ops; it is counted as 1, or 2 when
its input is not contiguous (the kernel reads a contiguous copy). Everything else is one kernel per op on either
device, as far as this count goes (a cuBLAS call may launch two; scaled dot-product attention is one fused kernel
when flash, memory-efficient or cuDNN takes it). Caveat for the `before` figures: with a mask AND grouped-query heads
(`enable_gqa`), as the graphs' proposals had, torch <= 2.11 has no fused CUDA backend (flash takes no mask, the
memory-efficient kernel wants equal head counts) and runs the math fallback, ~10-15 kernels per call that neither
column counts; the fused drafter folds the grouped heads instead (drafter_svc/dflash_model.py `attend`).

--tree DIR measures another checkout's drafter_svc (e.g. `git archive <commit> drafter_svc pdflash | tar -x -C DIR`)
and --label names the result; each run merges its label into benchmarks/results/drafter_ops_cpu.json, and the table
shows every label there. `before` is 3705aaa (the unfused drafter), `after` this checkout.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "drafter_ops_cpu.json"

#: aten ops that launch no kernel on a GPU, by name (besides every op whose schema makes it a view, `OpOverload.is_view`):
#: views and metadata-only ops, and allocations (the caching allocator hands out memory without a kernel; in a CUDA
#: graph they are no node).
NO_KERNEL = {
    # views and aliases (all also `is_view`, listed so the table says what is set apart)
    "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "unflatten",
    "flatten", "view_as", "expand_as", "diagonal", "movedim", "chunk", "lift_fresh",
    # allocations
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def counter():
    """A context manager that tallies the aten ops dispatched inside it: `.kernels` (Counter by op name), `.free`
    (the ops set apart), `.rms` (F.rms_norm calls: (kernels they dispatched, input contiguous))."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels: collections.Counter = collections.Counter()
            self.free: collections.Counter = collections.Counter()
            self.in_rms: int | None = None  # kernels dispatched inside the current F.rms_norm call

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = _name(func)
            if func.is_view or name in NO_KERNEL:
                self.free[name] += 1
            else:
                self.kernels[name] += 1
                if self.in_rms is not None:
                    self.in_rms += 1
            return func(*args, **(kwargs or {}))

    class Calls(TorchFunctionMode):
        def __init__(self, ops: Ops):
            super().__init__()
            self.ops = ops
            self.rms: list[tuple[int, bool]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.rms_norm or func is torch.rms_norm:
                self.ops.in_rms = 0
                try:
                    return func(*args, **kwargs)
                finally:
                    self.rms.append((self.ops.in_rms, args[0].is_contiguous()))
                    self.ops.in_rms = None
            return func(*args, **kwargs)

    class Both:
        def __enter__(self):
            self.ops = Ops()
            self.calls = Calls(self.ops)
            self.ops.__enter__()
            self.calls.__enter__()
            return self

        def __exit__(self, *exc):
            self.calls.__exit__(*exc)
            self.ops.__exit__(*exc)

        def result(self) -> dict:
            kernels = sum(self.ops.kernels.values())
            inside = sum(k for k, _ in self.calls.rms)
            fused = sum(1 if contiguous else 2 for _, contiguous in self.calls.rms)
            return {
                "kernels": kernels,
                "cuda": kernels - inside + fused,
                "set_apart": sum(self.ops.free.values()),
                "rms_norm_calls": len(self.calls.rms),
                "by_op": dict(sorted(self.ops.kernels.items(), key=lambda kv: (-kv[1], kv[0]))),
            }

    return Both()


def count(fn) -> dict:
    import torch

    with torch.no_grad(), counter() as c:
        fn()
    return c.result()


def measure(dtype_name: str, context: int) -> dict:
    import numpy as np
    import torch

    from drafter_svc.dflash_graphs import COMMIT_BUCKETS, DFlashGraphs
    from drafter_svc.drafters import make_factory
    from pdflash.defaults import default_drafter_dir, default_target_dir

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(0)
    f = make_factory("dflash", default_target_dir(), default_drafter_dir(), dtype=dtype)
    g = make_factory("dflash", default_target_dir(), default_drafter_dir(), dtype=dtype)
    graphs = DFlashGraphs(g.model, g.head.embed, g.head.lm_head, capacity=max(256, 2 * context), capture=False)
    g.use_graphs(graphs)
    prompt = rng.standard_normal((context, f.feature_dim)).astype(np.float32)
    out: dict = {"static": {"propose": {}, "commit": {}}, "eager": {"propose": {}, "commit": {}}}

    s = g.new_session()
    s.start(list(range(context)), prompt)
    assert s.graphed is not None and graphs.resident is s.graphed
    for t in graphs.propose_buckets:
        graphs._set_meta(context, t, 7)
        graphs._forward("propose", t)  # warm-up (the rope table, first-use work)
        out["static"]["propose"][str(t)] = count(lambda: graphs._forward("propose", t))
    for t in graphs.commit_buckets:
        try:  # t real rows at L..L+t-1 (the length does not move: each count rewrites the same rows)
            graphs._set_meta(context, t, 0, kind="commit")
        except TypeError:  # a tree from before the fusion: (L, n, anchor), the rows computed on the device
            graphs._set_meta(context, t, 0)
        graphs.features[:t].copy_(torch.from_numpy(rng.standard_normal((t, f.feature_dim)).astype(np.float32)))
        out["static"]["commit"][str(t)] = count(lambda: graphs._forward("commit", t))

    e = f.new_session()
    e.start(list(range(context)), prompt)
    e.propose(7, 3)  # warm-up
    for t in graphs.propose_buckets:
        out["eager"]["propose"][str(t)] = count(lambda: e.propose(7, t - 1))
    for t in COMMIT_BUCKETS:
        feats = rng.standard_normal((t, f.feature_dim)).astype(np.float32)
        out["eager"]["commit"][str(t)] = count(lambda: e.commit(list(range(t)), feats))
    return out


def table(results: dict) -> str:
    labels = list(results)
    lines = []
    for dtype in sorted({d for r in results.values() for d in r}):
        lines.append(f"\n{dtype}: kernels as the CPU dispatches them / on CUDA (F.rms_norm one kernel)")
        head = f"{'path':<7} {'call':<8} {'rows':>4}  " + "  ".join(f"{lab:>15}" for lab in labels)
        lines.append(head)
        lines.append("-" * len(head))
        first = results[labels[0]][dtype]
        for path in ("static", "eager"):
            for call in ("propose", "commit"):
                for rows in first[path][call]:
                    cells = []
                    for lab in labels:
                        r = results[lab].get(dtype, {}).get(path, {}).get(call, {}).get(rows)
                        cells.append(f"{r['kernels']:>7} / {r['cuda']:<5}" if r else f"{'-':>15}")
                    lines.append(f"{path:<7} {call:<8} {rows:>4}  " + "  ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=64, help="committed context rows when counting (counts do not depend on it)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose drafter_svc is measured")
    ap.add_argument("--label", default="current", help="the name of this run's results in the JSON")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    tree = pathlib.Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    import torch

    torch.set_num_threads(1)
    import drafter_svc

    assert pathlib.Path(drafter_svc.__file__).resolve().is_relative_to(tree), f"drafter_svc came from {drafter_svc.__file__}"
    with torch.no_grad():
        run = {dtype: measure(dtype, args.context) for dtype in args.dtypes}
    path = pathlib.Path(args.out)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("meta", {}).update({
        "what": "aten ops that launch a kernel (views, metadata ops and allocations set apart) per call of the demo "
                "DFlash drafter, counted on the CPU; `cuda`: the same with each F.rms_norm counted as its one CUDA "
                "kernel (two for a non-contiguous input)",
        "command": "python benchmarks/drafter_ops.py [--tree DIR --label NAME]",
        "no_kernel_ops": sorted(NO_KERNEL) + ["(any op whose schema is a view: OpOverload.is_view)"],
        "torch": torch.__version__, "machine": platform.machine(), "context": args.context,
    })
    doc.setdefault("runs", {})[args.label] = {"tree": str(tree), "results": run}
    print(table({lab: r["results"] for lab, r in doc["runs"].items()}))
    if not args.no_write:
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
