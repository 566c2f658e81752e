"""Checkpoints, tier moves and step rollback of ``OffloadAdamW``: ``torch.optim.AdamW``-compatible state
dicts (plus an fp32 ``master`` per parameter), loading into the existing host/device buffers, moving a
parameter's state from the host to the device after the first step is measured, and undoing a failed step.

[Note: step journal] a step is all-or-nothing. Host updates run on the worker while backward still runs, so
an interrupted backward or a failed update can leave some parameters updated: just before a slot's first
update of a step its step count is kept and the update itself copies its master and moments into undo
buffers reserved once at construction (pinned, beside the state: master + both moments more host memory,
no allocation per step), chunk by chunk just before updating each chunk (cache-blocked, so the copy adds
writes but few reads); each copy is tagged with the step's generation. A failure restores the slots tagged with the failed
generation and copies their weights back to the device. Device-placed state is snapshotted batch by batch
inside ``step()`` (transient device copies, freed when the device update returns). ``rollback=False``
turns the journal off (no undo memory, no copy; a failed step then leaves the parameters it reached updated).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tidal_stream._adamw_common import match_param_groups
from tidal_stream.adam_kernels import UndoCopy

__all__ = ["OffloadStateMixin"]


def _restore_host(s: Any) -> None:
    """Copy a slot's undo buffers back into its state (see [Note: step journal])."""
    s.undo.restore((s.master, s.exp_avg, s.exp_avg_sq))
    s.step.copy_(s.undo_step)
    s.undo_gen = -1


class DeviceJournal:
    """Transient copies of device-placed AdamW state taken batch by batch in ``step()``; restores on failure."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, its copy)

    def save(self, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` (masters, moments, step counts of the next launch) before it mutates them."""
        self._saved += [(t, t.clone()) for t in tensors]

    def restore(self) -> None:
        """Write every saved copy back, newest first."""
        for live, copy in reversed(self._saved):
            live.copy_(copy)
        self._saved = []


class OffloadStateMixin:
    """State-dict and placement methods of :class:`~tidal_stream.optimizer.OffloadAdamW`.

    Relies on the optimizer's ``state``, ``param_groups``, ``_slots`` (host), ``_gpu`` (device),
    ``_handles``, ``_worker``, ``_landed``, ``_to_push``, ``session``, ``synchronize()``, ``_push`` and
    ``_on_grad``; ``host_work()`` reads its counters ``_steps``, ``_host_updates``, ``_host_update_s``,
    ``_waited``, ``_step_marks`` and ``_rounds``.
    """

    _steps: int
    _host_updates: int
    _host_update_s: float
    _waited: Any
    _step_marks: Any
    _rounds: tuple[int, float, float]

    # ------------------------------------------------------------------ step journal
    def _journal(self, s: Any, gen: int) -> UndoCopy | None:
        """Before ``s``'s update of generation ``gen``: keep its step count and return the undo buffers the
        update copies the master and moments into, or None. (Its rounding noise needs no saved generator
        state: it is seeded from the step count, which the undo restores; see ``_update_generator``.)"""
        if s.undo is None or s.undo_gen == gen:
            return None
        s.undo_step.copy_(s.step)
        s.undo.copied = 0
        s.undo_gen = gen  # set before the update: a failure part-way restores the chunks it reached
        return s.undo

    def _save_rng(self, device: torch.device, gen: int) -> None:
        """Keep the device update's stochastic-rounding generator state from before generation ``gen``'s
        first update (so a retried step draws the same numbers); fp32 moments draw none."""
        if not self.rollback or self.moment_dtype == torch.float32:
            return
        saved = self._rng_undo.get(device)
        if saved is None or saved[0] != gen:
            self._rng_undo[device] = (gen, self._generator(device).get_state())

    def _drain_failure(self) -> BaseException | None:
        """Wait for the worker to finish or skip its queue; take its failure (if any), rolling back."""
        self._worker.drain()
        err = self._worker.take_error()
        if err is not None:
            failed = self._failed_gen if self._failed_gen is not None else self._gen
            self._rollback(failed)
        return err

    def _join(self) -> None:
        """Wait for every queued host job; on a failure, undo its step and raise the original exception."""
        err = self._drain_failure()
        if err is not None:
            raise err

    def _surface_failure(self) -> None:
        """Raise a host job's failure (after undoing its step) if one happened; never waits otherwise."""
        if self._worker.error is not None:
            self._join()

    def _rollback(self, gen: int) -> None:
        """Undo generation ``gen``'s host updates and forget the gradients of the failed step.

        Call only with the worker idle (drained). Restored weights are copied back to the device.
        """
        self._failed_gen = None
        for device, (saved_gen, rng) in list(self._rng_undo.items()):
            if saved_gen == gen:
                self._generator(device).set_state(rng)
                del self._rng_undo[device]
        for s in self._slots.values():
            if s.undo_gen == gen:
                if s.h2d_event is not None:
                    s.h2d_event.synchronize()  # why: the last copy back reads staging; don't overwrite it
                _restore_host(s)
                self._push(s, None)
            s.norm = None
            s.ready.set()
            s.landing_free.set()
        self._landed = []
        self._micro = 0
        self._updated_last_step = True  # the next zero_grad() clears the failed step's device gradients

    # ------------------------------------------------------------------ checkpoints

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
            getattr(self, "_unguarded", {}).pop(id(p), None)  # updated on the device now: nothing to wait for
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

    def _round_done(self) -> None:
        """Worker job queued after a step's host jobs: that step's seconds are all counted now."""
        self._rounds = (self._rounds[0] + 1, self._host_update_s, self._worker.busy_s)

    def host_work(self) -> dict[str, Any]:
        """What the host optimizer did since ``wrap()``: ``steps`` (optimizer steps that queued updates),
        ``updates`` (parameter updates the host ran), ``update_s`` (their seconds on the worker thread: the
        AdamW pass with its widening and narrowing, not the waits for copies; updates still queued are not
        in it yet); ``worker_busy_s`` (the seconds of every job the worker has finished: updates, gradient
        landings, copies back, with their waits); ``steps_done`` (steps whose host jobs have all run) and, over those, ``update_s_per_step``
        and ``worker_busy_s_per_step`` (every job the worker ran: updates, gradient landings, copies back,
        with their waits). Where a step's time goes besides: ``land_wait_s`` (the worker waiting for
        gradients' D2H copies), ``update_wait_s`` (the caller's forward waiting for pending updates), and
        ``last_step_idle`` — the worker's waits for work longer than a millisecond between the last two
        ``step()`` calls (clipped to them), as ``(seconds after the earlier, seconds)``."""
        done, done_update_s, done_busy_s = self._rounds
        idle = []
        if len(self._step_marks) >= 2:
            m0, m1 = list(self._step_marks)[-2:]
            for t, d in list(self._worker.idle_gaps):
                a, b = max(t, m0), min(t + d, m1)
                if b > a:
                    idle.append((a - m0, b - a))
        return {
            "steps": self._steps,
            "updates": self._host_updates,
            "update_s": self._host_update_s,
            "worker_busy_s": self._worker.busy_s,
            "steps_done": done,
            "update_s_per_step": done_update_s / done if done else 0.0,
            "worker_busy_s_per_step": done_busy_s / done if done else 0.0,
            "land_wait_s": self._waited["land"],
            "update_wait_s": self._waited["update"],
            "last_step_idle": idle,
        }

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
