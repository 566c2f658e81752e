"""Triton kernels that recast int8 / NF4 / NVFP4 weights to e4m3 with one scale per output row (CUDA).

They serve ``fp8_compute``. :func:`recast_rows` finds the row scales from the block scales (one small
kernel) and writes the ``[N, K]`` codes, the forward's operand, with the dequantize kernels' e4m3 output
(their flat, shuffle-free layout: one byte per weight written). :func:`recast_cols` writes the ``[K, N]``
codes, the input gradient's operand, from given row scales: tiles of packed bytes decoded into their even
and odd weights, each half transposed and stored. Both match :func:`tidal_quant.reference.recast_fp8` and
:func:`~tidal_quant.reference.fp8_row_scales` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_quant._triton import FMT_INT8, FMT_NVFP4, _decode_e4m3, e4m3x2, recast_e4m3, table

_FMT = {"int8": FMT_INT8, "nf4": 1, "nvfp4": FMT_NVFP4}
_CODE_MAX = {"int8": 127.0, "nf4": 1.0, "nvfp4": 6.0}  # reference.CODE_MAX, as kernel constants

# (tile rows, tile columns, warps) of recast_cols; recast_rows takes the dequantize kernel's config
COLS_CONFIG = (64, 64, 4)
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


@triton.jit
def _store_transposed(qt_ptr, y, rk, n0, N, BN: tl.constexpr, C: tl.constexpr):
    """``y [BN, C]`` (weight rows ``n0 + [0, BN)``, columns ``rk``) as e4m3 at ``qt[rk, rows]``: ``qt`` is
    ``[K, N]`` e4m3 viewed as int16 ``[K, N / 2]`` words, each the pair of rows ``2j, 2j + 1`` (``n0`` even)."""
    even, odd = tl.split(tl.reshape(tl.trans(y), (C, BN // 2, 2)))  # [C, BN/2] rows 2j and 2j + 1
    j = n0 // 2 + tl.arange(0, BN // 2)  # [BN/2] word columns
    mask = (2 * j < N)[None, :]
    tl.store(qt_ptr + rk[:, None].to(tl.int64) * (N // 2) + j[None, :], e4m3x2(even, odd), mask=mask)


@triton.jit
def _recast_cols_kernel(
    d_ptr, s_ptr, g_ptr, tab_ptr, inv_ptr, qt_ptr, N, K: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # one program: weight rows pid0 * BN + [0, BN), columns pid1 * BK + [0, BK) (K % BK == 0, K % BS == 0,
    # N even); inv: 1 / each row's scale; qt: the [K, N] e4m3 output as int16 words
    n0 = tl.program_id(0) * BN
    rn = (n0 + tl.arange(0, BN)).to(tl.int64)  # [BN]
    mn = rn < N
    k0 = tl.program_id(1) * BK
    inv = tl.load(inv_ptr + rn, mask=mn, other=1.0)[:, None]  # [BN, 1]
    if FMT == 0:  # int8: one code per weight
        rk = k0 + tl.arange(0, BK)  # [BK]
        q = tl.load(d_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None], other=0).to(tl.float32)
        s = tl.load(s_ptr + (rn[:, None] * K + rk[None, :]) // BS, mask=mn[:, None], other=0.0)
        _store_transposed(qt_ptr, (q * s) * inv, rk, n0, N, BN, BK)
    else:  # two weights per byte: the even and the odd columns, each a [BN, BK/2] half
        jb = k0 // 2 + tl.arange(0, BK // 2)  # [BK/2] byte columns
        byte = tl.load(d_ptr + rn[:, None] * (K // 2) + jb[None, :], mask=mn[:, None], other=0).to(tl.int32)
        s = tl.load(s_ptr + (rn[:, None] * K + 2 * jb[None, :]) // BS, mask=mn[:, None], other=0)
        if FMT == 2:  # nvfp4: low nibble = even weight; e4m3 scale times the tensor scale
            s = _decode_e4m3(s) * tl.load(g_ptr)
            even, odd = byte & 15, byte >> 4
        else:  # nf4: high nibble = even weight
            even, odd = byte >> 4, byte & 15
        # the dequantized weights (as the reference) times 1 / their row's scale, as reference.recast_fp8
        _store_transposed(qt_ptr, (tl.load(tab_ptr + even) * s) * inv, 2 * jb, n0, N, BN, BK // 2)
        _store_transposed(qt_ptr, (tl.load(tab_ptr + odd) * s) * inv, 2 * jb + 1, n0, N, BN, BK // 2)


def _pow2_dividing(k: int, cap: int) -> int:
    """The largest power of two ≤ ``cap`` that divides ``k``."""
    b = cap
    while k % b:
        b //= 2
    return b


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
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """e4m3 codes ``[K, N]`` (the transpose of :func:`recast_rows`' codes) given the inverse row scales ``[N]``.

    ``config`` = (tile rows, tile columns, warps) overrides :data:`COLS_CONFIG` (the columns are cut to a
    power of two dividing K).
    """
    n, k = shape
    bn, bk, warps = config or COLS_CONFIG
    bk = _pow2_dividing(k, bk)
    qt = torch.empty(k, n, dtype=torch.float8_e4m3fn, device=data.device)
    sc, g = _operands(fmt, scales, global_scale)
    tab = table("e2m1" if _FMT[fmt] == FMT_NVFP4 else "nf4", data.device)
    _recast_cols_kernel[(triton.cdiv(n, bn), k // bk)](
        data, sc, g, tab, inv_row_scales, qt.view(torch.int16), n, k, _FMT[fmt], block_size, bn, bk,
        num_warps=warps,
    )  # fmt: skip
    return qt
