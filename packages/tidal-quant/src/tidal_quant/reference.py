"""Pure-torch reference quantizers and dequantizers. They run on any device and define correctness.

Every Triton kernel in :mod:`tidal_quant._triton` is tested against these: bit-exact for quantize and
pack, bit-exact in fp32 (one fp32 multiply per element) for dequantize.

Rounding rules (all arithmetic in fp32):
- int8: ``scale = absmax / 127``; ``q = round_half_even(x / scale)`` clamped to ±127 (scale 0 → q 0).
- NF4 (as bitsandbytes): ``s = x * (1 / max(absmax, 1e-38))`` clamped to [-1, 1]; the code is the count
  of codebook midpoints strictly below ``s`` — an exact midpoint rounds to the lower code, the same as
  bitsandbytes' CUDA decision tree (``x > mid``) and its CPU ``bucketize``. Packing: high nibble first.
- FP8: ``scale = rowmax / 448``; ``q = e4m3_rne(clamp(x / scale, ±448))``.
- NVFP4: ``g = amax / (6·448)``; block scale ``e4m3_rne(min(blockmax / (6·g), 448))``; codes are e2m1
  round-half-even of ``x / (scale·g)`` saturating at 6; low nibble holds the even element.
- FP8 compute of a block format (``fp8_compute``): the row scale is ``max(block scale) · code max / 448``
  over the row's blocks (code max: int8 127, NF4 1, NVFP4 6 times ``g``), a bound on the row's largest
  dequantized value taken from the scales alone; ``q = e4m3_rne(clamp(w · (1 / row scale), ±448))`` of the
  fp32 dequantized ``w``: one division per row and a multiply per weight.
"""

from __future__ import annotations

import torch

from tidal_quant.formats import DOUBLE_QUANT_BLOCK, E2M1_MAX, FP8_MAX, NVFP4_BLOCK, n_blocks

# The 16 NF4 values of bitsandbytes (``get_4bit_type("nf4")``), as fp32.
NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# e2m1 magnitudes by 3-bit code; bit 3 is the sign.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# (threshold, ties-go-up) for e2m1 round-half-even: a tie goes to the code with an even mantissa.
E2M1_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
NF4_ABSMAX_FLOOR = 1e-38


def nf4_code(device: torch.device | str = "cpu") -> torch.Tensor:
    """The NF4 codebook, fp32 ``[16]``."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def nf4_midpoints(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 fp32 midpoints between adjacent NF4 values (equal to bitsandbytes' CUDA thresholds)."""
    c = nf4_code(device)
    return (c[:-1] + c[1:]) / 2


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """Values of the 16 e2m1 codes (bit 3 = sign), fp32 ``[16]``."""
    v = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([v, -v])


def _blocks(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flatten ``w`` row-major to fp32, zero-pad to whole blocks: ``[n_blocks, block_size]``."""
    flat = w.reshape(-1).float()
    pad = n_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def div_const(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` rounded as IEEE fp32 division on every device.

    A plain ``t / 448.0`` is computed on CUDA as ``t * (1 / 448.0)`` (torch's kernel for a CPU-scalar
    divisor), which differs from the CPU's true division in the last bit; a divisor tensor on ``t``'s
    own device keeps the correctly rounded division everywhere, so both devices give the same bytes.
    """
    return t / t.new_full((), c)


def _pad_flat(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, length - t.numel())) if t.numel() < length else t


