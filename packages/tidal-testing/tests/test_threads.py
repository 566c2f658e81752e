"""torch_threads: the body runs on the asked thread count, the previous count comes back, bad counts refused."""

from __future__ import annotations

import pytest
import torch

from tidal_testing import torch_threads


def test_sets_and_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    inner = 2 if before == 1 else 1
    with torch_threads(inner):
        assert torch.get_num_threads() == inner
    assert torch.get_num_threads() == before


def test_restores_after_an_error() -> None:
    before = torch.get_num_threads()
    inner = 2 if before == 1 else 1
    with pytest.raises(KeyError), torch_threads(inner):
        raise KeyError("body failed")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_bad_counts_name_the_option(bad) -> None:
    before = torch.get_num_threads()
    accepted = r"torch_threads\(n\): got .*accepted: a whole number >= 1"
    with pytest.raises(ValueError, match=accepted), torch_threads(bad):
        pass
    assert torch.get_num_threads() == before
