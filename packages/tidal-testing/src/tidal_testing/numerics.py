"""Numeric comparison helpers shared by the packages' tests."""

from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(ref²) / sum((ref - approx)²))``.

    Returns ``inf`` when the two are equal. Computed in float64 on the reference's device.
    """
    if reference.shape != approx.shape:
        raise ValueError(
            f"sqnr_db: shapes differ: reference {tuple(reference.shape)} vs approx {tuple(approx.shape)}"
        )
    ref = reference.detach().to(torch.float64)
    err = ref - approx.detach().to(device=ref.device, dtype=torch.float64)
    noise = float(err.square().sum())
    signal = float(ref.square().sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        raise ValueError("sqnr_db: the reference is all zeros; SQNR is undefined (never test on zeros)")
    return 10.0 * math.log10(signal / noise)


def assert_sqnr(reference: torch.Tensor, approx: torch.Tensor, min_db: float, what: str = "") -> float:
    """Assert ``sqnr_db(reference, approx) >= min_db`` and return the measured value."""
    got = sqnr_db(reference, approx)
    assert got >= min_db, f"{what or 'SQNR'}: {got:.2f} dB < required {min_db:.2f} dB"
    return got


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference, in float64 (0.0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().to(a.device).double()).abs().max())


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Assert two tensors have the same dtype, shape and bytes (NaNs with equal bits compare equal)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    ab = (
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    )  # reshape: 0-dim tensors cannot be viewed
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(ab, bb):
        diff = int((ab != bb).sum())
        raise AssertionError(f"{what or 'tensors'} differ in {diff} of {ab.numel()} bytes")
