"""A CUDA out-of-memory error mid-forward, mid-backward and mid-optimizer-step of a wrapped model.

On the CPU suite the error is simulated: ``torch.OutOfMemoryError("CUDA out of memory. Tried to allocate
...")`` raised from a forward hook of the middle block (mid-forward), from tidal's gradient hook on the
sixth gradient of the step (mid-backward: the later blocks' gradients have gone to the host and, without
clipping, been applied), or from the second AdamW kernel call (mid-step), on step 3 of 5, in the three
placements of ``test_faults.py``. Checked:

- the error keeps its type (``torch.OutOfMemoryError``) and message, and carries tidal's note: the VRAM
  budget in bytes, the step, and the fixes (``batch_tokens``, ``recompute=True``,
  ``activation_offload=True``, ``unwrap`` + ``wrap(..., vram_budget=lower)``);
- the decision log (``memory_report(model)["events"]``) holds one ``"oom"`` event with the figures;
- ``rollback=True``: weights and optimizer state equal those before the step, the arena holds the same
  blocks, nothing pending; retrying the batch gives weights bit-identical to a run that never failed;
- ``rollback=False`` (the default): every parameter either kept its weights and state from before the step
  or carries exactly the update of the run that never failed; training continues with a smaller batch.

The ``gpu`` test provokes a real CUDA OOM mid-forward under ``set_per_process_memory_fraction``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _common import batches, loss_of, make_model, weights
from test_faults import CONFIGS, FAIL_AT, OOM_MESSAGE, STEPS, _arena, _inject, _state, _train

from tidal_arena import arena_stats
from tidal_stream import memory_report, unwrap, wrap

pytestmark = pytest.mark.timeout(60)

BUDGET = "48MiB"
BUDGET_BYTES = 48 * 2**20
GRAD_AT = 6  # the gradient hook call (of the step) that fails mid-backward
WHERE = {
    "forward": {"forward"},
    "backward": {"a gradient hook (backward)"},
    # a host update fails on the worker; it surfaces at the next gradient hook, step() or synchronize()
    "step": {"a gradient hook (backward)", "optimizer.step()", "optimizer.synchronize()"},
}


def _wrapped(config: str, rollback: bool):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return wrap(model, opt, **{**CONFIGS[config], "rollback": rollback, "vram_budget": BUDGET})


def _inject_oom(model, opt, where: str, monkeypatch):
    """Arm an OOM for the next step; returns a disarm callable."""
    if where != "backward":
        return _inject(model, where, "oom", monkeypatch)
    real = opt._surface_failure
    calls = [0]

    def failing() -> None:
        # tidal's gradient hook checks for a failed host job first: a real OOM there (the gradient's
        # contiguous copy, the copy's event) leaves the same state: nothing of this gradient was shipped
        if sys._getframe(1).f_code.co_name == "_on_grad":
            calls[0] += 1
            if calls[0] == GRAD_AT:
                raise torch.OutOfMemoryError(OOM_MESSAGE)
        real()

    monkeypatch.setattr(opt, "_surface_failure", failing)
    return lambda: monkeypatch.setattr(opt, "_surface_failure", real)


def _oom_events(model) -> list[dict]:
    return [e for e in memory_report(model)["events"] if e["kind"] == "oom"]


def _check_error(err: BaseException, model, where: str, rollback: bool) -> None:
    assert isinstance(err, torch.OutOfMemoryError)
    if sys.version_info >= (3, 11):
        assert type(err) is torch.OutOfMemoryError, "the error's type changed"
        assert str(err) == OOM_MESSAGE
        note = "\n".join(err.__notes__)
    else:  # pragma: no cover - Python 3.10: a subclass raised from the original
        assert isinstance(err.__cause__, torch.OutOfMemoryError)
        note = str(err)
    assert note.count("tidal: out of memory in") == 1, note
    assert f"VRAM budget: 48.00 MiB ({BUDGET_BYTES} B)" in note
    (event,) = _oom_events(model)
    data = event["data"]
    assert f"(step {FAIL_AT + 1})" in note.splitlines()[0]
    # the peak is read when step() returns; a host update queued by step 3 may surface in synchronize()
    done = FAIL_AT + 1 if data["where"] == "optimizer.synchronize()" else FAIL_AT
    assert data["completed_steps"] == done and f"step() of step {done} returned" in note
    for fix in ("batch_tokens", "recompute=True", "activation_offload=True", "unwrap(model)", "vram_budget="):
        assert fix in note, f"the note does not name the fix {fix!r}"
    assert "zero_grad()" in note and f"rollback={rollback}" in note
    assert data["where"] in WHERE[where] and f"out of memory in {data['where']}" in note
    assert data["vram_budget_bytes"] == BUDGET_BYTES and data["step"] == FAIL_AT + 1
    assert str(BUDGET_BYTES) in event["message"]


# every parameter on the device: no tidal gradient hook runs in backward (see docs/reliability.md)
CASES = [(c, w) for c in CONFIGS for w in ("forward", "backward", "step") if (c, w) != ("device", "backward")]


@pytest.mark.parametrize("rollback", [True, False], ids=["rollback", "default"])
@pytest.mark.parametrize(("config", "where"), CASES)
def test_oom_note_state_and_continue(config, where, rollback, monkeypatch):
    data = batches(STEPS)
    clean, clean_opt = _wrapped(config, rollback)
    _train(clean, clean_opt, data[:FAIL_AT])
    clean_before = weights(clean)
    _train(clean, clean_opt, data[FAIL_AT : FAIL_AT + 1])
    ref_w, ref_s = weights(clean), _state(clean_opt)  # the failed step, done right

    model, opt = _wrapped(config, rollback)
    _train(model, opt, data[:FAIL_AT])
    before_w, before_s, before_a = weights(model), _state(opt), _arena()
    assert all(torch.equal(before_w[n], clean_before[n]) for n in before_w)

    disarm = _inject_oom(model, opt, where, monkeypatch)
    with pytest.raises(torch.OutOfMemoryError) as info:
        loss_of(model, data[FAIL_AT]).backward()
        opt.step()
        opt.synchronize()
    disarm()
    _check_error(info.value, model, where, rollback)
    opt.zero_grad()
    opt.synchronize()  # every queued copy and update drains without error
    assert _arena() == before_a, "arena blocks/bytes changed by the failed step"
    assert arena_stats()["pending_bytes"] == 0, "arena blocks still wait for a copy"

    after_w, after_s = weights(model), _state(opt)
    assert after_s.keys() == before_s.keys() or rollback is False
    updated = []
    for i, name in enumerate(before_w):
        keys = [k for k in after_s if k[0] == i]
        same = torch.equal(after_w[name], before_w[name]) and all(
            k in before_s and _equal(after_s[k], before_s[k]) for k in keys
        )
        as_ref = torch.equal(after_w[name], ref_w[name]) and all(_equal(after_s[k], ref_s[k]) for k in keys)
        assert same or (as_ref and not rollback), f"{name}: neither as before the step nor fully updated"
        updated += [] if same else [name]
    if rollback or where == "forward":
        assert not updated, f"updated by the failed step: {updated}"

    if rollback:  # retry the failed batch and go on: bit-identical to the run that never failed
        _train(model, opt, data[FAIL_AT:])
        _train(clean, clean_opt, data[FAIL_AT + 1 :])
        for (n, p), q in zip(model.named_parameters(), clean.parameters()):
            assert torch.equal(p, q), f"{n} differs from the run that never failed"
    else:  # go on with a smaller batch
        small = [(x[:1], y[:1]) for x, y in data[FAIL_AT:]]
        _train(model, opt, small)
        moved = weights(model)
        assert all(torch.isfinite(w).all() for w in moved.values())
        assert all(not torch.equal(moved[n], after_w[n]) for n in ("head.weight", "emb.weight"))
    assert len(_oom_events(model)) == 1
    unwrap(model)
    unwrap(clean)
    assert "forward" not in model.__dict__, "unwrap() left the forward wrapper"


def _equal(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_forward_wrapper_is_transparent():
    """The forward wrapper keeps the signature, the result and an earlier instance-level forward."""
    import inspect

    model = make_model()
    x = batches(1)[0][0]
    want = model(x)
    own = model.forward
    model.forward = lambda idx: own(idx) * 2  # a user's instance-level forward, set before wrap()
    user = model.__dict__["forward"]
    model, _ = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), offload=True)
    assert model.__dict__["forward"] is not user
    assert torch.equal(model(x), want * 2)
    unwrap(model)
    assert model.__dict__["forward"] is user
    del model.forward
    model, _ = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), offload=True)
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    assert torch.equal(model(x), want)
    unwrap(model)
    assert "forward" not in model.__dict__


@pytest.mark.gpu
def test_real_cuda_oom_mid_forward():
    """A batch far above the budget under ``set_per_process_memory_fraction``: a real OOM mid-forward
    carries the note with the device figures, is logged, and training goes on with a small batch."""
    dev = torch.device("cuda")
    model = make_model(device="cuda")
    model, opt = wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), offload=True, vram_budget="256MiB"
    )
    data = batches(2, device="cuda")
    _train(model, opt, data)
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_reserved(dev) + 256 * 2**20) / total)
    )
    try:
        big = torch.randint(0, 64, (2048, 2048), device=dev)  # 4 M tokens: ~0.5 GiB per [B, T, D] activation
        with pytest.raises(torch.OutOfMemoryError) as info:
            loss_of(model, (big, big)).backward()
        note = "\n".join(getattr(info.value, "__notes__", [str(info.value)]))
        assert "out of memory in forward" in note and f"({256 * 2**20} B)" in note
        assert "step() of step 2 returned: " in note and "allocated now: " in note and "n/a" not in note
        (event,) = _oom_events(model)
        assert event["data"]["allocated_bytes"] > 0 and event["data"]["last_step_peak_bytes"] > 0
        del big, info
        opt.zero_grad()
        opt.synchronize()
        torch.cuda.empty_cache()
        before = weights(model)
        _train(model, opt, batches(1, seed=5, device="cuda"))
        assert not torch.equal(before["head.weight"], model.head.weight)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    unwrap(model)


@pytest.mark.parametrize("config", ["host", "device"])
def test_replan_after_oom(config, monkeypatch):
    """The re-plan the note names: ``state_dict()``, ``unwrap()``, ``wrap(..., vram_budget=lower)``,
    ``load_state_dict()``; with ``rollback=True`` training then goes on bit-identically to a run that
    never failed."""
    data = batches(STEPS)
    clean, clean_opt = _wrapped(config, True)
    _train(clean, clean_opt, data)

    model, opt = _wrapped(config, True)
    _train(model, opt, data[:FAIL_AT])
    disarm = _inject_oom(model, opt, "forward", monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        loss_of(model, data[FAIL_AT]).backward()
    disarm()
    opt.zero_grad()
    state = opt.state_dict()
    unwrap(model)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = wrap(model, fresh, **{**CONFIGS[config], "vram_budget": "32MiB"})
    opt.load_state_dict(state)
    assert not _oom_events(model), "the new wrap starts a new decision log"
    _train(model, opt, data[FAIL_AT:])
    for (n, p), q in zip(model.named_parameters(), clean.parameters()):
        assert torch.equal(p, q), f"{n} differs from the run that never failed"
    unwrap(model)
    unwrap(clean)
