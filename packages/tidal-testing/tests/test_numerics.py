import math

import pytest
import torch

from tidal_testing import assert_bitwise_equal, assert_sqnr, devices, max_abs_diff, sqnr_db


def test_sqnr_of_known_noise():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(10_000, generator=g, dtype=torch.float64)
    noisy = ref + 0.01 * torch.randn(10_000, generator=g, dtype=torch.float64)
    # signal power 1, noise power 1e-4 -> 40 dB (±0.3 for the sample)
    assert abs(sqnr_db(ref, noisy) - 40.0) < 0.3


def test_sqnr_equal_is_inf_and_zero_reference_refused():
    x = torch.randn(16)
    assert sqnr_db(x, x.clone()) == math.inf
    with pytest.raises(ValueError, match="all zeros"):
        sqnr_db(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr_db(torch.zeros(4), torch.ones(5))


def test_assert_sqnr_fails_below_threshold():
    x = torch.randn(1000)
    with pytest.raises(AssertionError, match="dB"):
        assert_sqnr(x, x + 1.0, min_db=30)


def test_bitwise_equal_and_max_abs_diff():
    x = torch.randn(8, 8)
    assert_bitwise_equal(x, x.clone())
    y = x.clone()
    y[3, 3] += 1e-3
    with pytest.raises(AssertionError, match="differ in"):
        assert_bitwise_equal(x, y)
    assert max_abs_diff(x, y) == pytest.approx(1e-3, rel=1e-3)


def test_devices_marks_cuda_as_gpu():
    params = devices()
    assert [p.values[0] for p in params] == ["cpu", "cuda"]
    assert [m.name for m in params[1].marks] == ["gpu"]


def test_bitwise_equal_on_scalars():
    assert_bitwise_equal(torch.tensor(1.5), torch.tensor(1.5))
    with pytest.raises(AssertionError, match="differ in"):
        assert_bitwise_equal(torch.tensor(1.5), torch.tensor(2.5))
