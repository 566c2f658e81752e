"""CUDA graphs after the measured refinement: installed on the blocks that qualify, then the step that
captured them is measured against the budget, and they go if it left too little room.

[Note: graphs' memory] A captured block's saved activations, its static input and output and its
gradient buffers live in the graphs' private memory pool. The eager allocator cannot use that pool's
free blocks, and the pool's memory is not handed back while a graph of it lives. So a graphed step holds
more than the eager step that the refinement measured and sized. On the GPU machine, a LoRA step of a
14B model on an NF4 base at 2,048 tokens under a 24 GiB budget peaked at 23.63 GiB in the step that
captured (the refinement had sized 20.8 GiB), and the next step ran out of memory. Two measures:

- the refinement keeps activations only in the room left after the graphs' buffers
  (:func:`~tidal_stream.block_graphs.graphs_reserve_bytes`);
- the step that captured is measured like the first step (its peak of reserved bytes,
  :func:`~tidal_stream.placement.measured_room`); when it left less than half the refinement's headroom
  under the budget, the graphs go with their pool and every block runs eagerly from the next step,
  the step the refinement sized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal_stream.block_graphs import BlockGraphs, graphable_blocks
from tidal_stream.kept_activations import block_ranges
from tidal_stream.placement import foreign_device_bytes, measured_room

__all__ = ["check_capture_step", "install_block_graphs", "with_block_graphs"]


def install_block_graphs(session: Any, opt: Any) -> BlockGraphs | None:
    """CUDA graphs on the blocks that qualify (:func:`~tidal_stream.block_graphs.graphable_blocks`), logged
    with why the others stay eager; None when no block qualifies."""
    chosen, others = graphable_blocks(session, opt)
    not_graphed = "; ".join(f"blocks {block_ranges(ix)} stay eager: {why}" for why, ix in others.items())
    if not chosen:
        session.record("graphs", "no block is graphed" + (f" ({not_graphed})" if not_graphed else ""))
        return None
    graphs = BlockGraphs(session, chosen, foreign_device_bytes(opt, session.model, session.device))
    session.extensions.append(graphs)
    session.record(
        "graphs",
        f"blocks {block_ranges(sorted(chosen))} run as CUDA graphs of their forward and backward from the "
        "next step (captured at its first call, replayed while the inputs keep their shapes)"
        + (f"; {not_graphed}" if not_graphed else ""),
        blocks=sorted(chosen),
    )
    return graphs


def _over(session: Any, graphs: BlockGraphs) -> tuple[bool, int, int]:
    """``(over, used, headroom)``: the peak of reserved bytes since the statistics' last reset left less
    than half the headroom under the budget (or the device's usable memory)."""
    _, used, room, headroom = measured_room(session.device, graphs.foreign, graphs.budget)
    return room < -headroom // 2, used, headroom


def check_capture_step(session: Any, opt: Any, graphs: BlockGraphs, was_over: bool = False) -> None:
    """After an optimizer step: once ``graphs`` captured, measure that step (see [Note: graphs' memory]);
    before, check again after the next step (re-armed as the optimizer's after-update callback).

    The peak is the allocator's since its last reset (``wrap()`` resets it when a refinement follows the
    first step; tidal never resets it later: callers' own readings stay valid). ``was_over``: that peak
    was over already when the graphs came, so a peak over now says nothing of theirs: they stay."""
    if graphs not in session.extensions or graphs.released is not None:
        return  # unwrapped, or released already (a new input shape)
    states = [g.fwd is not None or g.failed is not None for g in graphs.graphs.values()]
    if not all(states):  # some block was not called by a training forward since the graphs came
        opt._after_first_update = lambda: check_capture_step(session, opt, graphs, was_over)
        return
    if not any(g.fwd is not None for g in graphs.graphs.values()):
        return  # nothing was captured: nothing holds memory
    over, used, headroom = _over(session, graphs)
    limit = f"{graphs.budget / 2**30:.2f} GiB budget" if graphs.budget is not None else "device"
    if not over or was_over:
        session.record(
            "graphs",
            f"the step that captured the CUDA graphs peaked at {used / 2**30:.2f} GiB reserved of the {limit}: "
            + (
                "the peak was that high before the graphs came; they stay"
                if over
                else f"they fit (at least {headroom / 2 / 2**30:.2f} GiB, half the headroom, left)"
            ),
            peak_reserved=used,
        )
        return
    graphs.close(
        f"released: the step that captured them peaked at {used / 2**30:.2f} GiB reserved, less than "
        f"{headroom / 2 / 2**30:.2f} GiB (half the headroom) under the {limit}"
    )
    session.record(
        "graphs",
        f"CUDA graphs {graphs.released}: every block runs eagerly from the next step, as the measured "
        "refinement sized it (wrap(..., cuda_graphs=False) skips the capture)",
        peak_reserved=used,
    )


def _no_room_for_graphs(session: Any) -> str | None:
    """Why the graphs' buffers that the measured refinement counted cannot fit, or None when they can.

    They fit when the step that captures them would still leave half the headroom under the budget, as
    :func:`check_capture_step` asks afterwards: room left by the refinement (its room, less what it moved
    to the device) + half the headroom >= the graphs' bytes. The refinement places the optimizer first
    (worth more than the graphs' launch savings); full fine-tuning's graphs, which hold every graphed
    block's weight gradients, may then not fit, and capturing them anyway ran out of memory."""
    refined = [e for e in session.events if e.kind == "placement" and "graphs_reserve_bytes" in e.data]
    if not refined:
        return None
    d = refined[-1].data
    need = d["graphs_reserve_bytes"]
    left = d["room"] - d["device_bytes"] - d["activations_kept_bytes"] + d["headroom"] // 2
    if not need or need <= left:
        return None
    return (
        f"their buffers ({need / 2**30:.2f} GiB) exceed what the measured refinement left under the budget "
        f"({max(left, 0) / 2**30:.2f} GiB with half the headroom); the room went to the optimizer"
    )


def with_block_graphs(session: Any, opt: Any, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """The optimizer's after-first-step callback: ``then`` (the measured refinement, if any), then CUDA
    graphs on the blocks that qualify (``cuda_graphs`` option; CUDA only), and after the step that
    captures them, :func:`check_capture_step`."""
    if session.options.cuda_graphs is False or session.device.type != "cuda":
        return then

    def after() -> None:
        if then is not None:
            then()
        short = _no_room_for_graphs(session)
        if short:
            session.record("graphs", f"no block is graphed: {short}")
            return
        graphs = install_block_graphs(session, opt)
        if graphs is not None:
            was_over = _over(session, graphs)[0]  # the peak before any capture
            opt._after_first_update = lambda: check_capture_step(session, opt, graphs, was_over)

    return after
