# stop 56 call 11 (H100, warm): align_fused as served (a program a chunk, moe.align_programs_chunk) against one program,
# the routing compared. Run from the repo root: PYTHONPATH=/tmp/site:$PWD python3 benchmarks/results/stop56_gpu/call11/align_default.py
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.kernel_bench import gpu_time_us  # noqa: E402
from pdflash_kernels.moe import align_fused  # noqa: E402

for e, k in ((128, 8), (32, 4)):
    for t in (16, 64, 256, 1024):
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
        sl = torch.randperm(e, device="cuda").int()
        a, b = align_fused(ids, e, 16, sl, programs=False), align_fused(ids, e, 16, sl)
        same = torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_slot, b.block_slot)
        print(e, t * k, round(gpu_time_us(lambda: align_fused(ids, e, 16, sl, programs=False)), 2),
              round(gpu_time_us(lambda: align_fused(ids, e, 16, sl)), 2), same)
