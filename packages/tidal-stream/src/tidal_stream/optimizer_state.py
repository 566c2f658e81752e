"""Checkpoints and tier moves of ``OffloadAdamW``: ``torch.optim.AdamW``-compatible state dicts (plus an
fp32 ``master`` per parameter), loading into the existing host/device buffers, and moving a parameter's
state from the host to the device after the first step is measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tidal_stream._adamw_common import match_param_groups

__all__ = ["OffloadStateMixin"]


class OffloadStateMixin:
    """State-dict and placement methods of :class:`~tidal_stream.optimizer.OffloadAdamW`.

    Relies on the optimizer's ``state``, ``param_groups``, ``_slots`` (host), ``_gpu`` (device),
    ``_handles``, ``session``, ``synchronize()`` and ``_on_grad``.
    """

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s layout (step, exp_avg, exp_avg_sq per parameter) plus an fp32 ``master``."""
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an ``OffloadAdamW`` or ``torch.optim.AdamW``/``Adam`` state dict into the existing buffers.

        Without a ``master`` entry the masters are taken from the current weights.
        """
        self.synchronize()
        id_map = match_param_groups("OffloadAdamW", state_dict, self.param_groups)
        for key, st in state_dict["state"].items():
            p = id_map[key]
            self._import_state(p, st)

    @torch.no_grad()
    def _import_state(self, p: nn.Parameter, st: dict[str, Any]) -> None:
        """Copy one parameter's AdamW state into this optimizer's buffers (host or device)."""
        mine = self.state.get(p)
        if mine is None:
            return  # frozen parameter
        step = st.get("step", 0)
        mine["step"].copy_(torch.as_tensor(float(step), dtype=torch.float32))
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                mine[k].copy_(st[k].reshape(p.shape))
        if "master" in st:
            mine["master"].copy_(st["master"].reshape(p.shape))
        else:
            mine["master"].copy_(p.detach())
        slot = self._slots.get(id(p))
        if slot is not None and slot.host_weight is not None:
            slot.host_weight.copy_(mine["master"].reshape(-1))  # streamed: the next refill carries it
        elif mine["master"].data_ptr() != p.data_ptr():
            p.data.copy_(mine["master"])

    def host_slots(self) -> list[Any]:
        """The host-placed parameters' slots (``slot.param``, ``slot.index`` in parameter order)."""
        return list(self._slots.values())

    @torch.no_grad()
    def move_to_device(self, params: Iterable[nn.Parameter]) -> int:
        """Move the state of host-placed ``params`` to the device (fused device AdamW from now on).

        Their host buffers stay reserved (reserved once, never per step). Returns the number of
        parameters moved.
        """
        self.synchronize()
        moved = 0
        for p in params:
            s = self._slots.get(id(p))
            if s is None or s.host_weight is not None:
                continue  # streamed weights keep their optimizer on the host
            del self._slots[id(p)]
            st = self.state[p]
            master = p.data if p.dtype == torch.float32 else st["master"].to(p.device)
            if p.dtype == torch.float32:
                master.copy_(st["master"])
            self.state[p] = {
                "step": st["step"].to(p.device),
                "exp_avg": st["exp_avg"].to(p.device),
                "exp_avg_sq": st["exp_avg_sq"].to(p.device),
                "master": master,
            }
            self._gpu[id(p)] = (p, s.group)
            moved += 1
        keep = set(self._slots)
        self._handles, old = [], self._handles
        for h in old:
            h.remove()
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._on_grad)
            for k, s in self._slots.items()
            if k in keep
        ]
        return moved

    def memory_tiers(self) -> dict[str, dict[str, int]]:
        """Optimizer bytes per tier: parameters updated there and the bytes of their state.

        Host bytes count every reserved host buffer (masters, moments, gradients, landing and staging).
        """
        dev_state = 0
        for p, _ in self._gpu.values():
            st = self.state.get(p)
            if not st:
                continue  # device state not allocated yet
            dev_state += st["exp_avg"].nbytes + st["exp_avg_sq"].nbytes
            if st["master"].data_ptr() != p.data_ptr():
                dev_state += st["master"].nbytes
        return {
            "host": {
                "params": sum(s.param.numel() for s in self._slots.values()),
                "bytes": self.session.host.stats()["host_bytes"],
            },
            "device": {"params": sum(p.numel() for p, _ in self._gpu.values()), "bytes": dev_state},
        }
