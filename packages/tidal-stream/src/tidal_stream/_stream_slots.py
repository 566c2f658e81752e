"""Records of :class:`~tidal_stream.streamed_blocks.StreamedBlocks`: one streamed tensor, one block, one change
of residency; and which blocks make up one streaming window."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tidal_stream.streams import StreamEvent

__all__ = ["ResidencyEvent", "_Block", "_Slot", "_tensors_of", "window_of"]


@dataclass(frozen=True)
class ResidencyEvent:
    """One change of the set of resident blocks, as given to ``observer`` and kept in ``history``."""

    seq: int
    """Running number of the event."""
    kind: Literal["fetch", "release"]
    """A block's device copy was refilled or released."""
    block: int
    """Index of the block in the list given to ``StreamedBlocks``."""
    phase: Literal["forward", "backward", "prefetch", "gather"]
    """What triggered it: a forward hook, a backward hook, a prefetch, or ``gathered()``."""
    resident: tuple[int, ...]
    """Blocks resident after the change."""
    resident_bytes: int
    """Device bytes of the resident blocks after the change."""


@dataclass
class _Slot:
    tensor: torch.Tensor  # the Parameter or buffer tensor whose device storage is resized
    host: torch.Tensor  # host master copy, same shape/strides
    nbytes: int
    trainable: bool
    source: torch.Tensor | None = None  # read instead of ``host`` when set (see ``set_source``)


@dataclass
class _Block:
    index: int
    module: nn.Module
    slots: list[_Slot]
    nbytes: int
    resident: bool = False
    ready: StreamEvent | None = None  # guards the H2D copy of the last refill
    compute: Any = None  # the stream the block's kernels were issued on in forward
    sourced: bool = False  # refilled from ``set_source`` tensors instead of the host copies
    fetches: int = 0  # refills since the last ``reset_stats``


def _tensors_of(output: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside a (nested) tuple/list/dict output."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors_of(o)]
    return []


def window_of(order: Iterable[_Block], depth: int, cap: int | None) -> frozenset[int]:
    """The blocks one streaming window holds when ``order``'s first block runs: it and the next ones while
    they are at most ``depth`` and their bytes (the running block's not counted) stay within ``cap``."""
    chosen: list[int] = []
    ahead = 0  # bytes of the blocks after the running one
    for b in order:
        if len(chosen) > depth or (chosen and cap is not None and ahead + b.nbytes > cap):
            break
        ahead += b.nbytes if chosen else 0
        chosen.append(b.index)
    return frozenset(chosen)
