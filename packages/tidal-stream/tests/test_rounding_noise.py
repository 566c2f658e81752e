"""Host stochastic rounding of bf16 moments: its noise is drawn in parallel pieces, deterministically."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tidal_stream.adam_kernels as ak


def _rounded(src: torch.Tensor, seed: int) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    ak.stochastic_round_(dst, src, torch.Generator().manual_seed(seed))
    return dst


@pytest.mark.parametrize("n", [1000, 3 * (1 << 18) + 5])  # one generator; several pieces with a ragged tail
def test_bits_depend_on_the_generator_not_on_the_thread_count(n, monkeypatch):
    src = torch.randn(n, generator=torch.Generator().manual_seed(0))
    runs = []
    for workers in (1, 3):
        monkeypatch.setattr(ak, "_POOL", ThreadPoolExecutor(max_workers=workers))
        runs.append(_rounded(src, 7))
    assert torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))
    assert not torch.equal(runs[0].view(torch.int16), _rounded(src, 8).view(torch.int16))


def test_rounding_is_unbiased_and_lands_on_the_two_neighbours():
    """1 + 0.3 ulp of bf16 rounds up 30 % of the time; only the two neighbouring bf16 values occur."""
    n = 4 * (1 << 18)
    ulp = 2.0**-7  # bf16 spacing at 1.0
    x = torch.full((n,), 1.0 + 0.3 * ulp)
    got = _rounded(x, 1).float()
    assert set(got.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(float((got > 1.0).float().mean()) - 0.3) < 0.003  # 1M draws: sd 0.00046
    # the noise is uniform over all 16 low bits in every piece (not only the first)
    pieces = got.view(-1, 1 << 18)
    assert ((pieces > 1.0).float().mean(1) - 0.3).abs().max() < 0.006


def test_non_finite_values_are_kept():
    n = 3 * (1 << 18)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")]).repeat(n // 3)
    got = _rounded(special, 2).float()
    assert torch.equal(got.isnan(), special.isnan()) and torch.equal(
        got[~got.isnan()], special[~special.isnan()]
    )
