"""Shared fixtures: few CPU threads (the CI box is shared), seeded RNG."""

import pytest
import torch

from tidal_testing import torch_threads


@pytest.fixture(autouse=True)
def _few_threads_and_seed():
    with torch_threads(2):
        torch.manual_seed(0)
        yield
