"""After the first step: blocks that offload or recompute their activations keep them on the device
while they fit the measured room.

The plan sized every block's activations for its ``batch_tokens`` (4,096 unless ``wrap()`` was told the
batch); a smaller real batch leaves room that copying activations to the host and back, or running a
block's forward twice, wastes. Offloaded blocks' bytes are measured by the first step; recomputed ones
never build their saved tensors in forward, so theirs are estimated from their measured input and the
census (:func:`keep_recomputed_activations`). Used by :mod:`tidal_stream.placement` (one GPU) and by
data parallel's first-step measurement.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "activation_candidates",
    "activations_of",
    "activations_to_refine",
    "block_ranges",
    "keep_activations",
    "keep_offloaded_activations",
    "keep_recomputed_activations",
    "kept_text",
]


def activations_of(session: Any) -> Any:
    """The session's activation-policy handle (None when no block offloads or recomputes)."""
    for ext in session.extensions:
        acts = getattr(ext, "activations", None)
        if acts is not None and hasattr(acts, "set_policy"):
            return acts
    return None


def activations_to_refine(session: Any) -> bool:
    """Some block of the session offloads or recomputes its activations (the first step may keep them)."""
    acts = activations_of(session)
    return acts is not None and bool({"offload", "recompute"} & set(acts.stats()["policies"]))


def keep_activations(session: Any, room: int) -> tuple[list[int], int]:
    """Offloaded blocks keep their activations while they fit (:func:`keep_offloaded_activations`), then
    recomputed ones in what is left (:func:`keep_recomputed_activations`).

    Offloaded ones go first: their bytes are measured, and each also saves two PCIe crossings.

    Returns:
        The blocks switched to ``keep``, and their (measured or estimated) bytes.
    """
    return _keep(session, room, activation_candidates(session))


def keep_offloaded_activations(session: Any, room: int) -> tuple[list[int], int]:
    """Switch offloaded blocks to keeping their activations on the device while their measured bytes fit.

    The plan sizes activations for ``batch_tokens`` (its default when wrap() was not told the batch): a
    smaller real batch leaves room that copying every block's activations to the host and back wastes
    (two PCIe crossings and host bookkeeping per saved tensor). The first step measured each offloaded
    block's bytes; kept ones all live at the end of forward, so their sum must fit in ``room``. The last
    blocks go first: backward needs them back first, the least time to prefetch.

    Returns:
        The blocks switched, and their measured bytes.
    """
    return _keep(session, room, activation_candidates(session, ("offload",)))


def keep_recomputed_activations(session: Any, room: int) -> tuple[list[int], int]:
    """Switch recomputed blocks to keeping their activations on the device while their estimated bytes fit.

    A recomputed block never builds its saved tensors in forward, so its bytes are estimated: the first
    step's measured input bytes times the census' kept-to-input bytes per token of that block (both grow
    with the tokens). Each switch saves a forward of the block in backward. Last blocks first, as
    :func:`keep_offloaded_activations`. Needs the census of ``wrap()``'s plan (``session.census``).

    Returns:
        The blocks switched, and their estimated bytes.
    """
    return _keep(session, room, activation_candidates(session, ("recompute",)))


def activation_candidates(
    session: Any, policies: tuple[str, ...] = ("offload", "recompute")
) -> list[tuple[int, int]]:
    """``(block, bytes)`` of the blocks that could keep their activations, in the order they are switched:
    offloaded ones last block first (bytes measured by the first step), then recomputed ones last block
    first (bytes estimated: the measured input bytes times the census' kept-to-input bytes per token).
    Blocks of unknown bytes are left out; recomputed ones need ``session.census`` of the handle's stack."""
    acts = activations_of(session)
    if acts is None:
        return []
    stats = acts.stats()
    now = stats["policies"]
    census = getattr(session, "census", None)
    inputs = stats["block_input_bytes"]

    def recomputed_bytes(i: int) -> int:
        if census is None or len(census.blocks) != len(now):
            return 0  # the census counted another stack than the handle's: no estimate to trust
        b = census.blocks[i]
        if not b.input_bytes_per_token:
            return 0
        return -(-inputs[i] * b.activation_bytes_per_token // b.input_bytes_per_token)

    bytes_of = {"offload": lambda i: stats["block_offloaded_bytes"][i], "recompute": recomputed_bytes}
    out = []
    for policy in policies:
        for i in reversed(range(len(now))):
            nbytes = bytes_of[policy](i) if now[i] == policy else 0
            if nbytes:
                out.append((i, nbytes))
    return out


def _keep(session: Any, room: int, candidates: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Switch the ``candidates`` (``(block, bytes)``, in order) to ``keep`` while their bytes fit in
    ``room`` together; one that does not fit is skipped, the next may.

    Returns:
        The blocks switched, and their bytes.
    """
    acts = activations_of(session)
    kept: list[int] = []
    total = 0
    for i, nbytes in candidates:
        if total + nbytes > room:
            continue
        acts.set_policy(i, "keep")
        kept.append(i)
        total += nbytes
    return sorted(kept), total


def block_ranges(idx: list[int]) -> str:
    """Block indices for the decision log: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in sorted(idx):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def kept_text(kept: list[int], kept_bytes: int) -> str:
    """The decision log's words for blocks switched to keeping their activations ("" when none)."""
    if not kept:
        return ""
    return (
        f"; blocks {block_ranges(kept)} KEEP their activations on the device ({kept_bytes / 2**30:.2f} GiB "
        "measured or estimated; they were offloaded or recomputed)"
    )
