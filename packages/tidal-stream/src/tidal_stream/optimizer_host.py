"""Host buffers of ``OffloadAdamW``: what each host-updated parameter reserves, pinned or pageable.

[Note: host buffers] per parameter updated on the host: an fp32 master and the two moments, plus
- fp32 weights: an fp32 gradient the device copy lands in; the master is the outgoing weight;
- 16-bit weights ("lean", the default): one landing buffer in the weight's dtype. The gradient lands
  there; the update widens it block by block into a per-thread scratch and narrows the new weight back
  into the same buffer, which the copy to the device reads (10 B per parameter with bf16 moments, 14 B
  with fp32). Accumulation (from the first time ``accumulation_steps`` exceeds 1) adds the fp32 sum;
  ``delayed_update`` keeps a separate fp32 gradient and staging buffer, since the next gradients land
  while the weights still go back.
Only what a device copy reads or writes is page-locked; the moments, the undo copies of ``rollback`` and
a master or gradient only the CPU touches stay pageable. tidal-plan's ``host_slot_bytes`` counts exactly
these bytes (a test checks it).
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_stream._adamw_common import check_contiguous
from tidal_stream.adam_kernels import UndoCopy
from tidal_stream.hostmem import HostRequest

__all__ = ["HostBuffersMixin"]


class HostBuffersMixin:
    """Reserving and laying out the host buffers of ``OffloadAdamW`` (see [Note: host buffers])."""

    _slots: dict[int, Any]
    session: Any
    moment_dtype: torch.dtype
    rollback: bool
    delayed_update: bool
    state: Any
    accumulation_steps: int

    def _allocate_host(self) -> None:
        """Reserve every host buffer at once and fill masters from the current weights."""
        reqs: list[HostRequest] = []
        for s in self._slots.values():
            p = s.param
            check_contiguous("OffloadAdamW", p, "host offload needs")
            n = p.numel()
            fp32, landing, lean = p.dtype == torch.float32, self._needs_landing(p), self._lean(p)
            # pinned: what a device copy reads or writes (the landing gradient, the outgoing weight, which
            # for fp32 weights is the master itself, and the fp32 gradient when it is the copy's target);
            # the moments, undo copies and a master or gradient only the CPU touches stay pageable
            reqs += [
                HostRequest("master", torch.float32, n, pinned=fp32),
                HostRequest("exp_avg", self.moment_dtype, n, pinned=False),
                HostRequest("exp_avg_sq", self.moment_dtype, n, pinned=False),
            ]
            if not lean:
                reqs.append(HostRequest("grad", torch.float32, n, pinned=not landing))
            if landing:
                reqs.append(HostRequest("grad_landing", p.dtype, n))
            if not fp32 and not lean:
                reqs.append(HostRequest("weight_staging", p.dtype, n))
            if self.rollback:
                reqs += [
                    HostRequest("undo_master", torch.float32, n, pinned=False),
                    HostRequest("undo_exp_avg", self.moment_dtype, n, pinned=False),
                    HostRequest("undo_exp_avg_sq", self.moment_dtype, n, pinned=False),
                ]
        bufs = iter(self.session.host.reserve(reqs))
        for s in self._slots.values():
            p = s.param
            lean = self._lean(p)
            s.master, s.exp_avg, s.exp_avg_sq = next(bufs), next(bufs), next(bufs)
            s.grad = None if lean else next(bufs)
            s.landing = next(bufs) if self._needs_landing(p) else None
            if lean:
                # block by block, the update reads the gradient before it writes the weight
                s.staging = s.landing
            else:
                s.staging = next(bufs) if p.dtype != torch.float32 else s.master
            if self.rollback:
                s.undo = UndoCopy(next(bufs), next(bufs), next(bufs))
            s.master.copy_(p.detach().reshape(-1))  # device -> host once at setup
            s.exp_avg.zero_()
            s.exp_avg_sq.zero_()
            self.state[p] = {
                "step": s.step,
                "exp_avg": s.exp_avg.view(p.shape),
                "exp_avg_sq": s.exp_avg_sq.view(p.shape),
                "master": s.master.view(p.shape),
            }

    def _reserve_accumulation_buffers(self) -> None:
        """Accumulating over micro-steps needs a landing buffer beside an fp32 sum for every slot."""
        missing = [s for s in self._slots.values() if s.landing is None]
        if missing:
            bufs = self.session.host.reserve(
                [HostRequest("grad_landing", s.param.dtype, s.param.numel()) for s in missing]
            )
            for s, buf in zip(missing, bufs):
                s.landing = buf
        sumless = [s for s in self._slots.values() if s.grad is None]
        if sumless:
            self._join()  # why: a queued lean update finds its gradient by s.grad being None
            # lean slots had no fp32 sum to accumulate in (only the CPU touches it: pageable)
            bufs = self.session.host.reserve(
                [HostRequest("grad", torch.float32, s.param.numel(), pinned=False) for s in sumless]
            )
            for s, buf in zip(sumless, bufs):
                s.grad = buf

    def _needs_landing(self, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 or self.accumulation_steps > 1 or self.delayed_update

    def _lean(self, p: torch.Tensor) -> bool:
        """Keep no fp32 gradient and no separate staging buffer for ``p`` (6 B/param less for 16-bit weights).

        The update widens the gradient from its landing buffer block by block and narrows the new weight
        back into the same buffer, which the copy to the device then reads. That needs one gradient per
        update (no accumulation: the fp32 sum is reserved if ``accumulation_steps`` grows later) and the
        buffer free until the next backward (not with ``delayed_update``, whose next gradients land while
        the weights still go back).
        """
        return p.dtype != torch.float32 and self.accumulation_steps == 1 and not self.delayed_update
