"""Records of :class:`~tidal_stream.streamed_blocks.StreamedBlocks`: one streamed tensor, one block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal_stream.streams import StreamEvent

__all__ = ["_Block", "_Slot", "_tensors_of"]


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


def _tensors_of(output: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside a (nested) tuple/list/dict output."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors_of(o)]
    return []
