"""Device parametrization: every test that can run on the CPU does, and its CUDA twin is gpu-marked."""

from __future__ import annotations

import os

import pytest

REQUIRE_GPU_ENV = "TIDAL_REQUIRE_GPU"


def require_gpu() -> bool:
    """True when ``TIDAL_REQUIRE_GPU=1``: a missing GPU is then an error, never a skip."""
    return os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0", "false", "False")


def cuda_available() -> bool:
    """True when torch sees a CUDA device (imports torch lazily)."""
    import torch

    return torch.cuda.is_available()


def devices() -> list:
    """Parameters for ``@pytest.mark.parametrize("device", devices())``: ``cpu`` and a gpu-marked ``cuda``.

    The ``cuda`` case carries the ``gpu`` marker, so CPU CI skips it and ``pytest -m gpu`` selects it.
    """
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
