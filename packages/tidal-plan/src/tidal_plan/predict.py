"""``predict()``: the cost model's step time for a given placement, at any batch size.

The planner searches placements for ``PlanConfig.batch_tokens``; a library that moves bytes after
measuring the real batch (``tidal-stream``'s first-step refinement) asks the same model what a changed
placement would take at the measured tokens, and picks the fastest one that fits.
"""

from __future__ import annotations

import dataclasses

from tidal_plan.census import ModelCensus
from tidal_plan.config import PlanConfig
from tidal_plan.cost import State, evaluate
from tidal_plan.errors import PlanConfigError
from tidal_plan.hardware import HardwareProfile
from tidal_plan.plan_types import Plan, StepPrediction
from tidal_plan.planner import _context

__all__ = ["plan_state", "predict"]


def predict(
    census: ModelCensus,
    profile: HardwareProfile,
    placement: Plan,
    config: PlanConfig | None = None,
    batch_tokens: int | None = None,
) -> StepPrediction:
    """The predicted step of ``placement``'s choices (weights, activations, optimizer per block, storage
    format, moments) under ``config``, for ``batch_tokens`` tokens.

    Args:
        census: the model's census (the one ``placement`` was planned for).
        profile: the machine.
        placement: a plan, possibly edited (``dataclasses.replace`` on its blocks and optimizer).
        config: the planning options (budget, prefetch depth, sequence length, loss chunking); default
            ``PlanConfig()``.
        batch_tokens: tokens per step; default ``placement.batch_tokens``.

    Raises:
        PlanConfigError: ``placement`` has another number of blocks than ``census``, or ``batch_tokens``
            is not a positive int.
    """
    if len(placement.blocks) != len(census.blocks):
        raise PlanConfigError(
            "placement",
            f"a plan of {len(placement.blocks)} blocks",
            f"a plan of the census' {len(census.blocks)} blocks",
            "predict with the census the plan was made from",
        )
    tokens = placement.batch_tokens if batch_tokens is None else batch_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise PlanConfigError("batch_tokens", tokens, "a positive int", "pass the tokens of one step")
    config = dataclasses.replace(config or PlanConfig(), batch_tokens=tokens)
    return evaluate(_context(census, profile, config), plan_state(placement)).prediction


def plan_state(placement: Plan) -> State:
    """The cost model's state of ``placement``'s choices (storage, moments, and per block: weights,
    activations, optimizer)."""
    return State(
        fmt=placement.quantize or "exact",
        moment=placement.optimizer.moment_dtype,
        resident=[b.weights == "resident" for b in placement.blocks],
        act=[b.activations for b in placement.blocks],
        opt_gpu=[b.optimizer == "gpu" for b in placement.blocks],
        outside_opt_gpu=placement.optimizer.outside_on_gpu,
    )
