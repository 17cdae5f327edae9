"""MXFP4: the OCP microscaling FP4 format (E2M1 values, one E8M0 scale per 32 values along K).

Pure torch (CPU or GPU); the reference every kernel is checked against.

Format (REFERENCE.md section 5):
- values: E2M1, +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; two per byte, the lower index of a pair in the low nibble;
- scales: one byte s per 32 consecutive values along the last (K) dimension, value 2^(s - 127) (255 = NaN);
- `blocks[..., K // 2]` uint8 and `scales[..., K // 32]` uint8 for a weight `w[..., K]` (K = the input
  dimension: rows are output features, as in nn.Linear and gpt-oss's `*_blocks`, so a row's K bytes are
  contiguous and a kernel reads them with wide loads).

Quantisation picks, per 32-value group, the smallest power-of-two scale that needs no clipping
(amax / scale <= 6) and rounds each value to the nearest E2M1 value, ties to the even code. So a group
whose values are all E2M1 values times one power of two round-trips exactly.

gpt-oss checkpoints store `*_blocks` as [E, N, K/32, 16] and `*_scales` as [E, N, K/32]: the same bytes;
`from_gpt_oss` only reshapes them.
"""

from __future__ import annotations

import dataclasses

import torch

GROUP = 32  # values per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BYTES_PER_WEIGHT = 0.5 + 1 / GROUP  # 0.53125

# Rounding |q| to the E2M1 magnitudes (codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6). Midpoints between two codes;
# a value exactly on a midpoint goes to the even code: the lower one (">") or the upper one (">=").
_LOWER_TIE = (0.25, 1.25, 2.5, 5.0)  # midpoints whose even neighbour is the lower code
_UPPER_TIE = (0.75, 1.75, 3.5)  # midpoints whose even neighbour is the upper code


def _lut(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w[..., K] (any float dtype, K % 32 == 0) -> (blocks[..., K/2] uint8, scales[..., K/32] uint8)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {w.shape[-1]}")
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize non-finite weights to MXFP4")
    x = w.detach().to(torch.float32).reshape(*w.shape[:-1], -1, GROUP)
    amax = x.abs().amax(dim=-1)
    # Smallest j with amax <= 6 * 2^j: a first guess from frexp, then corrected in exact arithmetic.
    mant, exp = torch.frexp(amax / 6.0)
    j = exp.to(torch.int32) - (mant == 0.5).to(torch.int32)
    six = torch.full_like(amax, 6.0)
    j = torch.where(amax > torch.ldexp(six, j.float()), j + 1, j)
    j = torch.where((j > -127) & (amax <= torch.ldexp(six, (j - 1).float())), j - 1, j)
    j = torch.where(amax == 0, torch.full_like(j, -127), j).clamp(-127, 127)
    q = x / torch.ldexp(torch.ones_like(amax), j.float()).unsqueeze(-1)
    a = q.abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for b in _LOWER_TIE:
        code += (a > b).to(torch.int32)
    for b in _UPPER_TIE:
        code += (a >= b).to(torch.int32)
    code = code | (((q < 0) & (code > 0)).to(torch.int32) << 3)
    code = code.reshape(*w.shape[:-1], -1, 2).to(torch.uint8)
    blocks = code[..., 0] | (code[..., 1] << 4)
    scales = (j + 127).to(torch.uint8)
    return blocks.reshape(*w.shape[:-1], -1).contiguous(), scales.contiguous()


def decode_codes(blocks: torch.Tensor) -> torch.Tensor:
    """blocks[..., K/2] -> E2M1 codes[..., K] (int64), lower index from the low nibble."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)
    return codes.reshape(*blocks.shape[:-1], -1).long()


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(blocks[..., K/2], scales[..., K/32]) -> w[..., K] in `dtype` (exact in float32 and bfloat16)."""
    if blocks.shape[:-1] != scales.shape[:-1] or blocks.shape[-1] * 2 != scales.shape[-1] * GROUP:
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not describe one MXFP4 tensor")
    vals = _lut(blocks.device)[decode_codes(blocks)]
    exps = scales.to(torch.int32) - 127
    scale = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps.float())
    scale = torch.where(scales == 255, torch.full_like(scale, float("nan")), scale)
    out = vals.reshape(*scales.shape, GROUP) * scale.unsqueeze(-1)
    return out.reshape(*blocks.shape[:-1], -1).to(dtype)


def from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss `*_blocks` [E, N, K/32, 16] + `*_scales` [E, N, K/32] -> this module's layout (no copy)."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"not a gpt-oss MXFP4 pair: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    return blocks.reshape(*blocks.shape[:2], -1), scales


