"""The shared benchmark fixtures of benchmarks/conftest.py."""

from __future__ import annotations

import time

import torch


def test_synced_benchmark_returns_the_result_and_records_the_device(synced_benchmark, request) -> None:
    x = torch.randn(64, 64)
    out = synced_benchmark(torch.mm, x, x)
    torch.testing.assert_close(out, x @ x)
    assert request.getfixturevalue("benchmark").extra_info["device"] == (
        "cuda" if torch.cuda.is_available() else "cpu"
    )


def test_step_timer_measures_the_block(step_timer) -> None:
    with step_timer():
        time.sleep(0.02)
    with step_timer():
        pass
    assert len(step_timer.seconds) == 2
    assert step_timer.seconds[0] >= 0.02 > step_timer.seconds[1]
