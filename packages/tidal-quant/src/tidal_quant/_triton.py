"""Triton kernels (CUDA): quantize, dequantize (to bf16 / fp16 / fp32, or to e4m3 for ``fp8_compute``) and
the fused dequant-matmul. Imported lazily by :mod:`tidal_quant.ops`; never at ``import tidal_quant``. The
FP8 paths' own kernels are in :mod:`tidal_quant._triton_fp8`.

Each kernel reproduces :mod:`tidal_quant.reference` exactly: divisions use ``div_rn`` (IEEE, as torch),
round-half-even uses the 1.5·2²³ trick (exact for |y| < 2²²; no FMA can form around an add), dequantize
is one fp32 multiply per element, and e4m3 scales are decoded bit by bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tidal_quant._device import device_at, device_of
from tidal_quant.reference import NF4_ABSMAX_FLOOR, e2m1_table, nf4_code

_RNE_MAGIC = 12582912.0  # 1.5 * 2**23
FMT_INT8, FMT_NF4, FMT_NVFP4, FMT_FP8 = 0, 1, 2, 3
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def table(name: str, device: torch.device) -> torch.Tensor:
    """The 16-entry fp32 value table of ``name`` ("nf4" or "e2m1") on ``device``, cached."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = (nf4_code if name == "nf4" else e2m1_table)(device)
    return _TABLES[key]


@triton.jit
def _decode_e4m3(b):
    """uint8 e4m3fn bits → fp32, exactly (finite codes only; code 0x80 gives -0.0, as torch).

    The sign is OR-ed into the bits rather than applied with unary minus: some Triton releases lower
    ``-v`` to ``0.0 - v``, which turns the -0.0 of code 0x80 into +0.0.
    """
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9, exact
    v = tl.where(e == 0, sub, normal).to(tl.uint32, bitcast=True)  # |value| bits
    sign = (b & 128).to(tl.uint32) << 24  # e4m3 sign bit → fp32 sign bit
    return (v | sign).to(tl.float32, bitcast=True)


@triton.jit
def _nf4_code_of(s):
    """Count of NF4 midpoints strictly below ``s`` (fp32 constants equal bitsandbytes' tree)."""
    c = (s > -0.8480964004993439).to(tl.int32)
    c += (s > -0.6106329262256622).to(tl.int32)
    c += (s > -0.4599952697753906).to(tl.int32)
    c += (s > -0.33967943489551544).to(tl.int32)
    c += (s > -0.23460740596055984).to(tl.int32)
    c += (s > -0.13791173323988914).to(tl.int32)
    c += (s > -0.045525018125772476).to(tl.int32)
    c += (s > 0.03979014977812767).to(tl.int32)
    c += (s > 0.1202552504837513).to(tl.int32)
    c += (s > 0.2035212516784668).to(tl.int32)
    c += (s > 0.2920137718319893).to(tl.int32)
    c += (s > 0.3893125355243683).to(tl.int32)
    c += (s > 0.5016634166240692).to(tl.int32)
    c += (s > 0.6427869200706482).to(tl.int32)
    c += (s > 0.8614784181118011).to(tl.int32)
    return c


@triton.jit
def _e2m1_code_of(y):
    a = tl.abs(y)
    c = (a > 0.25).to(tl.int32)
    c += (a >= 0.75).to(tl.int32)
    c += (a > 1.25).to(tl.int32)
    c += (a >= 1.75).to(tl.int32)
    c += (a > 2.5).to(tl.int32)
    c += (a >= 3.5).to(tl.int32)
    c += (a > 5.0).to(tl.int32)
    return c | ((y < 0).to(tl.int32) << 3)