# ---- pair words: the bits of each 32-bit word rearranged for a cheap decode ------------------------------
# A word of `blocks` (4 bytes, 8 consecutive values along K: value v in nibble v, bits 4v..4v+3 = m, e0, e1, sign)
# becomes a "pair word": its 8 values as 4 pairs (v0, v1), (v2, v3), (v4, v5), (v6, v7), each pair decoding to one
# bf16x2 register (lower K index in the low half), the order the MMA's register pairs take. In that register a value's
# magnitude bits go under the bf16 exponent's two low bits and the top mantissa bit (m -> bit 6, e0 -> 7, e1 -> 8 of its
# half: code 1 becomes the bf16 subnormal 2^-127, every code the E2M1 value times 2^-126) and its sign to bit 15 of its
# half; one bf16x2 multiply by 2^(s - 1) then gives the scaled values exactly (as pdflash_kernels.moe's decodes 3 and 4).
# The stored bits are placed so that each pair comes out of the word with one rotation and one AND:
#   pair 0: w & 0x81C081C0;  pair 1: rotl(w, 4) & 0x81C081C0;  pair 2: rotl(w, 10) & 0x81C081C0;
#   pair 3: (rotl(w, 6) & 0x80C080C0) | (rotl(w, 14) & 0x01000100)
# (no four rotations of the 8-bit pattern {6, 7, 8, 15, 22, 23, 24, 31} are disjoint, so the last pair takes two).
# Nine integer instructions a word against ~20 for the natural nibble order (benchmarks/fp4_loop_sass.py); the same
# bytes (a permutation of the bits inside each 4-byte word), so slice sizes and the byte map do not change.
PAIR_MASK = 0x81C081C0
_PAIR_ROT = ((0, 0), (4, 4), (10, 10), (6, 14))  # per pair: rotation of (m, e0, sign bits; and e1 for pairs 0-2), of e1


def _pair_word_sources() -> list[int]:
    """src[stored bit] = the natural bit (of the same word) stored there."""
    src = [-1] * 32
    for j, (rot, rot_e1) in enumerate(_PAIR_ROT):
        for half, v in ((0, 2 * j), (1, 2 * j + 1)):
            for role, target in enumerate((6, 7, 8, 15)):  # m, e0, e1, sign -> bf16 bit of the half
                t = target + 16 * half
                d = rot_e1 if role == 2 else rot
                stored = (t - d) % 32
                if src[stored] != -1:
                    raise AssertionError("pair-word bit positions collide")
                src[stored] = 4 * v + role
    if sorted(src) != list(range(32)):
        raise AssertionError("pair-word bit positions do not cover the word")
    return src


PAIR_WORD_SOURCES = tuple(_pair_word_sources())


