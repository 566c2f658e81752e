"""The forward wrapper that adds tidal's out-of-memory note keeps the model's forward intact."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from tidal_stream.oom import install_forward_note


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(input_ids)


class _Session:
    def record(self, *args: object, **kwargs: object) -> None:  # pragma: no cover - no OOM here
        raise AssertionError("no out-of-memory error is raised in these tests")


def test_signature_and_result_unchanged():
    torch.manual_seed(0)
    m = _Tiny()
    x = torch.randn(2, 4)
    ref = m(x)
    h = install_forward_note(_Session(), m)
    assert list(inspect.signature(m.forward).parameters) == ["input_ids", "attention_mask"]
    assert torch.equal(m(x), ref) and torch.equal(m.forward(input_ids=x), ref)
    h.remove()
    assert "forward" not in m.__dict__


def test_deepcopy_of_wrapped_model_runs_its_own_weights():
    torch.manual_seed(0)
    m = _Tiny()
    install_forward_note(_Session(), m)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.lin.weight.add_(1.0)  # the copy now differs from the original
    x = torch.randn(2, 4)
    assert torch.equal(c(x), nn.functional.linear(x, c.lin.weight, c.lin.bias))
    assert not torch.equal(c(x), m(x))


def test_instance_forward_set_before_is_kept_inside():
    torch.manual_seed(0)
    m = _Tiny()
    calls = []
    inner = m.forward

    def outer(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    m.forward = outer
    h = install_forward_note(_Session(), m)
    x = torch.randn(2, 4)
    assert torch.equal(m(x), m.lin(x)) and calls
    h.remove()
    assert m.__dict__["forward"] is outer
