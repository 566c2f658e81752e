"""Shared fixtures of tidal-hf's tests: tiny causal LMs of four architectures (2 layers, CPU)."""

from __future__ import annotations

import pytest
import torch

from tidal_hf.shapes import TINY_ARCHS, tiny_config
from tidal_testing import torch_threads


@pytest.fixture(autouse=True)
def _few_threads():
    # the CI machine is shared: keep each test on few host threads
    with torch_threads(2):
        yield


def make_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random causal LM of ``arch`` in eval-deterministic form (no dropout)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


@pytest.fixture(params=TINY_ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny():
    return make_tiny
