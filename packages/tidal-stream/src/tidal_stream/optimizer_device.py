"""The device-placed share of ``OffloadAdamW``'s update in ``step()``, all-or-nothing (see [Note: failed
steps] in optimizer.py).

fp32 moments: torch's fused AdamW, one launch per param group and batch of widened gradients. bf16 moments
on CUDA: the Triton kernel of ``adam_triton`` (one pass per element, stochastic rounding in-kernel, one
launch per param group and dtype mix); torch's path (widen, fused, round, per tensor) remains for CPU, for
Adam with L2 decay or ``maximize``, and where Triton is missing — which path runs is logged once.
"""

from __future__ import annotations

import os

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


def _triton_refusal(device: torch.device, h: AdamHyper) -> str | None:
    """Why the Triton kernel cannot update bf16 moments on ``device`` with ``h``, or None when it can."""
    interp = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU route of the kernel's tests
    if device.type != "cuda" and not interp:
        return f"the device is {device.type}, the kernel needs CUDA"
    if not h.decoupled or h.maximize:
        return "the kernel does AdamW with maximize=False only"
    from tidal_stream import adam_triton

    if not adam_triton.triton_available():
        return "Triton is not installed"
    return None


class DeviceUpdateMixin:
    """Device-update methods of ``OffloadAdamW``; relies on its ``_gpu``, ``state``, ``rollback``, ``_gen``,
    ``_order``, ``_seed``, ``moment_dtype``, ``session``, ``allocate_device_state()``, ``_generator()``,
    ``_save_rng()``, ``_drain_failure()`` and ``_rollback()``."""

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

    def _device_path(self, device: torch.device, h: AdamHyper) -> str:
        """``"triton"`` or ``"torch"`` for this update; each choice is logged once per optimizer."""
        why = "fp32 moments use torch's fused AdamW"
        if self.moment_dtype == torch.bfloat16:
            why = _triton_refusal(device, h)
        if why is None and self.__dict__.get("_triton_failed"):
            why = f"the Triton kernel failed: {self._triton_failed}"
        path = "triton" if why is None else "torch"
        logged: set[tuple[str, str | None]] = self.__dict__.setdefault("_device_paths_logged", set())
        if (path, why) not in logged:
            logged.add((path, why))
            if path == "triton":
                msg = "device AdamW: Triton multi-tensor kernel (bf16 moments, stochastic rounding in-kernel)"
            else:
                msg = f"device AdamW: torch fused AdamW per tensor batch ({why})"
            self.session.record("device-update", msg, path=path, device=str(device))
        return path

    def _device_update_triton(
        self,
        group: dict,
        params: list[nn.Parameter],
        coef: torch.Tensor | None,
        journal: DeviceJournal | None,
    ) -> None:
        """One Triton launch per dtype mix of ``params`` (one param group): no widened gradient copies."""
        h = AdamHyper.from_group(group)
        mixes: dict[tuple[torch.dtype, bool, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            narrow = self.state[p]["master"].data_ptr() != p.data_ptr()
            mixes.setdefault((p.grad.dtype, narrow, p.dtype), []).append(p)
        for (_, narrow, _), ps in mixes.items():
            states = [self.state[p] for p in ps]
            if self.__dict__.get("_triton_failed"):
                self._device_update_torch(group, ps, coef, journal)
                continue
            if journal is not None:
                journal.save([st[k] for st in states for k in ("master", "exp_avg", "exp_avg_sq", "step")])
            try:
                self._launch_triton(ps, states, h, narrow, coef)
            except Exception as e:
                # a kernel that does not compile here (another Triton version): nothing was written and the
                # step counts were restored, so torch's path can update this batch; logged and recorded
                if getattr(e, "tidal_wrote", True):
                    raise
                self._triton_failed = f"{type(e).__name__}: {str(e)[:200]}"
                self._device_path(ps[0].device, h)  # records the switch
                self._device_update_torch(group, ps, coef, journal)

    def _launch_triton(
        self,
        ps: list[nn.Parameter],
        states: list[dict],
        h: AdamHyper,
        narrow: bool,
        coef: torch.Tensor | None,
    ) -> None:
        """``adam_triton.adamw_triton_`` over one dtype mix of one param group."""
        from tidal_stream import adam_triton

        adam_triton.adamw_triton_(
            [st["master"] for st in states],
            [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps],
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [st["step"] for st in states],
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            tensor_ids=[self._order[id(p)] for p in ps],
            seed=self._seed,
            weights=[p.data for p in ps] if narrow else None,
            clip_coef=coef,
        )

    def _device_update_now(self, coef: torch.Tensor | None, journal: DeviceJournal | None) -> None:
        with record_function("tidal::device_adamw"):
            by_group: dict[int, tuple[dict, list[nn.Parameter]]] = {}
            for p, group in self._gpu.values():
                if p.grad is not None:
                    by_group.setdefault(id(group), (group, []))[1].append(p)
            for group, all_params in by_group.values():
                if self._device_path(all_params[0].device, AdamHyper.from_group(group)) == "triton":
                    self._device_update_triton(group, all_params, coef, journal)
                else:
                    self._device_update_torch(group, all_params, coef, journal)

    def _device_update_torch(
        self,
        group: dict,
        all_params: list[nn.Parameter],
        coef: torch.Tensor | None,
        journal: DeviceJournal | None,
    ) -> None:
        """torch's fused AdamW over ``all_params`` (one param group), a batch of widened gradients at a time."""
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
                journal.save([st[k] for st in states for k in ("master", "exp_avg", "exp_avg_sq", "step")])
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