# ----------------------------------------------------------------------------------------------- int8
def quantize_int8(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric int8. Returns (codes int8 with ``w``'s shape, fp32 scales ``[n_blocks]``)."""
    x = _blocks(w, block_size)  # [nb, bs]
    scale = div_const(x.abs().amax(dim=1), 127.0)  # [nb]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / safe[:, None]).clamp_(-127, 127).to(torch.int8)  # [nb, bs]
    return q.view(-1)[: w.numel()].view(w.shape), scale


def dequantize_int8(
    data: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``q * scale`` in fp32, cast to ``dtype``."""
    nb = scales.numel()
    q = _pad_flat(data.reshape(-1), nb * block_size).view(nb, block_size).float()
    return (q * scales[:, None]).view(-1)[: data.numel()].view(data.shape).to(dtype)


# ------------------------------------------------------------------------------------------------ nf4
def nf4_codes(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked NF4 codes (uint8 ``[n_blocks * block_size]``, pads included) and fp32 absmax."""
    x = _blocks(w, block_size)  # [nb, bs]
    absmax = x.abs().amax(dim=1)  # [nb]
    inv = 1.0 / absmax.clamp(min=NF4_ABSMAX_FLOOR)
    scaled = (x * inv[:, None]).clamp_(-1, 1)
    codes = torch.bucketize(scaled, nf4_midpoints(w.device), out_int32=True)  # midpoints < s
    return codes.to(torch.uint8).view(-1), absmax


def pack_hi_lo(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Pack the first ``n`` 4-bit codes (rounded up to even) two per byte, high nibble first."""
    c = codes[: n + (n % 2)]
    return (c[0::2] << 4) | c[1::2]


def quantize_nf4(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 as bitsandbytes: (packed uint8 ``[ceil(numel / 2)]``, fp32 absmax ``[n_blocks]``)."""
    codes, absmax = nf4_codes(w, block_size)
    return pack_hi_lo(codes, w.numel()), absmax


def dequantize_nf4(
    data: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``code[q] * absmax`` in fp32, cast to ``dtype`` (``absmax`` fp32, or
    bf16 / fp16 as tidal-kv's pages keep it)."""
    numel = shape[0] * shape[1]
    codes = torch.stack([data >> 4, data & 0xF], dim=1).view(-1).long()  # [2 * bytes]
    nb = absmax.numel()
    vals = _pad_flat(nf4_code(data.device)[codes], nb * block_size).view(nb, block_size)
    return (vals * absmax.float()[:, None]).view(-1)[:numel].view(shape).to(dtype)


# ---------------------------------------------------------------------------------- double quant
def compress_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: int8 codes of ``scales - offset`` in blocks of 256, their fp32 scales, offset.

    ``offset`` is the midrange ``(max + min) / 2``: it minimizes the largest centered value (what an
    absmax quantizer cares about) and, unlike a mean, does not depend on reduction order, so CPU and
    CUDA produce the same bytes.
    """
    offset = ((scales.amax() + scales.amin()) / 2).reshape(1)  # [1]
    q, s2 = quantize_int8(scales - offset, DOUBLE_QUANT_BLOCK)
    return q, s2, offset


def decompress_scales(q: torch.Tensor, scales2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`compress_scales` (fp32)."""
    return dequantize_int8(q, scales2, DOUBLE_QUANT_BLOCK, torch.float32) + offset


# ------------------------------------------------------------------------------------------------ fp8
def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp32 scale per output row: (codes ``[out, in]``, scales ``[out]``)."""
    x = w.float()
    scale = div_const(x.abs().amax(dim=1), FP8_MAX)  # [out]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (x / safe[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`."""
    return (data.float() * scales[:, None]).to(dtype)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) e4m3 quantization of activations: (codes, fp32 scales ``[rows, 1]``)."""
    xf = x.float()
    scale = div_const(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp_(min=1e-12)  # [T, 1]
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# ------------------------------------------------------------------------------------- fp8 compute
#: Largest |code value| of each block format: no dequantized weight exceeds its block scale times this.
CODE_MAX = {"int8": 127.0, "nf4": 1.0, "nvfp4": E2M1_MAX}


def fp8_row_scales(
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: tuple[int, int],
    block_size: int,
) -> torch.Tensor:
    """fp32 ``[N]`` scales of a block-format weight recast to e4m3, one per output row.

    Args:
        scales: the decompressed block scales: fp32 ``[n_blocks]`` (int8, nf4; blocks inside rows, so
            ``in_features % block_size == 0``) or e4m3 ``[N, K / 16]`` (nvfp4).
        global_scale: nvfp4's fp32 ``[1]`` tensor scale, else None.
        fmt: "int8", "nf4" or "nvfp4".
        shape: ``(N, K)``.
        block_size: elements per block.
    """
    n, k = shape
    if fmt == "nvfp4":
        assert global_scale is not None
        s = scales.float() * global_scale  # [N, K/16] effective block scales, as the dequantization
    else:
        s = scales.view(n, k // block_size)  # [N, K/bs]
    return div_const(s.amax(dim=1) * CODE_MAX[fmt], FP8_MAX)


def code_values(
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: tuple[int, int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-format weight split into fp32 ``[N, K]`` code values and each weight's fp32 block scale, so
    that their product is the dequantized weight (``in_features % block_size == 0``)."""
    n, k = shape
    if fmt == "nvfp4":
        assert global_scale is not None
        codes = torch.stack([data & 0xF, data >> 4], dim=-1).view(n, k).long()
        vals, blk, bs = e2m1_table(data.device)[codes], scales.float() * global_scale, NVFP4_BLOCK
    elif fmt == "nf4":
        codes = torch.stack([data >> 4, data & 0xF], dim=1).view(-1)[: n * k].long()
        vals, blk, bs = nf4_code(data.device)[codes].view(n, k), scales, block_size
    else:
        vals, blk, bs = data.float().view(n, k), scales, block_size
    return vals, blk.reshape(n, k // bs).repeat_interleave(bs, dim=1)


def inverse_row_scales(row_scales: torch.Tensor) -> torch.Tensor:
    """``1 / row_scales``, correctly rounded (one division per row), 1 where a scale is 0 (an all-zero row)."""
    safe = torch.where(row_scales == 0, torch.ones_like(row_scales), row_scales)
    return torch.ones_like(safe) / safe


def recast_fp8(values: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """e4m3 codes ``[N, K]`` of a block-format weight at per-row scales: ``(value × scale) × (1 / row)``.

    Args:
        values: fp32 ``[N, K]`` code values (:func:`code_values`).
        scales: fp32 ``[N, K]`` each weight's block scale.
        row_scales: fp32 ``[N]`` (:func:`fp8_row_scales`); a row scale of 0 (an all-zero row) counts as 1.
    """
    y = (values * scales) * inverse_row_scales(row_scales)[:, None]
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------- nvfp4
def nvfp4_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 scales: (e4m3 block scales ``[out, in // 16]``, fp32 global scale ``[1]``, fp32 effective scales)."""
    x = w.float().view(w.shape[0], -1, NVFP4_BLOCK)  # [N, K/16, 16]
    g = div_const(x.abs().amax(), E2M1_MAX * FP8_MAX).reshape(1)  # [1]
    g = torch.where(g == 0, torch.ones_like(g), g)
    bmax = x.abs().amax(dim=-1)  # [N, K/16]
    bs = (bmax / (E2M1_MAX * g)).clamp_(max=FP8_MAX).to(torch.float8_e4m3fn)
    eff = bs.float() * g  # [N, K/16]
    return bs, g, eff


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """e2m1 round-half-even codes (uint8, bit 3 = sign) of fp32 ``y``; magnitudes saturate at 6."""
    mag = y.abs()
    idx = torch.zeros_like(y, dtype=torch.uint8)
    for t, tie_up in E2M1_THRESHOLDS:
        idx += (mag >= t) if tie_up else (mag > t)
    return idx | ((y < 0).to(torch.uint8) << 3)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: (packed uint8 ``[out, in // 2]`` low nibble first, e4m3 scales, fp32 global scale)."""
    bs, g, eff = nvfp4_scales(w)
    safe = torch.where(eff == 0, torch.ones_like(eff), eff)
    x = w.float().view(w.shape[0], -1, NVFP4_BLOCK)
    codes = e2m1_codes(x / safe[..., None]).view(w.shape[0], -1)  # [N, K]
    return codes[:, 0::2] | (codes[:, 1::2] << 4), bs, g


def dequantize_nvfp4(
    data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: ``e2m1[q] * (scale * g)`` in fp32, cast to ``dtype``."""
    n = data.shape[0]
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).view(n, -1).long()  # [N, K]
    vals = e2m1_table(data.device)[codes].view(n, -1, NVFP4_BLOCK)
    eff = scales.float() * global_scale  # [N, K/16]
    return (vals * eff[..., None]).view(n, -1).to(dtype)
