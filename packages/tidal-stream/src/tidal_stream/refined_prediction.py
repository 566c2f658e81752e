"""The plan's cost model on the refined placement at the batch the first step measured.

The plan predicted its step for ``batch_tokens`` (4,096 unless ``wrap()`` was told the batch); after the
first step's refinement the placement changed and the real batch is known. The same cost model
(:func:`tidal_plan.predict`) then predicts the step of the placement as it now is at the measured tokens,
and the refinement's decision line reports it, so the prediction can be held against the measured steps.
Used by :mod:`tidal_stream.placement` (one GPU and data parallel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from tidal_stream.kept_activations import activations_of

__all__ = ["blocks_of_params", "measured_tokens", "predicted_step", "prediction_text"]


def measured_tokens(session: Any) -> int:
    """Tokens of the first step, from a block's measured input bytes and the census' input bytes per
    token (0 when nothing measured them)."""
    acts, census = activations_of(session), getattr(session, "census", None)
    if acts is None or census is None:
        return 0
    inputs = acts.stats()["block_input_bytes"]
    if len(inputs) != len(census.blocks):
        return 0
    per = [(n, b.input_bytes_per_token) for n, b in zip(inputs, census.blocks)]
    return max((n // k for n, k in per if n and k), default=0)


def blocks_of_params(session: Any, params: Iterable[Any]) -> set[Any]:
    """The census' block of each parameter (None: outside the stack)."""
    census = session.census
    named = session.model.named_parameters(remove_duplicate=False)
    index = {id(t): census.param_to_block.get(n) for n, t in named}
    return {index.get(id(p)) for p in params}


def predicted_step(session: Any, streamed: Iterable[int], host_blocks: set[Any]) -> tuple[int, float] | None:
    """The measured tokens and the predicted seconds of a step of the session's placement now.

    Args:
        session: the wrapping session (its plan, census, profile and plan options, and the activation
            handle with the first step's measurements).
        streamed: the blocks streaming their weights now.
        host_blocks: the blocks whose optimizer updates on the host now (None: parameters outside the
            stack).

    Returns:
        ``(tokens, seconds)``, or None without a plan made by ``wrap()`` (a given plan comes without its
        options) or without measured tokens.
    """
    config = getattr(session, "plan_config", None)
    tokens = measured_tokens(session)
    if config is None or session.plan is None or not tokens:
        return None
    from tidal_plan import predict

    policies = activations_of(session).stats()["policies"]
    placement = _placement(session, set(streamed), policies, host_blocks)
    # the blocks' CUDA graphs start with the next step: the prediction prices them (the plan did not)
    graphs = getattr(getattr(session, "options", None), "cuda_graphs", False) is not False
    graphs = graphs and session.device.type == "cuda"
    config = dataclasses.replace(config, cuda_graphs=graphs)
    return tokens, predict(session.census, session.profile, placement, config, batch_tokens=tokens).step_s


def prediction_text(prediction: tuple[int, float] | None) -> str:
    """One clause for the refinement's decision line ('' without a prediction)."""
    if prediction is None:
        return ""
    tokens, step_s = prediction
    return f"; the cost model predicts {step_s * 1e3:.0f} ms per step of this placement at the measured {tokens} tokens"


def _placement(session: Any, streamed: set[int], policies: list[str], host_blocks: set[Any]) -> Any:
    """``session.plan`` edited to the given live state: streamed blocks, activation policies, and where
    each block's optimizer runs (a streamed block's trainable weights update on the host)."""
    census, plan = session.census, session.plan
    blocks = []
    for b in plan.blocks:
        i = b.index
        weights = "streamed" if i in streamed else "resident"
        on_host = i in host_blocks or weights == "streamed"
        optimizer = "none" if not census.blocks[i].trainable_params else ("host" if on_host else "gpu")
        blocks.append(dataclasses.replace(b, weights=weights, activations=policies[i], optimizer=optimizer))
    opt = dataclasses.replace(plan.optimizer, outside_on_gpu=None not in host_blocks)
    return dataclasses.replace(plan, blocks=tuple(blocks), optimizer=opt)
