"""The verifier's kernel launches per verify forward (what one CUDA graph of `verifier_svc/runner.py` holds), counted on
the CPU: per decoder layer and per forward, for each tiny architecture.

    python benchmarks/forward_launches.py [--archs qwen3_moe gpt_oss mixtral] [--dtypes bfloat16 float32]
                                          [--layers 2] [--rounds 3] [--tree DIR --label NAME]

On the H200 a graphed Qwen3-30B-A3B-shaped verify forward (8 layers) takes ~1.94 ms for ~0.22 ms of weight bytes: every
kernel in a graph costs ~2 us whatever it does, so the launch count is the figure to cut, and it can be counted without
a GPU. Each architecture's tiny model (`pdflash.tiny.make_tiny_checkpoint`, --layers decoder layers) is loaded with the
kernels installed (`load_target(..., kernels="on")`: Triton under its CPU interpreter, TRITON_INTERPRET=1) into a
`VerifierCore` with the paged KV pool, one prompt is prefilled and --rounds verify rounds of block 1 (the anchor) and
block 4 (anchor + 3 drafts) run. Every call of `ForwardRunner.forward_tensors` (the code a CUDA graph captures; on the
CPU the verifier runs it eagerly) is counted:

- Triton launches: `triton.runtime.interpreter.InterpretedFunction.run` (a `kernel[grid](...)` call) is wrapped. Triton's
  `knobs.runtime.launch_enter_hook` would be the cleaner hook but only compiled kernels call it, the interpreter never;
- aten ops that launch a kernel on CUDA: a TorchDispatchMode (entered outside the verifier's `InvariantMode`, so it sees
  what that mode forwards to torch and what the kernels' Python launchers dispatch, not the ops it replaces) counts every
  op but views and metadata-only ops, allocations (`NO_KERNEL`, and every op whose schema is a view) and host reads
  (`SYNC`: `.item()`/`.tolist()`, counted apart: a CUDA graph cannot hold them). The ops the interpreter dispatches
  while it runs a kernel (its `set_`/`copy_`/clone marshalling of the arguments to and from host copies) are not
  launches and are skipped: the dispatch mode counts nothing while a Triton launch is in progress. Every other `copy_`
  is a real copy kernel.

Per layer: a forward pre-hook and hook on each decoder layer take the counts in between (every layer of a tiny model
launches the same; the table shows layer 0 and the JSON every layer); `outside` = the forward minus its layers
(embedding, rotary table, final norm, LM head, the logits' cast). The counts are deterministic (the same every round).

--tree DIR measures another checkout (its pdflash, kernels and verifier_svc come first on sys.path; e.g.
`git worktree add /tmp/base <commit>`) and --label names it; each run merges its label into
benchmarks/results/forward_launches_cpu.json, and the table shows every label there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import platform
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "forward_launches_cpu.json"

#: aten ops that launch no kernel on a GPU when their result aliases their input: views and metadata-only ops, and
#: dtype/size queries. With every op whose schema lets its result alias an input (`OpOverload.is_view`: also `to`,
#: `contiguous`, `reshape`, which copy when they must), they count as a launch only when the result has storage of its
#: own (`to(dtype)` casts, a `reshape` that cannot view, a `contiguous` of a strided tensor).
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "unflatten",
    "flatten", "view_as", "expand_as", "diagonal", "movedim", "chunk", "lift_fresh", "_reshape_alias",
    "promote_types", "result_type", "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "dim",
    "is_contiguous", "sym_is_contiguous", "is_same_size", "_has_compatible_shallow_copy_type",
}
#: allocations: the caching allocator hands out memory without a kernel (in a CUDA graph an allocation is no node)
ALLOC = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SYNC = {"_local_scalar_dense", "item"}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def _copied(out, args) -> bool:
    """True when an aliasing op's result does not share its input's storage (a cast or a copy ran)."""
    import torch

    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    res = next((o for o in outs if isinstance(o, torch.Tensor)), None)
    if src is None or res is None:
        return False
    return res.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


class LaunchCounter:
    """`with LaunchCounter() as c:` tallies the kernel launches dispatched inside: `c.triton` (Counter by kernel name),
    `c.aten` (Counter by op name), `c.free` (ops set apart), `c.syncs`; `c.total()` = Triton + aten launches."""

    def __init__(self):
        self.triton: collections.Counter = collections.Counter()
        self.aten: collections.Counter = collections.Counter()
        self.free: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self._in_kernel = 0
        self._stack = contextlib.ExitStack()

    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())

    def snapshot(self) -> dict:
        return {"triton": dict(self.triton), "aten": dict(self.aten)}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction

        counter = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter._in_kernel:  # inside a launch: the interpreter's own marshalling
                    return func(*args, **(kwargs or {}))
                out = func(*args, **(kwargs or {}))
                name = _name(func)
                if name in SYNC:
                    counter.syncs[name] += 1
                elif name in ALLOC:
                    counter.free[name] += 1
                elif func.is_view or name in NO_KERNEL:
                    (counter.aten if _copied(out, args) else counter.free)[name] += 1
                else:
                    counter.aten[name] += 1
                return out

        orig = InterpretedFunction.run

        def run(fn, *args, grid, warmup, **kwargs):
            if warmup:
                return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)
            counter.triton[fn.__name__] += 1
            counter._in_kernel += 1
            try:
                return orig(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._in_kernel -= 1

        InterpretedFunction.run = run
        self._stack.callback(setattr, InterpretedFunction, "run", orig)
        self._stack.enter_context(Ops())
        return self

    def __exit__(self, *exc):
        self._stack.close()


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for kind in ("triton", "aten"):
        d = {k: v - before[kind].get(k, 0) for k, v in after[kind].items() if v - before[kind].get(k, 0)}
        out[kind] = dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))
    out["launches"] = sum(out["triton"].values()) + sum(out["aten"].values())
    return out


class _Undo:
    """A hook handle for a patch: remove() puts back what was there."""

    def __init__(self, undo):
        self.remove = undo


def count_forward(runner, call) -> dict:
    """Run `call()` (one or more `runner.forward_tensors` calls) and return, per forward_tensors call, its launches:
    {"launches", "triton", "aten", "syncs", "layers": [per decoder layer {"launches", "triton", "aten"}], "outside",
    "rows"}."""
    forwards: list[dict] = []
    layers = list(runner.inner.layers[: runner.num_layers])
    with LaunchCounter() as c:
        marks: list[dict] = []
        handles = []
        chained = getattr(runner, "chain", None) is not None
        if chained:  # verifier_svc.prenorm: a layer runs from its attention to the next one's (its input norm is fused
            # into the previous layer's residual add), the last one to the LM head (its add + the final norm included)
            fused = list(runner.chain.attn)  # verifier_svc.fused_attention: the module is not called, its step is
            for i, layer in enumerate(layers):
                if fused[i] is None:
                    handles.append(layer.self_attn.register_forward_pre_hook(lambda m, a: marks.append(c.snapshot())))
                else:
                    def marked(x, kw, _f=fused[i]):
                        marks.append(c.snapshot())
                        return _f(x, kw)
                    runner.chain.attn[i] = marked
                    handles.append(_Undo(lambda i=i: runner.chain.attn.__setitem__(i, fused[i])))
            handles.append(runner.model.lm_head.register_forward_pre_hook(lambda m, a: marks.append(c.snapshot())))
        else:
            for layer in layers:
                handles.append(layer.register_forward_pre_hook(lambda m, a: marks.append(c.snapshot())))
                handles.append(layer.register_forward_hook(lambda m, a, o: marks.append(c.snapshot())))
        orig = runner.forward_tensors

        def forward_tensors(ids, *args, **kwargs):
            marks.clear()
            start, syncs = c.snapshot(), sum(c.syncs.values())
            out = orig(ids, *args, **kwargs)
            whole = _diff(c.snapshot(), start)
            if chained:
                per_layer = [_diff(marks[i + 1], marks[i]) for i in range(len(marks) - 1)]
            else:
                per_layer = [_diff(marks[2 * i + 1], marks[2 * i]) for i in range(len(marks) // 2)]
            whole["syncs"] = sum(c.syncs.values()) - syncs
            whole["layers"] = per_layer
            whole["outside"] = whole["launches"] - sum(x["launches"] for x in per_layer)
            whole["rows"] = int(ids.shape[1])
            forwards.append(whole)
            return out

        runner.forward_tensors = forward_tensors
        try:
            call()
        finally:
            runner.__dict__.pop("forward_tensors", None)
            for h in handles:
                h.remove()
    return forwards


def measure(arch: str, dtype: str, layers: int, rounds: int, blocks=(1, 4)) -> dict:
    import torch

    from pdflash.tiny import make_tiny_checkpoint
    from pdflash.types import DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PagedKVOptions, PrefillInput, VerifierCore
    from verifier_svc.model import load_target

    with tempfile.TemporaryDirectory() as tmp:
        d = make_tiny_checkpoint(pathlib.Path(tmp) / arch, arch, num_layers=layers)
        target = load_target(d, "cpu", dtype, kernels="on")
    core = VerifierCore(target, max_block_size=32, paged_kv=PagedKVOptions(mode="on", kv_cache_gb=0.01))
    if core.runner is None:
        raise RuntimeError(f"{arch}: no paged KV runner (kernels: {target.kernels})")
    rng = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, target.vocab_size, (20,), generator=rng).tolist()
    pre = core.prefill(PrefillInput("bench", tuple(prompt), SamplingParams(), 10 * rounds * max(blocks), ignore_eos=True))
    sid, anchor, union = pre.session_id, pre.tokens[-1], pre.routed_union
    state = {"round": 0, "anchor": anchor, "union": union}
    by_block: dict[int, list[dict]] = {}
    for block in blocks:
        def one_round(block=block):
            state["round"] += 1
            drafts = torch.randint(2, target.vocab_size, (block - 1,), generator=rng).tolist()
            res = core.verify(DraftResult(sid, state["round"], (state["anchor"], *drafts), state["union"],
                                          union_bytes(state["union"], target.byte_map)))
            state["anchor"], state["union"] = res.tokens[-1], res.routed_union

        def call(block=block):
            for _ in range(rounds):
                one_round(block)

        fw = count_forward(core.runner, call)
        by_block[block] = [f for f in fw if f["rows"] == block]
    core.end(sid)
    out = {}
    for block, fws in by_block.items():
        first = fws[0]
        out[f"block{block}"] = {
            "forwards": len(fws),
            "deterministic": all(f["launches"] == first["launches"] and f["aten"] == first["aten"] and f["triton"] == first["triton"] for f in fws),
            "launches": first["launches"],
            "triton": sum(first["triton"].values()),
            "aten": sum(first["aten"].values()),
            "syncs": first["syncs"],
            "per_layer": [x["launches"] for x in first["layers"]],
            "outside": first["outside"],
            "layer0_by_kernel": {**{f"triton:{k}": v for k, v in first["layers"][0]["triton"].items()},
                                 **{f"aten:{k}": v for k, v in first["layers"][0]["aten"].items()}},
            "by_kernel": {**{f"triton:{k}": v for k, v in first["triton"].items()},
                          **{f"aten:{k}": v for k, v in first["aten"].items()}},
        }
    return out


def table(results: dict) -> str:
    lines = ["| label | arch | dtype | block | per layer (triton + aten) | outside the layers | per forward | host syncs |",
             "|---|---|---|---|---|---|---|---|"]
    for label, run in results.items():
        for key, r in run["runs"].items():
            arch, dtype = key.split("/")
            for block, b in r.items():
                l0 = b["layer0_by_kernel"]
                tri = sum(v for k, v in l0.items() if k.startswith("triton:"))
                at = sum(v for k, v in l0.items() if k.startswith("aten:"))
                lines.append(f"| {label} | {arch} | {dtype} | {block.removeprefix('block')} | {b['per_layer'][0]} ({tri} + {at}) | "
                             f"{b['outside']} | {b['launches']} ({run['layers']} layers) | {b['syncs']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=["qwen3_moe", "gpt_oss", "mixtral"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", default=None, help="another checkout to measure (its code first on sys.path)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: the CPU runs the kernels' logic
    sys.path.insert(0, str(ROOT))
    if args.tree:
        sys.path.insert(0, str(pathlib.Path(args.tree).resolve()))
    import torch

    import verifier_svc

    torch.manual_seed(0)
    runs = {}
    for arch in args.archs:
        for dtype in args.dtypes:
            runs[f"{arch}/{dtype}"] = measure(arch, dtype, args.layers, args.rounds)
            b1 = runs[f"{arch}/{dtype}"]["block1"]
            print(f"{arch} {dtype}: block 1 {b1['launches']} launches ({b1['per_layer']} per layer)", file=sys.stderr)
    out = pathlib.Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[args.label] = {
        "tree": str(pathlib.Path(verifier_svc.__file__).resolve().parents[1]),
        "layers": args.layers,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
