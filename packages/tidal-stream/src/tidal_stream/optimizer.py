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
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from tidal_stream._adamw_common import (
    adamw_defaults,
    advance_micro,
    check_accumulation_steps,
    check_contiguous,
    moment_dtype_of,
    run_closure,
)
from tidal_stream.adam_kernels import AdamHyper, adam_update, adam_update_many
from tidal_stream.errors import StreamError
from tidal_stream.hostmem import HostRequest
from tidal_stream.optimizer_reads import ReadGuardMixin
from tidal_stream.optimizer_state import OffloadStateMixin
from tidal_stream.streams import StreamEvent, record_event, stream_context

__all__ = ["OffloadAdamW"]

log = logging.getLogger(__name__)

_INFLIGHT_FLOOR = 64 * 2**20  # device gradient bytes allowed in flight to the host (at least 2 tensors)
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


class _Slot:
    """Host-side state of one parameter (see module docstring)."""

    def __init__(self, param: nn.Parameter, group: dict, index: int) -> None:
        self.param = param
        self.group = group
        self.index = index
        self.master: torch.Tensor  # [N] fp32
        self.exp_avg: torch.Tensor  # [N]
        self.exp_avg_sq: torch.Tensor  # [N]
        self.grad: torch.Tensor  # [N] fp32
        self.landing: torch.Tensor | None = None  # [N] param dtype
        self.staging: torch.Tensor  # [N] param dtype (the master itself for fp32 params)
        self.step = torch.zeros((), dtype=torch.float32)
        self.norm: torch.Tensor | None = None
        self.host_weight: torch.Tensor | None = None  # [N] host copy of a streamed weight (part 2)
        self.guarded = False  # a forward of a module owning this weight has run (and waited for it)
        self.consumed: StreamEvent | None = None  # backward is done reading the device weight
        self.h2d_event: StreamEvent | None = None  # the last weight copy to the device
        self.ready = threading.Event()  # set: no update of this weight is pending
        self.ready.set()
        self.landing_free = threading.Event()  # set: the landing buffer may be overwritten
        self.landing_free.set()


