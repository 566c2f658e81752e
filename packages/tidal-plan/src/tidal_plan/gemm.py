"""Matmul time of the cost model: the roofline of each GEMM shape a block runs, forward and backward.

Used by :mod:`tidal_plan.cost` (``gpu_time``); ``ctx`` is its ``Context``.
"""

from __future__ import annotations

from typing import Any

# Per kernel: launch gap plus PyTorch's eager dispatch and autograd bookkeeping on the host, which bound
# short kernels (5-10 us per op on current CPUs; the midpoint-high end, since a step mixes both).
KERNEL_OVERHEAD_S = 8e-6
# fp32 weights on a GPU multiply without tensor cores (torch leaves TF32 off for matmuls): H100/H200
# specify 67 TFLOP/s fp32 against 989 dense bf16, about 1/15 of the profiled bf16 rate.
FP32_MATMUL_SHARE = 1 / 15
# Trainable fp32 weights beside a 16-bit model (PEFT keeps LoRA adapters in fp32) multiply on fp32 SIMT
# kernels whose time a roofline does not see at these skinny shapes (rank 16 against thousands): on the
# H200 the 2,016 adapter GEMMs of a lora14b step (512 tokens) took 13.0 us each on average, 4.7 to 19.3 us
# by shape (benchmarks/results/profile-lora14b-tidal-nf4-h200-2026-11-30.txt, three steps). The kernel
# time alone: the launch or graph gap is added as for every GEMM.
FP32_ADAPTER_GEMM_S = 13e-6

__all__ = [
    "FP32_ADAPTER_GEMM_S",
    "FP32_MATMUL_SHARE",
    "KERNEL_OVERHEAD_S",
    "block_matmuls_s",
    "gemm_launches",
    "gemm_s",
    "matmul_rate",
    "matmuls_s",
]


def _peak_rate(ctx: Any) -> float:
    """The profiled bf16 FLOP/s under sustained load (the peak rate when the profile has no sustained figure)."""
    prof = ctx.profile
    return (prof.matmul_sustained_tflops or prof.matmul_tflops) * 1e12


def matmul_rate(ctx: Any) -> float:
    """FLOP/s of the model's matmuls: :func:`_peak_rate`, or its fp32 share for fp32 weights on a GPU."""
    fp32_on_gpu = ctx.census.matmul_dtype_bytes == 4 and ctx.profile.device_kind == "cuda"
    return _peak_rate(ctx) * FP32_MATMUL_SHARE if fp32_on_gpu else _peak_rate(ctx)


def _roofline_s(ctx: Any, m: int, k: int, n: int, elem: int, rate: float) -> float:
    """FLOPs at ``rate`` or operands and result (``elem`` bytes each) at HBM bandwidth, whichever is longer."""
    bytes_s = elem * (m * k + k * n + m * n) / (ctx.profile.hbm_gbps * 1e9)
    return max(2 * m * k * n / rate, bytes_s)


def gemm_s(ctx: Any, m: int, k: int, n: int) -> float:
    """Roofline of one ``[m, k] x [k, n]`` matmul in the model's dtype, plus the per-kernel overhead."""
    return _roofline_s(ctx, m, k, n, ctx.census.matmul_dtype_bytes, matmul_rate(ctx)) + KERNEL_OVERHEAD_S


def fp32_adapter_gemm_s(ctx: Any, m: int, k: int, n: int) -> float:
    """One GEMM of a trainable fp32 weight in a 16-bit model on a GPU: the fp32 roofline (4-byte operands,
    :data:`FP32_MATMUL_SHARE` of the rate) or the measured small-shape time, whichever is longer."""
    roofline = _roofline_s(ctx, m, k, n, 4, _peak_rate(ctx) * FP32_MATMUL_SHARE)
    return max(roofline, FP32_ADAPTER_GEMM_S) + KERNEL_OVERHEAD_S


def matmuls_s(
    ctx: Any,
    shapes: tuple[tuple[int, int, bool], ...],
    matmul: int,
    frozen: int,
    trainable_elem: float = 0.0,
) -> tuple[float, float]:
    """Forward and backward seconds of a module's matmuls: forward, the input gradient, and the weight
    gradient of trainable weights (each the same GEMM shape). Trainable weights of ``trainable_elem`` = 4
    bytes in a 16-bit model on a GPU are priced by :func:`fp32_adapter_gemm_s`. Without shapes (an old
    census): the FLOPs of ``matmul`` weights (``frozen`` of them without a weight gradient) at the peak
    rate."""
    t = ctx.tokens
    if not shapes:
        rate = matmul_rate(ctx)
        return 2 * matmul * t / rate, (4 * matmul - 2 * frozen) * t / rate
    fp32_adapters = (
        trainable_elem == 4 and ctx.census.matmul_dtype_bytes == 2 and ctx.profile.device_kind == "cuda"
    )
    fwd = bwd = 0.0
    for k, n, trainable in shapes:
        g = fp32_adapter_gemm_s(ctx, t, k, n) if trainable and fp32_adapters else gemm_s(ctx, t, k, n)
        fwd += g
        bwd += g * (2 if trainable else 1)
    return fwd, bwd


def block_matmuls_s(ctx: Any, index: int) -> tuple[float, float]:
    """:func:`matmuls_s` of block ``index`` (-1: the layers outside the stack), cached in ``ctx``."""
    got = ctx.matmul_cache.get(index)
    if got is None:
        c = ctx.census
        if index < 0:
            elem = c.outside_trainable_bytes / max(1, c.outside_trainable_params)
            got = matmuls_s(
                ctx, c.outside_matmul_shapes, c.outside_matmul_params, c.outside_quantizable_params, elem
            )
        else:
            b = c.blocks[index]
            elem = b.trainable_bytes / max(1, b.trainable_params)
            got = matmuls_s(ctx, b.matmul_shapes, b.matmul_params, b.quantizable_params, elem)
        ctx.matmul_cache[index] = got
    return got


def gemm_launches(ctx: Any, index: int) -> tuple[int, int]:
    """GEMM kernels of block ``index`` forward and backward (the input gradient, and the weight gradient
    of trainable weights), as :func:`matmuls_s` counts them (0, 0 without shapes)."""
    shapes = ctx.census.blocks[index].matmul_shapes
    return len(shapes), sum(2 if trainable else 1 for _, _, trainable in shapes)
