"""Triton kernels that recast int8 / NF4 / NVFP4 weights to e4m3 with one scale per output row (CUDA).

They serve ``fp8_compute``. :func:`recast_rows` finds the row scales from the block scales (one small
kernel) and writes the ``[N, K]`` codes, the forward's operand, with the dequantize kernels' e4m3 output
(their flat, shuffle-free layout: one byte per weight written). :func:`recast_cols` writes the ``[K, N]``
codes, the input gradient's operand, from given row scales: the same recast, then a byte transpose. Both
match :func:`tidal_quant.reference.recast_fp8` and :func:`~tidal_quant.reference.fp8_row_scales` bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_quant._triton import FMT_INT8, FMT_NVFP4, _decode_e4m3, recast_e4m3, transpose_bytes

_FMT = {"int8": FMT_INT8, "nf4": 1, "nvfp4": FMT_NVFP4}
_CODE_MAX = {"int8": 127.0, "nf4": 1.0, "nvfp4": 6.0}  # reference.CODE_MAX, as kernel constants

_SCALES_PER_PROGRAM = 4096  # block scales one row-scales program reads


@triton.jit
def _row_scales_kernel(
    s_ptr, g_ptr, rs_ptr, N, PER_ROW: tl.constexpr, NSB: tl.constexpr, FMT: tl.constexpr,
    CODE_MAX: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # one program: BN rows' scales, max(block scale) * CODE_MAX / 448 over the row's PER_ROW blocks, into
    # rs[0] and their correctly rounded inverses (1 for a scale of 0) into rs[1]: rs is [2, N]
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
    mn = rn < N
    sb = tl.arange(0, NSB)  # [NSB] (the next power of two >= PER_ROW)
    ms = mn[:, None] & (sb[None, :] < PER_ROW)
    s = tl.load(s_ptr + rn[:, None] * PER_ROW + sb[None, :], mask=ms, other=0)  # [BN, NSB]
    if FMT == 2:  # nvfp4: e4m3 block scales times the tensor scale, as the dequantization
        s = _decode_e4m3(s) * tl.load(g_ptr)
    bound = tl.max(s, axis=1) * CODE_MAX  # [BN] no weight of the row is larger
    rs = tl.math.div_rn(bound, tl.full((BN,), 448.0, tl.float32))
    tl.store(rs_ptr + rn, rs, mask=mn)
    safe = tl.where(rs == 0.0, 1.0, rs)
    tl.store(rs_ptr + N + rn, tl.math.div_rn(tl.full((BN,), 1.0, tl.float32), safe), mask=mn)


def _operands(fmt: str, scales: torch.Tensor, global_scale: torch.Tensor | None):
    """(scales as the kernels read them: e4m3 ones as bytes; the global-scale pointer, any tensor if none)."""
    sc = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    g = global_scale if global_scale is not None else sc
    return sc, g


def row_scales(
    fmt: str, scales: torch.Tensor, global_scale: torch.Tensor | None, shape: tuple[int, int], block_size: int
) -> torch.Tensor:
    """fp32 ``[2, N]``: the recast weight's row scales (:func:`tidal_quant.reference.fp8_row_scales`) and
    their inverses (1 for a scale of 0), as :func:`tidal_quant.reference.recast_fp8` computes them."""
    n, k = shape
    sc, g = _operands(fmt, scales, global_scale)
    per_row = k // block_size
    nsb = triton.next_power_of_2(per_row)
    bn = max(1, _SCALES_PER_PROGRAM // nsb)
    rs = torch.empty(2, n, dtype=torch.float32, device=scales.device)
    _row_scales_kernel[(triton.cdiv(n, bn),)](sc, g, rs, n, per_row, nsb, _FMT[fmt], _CODE_MAX[fmt], bn)
    return rs


def recast_rows(
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    shape: tuple[int, int],
    block_size: int,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes ``[N, K]`` (float8_e4m3fn) and fp32 ``[2, N]`` row scales and their inverses
    (:func:`row_scales`) of an int8 / NF4 / NVFP4 weight.

    ``shape[1]`` must be a multiple of 16 and of ``block_size``; ``config`` (4-bit formats: packed bytes
    per program, warps) overrides the dequantize kernel's default.
    """
    rs = row_scales(fmt, scales, global_scale, shape, block_size)
    sc, _ = _operands(fmt, scales, global_scale)
    return recast_e4m3(_FMT[fmt], data, sc, global_scale, shape, block_size, rs[1], config), rs


def recast_cols(
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    inv_row_scales: torch.Tensor,
    shape: tuple[int, int],
    block_size: int,
) -> torch.Tensor:
    """e4m3 codes ``[K, N]`` (the transpose of :func:`recast_rows`' codes) given the inverse row scales ``[N]``:
    the row-major recast, then a tiled byte transpose (on the H200 that took 86-96 µs at 13824x5120 against
    200-222 µs for one kernel decoding tiles and storing them transposed)."""
    sc, _ = _operands(fmt, scales, global_scale)
    codes = recast_e4m3(_FMT[fmt], data, sc, global_scale, shape, block_size, inv_row_scales)  # [N, K]
    return transpose_bytes(codes)
