"""The device share of the host optimizer: which host-updated parameters move to the device in a room.

A unit is a host parameter alone, or a streamed block's parameters together with the block's weights
(the block stops streaming when its optimizer moves): its cost is the moments, the gradient kept until
``step()``, an fp32 master for 16-bit weights, the block's weight bytes, and the growth of the device
update's widening workspace. Units go in forward order (:func:`device_share`); used by the first-step
refinement of :mod:`tidal_stream.placement`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "device_share",
    "device_state_bytes",
    "promote_to_device",
    "share_units",
    "widen_workspace",
]


def device_state_bytes(t: torch.Tensor, moment_itemsize: int) -> int:
    """Device bytes that keeping ``t``'s optimizer there costs: moments, a gradient, an fp32 master if 16-bit."""
    n = t.numel()
    return 2 * n * moment_itemsize + n * t.element_size() + (0 if t.dtype == torch.float32 else 4 * n)


def widen_workspace(params: list[Any]) -> int:
    """Device bytes of the fp32 gradient copies the device update makes at once for ``params``: batches of
    at most ``_WIDEN_BATCH_BYTES``, each at least one tensor (``optimizer_device._widen_batches``)."""
    sizes = _widened_sizes(params)
    return _workspace(sum(sizes), max(sizes, default=0))


def _widened_sizes(params: list[Any]) -> list[int]:
    """fp32 bytes of the 16-bit tensors among ``params`` (those the device update widens)."""
    return [4 * t.numel() for t in params if t.dtype != torch.float32]


def _workspace(size_sum: int, size_max: int) -> int:
    """The widening workspace of tensors of these fp32 bytes in total and at most (widen_workspace)."""
    from tidal_stream.optimizer_device import _WIDEN_BATCH_BYTES

    return max(min(size_sum, _WIDEN_BATCH_BYTES), size_max)


def device_share(
    slots: list[Any],
    room: float,
    moment_itemsize: int,
    streaming: Any = None,
    on_device: list[Any] = (),  # type: ignore[assignment]
) -> tuple[list[nn.Parameter], int]:
    """Host slots to move to the device within ``room`` bytes, in forward (parameter) order.

    The earliest parameters are chosen: their updates are needed first by the next forward, while the
    host updates the later ones as their gradients land first in backward. A streamed weight moves only
    with its whole block, which then stops streaming (its weight bytes count too); that needs
    ``streaming`` (the weight-streaming extension, ``streamed_block_of`` / ``block_nbytes``), without it
    streamed weights stay. The cost of a parameter is :func:`device_state_bytes` (moments, its gradient
    kept until ``step()``, an fp32 master); the growth of the device update's widening workspace over
    that of ``on_device`` (the parameters already updated there) is counted too.

    Returns:
        The parameters and their total device bytes (workspace growth included).
    """
    return _prefix(share_units(slots, moment_itemsize, streaming, on_device), room)


def _prefix(units: list[tuple[list[nn.Parameter], int]], room: float) -> tuple[list[nn.Parameter], int]:
    """The leading units of :func:`share_units` that fit ``room``: their parameters and bytes."""
    chosen: list[nn.Parameter] = []
    total = 0
    for params, cumulative in units:
        if cumulative > room:
            break  # forward order: the next ones wait for a later unit's room
        chosen += params
        total = cumulative
    return chosen, total


def share_units(
    slots: list[Any],
    moment_itemsize: int,
    streaming: Any = None,
    on_device: list[Any] = (),  # type: ignore[assignment]
) -> list[tuple[list[nn.Parameter], int]]:
    """The units :func:`device_share` moves, in forward order, each with the device bytes of it and every
    unit before it (workspace growth included): a host parameter alone, or a streamed block's parameters
    together with the block's weight bytes. Parameters streamed by something that cannot stop streaming
    them are left out."""
    units: list[tuple[list[Any], int]] = []  # (slots, extra weight bytes), in forward order
    of_block: dict[int, list[Any]] = {}
    for s in sorted(slots, key=lambda s: s.index):
        if s.host_weight is None:
            units.append(([s], 0))
            continue
        blk = streaming.streamed_block_of(s.param) if streaming is not None else None
        if blk is None:
            continue  # streamed by something that cannot stop streaming it: its optimizer stays on the host
        if blk in of_block:
            of_block[blk].append(s)
        else:
            of_block[blk] = [s]
            units.append((of_block[blk], streaming.weights.block_nbytes(blk)))
    # the widening workspace (widen_workspace) grown one unit at a time over that of ``on_device``
    sizes = _widened_sizes(list(on_device))
    size_sum, size_max = sum(sizes), max(sizes, default=0)
    ws0 = _workspace(size_sum, size_max)
    out: list[tuple[list[nn.Parameter], int]] = []
    fixed = 0  # state, gradients and weights of the units so far
    for unit, extra in units:
        params = [s.param for s in unit]
        fixed += extra + sum(device_state_bytes(p, moment_itemsize) for p in params)
        grown = _widened_sizes(params)
        size_sum, size_max = size_sum + sum(grown), max([size_max, *grown])
        out.append((params, fixed + _workspace(size_sum, size_max) - ws0))
    return out


def promote_to_device(opt: Any, params: list[nn.Parameter], streaming: Any = None) -> tuple[int, list[int]]:
    """Move the optimizer of host-placed ``params`` to the device; streamed blocks among them stop streaming.

    Pending updates finish first, so the host copies the un-streamed blocks are filled from are current.

    Returns:
        The number of tensors moved and the stack indices of the blocks that stopped streaming.
    """
    opt.synchronize()  # why: an un-streamed block is filled from its host copy; pending updates write it
    wanted = {id(p) for p in params}
    slots = [s for s in opt.host_slots() if id(s.param) in wanted]
    blocks = sorted(
        {
            b
            for s in slots
            if s.host_weight is not None and (b := streaming.streamed_block_of(s.param)) is not None
        }
        if streaming is not None
        else set()
    )
    if blocks:
        streaming.unstream(blocks)
        for s in opt.host_slots():  # every slot of those blocks, also any not moved to the device
            if s.host_weight is not None and streaming.streamed_block_of(s.param) is None:
                # the weight is on the device for good now: its updates go there, not to the host copy
                s.host_weight = None
    return opt.move_to_device(params), blocks
