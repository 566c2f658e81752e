"""The pytest plugin entry point (registered as ``pytest11`` in tidal-testing's metadata)."""

from __future__ import annotations

import pytest

from tidal_testing.devices import REQUIRE_GPU_ENV, cuda_available, require_gpu


def pytest_configure(config: pytest.Config) -> None:
    """Register tidal's markers so ``--strict-markers`` accepts them."""
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped without one unless TIDAL_REQUIRE_GPU=1)"
    )
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip gpu-marked tests without CUDA — or, under ``TIDAL_REQUIRE_GPU=1``, fail the run instead."""
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items or cuda_available():
        return
    if require_gpu():
        raise pytest.UsageError(
            f"{REQUIRE_GPU_ENV}=1 but torch sees no CUDA device; {len(gpu_items)} gpu tests cannot run. "
            f"Run on a GPU machine or unset {REQUIRE_GPU_ENV}."
        )
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); set TIDAL_REQUIRE_GPU=1 to make this an error")
    for it in gpu_items:
        it.add_marker(skip)
