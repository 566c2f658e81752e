"""CUDA graphs after the measured refinement: installed on the blocks that qualify, then the step that
captured them is measured against the budget, and they go if it left too little room.

[Note: graphs' memory] A captured block's saved activations, its static input and output and its
gradient buffers live in the graphs' private memory pool. The eager allocator cannot use that pool's
free blocks, and the pool's memory is not handed back while a graph of it lives. So a graphed step holds
more than the eager step that the refinement measured and sized. On the GPU machine, a LoRA step of a
14B model on an NF4 base at 2,048 tokens under a 24 GiB budget peaked at 23.63 GiB in the step that
captured (the refinement had sized 20.8 GiB), and the next step ran out of memory. Two measures:

- the refinement keeps activations only in the room left after the graphs' buffers
  (:func:`~tidal_stream.block_graphs.graphs_reserve_by_block`), and the graphs go on as many blocks as
  that room holds (:func:`graphs_room`; full fine-tuning's blocks hold their weights' gradients too);
- the step that captured is measured like the first step (its peak of reserved bytes,
  :func:`~tidal_stream.placement.measured_room`); when it left less than half the refinement's headroom
  under the budget, the graphs go with their pool. That step measured what they really cost, so they
  come back once on the blocks that cost fits (:func:`_fewer_blocks`); released again, or when not even
  one block fits, every block runs eagerly from the next step, the step the refinement sized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tidal_stream.block_graphs import BlockGraphs, blocks_within, graphable_blocks, graphs_reserve_by_block
from tidal_stream.kept_activations import block_ranges
from tidal_stream.placement import foreign_device_bytes, measured_room

__all__ = ["check_capture_step", "graphs_room", "install_block_graphs", "with_block_graphs"]


def install_block_graphs(session: Any, opt: Any, room: int | None = None) -> BlockGraphs | None:
    """CUDA graphs on the blocks that qualify (:func:`~tidal_stream.block_graphs.graphable_blocks`) and,
    given ``room`` (bytes for their buffers), on as many of them as fit (:func:`blocks_within`), logged
    with why the others stay eager; None when no block is graphed."""
    chosen, others = graphable_blocks(session, opt)
    reserve = graphs_reserve_by_block(session, opt) if room is not None else {}
    if reserve:  # measured inputs: the buffers are known, and only the blocks within the room are graphed
        fit = set(blocks_within(reserve, room))
        over = sorted(i for i in chosen if i not in fit)
        if over:
            others[
                f"their buffers would exceed the {room / 2**30:.2f} GiB the measured refinement left them"
            ] = over
            chosen = {i: b for i, b in chosen.items() if i in fit}
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


def _over(session: Any, graphs: BlockGraphs) -> tuple[bool, int, int, int]:
    """``(over, used, headroom, room)``: the peak of reserved bytes since the statistics' last reset left
    less than half the headroom under the budget (or the device's usable memory)."""
    _, used, room, headroom = measured_room(session.device, graphs.foreign, graphs.budget)
    return room < -headroom // 2, used, headroom, room


def check_capture_step(
    session: Any, opt: Any, graphs: BlockGraphs, was_over: bool = False, retry: bool = True
) -> None:
    """After an optimizer step: once ``graphs`` captured, measure that step (see [Note: graphs' memory]);
    before, check again after the next step (re-armed as the optimizer's after-update callback).

    The peak is the allocator's since its last reset (``wrap()`` resets it when a refinement follows the
    first step, and before a second capture on fewer blocks; callers' readings across those resets
    lose the earlier peaks). ``was_over``: that peak was over already when the graphs came, so a peak
    over now says nothing of theirs: they stay. ``retry``: graphs released here may come back once on
    fewer blocks (:func:`_fewer_blocks`)."""
    if graphs not in session.extensions or graphs.released is not None:
        return  # unwrapped, or released already (a new input shape)
    states = [g.fwd is not None or g.failed is not None for g in graphs.graphs.values()]
    if not all(states):  # some block was not called by a training forward since the graphs came
        opt._after_first_update = lambda: check_capture_step(session, opt, graphs, was_over, retry)
        return
    captured = sorted(i for i, g in graphs.graphs.items() if g.fwd is not None)
    if not captured:
        return  # nothing was captured: nothing holds memory
    over, used, headroom, room = _over(session, graphs)
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
    fewer = _fewer_blocks(session, opt, captured, room, headroom) if retry else None
    session.record(
        "graphs",
        f"CUDA graphs {graphs.released}: "
        + (
            fewer[1]
            if fewer
            else "every block runs eagerly from the next step, as the measured refinement sized it "
            "(wrap(..., cuda_graphs=False) skips the capture)"
        ),
        peak_reserved=used,
    )
    if fewer:
        session.extensions.remove(graphs)
        # why: the released pool's memory goes back before the next capture is measured
        torch.cuda.empty_cache()
        # why: the next check reads the peak of the step that captures fewer blocks
        torch.cuda.reset_peak_memory_stats(session.device)
        again = install_block_graphs(session, opt, fewer[0])
        if again is not None:
            opt._after_first_update = lambda: check_capture_step(session, opt, again, False, retry=False)


#: the share of the measured graphs' cost per block that a second capture may take of the room
_RETRY_MARGIN = 0.8


def _fewer_blocks(
    session: Any, opt: Any, captured: list[int], room: int, headroom: int
) -> tuple[int, str] | None:
    """After graphs were released for taking too much: the step that captured them measured what they
    really cost (the refinement's room before them, less the room that step left). Graphs go once more on
    as many blocks as that cost per block fits in the room with half the headroom (with a margin),
    captured at the next step and checked after it for good. Returns ``(room for their estimated buffers,
    what is done)``, or None (no refinement to compare with, or not even one block fits).

    On the GPU machine full1.5b at 24 GiB: 16 graphed blocks cost 2.0-2.6 GiB (1.2-1.5x their estimated
    buffers) where 1.9 GiB was left, so they were released; graphed again, 9-11 blocks fit and stayed."""
    d = _refinement(session)
    if d is None:
        return None
    before = d["room"] - d["device_bytes"] - d["activations_kept_bytes"]  # the eager steps' room
    cost, allowed = before - room, before + headroom // 2
    reserve = graphs_reserve_by_block(session, opt)
    estimate = sum(reserve.get(i, 0) for i in captured)
    if cost <= 0 or allowed <= 0 or not estimate:
        return None
    fit = blocks_within(reserve, int(estimate * _RETRY_MARGIN * allowed / cost))
    if not fit:
        return None
    text = (
        f"they cost {cost / 2**30:.2f} GiB for {len(captured)} blocks ({cost / estimate:.1f}x their estimated "
        f"buffers) where {allowed / 2**30:.2f} GiB was left; blocks {block_ranges(fit)} are graphed again from "
        "the next step, checked once more after it"
    )
    return sum(reserve[i] for i in fit), text


def graphs_room(session: Any) -> int | None:
    """Bytes the measured refinement left for the CUDA graphs' buffers, or None when no refinement ran.

    The refinement (:func:`~tidal_stream.placement.refine_after_first_step`) places the optimizer first
    (worth more than the graphs' launch savings), then leaves room for the buffers of as many graphable
    blocks as fit with the step that captures them still leaving half the headroom under the budget (what
    :func:`check_capture_step` asks afterwards), then keeps activations in what is left. Full
    fine-tuning's graphs hold every graphed block's weight gradients: capturing them all on full1.5b at
    24 GiB ran out of memory, and the room may hold only some blocks."""
    d = _refinement(session)
    return None if d is None else d["graphs_reserve_bytes"]


def _refinement(session: Any) -> dict[str, Any] | None:
    """The data of the measured refinement's placement decision (the last), or None when none ran."""
    refined = [e for e in session.events if e.kind == "placement" and "graphs_reserve_bytes" in e.data]
    return refined[-1].data if refined else None


def with_block_graphs(session: Any, opt: Any, then: Callable[[], None] | None) -> Callable[[], None] | None:
    """The optimizer's after-first-step callback: ``then`` (the measured refinement, if any), then CUDA
    graphs on the blocks that qualify (``cuda_graphs`` option; CUDA only), and after the step that
    captures them, :func:`check_capture_step`."""
    if session.options.cuda_graphs is False or session.device.type != "cuda":
        return then

    def after() -> None:
        if then is not None:
            then()
        graphs = install_block_graphs(session, opt, graphs_room(session))
        if graphs is not None:
            was_over = _over(session, graphs)[0]  # the peak before any capture
            opt._after_first_update = lambda: check_capture_step(session, opt, graphs, was_over)

    return after