class OffloadAdamW(ReadGuardMixin, OffloadStateMixin, torch.optim.Optimizer):
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
        self.last_grad_norm: float | None = None
        self._micro = 0
        self._updated_last_step = True
        self._landed: list[_Slot] = []
        self._to_push: list[_Slot] = []
        self._seed = seed
        self._closed = False
        self._after_first_update: Any = None  # set by wrap(): measure, then place the device share
        # device gradients whose D2H copy is in flight, oldest first: (landed event, gradient, bytes)
        self._inflight: collections.deque[tuple[StreamEvent, torch.Tensor, int]] = collections.deque()
        self._inflight_bytes = 0
        self.max_inflight_grad_bytes = _INFLIGHT_FLOOR
        self._generators: dict[torch.device, torch.Generator] = {}
        # weights read outside their module's forward (a loss reading lm_head.weight directly): every guard
        # and the root module's pre-hook wait for their updates
        self._unguarded: dict[int, _Slot] = {}
        gpu_ids = {id(p) for p in gpu_params}
        self._slots: dict[int, _Slot] = {}
        self._gpu: dict[int, tuple[nn.Parameter, dict]] = {}
        seen: set[int] = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
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
    def _allocate_host(self) -> None:
        """Reserve every host buffer at once and fill masters from the current weights."""
        reqs: list[HostRequest] = []
        for s in self._slots.values():
            p = s.param
            check_contiguous("OffloadAdamW", p, "host offload needs")
            n = p.numel()
            reqs += [
                HostRequest("master", torch.float32, n),
                HostRequest("exp_avg", self.moment_dtype, n),
                HostRequest("exp_avg_sq", self.moment_dtype, n),
                HostRequest("grad", torch.float32, n),
            ]
            if self._needs_landing(p):
                reqs.append(HostRequest("grad_landing", p.dtype, n))
            if p.dtype != torch.float32:
                reqs.append(HostRequest("weight_staging", p.dtype, n))
        bufs = iter(self.session.host.reserve(reqs))
        for s in self._slots.values():
            p = s.param
            s.master, s.exp_avg, s.exp_avg_sq, s.grad = next(bufs), next(bufs), next(bufs), next(bufs)
            s.landing = next(bufs) if self._needs_landing(p) else None
            s.staging = next(bufs) if p.dtype != torch.float32 else s.master
            s.master.copy_(p.detach().reshape(-1))  # device -> host once at setup
            s.exp_avg.zero_()
            s.exp_avg_sq.zero_()
            self.state[p] = {
                "step": s.step,
                "exp_avg": s.exp_avg.view(p.shape),
                "exp_avg_sq": s.exp_avg_sq.view(p.shape),
                "master": s.master.view(p.shape),
            }

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per update (each ``step()`` call is one). May be changed between steps."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, n: int) -> None:
        check_accumulation_steps("OffloadAdamW", n)
        self._accumulation_steps = n
        if n > 1 and getattr(self, "_slots", None):
            missing = [s for s in self._slots.values() if s.landing is None]
            if missing:
                # accumulating needs a landing buffer beside the fp32 sum: reserve them once, now
                bufs = self.session.host.reserve(
                    [HostRequest("grad_landing", s.param.dtype, s.param.numel()) for s in missing]
                )
                for s, buf in zip(missing, bufs):
                    s.landing = buf

    def _needs_landing(self, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 or self.accumulation_steps > 1 or self.delayed_update

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

    def _release_waiters(self) -> None:
        for s in self._slots.values():
            s.ready.set()
            s.landing_free.set()

    # ------------------------------------------------------------------ backward path
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ship the gradient to host and free it on the device."""
        s = self._slots[id(p)]
        g = p.grad
        if g is None:
            return
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
            if self.max_grad_norm is None and not self.delayed_update:
                s.ready.clear()  # the update follows the landing at once, on the worker
        # hyper-parameters are read now, on the caller's thread: a scheduler may change lr before the job runs
        hyper = AdamHyper.from_group(s.group)
        self._worker.submit(self._land, s, landed, direct, self._micro, last, hyper)

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

    def _land(
        self,
        s: _Slot,
        landed: StreamEvent,
        direct: bool,
        micro: int,
        last: bool,
        hyper: AdamHyper,
    ) -> None:
        with record_function("tidal::grad_land"):
            landed.synchronize()  # why: the D2H copy of this gradient must have finished
            if not direct:
                assert s.landing is not None
                if micro == 0:
                    s.grad.copy_(s.landing)  # widen to fp32
                else:
                    s.grad.add_(s.landing)  # accumulate in fp32
                s.landing_free.set()
            if not last:
                return
            if self.max_grad_norm is not None:
                s.norm = torch.linalg.vector_norm(s.grad)
            elif not self.delayed_update:
                self._update(s, None, hyper)

    def _update(self, s: _Slot, coef: torch.Tensor | None, hyper: AdamHyper) -> None:
        with record_function("tidal::host_adamw"):
            if s.h2d_event is not None:
                s.h2d_event.synchronize()  # why: the previous copy back reads staging; don't overwrite it
            if coef is not None:
                s.grad.mul_(coef)
            adam_update(
                s.master,
                s.grad,
                s.exp_avg,
                s.exp_avg_sq,
                s.step,
                hyper,
                self._generator(torch.device("cpu")),
            )
            if self.delayed_update:
                self._to_push.append(s)  # copied back in the next step()
            else:
                self._push(s, s.consumed)

    def _push(self, s: _Slot, after: StreamEvent | None) -> None:
        """Copy the slot's new weight to the device on the H2D stream and publish its event."""
        with record_function("tidal::weight_h2d"):
            if s.host_weight is not None:
                # a streamed weight: the next refill carries the host copy to the device
                if after is not None:
                    after.synchronize()  # why: a refill issued before `after` may still read the host copy
                s.host_weight.copy_(s.master)
                s.ready.set()
                return
            if s.staging is not s.master:
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
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One micro-step: on the last of ``accumulation_steps``, queue every update and return."""
        loss = run_closure(closure)
        if self._closed:
            raise StreamError(
                "OffloadAdamW.step(): this optimizer was closed by unwrap() (its host buffers are released). "
                "Fix: wrap the model again, or save optimizer.state_dict() before unwrap() and load it."
            )
        self._worker.check()
        self._reap()
        if not advance_micro(self):
            return loss
        with record_function("tidal::step"):
            coef = self._clip_coef() if self.max_grad_norm is not None else None
            if self.delayed_update:
                self._worker.join()  # why: step t-1's updates (run during this fwd/bwd) must be done
                self._push_pending()
            if self.max_grad_norm is not None or self.delayed_update:
                # without either, each update was already queued as its gradient landed
                for s in self._landed:
                    if not self.delayed_update:
                        s.ready.clear()
                    self._worker.submit(self._update, s, coef, AdamHyper.from_group(s.group))
            self._landed = []
            self._device_update(coef)
        if self._after_first_update is not None:
            callback, self._after_first_update = self._after_first_update, None
            callback()
        return loss

    def _push_pending(self) -> None:
        done = record_event(self.session.streams.compute())  # why: this step's backward reads the weights
        for s in self._to_push:
            self._push(s, done)
        self._to_push = []

    def _clip_coef(self) -> torch.Tensor:
        """Global-norm clip coefficient, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        self._worker.join()  # why: the norm needs every landed gradient of this step
        norms = [s.norm for s in self._landed if s.norm is not None]
        dev_grads = [p.grad for p, _ in self._gpu.values() if p.grad is not None]
        if dev_grads:
            per_tensor = torch._foreach_norm(dev_grads)  # one launch; one device -> host copy below
            norms += list(torch.stack([n.float() for n in per_tensor]).cpu().unbind())
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        self.last_grad_norm = float(total)
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    def _device_update(self, coef: torch.Tensor | None) -> None:
        """Fused AdamW on the device for the parameters the plan kept there, one launch per param group."""
        if not self._gpu:
            return
        self.allocate_device_state()
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

    def synchronize(self) -> None:
        """Block until every queued update has run and its weight is back on the device."""
        self._worker.join()
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
                self._worker.join()  # their landing jobs must finish before the slots are reset
                for s in self._landed:
                    s.norm = None
                self._landed = []

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
