"""The device-placed share of ``OffloadAdamW``'s update: torch's fused AdamW in ``step()``, one launch per
param group and batch of widened gradients, all-or-nothing (see [Note: failed steps] in optimizer.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

from tidal_stream.adam_kernels import AdamHyper, adam_update_many
from tidal_stream.optimizer_state import DeviceJournal

__all__ = ["DeviceUpdateMixin"]

# fp32 gradient copies made at once by the device update (at least one tensor); tidal_plan's cost model
# counts max(this, the largest tensor's fp32 copy) as the update's workspace
_WIDEN_BATCH_BYTES = 256 * 2**20


def _widen_batches(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` cut into runs whose fp32 gradient copies stay within ``_WIDEN_BATCH_BYTES``."""
    out: list[list[nn.Parameter]] = [[]]
    used = 0
    for p in params:
        cost = 0 if p.dtype == torch.float32 else 4 * p.numel()
        if out[-1] and used + cost > _WIDEN_BATCH_BYTES:
            out.append([])
            used = 0
        out[-1].append(p)
        used += cost
    return out


class DeviceUpdateMixin:
    """Device-update methods of ``OffloadAdamW``; relies on its ``_gpu``, ``state``, ``rollback``, ``_gen``,
    ``allocate_device_state()``, ``_generator()``, ``_save_rng()``, ``_drain_failure()`` and ``_rollback()``."""

    def _device_update(self, coef: torch.Tensor | None) -> None:
        """Fused AdamW on the device for the parameters the plan kept there, one launch per param group."""
        if not self._gpu:
            return
        self.allocate_device_state()
        journal = DeviceJournal() if self.rollback else None
        try:
            self._device_update_now(coef, journal)
        except BaseException:
            if journal is not None:
                journal.restore()
                for p, _ in self._gpu.values():
                    st = self.state[p]
                    if st["master"].data_ptr() != p.data_ptr():
                        p.data.copy_(st["master"])  # re-narrow the restored fp32 master
                err = self._drain_failure()  # this step's host updates: undone as well
                if err is None:
                    self._rollback(self._gen)
            raise

    def _device_update_now(self, coef: torch.Tensor | None, journal: DeviceJournal | None) -> None:
        with record_function("tidal::device_adamw"):
            by_group: dict[int, tuple[dict, list[nn.Parameter]]] = {}
            for p, group in self._gpu.values():
                if p.grad is not None:
                    by_group.setdefault(id(group), (group, []))[1].append(p)
            for group, all_params in by_group.values():
                # fp32 copies of 16-bit gradients are made a batch at a time: widening the whole device
                # share at once would need 4 bytes per parameter more VRAM than the plan counts
                for params in _widen_batches(all_params):
                    states = [self.state[p] for p in params]
                    grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in params]
                    if coef is not None:
                        torch._foreach_mul_(grads, coef.to(grads[0].device))
                    masters = [st["master"] for st in states]
                    if journal is not None:
                        self._save_rng(params[0].device, self._gen)
                        journal.save(
                            [st[k] for st in states for k in ("master", "exp_avg", "exp_avg_sq", "step")]
                        )
                    adam_update_many(
                        masters,
                        grads,
                        [st["exp_avg"] for st in states],
                        [st["exp_avg_sq"] for st in states],
                        [st["step"] for st in states],
                        AdamHyper.from_group(group),
                        self._generator(params[0].device),
                    )
                    narrow = [(p, m) for p, m in zip(params, masters) if m.data_ptr() != p.data_ptr()]
                    if narrow:
                        # fp32 masters -> the 16-bit weights the model computes with
                        torch._foreach_copy_([p.data for p, _ in narrow], [m for _, m in narrow])
                    del grads
