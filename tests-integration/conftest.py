"""Shared settings of the cross-package scenarios: few threads (CI machines are small and shared)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _few_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)
