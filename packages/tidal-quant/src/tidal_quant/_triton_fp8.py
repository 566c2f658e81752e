"""Triton kernels of the FP8 paths (CUDA): per-row e4m3 quantization of activations and gradients, the
byte transpose of e4m3 weights, and the recast of int8 / NF4 / NVFP4 weights to e4m3 for ``fp8_compute``.

Imported lazily by :mod:`tidal_quant.fp8_ops`, like :mod:`tidal_quant._triton`, whose dequantize kernels
write the recast's row-major codes.

The recast: :func:`recast_rows` finds the row scales from the block scales (one small kernel) and writes
the ``[N, K]`` codes, the forward's operand, with the dequantize kernels' e4m3 output (their flat,
shuffle-free layout: one byte per weight written). :func:`recast_cols` writes the ``[K, N]`` codes, the
input gradient's operand, from given row scales: the same recast, then a byte transpose. Both match
:func:`tidal_quant.reference.recast_fp8` and :func:`~tidal_quant.reference.fp8_row_scales` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_quant._device import device_of
from tidal_quant._triton import FMT_INT8, FMT_NF4, FMT_NVFP4, _decode_e4m3, _pow2, dequant_launch
from tidal_quant.reference import CODE_MAX


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    # dst[C, R] = src[R, C]ᵀ for one-byte elements, one [BR, BC] tile per program
    rr = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rc = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    t = tl.load(src_ptr + rr[:, None] * C + rc[None, :], mask=(rr[:, None] < R) & (rc[None, :] < C))
    tl.store(dst_ptr + rc[:, None] * R + rr[None, :], tl.trans(t), mask=(rc[:, None] < C) & (rr[None, :] < R))


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """Row-major ``xᵀ`` ``[C, R]`` of a contiguous one-byte ``[R, C]`` tensor (uint8 / float8)."""
    r, c = x.shape
    src = x.view(torch.uint8)
    out = torch.empty(c, r, dtype=torch.uint8, device=x.device)
    with device_of(x):
        _transpose_kernel[(triton.cdiv(r, 64), triton.cdiv(c, 64))](src, out, r, c, 64, 64)
    return out.view(x.dtype)


@triton.jit
def _row_scale(amax, s_ptr, row, BLOCK: tl.constexpr):
    """max(amax) / 448 (≥ 1e-12) of one row, stored at ``s_ptr[row]`` and returned as a [BLOCK] vector.

    Computed identically in every lane: a vector keeps div_rn's operands fp32 tensors.
    """
    scale = tl.math.div_rn(
        tl.zeros((BLOCK,), tl.float32) + tl.max(amax, 0), tl.full((BLOCK,), 448.0, tl.float32)
    )
    scale = tl.maximum(scale, tl.full((BLOCK,), 1e-12, tl.float32))
    tl.store(s_ptr + row, tl.max(scale, 0))  # every lane holds the same value: one scalar store
    return scale


@triton.jit
def _row_tile(x_ptr, c_ptr, row, stride_x, kt, K: tl.constexpr, HAS_C: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``kt`` of row ``row``: fp32 ``x`` (times the column scales ``c`` with ``HAS_C``) [BLOCK], its
    column offsets and their mask (columns past ``K`` read as 0)."""
    offs = kt * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_C:
        x = x * tl.load(c_ptr + offs, mask=m, other=0.0)
    return x, offs, m


@triton.jit
def _store_e4m3(q_ptr, row, x, offs, m, scale, K: tl.constexpr):
    """``x / scale`` clamped to ±448, cast to the codes' dtype, stored at row ``row`` of ``q``."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + row * K + offs, y.to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rows_fp8_kernel(
    x_ptr, c_ptr, q_ptr, s_ptr, stride_x, K: tl.constexpr, HAS_C: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    # one program per row: pass 1 finds the row's absmax (of x * c), pass 2 writes e4m3 codes; a row
    # that fits one tile (K <= BLOCK) is read once and kept in registers between the two
    row = tl.program_id(0).to(tl.int64)
    if K <= BLOCK:
        x, offs, m = _row_tile(x_ptr, c_ptr, row, stride_x, 0, K, HAS_C, BLOCK)
        scale = _row_scale(tl.abs(x), s_ptr, row, BLOCK)
        _store_e4m3(q_ptr, row, x, offs, m, scale, K)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for kt in range(0, (K + BLOCK - 1) // BLOCK):
            x, offs, m = _row_tile(x_ptr, c_ptr, row, stride_x, kt, K, HAS_C, BLOCK)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(amax, s_ptr, row, BLOCK)
        for kt in range(0, (K + BLOCK - 1) // BLOCK):
            x, offs, m = _row_tile(x_ptr, c_ptr, row, stride_x, kt, K, HAS_C, BLOCK)
            _store_e4m3(q_ptr, row, x, offs, m, scale, K)


def rows_fp8_config(k: int) -> tuple[int, int]:
    """(tile width, warps) of :func:`quantize_rows_fp8` for rows ``k`` wide.

    Narrow tiles, the row read twice (the second time from L2): a program holding a whole 5120- or
    13824-wide row in registers leaves too few rows in flight per SM. On the H200 (rows_fp8_sweep.py)
    1024-wide tiles at 8 warps took 11-14 µs for 2048 rows of 5120 against 25-28 µs for one 8192 tile,
    and 2048-wide ones at 16 warps 35-39 µs for 2048 rows of 13824 against 49-55 µs for one 16384 tile.
    """
    block = min(_pow2(k), 1024 if k <= 8192 else 2048)
    return block, 16 if block >= 2048 else 8 if block >= 1024 else 4


def quantize_rows_fp8(
    x: torch.Tensor, col_scale: torch.Tensor | None = None, *, config: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes of ``x * col_scale`` (as :func:`tidal_quant.reference.quantize_rows_fp8`).

    Returns (codes ``[T, K]`` float8_e4m3fn, fp32 scales ``[T, 1]``); one kernel. ``config`` (tile width,
    warps) overrides :func:`rows_fp8_config`; rows wider than the tile are read twice (the second read
    mostly hits L2). Every config gives the same bytes: the row's absmax is a max, in any order.
    """
    x = x.contiguous()
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    c = col_scale.contiguous() if col_scale is not None else s
    block, warps = config or rows_fp8_config(k)
    with device_of(x):
        _rows_fp8_kernel[(t,)](x, c, q, s, x.stride(0), k, col_scale is not None, block, num_warps=warps)
    return q, s


# ------------------------------------------------------------------------------------ recast
_FMT = {"int8": FMT_INT8, "nf4": FMT_NF4, "nvfp4": FMT_NVFP4}

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
    with device_of(scales):
        _row_scales_kernel[(triton.cdiv(n, bn),)](sc, g, rs, n, per_row, nsb, _FMT[fmt], CODE_MAX[fmt], bn)
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
    recast = dequant_launch(
        _FMT[fmt], data, sc, global_scale, shape, block_size, None, inv_row_scales=rs[1], config=config
    )
    return recast(), rs


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
    recast = dequant_launch(
        _FMT[fmt], data, sc, global_scale, shape, block_size, None, inv_row_scales=inv_row_scales
    )
    return transpose_bytes(recast())  # [N, K] codes, transposed
