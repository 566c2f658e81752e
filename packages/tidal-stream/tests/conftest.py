"""Shared fixtures of tidal-stream's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test on one host thread (the CI machine is shared), then restore the old count."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
