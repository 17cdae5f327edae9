"""pdflash kernels: MXFP4 experts and batch-invariant Triton kernels for the GPU verifier.

Pure functions on tensors (no gRPC, no model code):
- `pdflash_kernels.mxfp4`: the MXFP4 format (quantize / dequantize, gpt-oss layout, one expert's arena layout);
- `pdflash_kernels.moe`: grouped MoE experts (all routed pairs of a layer, bf16 or MXFP4 weights, slot table);
- `pdflash_kernels.linear`, `pdflash_kernels.reduce`, `pdflash_kernels.attention`: batch-invariant matmul, row reductions, attention;
- `pdflash_kernels.fused`: RMSNorm, rotary (q and k) and MoE routing, one launch each (a decode step's small ops);
- `pdflash_kernels.dispatch`: the torch dispatch mode that routes a model's matmuls and reductions to them;
- `pdflash_kernels.installer`: puts all of it under a loaded transformers model (`install(model) -> Installation`);
- `pdflash_kernels.reference`: torch references (any device), the tests' oracle and the CPU path.
"""

from pdflash_kernels.runtime import triton_usable

__all__ = ["install", "triton_usable"]


def install(model, experts_format: str = "native", probe: bool = True, fuse: bool = True):
    from pdflash_kernels.installer import install as _install

    return _install(model, experts_format=experts_format, probe=probe, fuse=fuse)
