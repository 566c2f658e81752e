"""Host stochastic rounding of bf16 moments: noise read from a fixed table at drawn offsets, deterministically."""

from __future__ import annotations

import pytest
import torch

import tidal_stream.adam_kernels as ak
from tidal_testing import torch_threads


def _rounded(src: torch.Tensor, seed: int) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    ak.stochastic_round_(dst, src, torch.Generator().manual_seed(seed))
    return dst


@pytest.mark.parametrize("n", [1000, ak._CHUNK + 5])  # one piece; two pieces with a ragged tail
def test_bits_depend_on_the_generator_not_on_the_thread_count(n):
    src = torch.randn(n, generator=torch.Generator().manual_seed(0))
    runs = []
    for threads in (1, 2):
        with torch_threads(threads):
            runs.append(_rounded(src, 7))
    assert torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))
    assert not torch.equal(runs[0].view(torch.int16), _rounded(src, 8).view(torch.int16))


def test_noise_table_holds_every_16_bit_value_equally_often():
    table = ak._noise_table()
    assert table.dtype == torch.int32 and table.numel() == ak._NOISE_PERIOD + ak._CHUNK
    counts = torch.bincount(table[: ak._NOISE_PERIOD], minlength=1 << 16)
    assert counts.numel() == 1 << 16 and bool((counts == ak._NOISE_PERIOD >> 16).all())
    assert torch.equal(table[ak._NOISE_PERIOD :], table[: ak._CHUNK])  # the wrap-around window


def test_one_element_rounds_up_as_often_as_its_fraction_over_many_calls():
    """Unbiased per element, not only across a tensor: the same value rounded 20,000 times with one
    generator goes up 30 % of the time (each call draws a new offset into the table)."""
    gen = torch.Generator().manual_seed(5)
    ulp = 2.0**-7
    x = torch.full((3,), 1.0 + 0.3 * ulp)
    dst = torch.empty(3, dtype=torch.bfloat16)
    ups = 0
    for _ in range(20000):
        ak.stochastic_round_(dst, x, gen)
        ups += int(dst[1].float() > 1.0)
    assert abs(ups / 20000 - 0.3) < 0.012  # sd 0.0032


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
