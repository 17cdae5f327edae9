"""Run pytest with a sweep's winners in place, before they are pasted into pdflash_kernels/moe.py: one GPU call can sweep the
MoE GEMM variants, then check the winning configs end to end (bit-identical rows, block widths equal to block 1).

    python benchmarks/kernel_bench.py --out OUT --sweep --skip-main ... > OUT/sweep.txt
    python benchmarks/with_sweep_winners.py OUT/sweep.txt -- tests/test_gpu_verifier.py -k "every_drafter"

Reads the block the sweep prints after "# ---- paste into pdflash_kernels/moe.py" (PAIR_DEFAULT / PAIR_SHAPE_OVERRIDES /
FP4_DEFAULT / SHAPE_OVERRIDES assignments over pdflash_kernels.moe's variant tables), executes it in pdflash_kernels.moe's namespace
(the configs are looked up per call: `pdflash_kernels.moe.variant_config`), prints what changed, and runs pytest in this
process. Exit status: pytest's.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARK = "# ---- paste into pdflash_kernels/moe.py"
NAMES = ("PAIR_DEFAULT", "PAIR_SHAPE_OVERRIDES", "FP4_DEFAULT", "SHAPE_OVERRIDES", "BF16_DEFAULT")


def winners_block(text: str) -> str:
    """The sweep output's paste block (the lines after its marker), or an error naming what is missing."""
    if MARK not in text:
        raise SystemExit(f"no {MARK!r} block in the sweep output: did the sweep finish?")
    lines = text.split(MARK, 1)[1].splitlines()[1:]
    keep = []
    for line in lines:
        if line.startswith("sweep written to"):
            break
        keep.append(line)
    return "\n".join(keep)


def apply(block: str) -> dict:
    """Execute the block in pdflash_kernels.moe's namespace; returns the names it set, as they now stand."""
    from pdflash_kernels import moe

    before = {n: repr(getattr(moe, n)) for n in NAMES}
    exec(compile(block, "<sweep winners>", "exec"), moe.__dict__)
    return {n: getattr(moe, n) for n in NAMES if repr(getattr(moe, n)) != before[n]}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit("usage: with_sweep_winners.py SWEEP_TXT -- PYTEST_ARGS...")
    block = winners_block(pathlib.Path(argv[0]).read_text())
    changed = apply(block)
    print("# sweep winners in place for this run:" if changed else "# the sweep's winners are the current defaults")
    for name, value in changed.items():
        print(f"#   {name} = {value}")
    import pytest

    return int(pytest.main(argv[2:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
