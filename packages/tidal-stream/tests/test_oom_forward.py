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


def test_forward_tokens_counts_ids_or_embedding_rows():
    from tidal_stream.oom import forward_tokens

    ids = torch.zeros(2, 6, dtype=torch.long)
    assert forward_tokens((), {"input_ids": ids}) == 12
    assert forward_tokens((object(), ids), {}) == 12  # a bound model first, then the ids
    assert forward_tokens((), {"inputs_embeds": torch.zeros(2, 6, 8)}) == 12
    assert forward_tokens((), {}) is None and forward_tokens((torch.tensor(3),), {}) is None


class _PlannedSession:
    """What the note reads of a session whose plan sized 8 tokens per step, on the CPU."""

    def __init__(self) -> None:
        import types

        self.device = torch.device("cpu")
        self.options = types.SimpleNamespace(vram_budget_bytes=2**30, vram_budget="1GiB", rollback=False)
        self.plan = types.SimpleNamespace(tiers={"vram": 2**29}, vram_budget_bytes=2**30, batch_tokens=8)
        self.model = None
        self.events: list[tuple[str, str, dict]] = []

    def record(self, kind: str, message: str, **data: object) -> None:
        self.events.append((kind, message, data))


def test_a_forward_larger_than_the_plans_batch_is_logged_once_and_named_in_the_note(caplog):
    """The plan sized 8 tokens per step, a forward brings 12: one warning and one "plan" event before it
    runs (none for a forward within the plan, none again for the next larger one), and an out-of-memory
    note names both figures and the batch_tokens that plans for them."""
    from tidal_stream.oom import oom_note

    m, session = _Tiny(), _PlannedSession()
    install_forward_note(session, m)
    m(torch.randn(2, 4, 4))  # 8 rows of 4: the plan's batch
    assert session.events == [] and "this forward" not in oom_note(session, "forward")[0]
    with caplog.at_level("WARNING", logger="tidal_stream.oom"):
        m(torch.randn(3, 4, 4))
        m(torch.randn(3, 4, 4))
    assert [(k, d) for k, _, d in session.events] == [("plan", {"tokens": 12, "planned_tokens": 8})]
    assert "wrap(..., batch_tokens=12)" in session.events[0][1] and len(caplog.records) == 1
    note, data = oom_note(session, "forward")
    assert "this forward: 12 tokens; the plan sized activations and the loss for 8 per step" in note
    assert data["forward_tokens"] == 12 and data["planned_tokens"] == 8
