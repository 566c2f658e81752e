"""Out-of-memory errors that pass through tidal: annotated with the figures and the fixes, never swallowed.

[Note: out of memory] a ``torch.OutOfMemoryError`` raised during a training step of a wrapped model —
in the model's forward (``wrap()`` installs an instance-level forward wrapper, removed by ``unwrap()``;
the streaming and prefetch hooks of the block stack run inside it), in the optimizer's gradient hooks,
in ``step()`` or in ``synchronize()`` — gets a note naming the VRAM budget, the plan's predicted device
bytes (when a plan exists), the device peak read at the end of the last completed step, what is allocated
now, the forward's tokens when they exceed those the plan sized activations and the loss for (wrap()'s
plan assumes 4,096 per step unless told ``batch_tokens``; the first such forward is also logged before
anything runs out), and the fixes (a smaller batch or ``batch_tokens``, ``recompute=True`` /
``activation_offload=True``, or a re-plan: ``unwrap()`` then ``wrap(..., vram_budget=lower)``). The
event goes to the decision log (``memory_report(model)["events"]``, kind ``"oom"``). The exception keeps
its type and object (Python ≥ 3.11: ``add_note``); on 3.10 a :class:`TidalOutOfMemoryError` — a
``torch.OutOfMemoryError`` subclass, so ``except torch.OutOfMemoryError`` still catches it — is raised
from the original with the note in its message. The state afterwards is that of any failed step (see [Note: failed steps] in optimizer.py):
call ``optimizer.zero_grad()`` and continue (with a smaller batch).

Limit: an OOM raised by torch's own backward kernels, outside tidal's gradient hooks, reaches the caller
of ``backward()`` without passing through tidal code and is not annotated.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "TidalOutOfMemoryError",
    "annotates_oom",
    "forward_tokens",
    "install_forward_note",
    "note_forward_tokens",
    "note_step_done",
    "oom_note",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_NOTED = "_tidal_oom_noted"  # set on an exception once annotated: a note is added once per exception


class TidalOutOfMemoryError(torch.OutOfMemoryError):
    """Python 3.10 only (no ``BaseException.add_note``): the original OOM with tidal's note in the message,
    raised ``from`` it. A ``torch.OutOfMemoryError``, so ``except torch.OutOfMemoryError`` catches it."""


@dataclass
class _StepMemory:
    """What the note reports about the steps before the failure."""

    steps: int = 0
    """Optimizer steps completed (``step()`` calls that returned)."""
    peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` read at the end of the last completed step (CUDA only)."""


_STEPS: weakref.WeakKeyDictionary[Any, _StepMemory] = weakref.WeakKeyDictionary()
_TOKENS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # tokens of the last forward
_TOLD: weakref.WeakSet[Any] = weakref.WeakSet()  # sessions already told their batch outgrew the plan


def forward_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Tokens of one forward call of a causal LM: the elements of ``input_ids`` (the keyword, else the
    first tensor argument), or the rows of ``inputs_embeds`` / a floating first argument; None if neither."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    if x.is_floating_point():  # embeddings: [..., hidden]
        return x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else None
    return x.numel()


def _planned_tokens(session: Any) -> int:
    """Tokens per step the session's plan sized activations and the loss for (0: no plan)."""
    plan = getattr(session, "plan", None)
    return int(getattr(plan, "batch_tokens", 0) or 0) if plan is not None else 0