def _permute_word_bits(blocks: torch.Tensor, src: tuple[int, ...]) -> torch.Tensor:
    """Each aligned 4-byte word's bits permuted (stored bit p = natural bit src[p]), as rotations of masked copies: the
    bits that move by the same amount move together (10 groups for pair words), in chunks (bounded temporaries)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % 4:
        raise ValueError(f"pair words need uint8 blocks whose rows are whole 4-byte words, got {blocks.dtype} {tuple(blocks.shape)}")
    groups: dict[int, int] = {}
    for stored, natural in enumerate(src):
        d = (stored - natural) % 32
        groups[d] = groups.get(d, 0) | (1 << natural)
    def i32(x: int) -> int:  # a 32-bit pattern as the int32 torch holds it
        return x - (1 << 32) if x >= 1 << 31 else x

    flat = blocks.contiguous().reshape(-1).view(torch.int32)
    out = torch.empty_like(flat)
    step = 1 << 24  # words per chunk
    for lo in range(0, flat.numel(), step):
        w = flat[lo : lo + step]
        acc = torch.zeros_like(w)
        for d, mask in groups.items():
            m = w & i32(mask)
            if d:  # rotate left by d (int32 shifts: >> fills with the sign bit, masked off)
                m = (m << d) | ((m >> (32 - d)) & ((1 << d) - 1))
            acc |= m
        out[lo : lo + step] = acc
    return out.view(torch.uint8).reshape(blocks.shape)


def to_pair_words(blocks: torch.Tensor) -> torch.Tensor:
    """blocks[..., K/2] (this module's nibble order) -> the same values as pair words (K a multiple of 8)."""
    return _permute_word_bits(blocks, PAIR_WORD_SOURCES)


def from_pair_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_pair_words`."""
    inv = [0] * 32
    for stored, natural in enumerate(PAIR_WORD_SOURCES):
        inv[natural] = stored
    return _permute_word_bits(words, tuple(inv))


def nibble_blocks(blocks: torch.Tensor, pair_words: bool) -> torch.Tensor:
    """Blocks in this module's nibble order, whether they are stored as pair words (`pair_words`) or not."""
    return from_pair_words(blocks) if pair_words else blocks


def decode_pair_words(words: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pair words decoded the way the kernels do (rotations, masks, one multiply by 2^(s - 1) per bf16 pair), in torch:
    the reference the kernel's decode is checked against. Scale bytes above 128 read as 128 (pdflash_kernels.moe's fast decodes)."""
    b = words.contiguous().reshape(*words.shape[:-1], -1, 4).to(torch.int64)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)

    def rotl(x: torch.Tensor, d: int) -> torch.Tensor:
        return ((x << d) | (x >> (32 - d))) & 0xFFFFFFFF if d else x

    pairs = [w & PAIR_MASK, rotl(w, 4) & PAIR_MASK, rotl(w, 10) & PAIR_MASK,
             (rotl(w, 6) & 0x80C080C0) | (rotl(w, 14) & 0x01000100)]
    halves = []
    for p in pairs:
        halves += [p & 0xFFFF, p >> 16]
    bits = torch.stack(halves, dim=-1)  # [..., words, 8] bf16 bit patterns in K order
    vals = (bits.to(torch.int32) << 16).view(torch.float32)  # bf16 -> fp32: E2M1 value * 2^-126 (exact)
    s = scales.to(torch.int32).clamp(max=128)
    mult = torch.ldexp(torch.ones_like(s, dtype=torch.float32), (s - 1).float())  # 2^(s-127) * 2^126
    vals = vals.reshape(*scales.shape, GROUP) * mult.unsqueeze(-1)
    return vals.reshape(*words.shape[:-1], -1).to(dtype)


# ---- the arena layout of one expert ------------------------------------------------------------------
ALIGN = 256  # bytes; every section starts on it (full 128-byte lines, 16-byte vector loads)
SCALE_ROW_ALIGN = 4  # bytes; a scale row is stored padded to a multiple (pdflash_kernels.moe reads scales as 32-bit words:
# MoeConfig.s_words). gpt-oss-20b's rows of 2880 / 32 = 90 bytes are stored in 92; Qwen3's and Mixtral's need none.


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each part of one MXFP4 expert lies in its contiguous slice of an arena (host store or GPU slot).

    Sections, each starting on a 256-byte boundary, in this order (R1 = `rows1`: 2I, or I for up-only experts):
      w1_blocks [R1, H/2] u8 · w1_scales [R1, H/32] u8   (gated: gate and up rows, in the model's order; up-only
                                                          (`gated` False, Nemotron-H's relu^2): the I up rows alone)
      w2_blocks [H, I/2] u8  · w2_scales [H, I/32] u8
    (a scale row is stored in a multiple of SCALE_ROW_ALIGN bytes, its padding unread: `views` gives [.., K/32])
      b1 [R1] bf16, b2 [H] bf16                            (only when the experts have biases)
    Rows are output features and K (the input dimension) is contiguous inside a row, so a kernel reads a
    row's packed values with 16-byte loads. `nbytes` (a multiple of 256) is what the byte map reports: an up-only
    expert's slice holds no gate rows, so it is about a third smaller than a gated one of the same width.
    """

    hidden: int
    intermediate: int
    has_bias: bool
    gated: bool = True  # False: up-only experts (no gate; pdflash_kernels.moe.ACT_RELU2), w1 is the I up rows

    @property
    def rows1(self) -> int:
        """Rows of w1 (and entries of b1): gate and up rows (2I), or the up rows alone (I)."""
        return 2 * self.intermediate if self.gated else self.intermediate

    def _sections(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        h, i, r1 = self.hidden, self.intermediate, self.rows1
        s = [
            ("w1_blocks", (r1, h // 2), torch.uint8),
            ("w1_scales", (r1, h // GROUP), torch.uint8),
            ("w2_blocks", (h, i // 2), torch.uint8),
            ("w2_scales", (h, i // GROUP), torch.uint8),
        ]
        if self.has_bias:
            s += [("b1", (r1,), torch.bfloat16), ("b2", (h,), torch.bfloat16)]
        return s

    @staticmethod
    def _stored(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A section's shape as stored: scale rows padded to SCALE_ROW_ALIGN bytes."""
        if name.endswith("_scales"):
            rows, cols = shape
            return rows, -(-cols // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN
        return shape

    def _section_bytes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return int(torch.Size(self._stored(name, shape)).numel()) * torch.empty((), dtype=dtype).element_size()

    @property
    def offsets(self) -> dict[str, int]:
        out, pos = {}, 0
        for name, shape, dtype in self._sections():
            out[name] = pos
            pos += _align(self._section_bytes(name, shape, dtype))
        return out

    @property
    def nbytes(self) -> int:
        name, shape, dtype = self._sections()[-1]
        return self.offsets[name] + _align(self._section_bytes(name, shape, dtype))

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """arena [S, >= nbytes] uint8 (S experts or slots, one per row) -> per-section views [S, ...]."""
        if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.shape[1] < self.nbytes:
            raise ValueError(f"arena must be uint8 [S, >= {self.nbytes}], got {arena.dtype} {tuple(arena.shape)}")
        if arena.stride(1) != 1:
            raise ValueError("arena rows must be contiguous")
        out = {}
        offs = self.offsets
        for name, shape, dtype in self._sections():
            esize = torch.empty((), dtype=dtype).element_size()
            raw = arena[:, offs[name] : offs[name] + self._section_bytes(name, shape, dtype)]
            if esize > 1:
                raw = raw.view(dtype)  # rows are 256-byte aligned and the row stride is even
            stored = self._stored(name, shape)
            view = raw.unflatten(1, stored)
            out[name] = view[..., : shape[-1]] if stored != shape else view
        return out

    def pack(self, arena_row: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Copy one expert's parts (w1_blocks, w1_scales, w2_blocks, w2_scales[, b1, b2]) into an arena row."""
        views = self.views(arena_row.reshape(1, -1))
        for name, v in views.items():
            v[0].copy_(parts[name])


@dataclasses.dataclass
class MXFP4Experts:
    """One layer's routed experts in MXFP4, [E, ...] each (rows = output features, gate rows then up rows; up-only
    experts: the up rows alone, told apart by the shapes: w1 has I rows where w2 has I columns)."""

    w1_blocks: torch.Tensor  # [E, R1, H/2] (R1 = 2I, or I up-only)
    w1_scales: torch.Tensor  # [E, R1, H/32]
    w2_blocks: torch.Tensor  # [E, H, I/2]
    w2_scales: torch.Tensor  # [E, H, I/32]
    b1: torch.Tensor | None = None  # [E, R1]
    b2: torch.Tensor | None = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return self.w1_blocks.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_blocks.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w2_blocks.shape[2] * 2  # (w2's K: I values, two a byte)

    @property
    def gated(self) -> bool:
        """w1 holds gate and up rows (2I); False: the up rows alone (I), up-only experts."""
        rows = self.w1_blocks.shape[1]
        if rows not in (self.intermediate, 2 * self.intermediate):
            raise ValueError(f"w1 has {rows} rows; experts of width {self.intermediate} (w2) have "
                             f"{2 * self.intermediate} (gate and up) or {self.intermediate} (up-only)")
        return rows == 2 * self.intermediate

    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.hidden, self.intermediate, self.b1 is not None, self.gated)

    def parts(self, e: int) -> dict[str, torch.Tensor]:
        p = {"w1_blocks": self.w1_blocks[e], "w1_scales": self.w1_scales[e], "w2_blocks": self.w2_blocks[e], "w2_scales": self.w2_scales[e]}
        if self.b1 is not None:
            p["b1"], p["b2"] = self.b1[e], self.b2[e]
        return p

    def to_arena(self, pin: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
        """All experts packed one per row of a uint8 arena [E, layout.nbytes] (on `device`; host memory by default)."""
        lay = self.layout()
        arena = torch.zeros(self.num_experts, lay.nbytes, dtype=torch.uint8, pin_memory=pin, device=device)
        views = lay.views(arena)
        for name, v in views.items():
            v.copy_(getattr(self, name))
        return arena

    @classmethod
    def quantize(cls, w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None):
        """w1 [E, 2I, H] (gate rows then up rows; up-only experts: [E, I, H]), w2 [E, H, I]: float weights -> MXFP4."""
        w1b, w1s = quantize(w1)
        w2b, w2s = quantize(w2)
        bf = (lambda b: None if b is None else b.detach().to(torch.bfloat16).contiguous())
        return cls(w1b, w1s, w2b, w2s, bf(b1), bf(b2))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize(self.w1_blocks, self.w1_scales, dtype), dequantize(self.w2_blocks, self.w2_scales, dtype)


def big_scales(*scales: torch.Tensor) -> bool:
    """Whether any E8M0 scale byte is above 128 (2^1: a block whose largest |w| exceeds 12). The kernels' fast
    decoders cannot represent those blocks' scale and fall back to exact selects (pdflash_kernels.moe)."""
    return any(bool((s > 128).any()) for s in scales)
