"""Setting up :class:`~tidal_stream.streamed_blocks.StreamedBlocks`: each block's parameters and buffers
get a host copy (or adopt a shared one) and an empty device storage the refills fill."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tidal_stream._empty_guard import guard
from tidal_stream._host_buffers import HostBuffers
from tidal_stream._stream_slots import _Block, _Slot
from tidal_stream.errors import SlotBudgetError, StreamingError

__all__ = ["BlockAdoption"]

_ARENA_ALIGN = 512  # bytes: tidal_arena's default block alignment, which every carved buffer is rounded to


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN


class BlockAdoption:
    """Moves the tensors of a block stack to host copies; see ``StreamedBlocks``' arguments of the same names."""

    def __init__(
        self,
        device: torch.device,
        host: HostBuffers,
        slot_bytes: int | None,
        stream_trainable: bool,
        adopt_host: Callable[[torch.Tensor], bool] | None,
    ) -> None:
        self.device = device
        self.host = host
        self.slot_bytes = slot_bytes
        self.stream_trainable = stream_trainable
        self.adopt_host = adopt_host
        self.adopted_bytes = 0  # host bytes used in place (adopt_host), not copied

    def adopt(self, modules: list[nn.Module]) -> list[_Block]:
        """Validate every block, then move its tensors to host copies and empty their device storage."""
        # pass 1: validate everything before touching any tensor, so an error leaves the model intact
        seen: dict[int, int] = {}
        plan: list[list[tuple[nn.Module, str, torch.Tensor, bool]]] = []
        for i, mod in enumerate(modules):
            found: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
            for sub in mod.modules():
                for store, is_param in ((sub._parameters, True), (sub._buffers, False)):
                    for name, t in store.items():
                        if t is None or (is_param and t.requires_grad and not self.stream_trainable):
                            continue
                        if id(t) in seen:
                            if seen[id(t)] != i:
                                raise StreamingError(
                                    f"StreamedBlocks: tensor {name!r} is shared by blocks {seen[id(t)]} and {i}; "
                                    "accepted: blocks that own their weights. Fix: keep tied weights out of "
                                    "the streamed blocks (leave those blocks resident)."
                                )
                            continue
                        if t.numel() > 0 and t.untyped_storage().nbytes() == 0:
                            raise StreamingError(
                                f"StreamedBlocks: block {i} tensor {name!r} has no storage (already streamed "
                                "or released); accepted: materialized weights. Fix: call .remove() on the "
                                "StreamedBlocks that owns these blocks first."
                            )
                        seen[id(t)] = i
                        found.append((sub, name, t, is_param))
            nbytes = sum(t.numel() * t.element_size() for _, _, t, _ in found)
            if self.slot_bytes is not None and nbytes > self.slot_bytes:
                raise SlotBudgetError(
                    f"StreamedBlocks: block {i} ({type(mod).__name__}) holds {nbytes} bytes of weights, more "
                    f"than slot_bytes={self.slot_bytes}; accepted: every block <= slot_bytes. Fix: raise "
                    f"slot_bytes to at least {nbytes}, or split the block."
                )
            plan.append(found)
        # pass 2, block by block: page-lock exactly the block's bytes, copy its tensors in and empty their
        # storage. A model built in host memory then frees its pageable originals as their pinned copies
        # fill, so the host never holds the streamed weights twice (lora110b: 103 GiB pinned out of a
        # 207 GiB model on a 256 GiB host).
        out: list[_Block] = []
        for i, (mod, found) in enumerate(zip(modules, plan)):
            own = [t for _, _, t, _ in found if not self._adopts(t)]
            self.host.reserve_own_arena(sum(_aligned(t.numel() * t.element_size()) for t in own))
            slots = [self._adopt_tensor(sub, name, t, is_param, i) for sub, name, t, is_param in found]
            out.append(_Block(i, mod, slots, sum(s.nbytes for s in slots)))
        return out

    def _adopts(self, t: torch.Tensor) -> bool:
        """``t`` is a frozen host tensor that ``adopt_host`` lets serve as its own host copy."""
        if self.adopt_host is None or t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
            return False
        return bool(self.adopt_host(t))

    def _adopt_tensor(self, owner: nn.Module, name: str, t: torch.Tensor, is_param: bool, i: int) -> _Slot:
        src = t.detach()
        if self._adopts(t):
            host = src  # the shared host copy itself: read in place, never written (frozen)
            self.adopted_bytes += src.numel() * src.element_size()
        else:
            host = self.host.empty_like(src.contiguous(), tag=f"stream.block{i}.{name}")
            host.copy_(src)
        dev = torch.empty(src.shape, dtype=src.dtype, device=self.device)  # [same shape], contiguous
        if is_param:
            t.data = dev  # the Parameter object stays; only its data moves
            tensor = t
        else:
            owner._buffers[name] = dev
            tensor = dev
        nbytes = dev.untyped_storage().nbytes()
        dev.untyped_storage().resize_(0)
        guard(tensor, f"block {i} {type(owner).__name__}.{name}")  # a clear error on reads between uses
        return _Slot(tensor, host, nbytes, bool(is_param and t.requires_grad))
