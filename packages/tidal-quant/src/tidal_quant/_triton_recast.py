"""Triton kernels that recast int8 / NF4 / NVFP4 weights to e4m3 with one scale per output row (CUDA).

They serve ``fp8_compute``: the weight is dequantized tile by tile in registers, as the fused
dequant-matmul does, divided by its row's scale and stored as e4m3 codes, one byte per weight, ready for
``torch._scaled_mm``. :func:`recast_rows` writes ``[N, K]`` (the forward's operand) and the row scales;
:func:`recast_cols` writes ``[K, N]`` (the input gradient's operand) from given row scales. Both match
:func:`tidal_quant.reference.recast_fp8` and :func:`~tidal_quant.reference.fp8_row_scales` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal_quant._triton import FMT_NVFP4, _decode_e4m3, scale_mode, table, tile_values

_FMT = {"int8": 0, "nf4": 1, "nvfp4": 2}
_CODE_MAX = {"int8": 127.0, "nf4": 1.0, "nvfp4": 6.0}  # reference.CODE_MAX, as kernel constants

# (rows per program, columns per step, warps) of recast_rows: each program walks whole rows, so the row
# scale is found once; (rows, columns, warps) of recast_cols' [rows, columns] tiles, 64 x 64 bytes out
ROWS_CONFIG = (4, 512, 4)
COLS_CONFIG = (64, 64, 4)


@triton.jit
def _e4m3_of(w, rs):
    """``w / rs`` (rs 0: 1) clamped to ±448, fp32; the caller's cast to e4m3 rounds to nearest even."""
    safe = tl.where(rs == 0.0, 1.0, rs)
    y = tl.math.div_rn(w, safe[:, None] + tl.zeros_like(w))
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def _recast_rows_kernel(
    d_ptr, s_ptr, g_ptr, tab_ptr, q_ptr, rs_ptr, N, K: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
    NSB: tl.constexpr, CODE_MAX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SMODE: tl.constexpr,
):  # fmt: skip
    # one program: BN whole rows. The rows' scales first (from the block scales alone), then the rows'
    # codes BK columns at a time; K % BK == 0 and K % BS == 0 (blocks stay inside rows)
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
    mn = rn < N
    per_row: tl.constexpr = K // BS
    sb = tl.arange(0, NSB)  # [NSB] block of the row (NSB: next power of two >= per_row)
    ms = mn[:, None] & (sb[None, :] < per_row)
    s = tl.load(s_ptr + rn[:, None] * per_row + sb[None, :], mask=ms, other=0)  # [BN, NSB]
    if FMT == 2:  # nvfp4: e4m3 block scales times the tensor scale, as the dequantization
        s = _decode_e4m3(s) * tl.load(g_ptr)
    bound = tl.max(s, axis=1) * CODE_MAX  # [BN] no weight of the row is larger
    rs = tl.math.div_rn(bound, tl.full((BN,), 448.0, tl.float32))
    tl.store(rs_ptr + rn, rs, mask=mn)
    for kt in range(0, K // BK):
        k0 = kt * BK
        w = tile_values(d_ptr, s_ptr, g_ptr, tab_ptr, rn, mn, k0, K, FMT, BS, BN, BK, SMODE)  # [BN, BK]
        rk = k0 + tl.arange(0, BK)
        y = _e4m3_of(w, rs)
        tl.store(q_ptr + rn[:, None] * K + rk[None, :], y.to(q_ptr.dtype.element_ty), mask=mn[:, None])


@triton.jit
def _recast_cols_kernel(
    d_ptr, s_ptr, g_ptr, tab_ptr, rs_ptr, qt_ptr, N, K: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, SMODE: tl.constexpr,
):  # fmt: skip
    # one program: the [BN, BK] tile at (rows pid 0, columns pid 1), stored transposed into qt [K, N]
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
    mn = rn < N
    k0 = tl.program_id(1) * BK
    w = tile_values(d_ptr, s_ptr, g_ptr, tab_ptr, rn, mn, k0, K, FMT, BS, BN, BK, SMODE)  # [BN, BK]
    rs = tl.load(rs_ptr + rn, mask=mn, other=1.0)
    y = tl.trans(_e4m3_of(w, rs))  # [BK, BN]
    rk = (k0 + tl.arange(0, BK)).to(tl.int64)
    tl.store(qt_ptr + rk[:, None] * N + rn[None, :], y.to(qt_ptr.dtype.element_ty), mask=mn[None, :])


def _pow2_dividing(k: int, cap: int) -> int:
    """The largest power of two ≤ ``cap`` that divides ``k``."""
    b = cap
    while k % b:
        b //= 2
    return b


def _operands(fmt: str, data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None):
    """(data, scales as the kernels read them, global-scale pointer, value table)."""
    sc = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    g = global_scale if global_scale is not None else sc
    tab = table("e2m1" if _FMT[fmt] == FMT_NVFP4 else "nf4", data.device)
    return data, sc, g, tab


def recast_rows(
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    shape: tuple[int, int],
    block_size: int,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes ``[N, K]`` (float8_e4m3fn) and fp32 row scales ``[N]`` of an int8 / NF4 / NVFP4 weight.

    ``shape[1]`` must be a multiple of 16 and of ``block_size``; ``config`` = (rows per program, columns per
    step, warps) overrides :data:`ROWS_CONFIG` (the columns per step are cut to a power of two dividing K).
    """
    n, k = shape
    bn, bk, warps = config or ROWS_CONFIG
    bk = _pow2_dividing(k, bk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=data.device)
    rs = torch.empty(n, dtype=torch.float32, device=data.device)
    d, sc, g, tab = _operands(fmt, data, scales, global_scale)
    per_row = k // block_size
    nsb = 1 << max(0, (per_row - 1).bit_length())
    _recast_rows_kernel[(triton.cdiv(n, bn),)](
        d, sc, g, tab, q, rs, n, k, _FMT[fmt], block_size, nsb, _CODE_MAX[fmt], bn, bk,
        scale_mode(block_size, bk), num_warps=warps,
    )  # fmt: skip
    return q, rs


def recast_cols(
    fmt: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    row_scales: torch.Tensor,
    shape: tuple[int, int],
    block_size: int,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """e4m3 codes ``[K, N]`` (the transpose of :func:`recast_rows`' codes) at the given row scales ``[N]``."""
    n, k = shape
    bn, bk, warps = config or COLS_CONFIG
    bk = _pow2_dividing(k, bk)
    qt = torch.empty(k, n, dtype=torch.float8_e4m3fn, device=data.device)
    d, sc, g, tab = _operands(fmt, data, scales, global_scale)
    _recast_cols_kernel[(triton.cdiv(n, bn), k // bk)](
        d, sc, g, tab, row_scales, qt, n, k, _FMT[fmt], block_size, bn, bk, scale_mode(block_size, bk),
        num_warps=warps,
    )  # fmt: skip
    return qt
