"""Where the one-launch MoE call's time goes (a probe, not a benchmark): `fragments.fragment_moe_one` variants made by
editing pdflash_kernels/fragments.py's source (copies in /tmp), each timed on the same call (CUDA-graph time) beside
the four launches. base: as served; sleep: the down tiles' wait with nanosleep; up_only: gate/up tiles only;
down_nowait: down tiles only, not waiting (reads stale h: time only); no_combine: no fused combine; prologue: tickets,
block count and the counters' reset, no tile; pid_roles: roles by program id instead of a ticket (timing only: safe
while programs start in id order); ticket_unused: the ticket taken, roles by program id; padded: the ticket, the done
count and each block's count in cache lines of their own; pid_padded: both. Each case is timed twice, in two rounds. `=` after a time: bits equal to the four launches.

    python benchmarks/one_launch_probe.py [variant ...]   (on the GPU machine; ~1 minute; default every variant)
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.kernel_bench import MODELS, as_served, gpu_time_us, hf_experts, routing  # noqa: E402

SRC = (ROOT / "pdflash_kernels" / "fragments.py").read_text()
SLEEP = '                    gl.inline_asm_elementwise("nanosleep.u32 128; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)\n'
WAIT = "                    ready = gl.atomic_add(cnt_ptr + 2 + b, 0, sem=\"acquire\", scope=\"gpu\")\n"
TICKET = '        t = gl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")  # this program\'s ticket\n'
PADDED = [("cnt_ptr + 2 + b,", "cnt_ptr + 64 + b * 32,"), ("cnt_ptr + 2 + MB,", "cnt_ptr + 64 + MB * 32,"),
          ("gl.atomic_add(cnt_ptr + 1, 1,", "gl.atomic_add(cnt_ptr + 32, 1,"),
          ("used = 2 + MB + T * TB", "used = 64 + MB * 32 + T * TB"),
          ("linear._counters(x.device, 2 + mb + t * tb)", "linear._counters(x.device, 64 + 32 * mb + t * tb)")]
VARIANTS = {
    "base": [],
    "sleep": [(WAIT, WAIT + SLEEP)],
    "up_only": [("        if t < na + nblocks * TB:\n", "        if t < na:\n")],
    "down_nowait": [("        if t < na + nblocks * TB:\n", "        if (t >= na) & (t < na + nblocks * TB):\n"),
                    ("while ready < TA:", "while ready < 0:")],
    "no_combine": [("                _combine_tile(y_ptr,", "                if False:\n                    _combine_tile(y_ptr,")],
    "prologue": [("        if t < na + nblocks * TB:\n", "        if t < 0:\n")],
    # roles by program id, no ticket (safe only while the GPU starts programs in id order: timing only)
    "pid_roles": [(TICKET, "        t = gl.program_id(0)\n")],
    # the ticket taken but not used (roles by program id): the atomic's own cost
    "ticket_unused": [(TICKET, '        tkt = gl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")\n        t = gl.program_id(0)\n')],
    # the ticket, the done count and each block's count in 128-byte lines of their own (the waiting tiles' reads and the
    # gate/up tiles' releases off the ticket's line)
    "padded": PADDED,
    "pid_padded": PADDED + [(TICKET, "        t = gl.program_id(0)\n")],
}


def load(name, edits, src=SRC, prefix="frag"):
    """`src` (fragments.py's source) with each edit made (every occurrence; each must be there), as module
    `{prefix}_{name}` from /tmp."""
    for a, b in edits:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = pathlib.Path(f"/tmp/{prefix}_{name}.py")
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    from pdflash_kernels import fragments as F
    from pdflash_kernels.installer import expert_weights

    names = sys.argv[1:] or list(VARIANTS)
    mods = {n: load(n, VARIANTS[n]) for n in names}
    for m in mods.values():
        m.ONE_LAUNCH_PAIRS = 128  # every shape
    for model, active, tpe in (("qwen3-30b-a3b", 8, 1), ("qwen3-30b-a3b", 32, 1), ("gpt-oss-20b", 8, 1), ("gpt-oss-20b", 8, 4)):
        e, k, h, i = MODELS[model]
        w = as_served(expert_weights(hf_experts(model), "mxfp4"), pair_words=True)
        fw = F.FragmentExperts.from_weights(w)
        x, ids, wts = routing(e, k, h, active, tpe)
        with torch.inference_mode():
            saved, F.ONE_LAUNCH_PAIRS = F.ONE_LAUNCH_PAIRS, 0
            four = gpu_time_us(lambda: F.fragment_moe(x, ids, wts, fw, e))
            F.ONE_LAUNCH_PAIRS = saved
            ref = F.fragment_moe(x, ids, wts, fw, e)
            for rnd in range(2):
                if rnd:
                    F.ONE_LAUNCH_PAIRS = 0
                    four = gpu_time_us(lambda: F.fragment_moe(x, ids, wts, fw, e))
                    F.ONE_LAUNCH_PAIRS = saved
                row = [f"{model} A={active} T={x.shape[0]}: four {four:6.1f}"]
                for n, m in mods.items():
                    fwm = m.FragmentExperts(**{f.name: getattr(fw, f.name) for f in dataclasses.fields(fw)})
                    call = lambda: m.fragment_moe_one(x, ids, wts, fwm, e)  # noqa: E731
                    out = call()
                    checked = n in ("base", "sleep", "pid_roles", "ticket_unused", "padded", "pid_padded")
                    same = "=" if checked and torch.equal(out, ref) else ("!" if checked else "")
                    row.append(f"{n} {gpu_time_us(call):6.1f}{same}")
                print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