def note_forward_tokens(session: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Remember a forward's tokens for the note; the first forward larger than the plan's batch is logged
    (a warning and a ``"plan"`` event) with the option that plans for it, before memory can run out."""
    tokens = forward_tokens(args, kwargs)
    if tokens is None:
        return
    _TOKENS[session] = tokens
    planned = _planned_tokens(session)
    if planned and tokens > planned and session not in _TOLD:
        _TOLD.add(session)
        msg = (
            f"this forward has {tokens} tokens, more than the {planned} per step the plan sized activations "
            f"and the loss for: memory may run out; wrap(..., batch_tokens={tokens}) plans for this batch"
        )
        log.warning("tidal: %s", msg)
        session.record("plan", msg, tokens=tokens, planned_tokens=planned)


def note_step_done(session: Any) -> None:
    """Record the end of a completed optimizer step (called by ``OffloadAdamW.step()``)."""
    mem = _STEPS.setdefault(session, _StepMemory())
    mem.steps += 1
    dev = session.device
    if dev.type == "cuda":
        # peak since the statistics' last reset (no reset here: callers' own peak readings stay valid)
        mem.peak_bytes = torch.cuda.max_memory_allocated(dev)


def _gib(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB ({n} B)" if n >= 2**30 else f"{n / 2**20:.2f} MiB ({n} B)"


def oom_note(session: Any, where: str, queued: bool = False) -> tuple[str, dict[str, Any]]:
    """The note for an OOM raised in ``where`` of ``session``'s model, and its figures (for the log).

    Args:
        session: the wrapping :class:`~tidal_stream.session.Session`.
        where: what was running (``"forward"``, ``"gradient hook"``, ``"optimizer.step()"``, ...).
        queued: the failure belongs to the last step whose ``step()`` returned (its queued host
            updates), not to the step under way.

    Returns:
        ``(note, data)``: the multi-line note and a dict of the numbers behind it.
    """
    dev = session.device
    opts = session.options
    mem = _STEPS.get(session, _StepMemory())
    budget = opts.vram_budget_bytes
    plan = session.plan
    planned = getattr(plan, "tiers", {}).get("vram") if plan is not None else None
    plan_budget = getattr(plan, "vram_budget_bytes", None) if plan is not None else None
    allocated = reserved = total = None
    if dev.type == "cuda":
        allocated = torch.cuda.memory_allocated(dev)
        reserved = torch.cuda.memory_reserved(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
    model = type(session.model).__name__ if session.model is not None else "model"
    if budget is not None:
        budget_line = f"VRAM budget: {_gib(budget)} (wrap(vram_budget={opts.vram_budget!r}))"
    elif plan_budget:
        budget_line = (
            f"VRAM budget: {_gib(plan_budget)} (the plan's, headroom included; no vram_budget given)"
        )
    elif total is not None:
        budget_line = f"VRAM budget: none given; the device has {_gib(total)}"
    else:
        budget_line = f"VRAM budget: none given (device {dev})"
    plan_line = (
        f"plan's predicted device bytes: {_gib(planned)}"
        if planned is not None
        else "plan's predicted device bytes: no plan was made for this model"
    )
    step = mem.steps if queued else mem.steps + 1
    if mem.steps == 0:
        peak_line = "measured peak of the last completed step: no step completed yet"
    elif mem.peak_bytes is None:
        peak_line = f"measured peak when step() of step {mem.steps} returned: not measured on {dev}"
    else:
        peak_line = (
            f"measured peak when step() of step {mem.steps} returned: {_gib(mem.peak_bytes)} "
            "(torch.cuda.max_memory_allocated since its last reset)"
        )
    now_line = (
        f"allocated now: {_gib(allocated)}, reserved {_gib(reserved)}"
        if allocated is not None
        else f"allocated now: not measured on {dev}"
    )
    tokens, planned_tokens = _TOKENS.get(session), _planned_tokens(session)
    outgrown = tokens is not None and planned_tokens and tokens > planned_tokens
    tokens_line = (
        [
            f"  this forward: {tokens} tokens; the plan sized activations and the loss for {planned_tokens} "
            f"per step: wrap(..., batch_tokens={tokens}) plans for this batch."
        ]
        if outgrown
        else []
    )
    lower = budget if budget is not None else (plan_budget or total)
    lower_txt = f"lower than {_gib(lower).split(' (')[0]}" if lower else "lower"
    note = "\n".join(
        [
            f"tidal: out of memory in {where} of the wrapped {model} on {dev} (step {step}).",
            f"  {budget_line}",
            f"  {plan_line}",
            f"  {peak_line}",
            f"  {now_line}",
            *tokens_line,
            "  Fixes: a smaller batch (or wrap(..., batch_tokens=smaller)); recompute=True or "
            "activation_offload=True; or re-plan with new figures: save optimizer.state_dict(), unwrap(model), "
            f"wrap(model, ..., vram_budget={lower_txt}) and load the state dict.",
            "  To continue: optimizer.zero_grad(), then train on ("
            + (
                "rollback=True: the failed step is undone exactly)."
                if opts.rollback
                else "rollback=False: parameters updated before the failure keep their update)."
            ),
        ]
    )
    data = {
        "where": where,
        "step": step,
        "completed_steps": mem.steps,
        "vram_budget_bytes": budget if budget is not None else plan_budget,
        "planned_vram_bytes": planned,
        "last_step_peak_bytes": mem.peak_bytes,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "forward_tokens": tokens,
        "planned_tokens": planned_tokens or None,
    }
    return note, data


def _annotate(session: Any, exc: torch.OutOfMemoryError, where: str, queued: bool = False) -> BaseException:
    """Add the note (once) and log the event; returns the exception to raise."""
    if getattr(exc, _NOTED, False):
        return exc
    note, data = oom_note(session, where, queued)
    lines = note.splitlines()
    session.record("oom", "; ".join(line.strip().rstrip(".") for line in lines[:5]), **data)
    if sys.version_info >= (3, 11):
        exc.add_note(note)
        setattr(exc, _NOTED, True)
        return exc
    out = TidalOutOfMemoryError(f"{exc}\n{note}")  # pragma: no cover - Python 3.10
    setattr(out, _NOTED, True)  # pragma: no cover
    return out  # pragma: no cover


def annotates_oom(where: str, queued: bool = False) -> Callable[[F], F]:
    """Decorate a method of an object with a ``session``: an OOM passing through gets tidal's note
    (``queued``: see :func:`oom_note`)."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except torch.OutOfMemoryError as exc:
                out = _annotate(self.session, exc, where, queued)
                if out is exc:
                    raise
                raise out from exc  # pragma: no cover - Python 3.10

        return inner  # type: ignore[return-value]

    return deco


class _ForwardHandle:
    """Removes the forward wrapper (``Session.close()`` calls ``remove()``)."""

    def __init__(self, model: nn.Module, wrapper: Any, previous: Any) -> None:
        self.model, self.wrapper, self.previous = model, wrapper, previous

    def remove(self) -> None:
        model = self.model
        if model is None:
            return
        self.model = None
        current = model.__dict__.get("forward")
        if current is not self.wrapper:
            # someone wrapped forward again on top (e.g. an autocast wrapper): leave theirs in place
            log.info(
                "out-of-memory note: %s.forward was replaced after wrap(); left as it is",
                type(model).__name__,
            )
            return
        if self.previous is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = self.previous


def install_forward_note(session: Any, model: nn.Module) -> _ForwardHandle:
    """Wrap ``model.forward`` (instance-level) so an OOM in forward gets tidal's note.

    The call, its arguments, result and signature (``inspect.signature`` follows ``__wrapped__``) are
    unchanged; an instance-level ``forward`` set before is kept inside and restored by ``remove()``.
    """
    previous = model.__dict__.get("forward")
    orig = model.forward

    def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        note_forward_tokens(session, args, kwargs)
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            out = _annotate(session, exc, "forward")
            if out is exc:
                raise
            raise out from exc  # pragma: no cover - Python 3.10

    if isinstance(orig, types.MethodType):
        func, bound_here = orig.__func__, orig.__self__ is model

        # a bound method again (with __func__), as code that re-wraps forward expects; it calls the
        # original function on the model it is bound to, so a copy of the model (copy.deepcopy rebinds
        # bound methods in __dict__) runs its own weights, never the original model's
        def forward(_self: Any, *args: Any, **kwargs: Any) -> Any:
            if bound_here:
                return _run(func, _self, *args, **kwargs)
            return _run(orig, *args, **kwargs)

        functools.update_wrapper(forward, orig.__func__)
        wrapper: Any = types.MethodType(forward, model)
    else:
        wrapper = functools.wraps(orig)(functools.partial(_run, orig))
    model.__dict__["forward"] = wrapper
    return _ForwardHandle(model, wrapper, previous)