@triton.jit
def _quant_blocks_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    numel,
    nblocks,
    BS: tl.constexpr,
    BSP: tl.constexpr,
    ROWS: tl.constexpr,
    NF4: tl.constexpr,
):
    # one program: ROWS blocks of BS flattened elements (BSP = next power of two ≥ BS)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [R]
    cols = tl.arange(0, BSP)  # [BSP]
    offs = rows[:, None] * BS + cols[None, :]  # [R, BSP]
    valid = (cols[None, :] < BS) & (offs < numel) & (rows[:, None] < nblocks)
    x = tl.load(w_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    if NF4:
        inv = tl.math.div_rn(
            tl.full(amax.shape, 1.0, tl.float32), tl.maximum(amax, tl.full(amax.shape, NF4_FLOOR, tl.float32))
        )
        inv = tl.where(amax == 0.0, 0.0, inv)  # an all-zero block scales to 0 (as 0 * 1e38 does)
        s = tl.minimum(tl.maximum(x * inv[:, None], -1.0), 1.0)
        c = _nf4_code_of(s)  # [R, BSP]
        hi, lo = tl.split(tl.reshape(c, (ROWS, BSP // 2, 2)))  # even / odd elements
        byte = ((hi << 4) | lo).to(tl.uint8)  # [R, BSP/2]
        bcols = tl.arange(0, BSP // 2)
        boffs = rows[:, None] * (BS // 2) + bcols[None, :]
        bvalid = (bcols[None, :] < BS // 2) & (boffs < (numel + 1) // 2) & (rows[:, None] < nblocks)
        tl.store(q_ptr + boffs, byte, mask=bvalid)
        tl.store(s_ptr + rows, amax, mask=rows < nblocks)
    else:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        safe = tl.where(scale == 0.0, 1.0, scale)
        y = tl.math.div_rn(x, safe[:, None] + tl.zeros_like(x))
        r = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127.x)
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(q_ptr + offs, r.to(tl.int8), mask=valid)
        tl.store(s_ptr + rows, scale, mask=rows < nblocks)


NF4_FLOOR: tl.constexpr = tl.constexpr(NF4_ABSMAX_FLOOR)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def quantize_blocks(w: torch.Tensor, block_size: int, nf4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 (codes shaped like ``w``) or NF4 (packed bytes) codes plus fp32 block scales."""
    w = w.contiguous()
    numel = w.numel()
    nb = triton.cdiv(numel, block_size)
    if nf4:
        q = torch.empty((numel + 1) // 2, dtype=torch.uint8, device=w.device)
    else:
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(nb, dtype=torch.float32, device=w.device)
    bsp = _pow2(block_size)
    rows = max(1, 4096 // bsp)
    with device_of(w):
        _quant_blocks_kernel[(triton.cdiv(nb, rows),)](w, q, s, numel, nb, block_size, bsp, rows, nf4)
    return q, s


@triton.jit
def _nvfp4_quant_kernel(w_ptr, eff_ptr, q_ptr, n_bytes, BLOCK: tl.constexpr):
    # one program: BLOCK output bytes = 2*BLOCK elements; eff scale per 16 elements (8 bytes)
    b = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # [B]
    m = b < n_bytes
    x0 = tl.load(w_ptr + 2 * b, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(w_ptr + 2 * b + 1, mask=m, other=0.0).to(tl.float32)
    eff = tl.load(eff_ptr + b // 8, mask=m, other=1.0)
    safe = tl.where(eff == 0.0, 1.0, eff)
    c0 = _e2m1_code_of(tl.math.div_rn(x0, safe))
    c1 = _e2m1_code_of(tl.math.div_rn(x1, safe))
    tl.store(q_ptr + b, (c0 | (c1 << 4)).to(tl.uint8), mask=m)


def quantize_nvfp4_codes(w: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """Packed NVFP4 codes of ``w`` ``[N, K]`` given fp32 effective block scales ``[N, K/16]``."""
    w = w.contiguous()
    q = torch.empty(w.shape[0], w.shape[1] // 2, dtype=torch.uint8, device=w.device)
    n = q.numel()
    with device_of(w):
        _nvfp4_quant_kernel[(triton.cdiv(n, 1024),)](w, eff.contiguous(), q, n, 1024)
    return q


@triton.jit
def clamp_e4m3(y):
    """``y`` clamped to ±448, e4m3's finite range; the caller's cast rounds to nearest even."""
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def e4m3x2(lo, hi):
    """int16 words of e4m3 pairs: ``lo`` rounded to nearest even in the low byte, ``hi`` in the high byte,
    both saturating at ±448 (as clamping first, as the reference does). One PTX instruction per pair.

    Written out because Triton 3.6's own fp32 -> e4m3 cast, packed into such words, put wrong bytes at one
    position in eight in the 4-bit dequantize kernel's layout on the H200 (a byte permute across the two
    rows a thread holds); this leaves no cast or byte shuffle to the compiler.
    """
    return tl.inline_asm_elementwise(
        "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [lo, hi], dtype=tl.int16, is_pure=True, pack=1
    )


@triton.jit
def _dequant_int8_kernel(
    d_ptr, s_ptr, out_ptr, numel, inv_ptr, K, BS: tl.constexpr, NG: tl.constexpr,
    EVEN: tl.constexpr, WIDE: tl.constexpr, E4M3: tl.constexpr,
):  # fmt: skip
    # one program: NG groups of 8 contiguous int8 codes; a block size that is a multiple of 8 loads one
    # scale per group (broadcast), any other even block size one per element. The [NG, 8] code tile and
    # the [NG, 8] output tile share one register layout (8 codes in, 8 values out per thread). E4M3: the
    # values times their row's inverse scale inv[row] become e4m3 codes (rows of K elements, K % 8 == 0)
    pid = tl.program_id(0)
    if WIDE:  # 2**31 elements or more: 64-bit offsets
        pid = pid.to(tl.int64)
    grp = pid * NG + tl.arange(0, NG)  # [NG]
    u = grp[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NG, 8] element offsets
    if EVEN:  # the grid tiles the codes exactly: no masks, so loads and stores stay vectorized
        q = tl.load(d_ptr + u).to(tl.float32)
        if BS % 8 == 0:
            s = tl.load(s_ptr + (grp * 8) // BS)[:, None]
        else:
            s = tl.load(s_ptr + u // BS)
        if E4M3:  # the dequantized weight times 1 / its row's scale (reference.recast_fp8)
            inv = tl.load(inv_ptr + (grp * 8) // K)[:, None]
            tl.store(out_ptr + u, clamp_e4m3((q * s) * inv).to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + u, (q * s).to(out_ptr.dtype.element_ty))
    else:
        m = u < numel
        q = tl.load(d_ptr + u, mask=m, other=0).to(tl.float32)
        if BS % 8 == 0:
            s = tl.load(s_ptr + (grp * 8) // BS, mask=grp * 8 < numel, other=0.0)[:, None]
        else:
            s = tl.load(s_ptr + u // BS, mask=m, other=0.0)
        if E4M3:
            inv = tl.load(inv_ptr + (grp * 8) // K, mask=grp * 8 < numel, other=1.0)[:, None]
            tl.store(out_ptr + u, clamp_e4m3((q * s) * inv).to(out_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(out_ptr + u, (q * s).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dequant_4bit_kernel(
    d_ptr, s_ptr, g_ptr, tab_ptr, out_ptr, n_bytes, nblocks, inv_ptr, K, INNER, OSTRIDE,
    GB: tl.constexpr, NG: tl.constexpr, NVFP4: tl.constexpr, OUT: tl.constexpr, EVEN: tl.constexpr,
    WIDE: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # one program: NG groups of 4 contiguous packed bytes (4 * NG bytes, GB per scale block). Byte i
    # holds elements 2i and 2i+1, so both are packed into one output word (OUT 0: bf16 pair as an
    # int32 word, 1: fp16 pair, 2: fp32 pair as an int64 word, 3: e4m3 pair of the values times their
    # row's inverse scale inv[row], as an int16 word; rows of K elements, K % 8 == 0)
    # stored at word i: the [NG, 4] byte tile and the [NG, 4] word tile share one register layout, so no
    # shuffle sits between load and store. ROWS: the output is strided rows of INNER words, row r starting
    # at word r * OSTRIDE (a token range of a K/V buffer, tidal-kv's page gathers); word i goes there.
    pid = tl.program_id(0)
    if WIDE:  # more than 2**31 bytes: 64-bit offsets
        pid = pid.to(tl.int64)
    grp = pid * NG + tl.arange(0, NG)  # [NG] 4-byte groups
    boffs = grp[:, None] * 4 + tl.arange(0, 4)[None, :]  # [NG, 4] byte (= word) offsets
    sid = (grp * 4) // GB  # [NG] scale-block id of each group (GB % 4 == 0: a group never straddles)
    if EVEN:  # the grid tiles the data exactly: no masks, so loads and stores stay vectorized
        byte = tl.load(d_ptr + boffs).to(tl.int32)
        sb = tl.load(s_ptr + sid)
    else:
        byte = tl.load(d_ptr + boffs, mask=boffs < n_bytes, other=0).to(tl.int32)
        sb = tl.load(s_ptr + sid, mask=sid < nblocks, other=0)
    if NVFP4:  # e4m3 scale per 16 elements times the fp32 tensor scale; low nibble = even element
        s = (_decode_e4m3(sb) * tl.load(g_ptr))[:, None]
        first = byte & 15
        second = byte >> 4
    else:  # nf4: absmax per block (fp32, or bf16 / fp16 from tidal-kv's pages); high nibble = even element
        s = sb.to(tl.float32)[:, None]
        first = byte >> 4
        second = byte & 15
    v0 = tl.load(tab_ptr + first) * s  # [NG, 4] even elements (fp32, as the reference)
    v1 = tl.load(tab_ptr + second) * s  # [NG, 4] odd elements
    if OUT == 3:  # e4m3 pair of the weights times 1 / the row's scale → one 16-bit word, even element low
        if EVEN:
            inv = tl.load(inv_ptr + (grp * 8) // K)[:, None]
        else:
            inv = tl.load(inv_ptr + (grp * 8) // K, mask=grp * 4 < n_bytes, other=1.0)[:, None]
        w = e4m3x2(v0 * inv, v1 * inv)
    elif OUT == 2:  # fp32 pair → one 64-bit word, even element in the low half (little-endian)
        lo = v0.to(tl.uint32, bitcast=True).to(tl.uint64)
        w = (lo | (v1.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)
    else:  # 16-bit pair (round to nearest even, as torch) → one 32-bit word
        if OUT == 1:
            h0 = v0.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            h1 = v1.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            h0 = v0.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
            h1 = v1.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        w = (h0 | (h1 << 16)).to(tl.int32, bitcast=True)
    woffs = (boffs // INNER) * OSTRIDE + boffs % INNER if ROWS else boffs
    if EVEN:
        tl.store(out_ptr + woffs, w)
    else:
        tl.store(out_ptr + woffs, w, mask=boffs < n_bytes)


@triton.jit
def _dequant_fp8_kernel(d_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    # one program: a [BN, BK] tile of e4m3 codes (as bytes) times the per-row fp32 scales
    rn = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # [BN]
    rk = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)  # [BK]
    m = (rn[:, None] < N) & (rk[None, :] < K)
    offs = rn[:, None] * K + rk[None, :]
    q = _decode_e4m3(tl.load(d_ptr + offs, mask=m, other=0))
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)  # [BN]
    tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=m)


# output dtype → (kernel OUT id, word dtype holding one byte's two elements)
_WORDS = {
    torch.bfloat16: (0, torch.int32),
    torch.float16: (1, torch.int32),
    torch.float32: (2, torch.int64),
}


# (packed bytes per program, warps) of the NF4 / NVFP4 dequantize kernel. 1024 bytes at 4 warps: 8 per thread
# (two coalesced 4-byte loads in, two 16-byte stores of bf16 pairs out), many small programs in flight. On the
# H200 (dequant_sweep.py) that took 4.6 / 19.6 / 48.0 / 47.8 µs at Qwen2.5-14B's 1024x5120 / 5120x5120 /
# 13824x5120 / 5120x13824 weights (70 / 82 / 91 / 91 % of the copy bandwidth) against 6.6 / 23.6 / 54.3 /
# 53.8 µs with 8192 bytes at 8 warps, within 1 µs of the best of the 19 configs swept at every shape.
DEQUANT_4BIT_CONFIG = (1024, 4)


class DequantLaunch:
    """Dequantize one weight again and again: every kernel argument but the output is worked out once.

    Calling it allocates the output and launches the kernel. A layer keeps one per activation dtype
    (:class:`tidal_quant.linear_ops.LinearPlan`), so its eager calls skip the argument arithmetic; on the
    H200 machine that took a dequantize from 32 to about 21 µs of host time, of which the launch itself is
    about 19 (benchmarks/results/quant-host-parts-base-h200-2026-11-30.txt, quant-fwd-parts-h200-2026-11-30.txt).
    """

    __slots__ = (
        "_after",
        "_before",
        "_device",
        "_dtype",
        "_fn",
        "_grid",
        "_index",
        "_shape",
        "_size",
        "_warps",
        "_word",
    )

    def __init__(self, fn, grid, before, after, warps, size, dtype, word, shape, device):
        self._fn, self._grid, self._warps = fn, grid, warps
        self._before, self._after = before, after  # kernel arguments before / after the output's
        self._size, self._dtype, self._device = size, dtype, device  # the buffer allocated per launch
        self._index = device.index  # launched with this device current (see `tidal_quant._device`)
        self._word = word  # dtype the kernel writes the buffer as (None: the buffer's own)
        self._shape = shape  # the result's shape (a prefix of the flat buffer), None: the buffer itself

    def __call__(self) -> torch.Tensor:
        buf = torch.empty(self._size, dtype=self._dtype, device=self._device)
        self.into(buf)
        if self._shape is None:
            return buf
        numel = self._shape[0] * self._shape[1]
        return (buf if numel == buf.numel() else buf[:numel]).view(self._shape)

    def into(self, out: torch.Tensor) -> None:
        """Launch into ``out``, a buffer of the launch's dtype (made by the caller, with the layout the
        kernel arguments were worked out for)."""
        self.into_words(out if self._word is None else out.view(self._word))

    def into_words(self, words: torch.Tensor) -> None:
        """:meth:`into` with ``out`` already viewed as the words the kernel writes (see ``word``)."""
        with device_at(self._index):
            self._fn[self._grid](*self._before, words, *self._after, num_warps=self._warps)


def dequant_launch(
    fmt_id: int,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    shape: tuple[int, int],
    block_size: int,
    dtype: torch.dtype | None,
    *,
    inv_row_scales: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
) -> DequantLaunch:
    """A :class:`DequantLaunch` of int8 / NF4 / NVFP4 / FP8 ``data`` (fp8 and e4m3 scales as uint8 views) to
    ``dtype``, or, with ``inv_row_scales`` (fp32 ``[N]``, 1 / each row's scale; not fp8), to e4m3 codes at
    those row scales (``dtype`` unused). ``config``: the 4-bit kernel's (packed bytes per program, warps)."""
    data = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
    scales = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    if fmt_id in (FMT_NF4, FMT_NVFP4):
        return _dequant_4bit_launch(
            fmt_id == FMT_NVFP4, data, scales, global_scale, shape, block_size, dtype, config, inv_row_scales
        )
    if fmt_id == FMT_INT8:
        return _dequant_int8_launch(data, scales, shape, block_size, dtype, inv_row_scales)
    assert fmt_id == FMT_FP8 and inv_row_scales is None, fmt_id
    n, k = shape
    grid = (triton.cdiv(n, 16), triton.cdiv(k, 512))
    return DequantLaunch(
        _dequant_fp8_kernel, grid, (data, scales), (n, k, 16, 512), 8, shape, dtype, None, None, data.device
    )


def dequant_rows_launch(
    fmt_id: int, data: torch.Tensor, scales: torch.Tensor, block_size: int, dst: torch.Tensor, row_stride: int
):
    """A zero-argument launch that dequantizes NF4 ``data`` into ``dst``, strided rows of contiguous
    ``[T, D]`` elements ``row_stride`` elements apart (``data``: the packed bytes of those elements in row
    order; checked by :func:`tidal_quant.ops.dequant_rows_launch`)."""
    assert fmt_id == FMT_NF4, fmt_id
    inner = dst.shape[-2] * dst.shape[-1] // 2  # words (two elements each) per row
    rows = (data.numel() // inner, inner, row_stride // 2)  # one packed byte per output word
    shape = (data.numel() * 2 // dst.shape[-1], dst.shape[-1])
    launch = _dequant_4bit_launch(False, data, scales, None, shape, block_size, dst.dtype, None, None, rows)
    return functools.partial(launch.into_words, dst.view(_WORDS[dst.dtype][1]))  # the view made once


def _dequant_4bit_launch(
    nvfp4, data, scales, global_scale, shape, block_size, dtype, config, inv_row_scales, rows=None
):
    n_bytes = data.numel()
    if inv_row_scales is None:
        out_id, word = _WORDS[dtype]
    else:
        dtype, (out_id, word) = torch.float8_e4m3fn, (3, torch.int16)
    gb = 8 if nvfp4 else block_size // 2  # packed bytes per scale (a power of two ≥ 8)
    g = global_scale if nvfp4 else scales
    tab = table("e2m1" if nvfp4 else "nf4", data.device)
    per_program, warps = config or DEQUANT_4BIT_CONFIG
    even = n_bytes % per_program == 0
    # rows: (row count, words per row, words between row starts) of a strided output, else one flat buffer
    n_rows, inner, ostride = rows or (1, n_bytes, n_bytes)
    wide = max(n_bytes, (n_rows - 1) * ostride + inner) + per_program >= 2**31
    e4m3 = inv_row_scales is not None
    inv, k = (inv_row_scales, shape[1]) if e4m3 else (scales, 1)  # K only matters for e4m3 output
    consts = (gb, per_program // 4, nvfp4, out_id, even, wide, rows is not None)
    after = (n_bytes, scales.numel(), inv, k, inner, ostride, *consts)
    # [2 * n_bytes] elements (one of padding when numel is odd), written as n_bytes words
    grid = (triton.cdiv(n_bytes, per_program),)
    return DequantLaunch(
        _dequant_4bit_kernel,
        grid,
        (data, scales, g, tab),
        after,
        warps,
        (2 * n_bytes,),
        dtype,
        word,
        shape,
        data.device,
    )


def _dequant_int8_launch(data, scales, shape, block_size, dtype, inv_row_scales):
    e4m3 = inv_row_scales is not None
    numel = shape[0] * shape[1]
    blk = 8192  # codes per program: 32 per thread at 8 warps
    even, wide = numel % blk == 0, numel + blk >= 2**31
    inv, k = (inv_row_scales, shape[1]) if e4m3 else (scales, 1)  # K only matters for e4m3 output
    after = (numel, inv, k, block_size, blk // 8, even, wide, e4m3)
    out_dtype = torch.float8_e4m3fn if e4m3 else dtype
    grid = (triton.cdiv(numel, blk),)
    return DequantLaunch(
        _dequant_int8_kernel, grid, (data, scales), after, 8, shape, out_dtype, None, None, data.device
    )


def _dequant_4bit(nvfp4, data, scales, global_scale, shape, block_size, dtype, config=None) -> torch.Tensor:
    """NF4 / NVFP4 → ``dtype`` at a given kernel ``config`` (benchmarks/quant/dequant_sweep.py)."""
    return _dequant_4bit_launch(nvfp4, data, scales, global_scale, shape, block_size, dtype, config, None)()


def dequantize(*args) -> torch.Tensor:
    """Dequantize once: ``dequant_launch(fmt_id, data, scales, global_scale, shape, block_size, dtype)()``."""
    return dequant_launch(*args)()


@triton.jit
def _scaled(v, s_ptr, g_ptr, rn, k0, mn, K: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, SMODE: tl.constexpr):  # fmt: skip
    """``v [BN, BK]`` (code values of rows ``rn``, columns ``k0 + [0, BK)``) times their block scales.

    SMODE 0: one scale per element (any block size); 1: one scale per row of the tile (BK divides BS);
    2: BK / BS scales per row, broadcast by reshape (BS a power of two dividing BK).
    """
    if SMODE == 1:
        s = tl.load(s_ptr + (rn * K + k0) // BS, mask=mn, other=0)  # [BN]
        if FMT == 2:
            s = _decode_e4m3(s) * tl.load(g_ptr)
        return v * s[:, None]
    elif SMODE == 2:
        sb = (rn[:, None] * K + k0) // BS + tl.arange(0, BK // BS)[None, :]  # [BN, BK/BS]
        s = tl.load(s_ptr + sb, mask=mn[:, None], other=0)
        if FMT == 2:
            s = _decode_e4m3(s) * tl.load(g_ptr)
        return tl.reshape(tl.reshape(v, (BN, BK // BS, BS)) * s[:, :, None], (BN, BK))
    else:
        eidx = rn[:, None] * K + k0 + tl.arange(0, BK)[None, :]  # [BN, BK] flat element index
        s = tl.load(s_ptr + eidx // BS, mask=mn[:, None], other=0)
        if FMT == 2:
            s = _decode_e4m3(s) * tl.load(g_ptr)
        return v * s


@triton.jit
def tile_values(d_ptr, s_ptr, g_ptr, tab_ptr, rn, mn, k0, K: tl.constexpr, FMT: tl.constexpr, BS: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, SMODE: tl.constexpr):  # fmt: skip
    """fp32 ``[BN, BK]``: the dequantized weights (int8 / NF4 / NVFP4) of rows ``rn`` (valid where ``mn``),
    columns ``k0 + [0, BK)``; each is its code's value times its block scale, as :mod:`reference`."""
    if FMT == 0:
        rk = k0 + tl.arange(0, BK)
        v = tl.load(d_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None], other=0).to(tl.float32)
    else:
        rb = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(d_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=mn[:, None], other=0)
        byte = byte.to(tl.int32)  # [BN, BK/2]
        hi = tl.load(tab_ptr + (byte >> 4))
        lo = tl.load(tab_ptr + (byte & 15))
        if FMT == 1:  # nf4: high nibble first
            v = tl.reshape(tl.join(hi, lo), (BN, BK))
        else:  # nvfp4: low nibble first
            v = tl.reshape(tl.join(lo, hi), (BN, BK))
    return _scaled(v, s_ptr, g_ptr, rn, k0, mn, K, FMT, BS, BN, BK, SMODE)


@triton.jit
def _qmm_kernel(
    x_ptr, d_ptr, s_ptr, g_ptr, tab_ptr, y_ptr, M, N, stride_xm, K: tl.constexpr,
    FMT: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SMODE: tl.constexpr, KT: tl.constexpr,
):  # fmt: skip
    # y[M, N] = x[M, K] @ dequant(W)[N, K]^T; K % BK == 0 and K % BS == 0 (blocks stay inside rows).
    # Split-K: program (n, m, s) covers K tiles [s * KT, (s + 1) * KT) and writes its fp32 partial
    # product to y[s] (y [S, M, N]; the caller sums); with one split, y [M, N] in the output dtype.
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)  # [BM]
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)  # [BN]
    mm = rm < M
    mn = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(pid_s * KT, (pid_s + 1) * KT):
        k0 = kt * BK
        rk = k0 + tl.arange(0, BK)  # [BK]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None], other=0.0)
        w = tile_values(d_ptr, s_ptr, g_ptr, tab_ptr, rn, mn, k0, K, FMT, BS, BN, BK, SMODE)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    y = acc.to(y_ptr.dtype.element_ty)
    rn32 = pid_n * BN + tl.arange(0, BN)
    y_ptr += pid_s.to(tl.int64) * M * N  # this split's partial product
    tl.store(y_ptr + rm[:, None] * N + rn32[None, :], y, mask=mm[:, None] & (rn32[None, :] < N))


def scale_mode(block_size: int, bk: int) -> int:
    """How :func:`_qmm_kernel` fetches scales for a block size and K tile (see ``_scaled``)."""
    pow2 = block_size & (block_size - 1) == 0
    if pow2 and block_size % bk == 0:
        return 1
    if pow2 and bk % block_size == 0:
        return 2
    return 0


def fused_matmul(
    fmt_id: int,
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    shape: tuple[int, int],
    block_size: int,
    config: tuple[int, ...],
) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T`` in one kernel (two with split-K).

    ``config = (BM, BN, BK[, num_warps, num_stages[, split]])``: ``split`` programs share each output
    tile's K range (more programs in flight when few tokens leave few tiles); it must divide ``K / BK``.
    """
    m, k = x.shape
    n = shape[0]
    bm, bn, bk = config[:3]
    launch = {"num_warps": config[3], "num_stages": config[4]} if len(config) >= 5 else {}
    split = config[5] if len(config) >= 6 else 1
    assert (k // bk) % split == 0, (k, bk, split)
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)  # fp32 partial products
    tab = table("e2m1" if fmt_id == FMT_NVFP4 else "nf4", x.device)
    g = global_scale if global_scale is not None else scales
    sc = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    smode = scale_mode(block_size, bk)
    with device_of(x):
        _qmm_kernel[grid](
            x, data, sc, g, tab, y, m, n, x.stride(0), k, fmt_id, block_size, bm, bn, bk, smode,
            k // bk // split, **launch,
        )  # fmt: skip
    return y if split == 1 else y.sum(0).to(x.dtype)  # [M, N]
