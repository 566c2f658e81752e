"""Reads of weights whose update is in flight: module guards, unguarded reads, streamed host copies.

Mixed into :class:`~tidal_stream.optimizer.OffloadAdamW`. Every module's forward-pre-hook waits for the
pending updates of the host-placed weights it owns (host-side: the update is queued; device-side: the
compute stream waits on the H2D copy's event). Streamed weights (part 2) are updated in their host copies
and refills wait for them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from tidal_stream.errors import StreamError

__all__ = ["ReadGuardMixin"]


class ReadGuardMixin:
    """Read-side methods of ``OffloadAdamW``; relies on its ``_slots``, ``_gpu``, ``_unguarded``,
    ``_worker`` and ``session``."""

    def install_read_guards(self, model: nn.Module) -> list[Any]:
        """Make every module forward wait for in-flight updates of the host-placed weights it owns.

        [Note: unguarded reads] a weight read outside its own module's forward (e.g. a chunked loss using
        ``lm_head.weight``) is detected in the first backward (its gradient arrives but no guard of it
        ran); from then on every guard, and ``model``'s own forward, wait for its pending update.
        """
        handles = [model.register_forward_pre_hook(lambda module, args: self._wait_unguarded())]
        for mod in model.modules():
            slots = [self._slots[id(p)] for p in mod.parameters(recurse=False) if id(p) in self._slots]
            if slots:
                handles.append(mod.register_forward_pre_hook(self._make_guard(slots)))
        return handles

    def _wait_ready(self, s: Any, compute: Any) -> None:
        """Block until ``s``'s update is queued, then make ``compute`` wait for its copy to the device."""
        if not s.ready.is_set():
            self._wait_update(s)  # the worker has not yet queued this weight's copy back
        ev = s.h2d_event
        if ev is not None:
            ev.wait(compute)  # why: this forward reads the weight the H2D stream is writing

    def _wait_update(self, s: Any) -> None:
        """Block until the worker has finished ``s``'s update, counting the seconds waited."""
        t0 = time.perf_counter()
        with record_function("tidal::wait_update"):
            s.ready.wait()  # why: the caller reads this weight (on the device or in its host copy) next
        self._waited["update"] += time.perf_counter() - t0
        self._surface_failure()

    def _wait_unguarded(self) -> None:
        if self._unguarded:
            compute = self.session.streams.compute()
            for s in list(self._unguarded.values()):
                self._wait_ready(s, compute)

    def attach_streaming(self, ext: Any) -> int:
        """Write new weights of streamed parameters into their host copies instead of the device.

        ``ext`` is the weight-streaming extension (``host_tensor(param)``, ``set_before_fetch(fn)``): a
        streamed parameter's device storage is empty between uses, so its update lands in the host copy
        the next refill reads, and refills wait for pending updates. Returns the number of such slots.
        """
        n = 0
        for s in self._slots.values():
            ht = ext.host_tensor(s.param)
            if ht is not None:
                s.host_weight = ht.reshape(-1)
                n += 1
        streamed_on_device = [p for p, _ in self._gpu.values() if ext.host_tensor(p) is not None]
        if streamed_on_device:
            raise StreamError(
                f"OffloadAdamW: {len(streamed_on_device)} parameters both stream their weights and keep their "
                "optimizer on the device; accepted: streamed parameters update on the host. Fix: pass "
                "offload=True or offload='auto' with a plan that keeps streamed blocks' optimizer on the host."
            )
        if n:
            ext.set_before_fetch(self._before_fetch)
        return n

    def _before_fetch(self, block_index: int, tensors: list[torch.Tensor]) -> None:
        """A refill is about to read host copies: wait for the pending updates that write them."""
        for t in tensors:
            s = self._slots.get(id(t))
            if s is not None and not s.ready.is_set():
                self._wait_update(s)  # the worker is still writing this weight's host copy

    def _make_guard(self, slots: list[Any]) -> Any:
        def guard(module: nn.Module, args: Any) -> None:
            compute = self.session.streams.compute()
            for s in slots:
                if self._slots.get(id(s.param)) is not s:
                    continue  # moved to the device (move_to_device synchronized its last host update)
                s.guarded = True
                self._wait_ready(s, compute)
            self._wait_unguarded()

        return guard
