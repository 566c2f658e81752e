"""``OffloadAdamW``: AdamW whose state and gradients live in host memory, updated while backward runs.

Per host-placed parameter (a "slot"): an fp32 master, both moments, an fp32 gradient and, when needed,
a landing buffer in the parameter's dtype and a staging buffer for the weight going back. Data flow:

1. a post-accumulate-grad hook copies the gradient to host on the D2H stream and drops the device
   gradient (the job holds it until the copy's event completes, then releases it);
2. the host worker waits for that event, accumulates into the fp32 gradient and — on the last
   micro-step, when no clipping is asked — runs torch's fused AdamW on the slot at once, overlapping the
   rest of backward;
3. the new weight is copied back on the H2D stream; its event guards the next read (module
   forward-pre-hooks wait for it).

[Note: clipping] the global norm needs every gradient, so with ``max_grad_norm`` the per-tensor norms are
computed as gradients land, and the updates start only in ``step()`` — the host update is then no longer
overlapped with backward (it overlaps the next forward instead): expect the exposed optimizer time to grow
by roughly the host update time.

[Note: delayed update] with ``delayed_update=True`` the updates of step t run during forward/backward of
step t+1 and their weights are copied to the device in ``step()`` of t+1: the model trains on weights one
step stale (as ZeRO-Offload's delayed parameter update).

Parameters the plan keeps on the device ("gpu" slots) hold fp32 master + moments there and are updated in
``step()`` by the fused device kernel — the two ends (all-host, all-device) are the same code.

[Note: failed steps] a step is all-or-nothing (see [Note: step journal] in optimizer_state.py): an
exception in backward, in a host update or in the device update restores every parameter, moment and step
count touched by the failed step, and the original exception is raised (a host job's failure surfaces on
the training thread at the next gradient hook, forward guard, ``step()``, ``zero_grad()`` or
``synchronize()``). Every wait on the worker is released on failure, so a failed step never hangs. After an
interrupted backward, call ``zero_grad()`` (it undoes the updates that backward started) before retrying.
Limit: with parameters on both tiers, a host failure that surfaces after ``step()`` returned (its device
update already done) undoes the host part only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from tidal_stream._adamw_common import (
    adamw_defaults,
    advance_micro,
    check_accumulation_steps,
    moment_dtype_of,
    run_closure,
)
from tidal_stream.adam_kernels import AdamHyper, UndoCopy, adam_update
from tidal_stream.errors import StreamError
from tidal_stream.oom import annotates_oom, note_step_done
from tidal_stream.optimizer_device import DeviceUpdateMixin
from tidal_stream.optimizer_host import HostBuffersMixin
from tidal_stream.optimizer_reads import ReadGuardMixin
from tidal_stream.optimizer_state import OffloadStateMixin
from tidal_stream.streams import StreamEvent, record_event, stream_context

__all__ = ["OffloadAdamW"]

log = logging.getLogger(__name__)

_INFLIGHT_FLOOR = 64 * 2**20  # device gradient bytes allowed in flight to the host (at least 2 tensors)


class _Slot:
    """Host-side state of one parameter (see module docstring)."""

    def __init__(self, param: nn.Parameter, group: dict, index: int) -> None:
        self.param = param
        self.group = group
        self.index = index
        self.master: torch.Tensor  # [N] fp32
        self.exp_avg: torch.Tensor  # [N]
        self.exp_avg_sq: torch.Tensor  # [N]
        self.grad: torch.Tensor | None = None  # [N] fp32; None: lean (see OffloadAdamW._lean)
        self.landing: torch.Tensor | None = None  # [N] param dtype
        self.staging: torch.Tensor  # [N] param dtype (the master itself for fp32 params)
        self.step = torch.zeros((), dtype=torch.float32)
        self.norm: torch.Tensor | None = None
        self.host_weight: torch.Tensor | None = None  # [N] host copy of a streamed weight (part 2)
        # undo copy of master and moments, the step count before the update, their generation (-1: none)
        self.undo: UndoCopy | None = None
        self.undo_step = torch.zeros((), dtype=torch.float32)
        self.undo_gen = -1
        self.guarded = False  # a forward of a module owning this weight has run (and waited for it)
        self.consumed: StreamEvent | None = None  # backward is done reading the device weight
        self.h2d_event: StreamEvent | None = None  # the last weight copy to the device
        self.ready = threading.Event()  # set: no update of this weight is pending
        self.ready.set()
        self.landing_free = threading.Event()  # set: the landing buffer may be overwritten
        self.landing_free.set()


class OffloadAdamW(
    ReadGuardMixin, OffloadStateMixin, DeviceUpdateMixin, HostBuffersMixin, torch.optim.Optimizer
):
    """AdamW with fp32 masters, moments and gradients in host memory, updated during backward.

    Usually created by ``wrap()``. The loop is unchanged: ``loss.backward(); opt.step(); opt.zero_grad()``.
    ``step()`` returns once the updates are queued; :meth:`synchronize` waits for them. Module forwards
    wait for the weights they read when :meth:`install_read_guards` was called (``wrap()`` does).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: moment decays.
        eps: denominator epsilon.
        weight_decay: decoupled weight decay (L2 when ``decoupled_weight_decay=False``, as ``Adam``).
        decoupled_weight_decay: AdamW (True) or Adam (False) semantics.
        session: the owning ``Session`` (streams, host memory, decision log); None makes one for the
            device of the first parameter (then call :meth:`install_read_guards` on the model).
        gpu_params: parameters whose state stays on the device (updated by the fused device kernel).
        accumulation_steps: micro-steps per update; each ``step()`` call is one micro-step.
        max_grad_norm: global-norm clipping, or None.
        moment_dtype: ``"fp32"`` or ``"bf16"`` (stochastic rounding).
        delayed_update: one-step-stale updates overlapping the next forward/backward.
        seed: seed of the stochastic-rounding generators.
        defer_device_state: create the device-placed state later (:meth:`allocate_device_state`), once
            the weights are on the device.
        rollback: undo a failed step exactly (see [Note: failed steps]); costs one more master and pair
            of moments of pinned host memory per host-placed parameter, and a transient copy of the device
            state during ``step()``. False: no undo memory; a failed step leaves the parameters it reached
            updated.
    """

    #: Streamed weights are updated through their host copies (see :meth:`attach_streaming`); the
    #: weight-streaming installer checks this before streaming trained weights.
    host_weight_updates = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        session: Any = None,
        gpu_params: Iterable[nn.Parameter] = (),
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        moment_dtype: str = "fp32",
        delayed_update: bool = False,
        seed: int = 0,
        defer_device_state: bool = False,
        rollback: bool = False,
    ) -> None:
        defaults = adamw_defaults(lr, betas, eps, weight_decay, decoupled_weight_decay, torch_switches=True)
        super().__init__(params, defaults)
        moment = moment_dtype_of("OffloadAdamW", moment_dtype)
        if session is None:
            from tidal_stream.options import WrapOptions
            from tidal_stream.session import Session

            first = next((p for g in self.param_groups for p in g["params"]), None)
            device = first.device if first is not None else torch.device("cpu")
            session = Session(None, WrapOptions(device=device), device)
            session.optimizer = self
        self._owns_session = session.optimizer is self
        self.session = session
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.moment_dtype = moment
        self.delayed_update = delayed_update
        self.rollback = rollback
        self._gen = 0  # update generation: bumped at each update boundary (tags the undo copies)
        self._failed_gen: int | None = None  # generation of the host job that failed
        # per device: (generation, stochastic-rounding generator state before its first update)
        self._rng_undo: dict[torch.device, tuple[int, torch.Tensor]] = {}
        self.last_grad_norm: float | None = None
        self._micro = 0
        self._updated_last_step = True
        self._landed: list[_Slot] = []
        self._to_push: list[_Slot] = []
        self._seed = seed
        self._closed = False
        self._host_updates = 0  # parameter updates the host ran (worker thread)
        self._host_update_s = 0.0  # seconds of them: the AdamW pass with its widening and narrowing
        # seconds waited: "land" (worker, for gradients' D2H copies), "update" (caller, for pending updates)
        self._waited: collections.Counter[str] = collections.Counter()
        self._step_marks: collections.deque[float] = collections.deque(maxlen=64)  # perf_counter per step()
        self._rounds = (0, 0.0, 0.0)  # steps whose host jobs all ran: (count, update_s, worker busy_s then)
        self._steps = 0  # steps that queued updates (the last micro-step of each)
        self._after_first_update: Any = None  # set by wrap(): measure, then place the device share
        # device gradients whose D2H copy is in flight, oldest first: (landed event, gradient, bytes)
        self._inflight: collections.deque[tuple[StreamEvent, torch.Tensor, int]] = collections.deque()
        self._inflight_bytes = 0
        self.max_inflight_grad_bytes = _INFLIGHT_FLOOR
        self._generators: dict[torch.device, torch.Generator] = {}
        self._host_rng = torch.Generator()  # the host updates' stochastic rounding, seeded per update
        # weights read outside their module's forward (a loss reading lm_head.weight directly): every guard
        # and the root module's pre-hook wait for their updates
        self._unguarded: dict[int, _Slot] = {}
        gpu_ids = {id(p) for p in gpu_params}
        self._order: dict[int, int] = {}  # parameter -> position in param_groups (fixed reduction order)
        self._slots: dict[int, _Slot] = {}
        self._gpu: dict[int, tuple[nn.Parameter, dict]] = {}
        seen: set[int] = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                self._order[id(p)] = len(seen) - 1
                if id(p) in gpu_ids:
                    self._gpu[id(p)] = (p, group)
                else:
                    self._slots[id(p)] = _Slot(p, group, len(seen) - 1)
        self._allocate_host()
        self._device_ready = False
        if not defer_device_state:
            self.allocate_device_state()
        largest = max((s.param.numel() * s.param.element_size() for s in self._slots.values()), default=0)
        self.max_inflight_grad_bytes = max(_INFLIGHT_FLOOR, 2 * largest)
        from tidal_stream.worker import HostWorker

        self._worker = HostWorker(session.device, self._release_waiters)
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self._slots.values()
        ]

    # ------------------------------------------------------------------ setup
    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per update (each ``step()`` call is one). May be changed between steps."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, n: int) -> None:
        check_accumulation_steps("OffloadAdamW", n)
        self._accumulation_steps = n
        if n > 1 and getattr(self, "_slots", None):
            self._reserve_accumulation_buffers()

    def allocate_device_state(self) -> None:
        """fp32 master (the parameter itself when fp32) and moments on the device for "gpu" slots.

        ``wrap()`` calls it once the weights are on the device; direct users get it at construction.
        """
        if self._device_ready:
            return
        self._device_ready = True
        for p, _ in self._gpu.values():
            master = p.data if p.dtype == torch.float32 else p.detach().float()
            self.state[p] = {
                # the fused device kernel wants its step counter on the device
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, dtype=self.moment_dtype),
                "exp_avg_sq": torch.zeros_like(p, dtype=self.moment_dtype),
                "master": master,
            }

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed)
            self._generators[device] = g
        return g

    def _update_generator(self, s: _Slot) -> torch.Generator:
        """The stochastic-rounding generator of ``s``'s host update, seeded from the optimizer's seed, the
        parameter and its step count alone: the bits do not depend on the order in which the worker runs
        the updates (see [Note: update order]), and a retried or resumed step draws the same numbers."""
        step = int(s.step.item())  # the count before this update (a rollback restores it)
        mixed = self._seed * 0x9E3779B97F4A7C15 + s.index * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB
        self._host_rng.manual_seed(mixed & (2**63 - 1))
        return self._host_rng

    def _release_waiters(self) -> None:
        for s in self._slots.values():
            s.ready.set()
            s.landing_free.set()

    # ------------------------------------------------------------------ backward path
    @annotates_oom("a gradient hook (backward)")
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship the gradient to host and free it on the device."""
        s = self._slots[id(p)]
        g = p.grad
        if g is None:
            return
        self._surface_failure()  # a failed host job: undo its step and raise it here, in backward
        last = self._micro == self.accumulation_steps - 1
        direct = self._micro == 0 and s.landing is None
        target = s.grad if direct else s.landing
        assert target is not None
        with record_function("tidal::grad_d2h"):
            if not direct:
                s.landing_free.wait()  # the previous micro-step's gradient must be consumed first
                s.landing_free.clear()
            src = g if g.is_contiguous() else g.contiguous()
            streams = self.session.streams
            produced = record_event(streams.compute())  # why: backward wrote this gradient on compute
            produced.wait(streams.d2h)  # why: the D2H copy must start after the gradient exists
            with stream_context(streams.d2h):
                target.view(src.shape).copy_(src, non_blocking=True)
            landed = record_event(streams.d2h)  # why: host reads the gradient only after it landed
        nbytes = src.numel() * src.element_size()
        self.session.d2h_bytes += nbytes
        p.grad = None
        self._hold_until_landed(landed, src, nbytes)
        if not s.guarded and s.host_weight is None and id(p) not in self._unguarded:
            self._unguarded[id(p)] = s  # read outside its module's forward (see install_read_guards)
        if last:
            s.consumed = landed  # backward no longer reads this weight: the copy back may overwrite it
            if s not in self._landed:  # listed once per step, whatever happened to an earlier backward
                self._landed.append(s)
        # hyper-parameters are read now, on the caller's thread: a scheduler may change lr before the job runs
        hyper = AdamHyper.from_group(s.group)
        now = last and self.max_grad_norm is None and not self.delayed_update
        self._submit(
            s,
            now,
            self._in_step,
            self._gen,
            self._land_now,
            s,
            landed,
            direct,
            self._micro,
            last,
            hyper,
            self._gen,
            order=s.index if now else None,  # step() runs the ones still pending in parameter order
        )

    def _submit(self, s: _Slot, updates: bool, fn: Any, *args: Any, order: int | None = None) -> None:
        """Queue a worker job; ``updates``: it updates ``s``, whose readers wait until it is done.
        ``order``: the job may run in that order among the step's other such jobs (``HostWorker.reorder``).

        A job queued after a failure is skipped and the worker releases every waiter then, so a reader
        never waits for an update that will not run; the failure surfaces at the next check.
        """
        self._surface_failure()
        if updates:
            s.ready.clear()
        self._worker.put(fn, *args, order=order)

    def _hold_until_landed(self, landed: StreamEvent, src: torch.Tensor, nbytes: int) -> None:
        """Keep the device gradient alive until its D2H copy is done, then let the allocator reuse it.

        Held references (not ``record_stream``): completed copies are dropped at each new gradient, and
        past ``max_inflight_grad_bytes`` backward waits for the oldest copy — so device memory holds a
        bounded window of gradients whatever the host's pace.
        """
        q = self._inflight
        q.append((landed, src, nbytes))
        self._inflight_bytes += nbytes
        self._reap()

    def _reap(self) -> None:
        """Drop the held gradients whose copy finished; wait for the oldest while over the byte bound."""
        q = self._inflight
        while q and (q[0][0].query() or self._inflight_bytes > self.max_inflight_grad_bytes):
            ev, _, n = q.popleft()
            ev.synchronize()  # why: the copy still reads this gradient; it may be freed only after
            self._inflight_bytes -= n

    def _in_step(self, gen: int, job: Any, *args: Any) -> None:
        """Run a host job of step ``gen``; a failure marks that step as the one the rollback undoes."""
        try:
            job(*args)
        except BaseException:
            self._failed_gen = gen
            raise

    def _land_now(
        self,
        s: _Slot,
        landed: StreamEvent,
        direct: bool,
        micro: int,
        last: bool,
        hyper: AdamHyper,
        gen: int,
    ) -> None:
        with record_function("tidal::grad_land"):
            t0 = time.perf_counter()
            landed.synchronize()  # why: the D2H copy of this gradient must have finished
            self._waited["land"] += time.perf_counter() - t0
            now = last and self.max_grad_norm is None and not self.delayed_update
            if not direct and not now and s.grad is not None:
                assert s.landing is not None
                if micro == 0:
                    s.grad.copy_(s.landing)  # widen to fp32
                else:
                    s.grad.add_(s.landing)  # accumulate in fp32
                s.landing_free.set()
            if not last:
                return
            if self.max_grad_norm is not None:
                # lean: the gradient waits in its landing buffer for the update; widened as the update will
                s.norm = torch.linalg.vector_norm(s.grad if s.grad is not None else s.landing.float())
            elif now:
                # the update widens (or accumulates) the landed gradient block by block itself
                self._update_now(s, None, hyper, gen, land=None if direct else micro > 0)

    def _update_now(
        self, s: _Slot, coef: torch.Tensor | None, hyper: AdamHyper, gen: int, land: bool | None = None
    ) -> None:
        """Update ``s`` (``land``: its gradient is still in the landing buffer; True: add it to ``s.grad``)."""
        if land is None and s.grad is None:
            land = False  # lean: the gradient is read from the landing buffer (see _lean)
        with record_function("tidal::host_adamw"):
            if s.h2d_event is not None:
                s.h2d_event.synchronize()  # why: the previous copy back reads staging; don't overwrite it
            undo = self._journal(s, gen)  # the update copies the old state there, chunk by chunk
            # narrowed during the update when the weight goes back right after it: into the staging
            # buffer, or straight into a streamed weight's host copy once backward's last read of the
            # device weight is done (the refills that read the host copy wait for this update)
            if s.host_weight is not None:
                narrow = not self.delayed_update and (s.consumed is None or s.consumed.query())
            else:
                narrow = not self.delayed_update and s.staging is not s.master
            target = s.host_weight if s.host_weight is not None else s.staging
            t0 = time.perf_counter()
            adam_update(
                s.master,
                s.grad,
                s.exp_avg,
                s.exp_avg_sq,
                s.step,
                hyper,
                self._update_generator(s),
                undo=undo,
                landing=None if land is None else s.landing,
                accumulate=bool(land),
                grad_scale=coef,
                narrow_to=target if narrow else None,
            )
            self._host_update_s += time.perf_counter() - t0
            self._host_updates += 1
            if land is not None:
                s.landing_free.set()
            if self.delayed_update:
                self._to_push.append(s)  # copied back in the next step()
            else:
                self._push(s, s.consumed, narrowed=narrow)

    def _push(self, s: _Slot, after: StreamEvent | None, narrowed: bool = False) -> None:
        """Copy the slot's new weight to the device on the H2D stream and publish its event."""
        with record_function("tidal::weight_h2d"):
            if s.host_weight is not None:
                # a streamed weight: the next refill carries the host copy to the device
                if not narrowed:
                    if after is not None:
                        after.synchronize()  # why: a refill issued before `after` may still read the host copy
                    s.host_weight.copy_(s.master)
                s.ready.set()
                return
            if s.staging is not s.master and not narrowed:
                s.staging.copy_(s.master)  # narrow fp32 -> the parameter's dtype on the host
            streams = self.session.streams
            if after is not None:
                after.wait(streams.h2d)  # why: backward must be done reading the old device weight
            with stream_context(streams.h2d):
                s.param.data.view(-1).copy_(s.staging, non_blocking=True)
            s.h2d_event = record_event(streams.h2d)  # why: reads of this weight wait for the copy
            self.session.h2d_bytes += s.staging.numel() * s.staging.element_size()
            s.ready.set()

    # ------------------------------------------------------------------ step
    @annotates_oom("optimizer.step()")
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One micro-step: on the last of ``accumulation_steps``, queue every update and return."""
        loss = run_closure(closure)
        if self._closed:
            raise StreamError(
                "OffloadAdamW.step(): this optimizer was closed by unwrap() (its host buffers are released). "
                "Fix: wrap the model again, or save optimizer.state_dict() before unwrap() and load it."
            )
        self._surface_failure()
        self._reap()
        if not advance_micro(self):
            return loss
        self._steps += 1
        self._step_marks.append(time.perf_counter())
        with record_function("tidal::step"):
            coef = self._clip_coef() if self.max_grad_norm is not None else None
            if self.delayed_update:
                self._join()  # why: step t-1's updates (run during this fwd/bwd) must be done
                self._push_pending()
            if self.max_grad_norm is not None or self.delayed_update:
                # without either, each update was already queued as its gradient landed; in parameter
                # order, so the next forward's first blocks wait for the first updates only
                for s in sorted(self._landed, key=lambda s: s.index):
                    hyper = AdamHyper.from_group(s.group)
                    self._submit(
                        s,
                        not self.delayed_update,
                        self._in_step,
                        self._gen,
                        self._update_now,
                        s,
                        coef,
                        hyper,
                        self._gen,
                    )
            else:
                # [Note: update order] each update was queued as its gradient landed, in backward's
                # order (last block first), but the next forward reads the first blocks first: the
                # updates still pending run in parameter order instead, so the next forward can start
                # after the first blocks' updates rather than after all of them (full8b on one GPU:
                # most are still pending here; its step stayed bound by the host updates themselves)
                self._worker.reorder()
            self._landed = []
            self._worker.put(self._round_done)  # after this step's host jobs: its per-step seconds are known
            self._device_update(coef)
            self._gen += 1  # this step's updates are all queued: later undo copies belong to the next
        if self._after_first_update is not None:
            callback, self._after_first_update = self._after_first_update, None
            callback()
        note_step_done(self.session)  # the out-of-memory note reports this step's peak
        return loss

    def _push_pending(self) -> None:
        done = record_event(self.session.streams.compute())  # why: this step's backward reads the weights
        for s in self._to_push:
            self._push(s, done)
        self._to_push = []

    def _clip_coef(self) -> torch.Tensor:
        """Global-norm clip coefficient, as ``torch.nn.utils.clip_grad_norm_`` computes it.

        Deterministic: the per-tensor norms are combined in parameter order once all have landed, not in
        the (thread-dependent) order the gradients arrived.
        """
        self._join()  # why: the norm needs every landed gradient of this step
        norms = [(s.index, s.norm) for s in self._landed if s.norm is not None]
        dev = [(self._order[k], p.grad) for k, (p, _) in self._gpu.items() if p.grad is not None]
        if dev:
            per_tensor = torch._foreach_norm([g for _, g in dev])  # one launch; one device -> host copy below
            host = torch.stack([n.float() for n in per_tensor]).cpu().unbind()
            norms += [(i, n) for (i, _), n in zip(dev, host)]
        norms.sort(key=lambda e: e[0])
        total = torch.linalg.vector_norm(torch.stack([n for _, n in norms])) if norms else torch.zeros(())
        self.last_grad_norm = float(total)
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    @annotates_oom("optimizer.synchronize()", queued=True)
    def synchronize(self) -> None:
        """Block until every queued update has run and its weight is back on the device.

        Raises a failed host update's original exception, after undoing its step.
        """
        self._join()
        while self._inflight:
            self._inflight.popleft()  # the worker synchronized on every landed event already
        self._inflight_bytes = 0
        if self.delayed_update and self._to_push:
            self._push_pending()
        for s in self._slots.values():
            if s.h2d_event is not None:
                s.h2d_event.synchronize()  # why: callers read the weights right after this returns

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear device gradients after an update; a no-op between micro-steps (they accumulate).

        At an update boundary it also forgets gradients that landed from a backward that never reached
        ``step()`` (an interrupted backward), so a retried step neither updates nor counts them twice.
        """
        if self._updated_last_step:
            super().zero_grad(set_to_none=set_to_none)
            if self._landed:
                # why: their landing (and, without clipping, update) jobs must finish before the undo
                self._join()
                self._rollback(self._gen)  # an interrupted backward: undo the updates it started

    def close(self) -> None:
        """Finish pending work, remove the gradient hooks and stop the worker (``unwrap()`` calls it)."""
        if self._closed:
            return
        self.synchronize()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._worker.close()
        self._closed = True
        if self._owns_session:
            self.session.close()  # made by this optimizer: release its host buffers too
