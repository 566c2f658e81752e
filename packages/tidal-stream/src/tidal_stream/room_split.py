"""How the first step's measured room is shared between weights and activations.

After the first step the room the plan left (it sized everything for ``batch_tokens``, not the real batch)
can go to weights — optimizer state moved to the device, blocks that stop streaming — or to activations
that offloaded or recomputed blocks then keep. Which is worth more depends on the batch: at a few hundred
tokens a recomputed block's second forward is pure loss, while a streamed block's copy may hide behind
the compute, and at thousands the reverse can hold. So the plan's own cost model
(:func:`tidal_plan.predict`), at the tokens the first step measured, predicts every split — the first
``k`` activation candidates reserved, the weights given the rest, the activations whatever is left after
them — and the fastest is taken. Used by :mod:`tidal_stream.placement` (one GPU and data parallel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from tidal_stream.kept_activations import activation_candidates, activations_of

__all__ = ["RoomSplit", "activation_reserve", "blocks_of_params", "measured_tokens"]

WeightMoves = Callable[[int], tuple[set[Any], set[int], int]]
"""Given the room for weights: the blocks whose optimizer moves to the device (None: outside the stack),
the blocks that stop streaming, and the bytes all of it takes."""


@dataclasses.dataclass(frozen=True)
class RoomSplit:
    """The split chosen: bytes reserved for activations and the predicted steps behind the choice."""

    reserve: int
    tokens: int
    step_s: float
    weights_first_s: float

    def text(self) -> str:
        """One clause for the refinement's decision line."""
        return (
            f"; room split by the cost model at the measured {self.tokens} tokens/step: "
            f"{self.reserve / 2**30:.2f} GiB held for activations first (predicted step "
            f"{self.step_s * 1e3:.0f} ms; {self.weights_first_s * 1e3:.0f} ms with weights first)"
        )


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
    index = {
        id(t): census.param_to_block.get(n) for n, t in session.model.named_parameters(remove_duplicate=False)
    }
    return {index.get(id(p)) for p in params}


def activation_reserve(
    session: Any, room: int, streamed: Iterable[int], host_blocks: set[Any], weight_moves: WeightMoves
) -> RoomSplit | None:
    """The bytes of ``room`` to hold for activations before the weights take theirs.

    Args:
        session: the wrapping session (its plan, census, profile and plan options, and the activation
            handle with the first step's measurements).
        room: the measured room in bytes.
        streamed: the blocks streaming their weights now.
        host_blocks: the blocks whose optimizer updates on the host now (None: parameters outside the
            stack).
        weight_moves: what the weights would take of a given room (:data:`WeightMoves`).

    Returns:
        The split, or None when there is nothing to weigh (no candidates, no room, no plan made by
        ``wrap()`` — a given plan has no options to predict with — or no measured tokens).
    """
    cands = activation_candidates(session)
    config = getattr(session, "plan_config", None)
    tokens = measured_tokens(session)
    if room <= 0 or not cands or config is None or session.plan is None or not tokens:
        return None
    from tidal_plan import predict

    policies = list(activations_of(session).stats()["policies"])
    streamed = set(streamed)
    best: tuple[float, int] | None = None
    first_s = 0.0
    reserve = 0
    for k in range(len(cands) + 1):
        reserve += cands[k - 1][1] if k else 0
        if reserve > room:
            break
        to_device, unstreamed, weight_bytes = weight_moves(room - reserve)
        kept = _fill(cands, room - weight_bytes)
        placement = _placement(
            session,
            streamed - unstreamed,
            [("keep" if i in kept else p) for i, p in enumerate(policies)],
            host_blocks - to_device,
        )
        step = predict(session.census, session.profile, placement, config, batch_tokens=tokens).step_s
        first_s = first_s or step
        if best is None or step < best[0]:
            best = (step, reserve)
    assert best is not None  # k = 0 always fits: reserve 0 <= room
    return RoomSplit(best[1], tokens, best[0], first_s)


def _fill(cands: list[tuple[int, int]], room: int) -> set[int]:
    """The candidates kept_activations' fill would switch in ``room`` (each that fits, in order)."""
    kept, total = set(), 0
    for i, nbytes in cands:
        if total + nbytes <= room:
            kept.add(i)
            total += nbytes
    return kept


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
