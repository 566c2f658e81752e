"""Shared fixtures: few CPU threads (the CI box is shared), seeded RNG."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _few_threads_and_seed():
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(prev)
