"""``ShardedHostAdamW``: data parallel AdamW whose state is split across ranks and updated on the host.

Flat layout: the trainable parameters, in optimizer order, laid end to end form ``N`` elements; with ``W``
ranks each owns ``S = ceil(N / W)`` of them (rank ``r``: ``[r*S, min((r+1)*S, N))``; the last shard is
padded). A rank keeps only its shard's fp32 master, moments and gradient in host memory.

One optimizer step:

1. backward: each parameter's post-accumulate-grad hook marks it ready; when every parameter of a bucket
   (consecutive parameters in reverse order, ``bucket_bytes`` of fp32 gradient) is ready, the bucket is
   packed (fp32) and an asynchronous all-reduce (sum) starts, so reduction overlaps the rest of backward.
   Buckets start in one fixed order on every rank (collectives must match); a bucket is drained — the
   part of it inside this rank's shard is copied to the host gradient on the D2H stream — once its
   all-reduce has completed (polled as later buckets start), when more than ``max_inflight_buckets`` are
   in flight, or in ``step()``. A worker thread waits for the copy, divides by ``W`` (the average) and,
   without clipping (and with fp32 moments), runs that part's fused host AdamW update at once,
   overlapping backward.
2. ``step()``: the remaining buckets start (missing gradients count as zeros), every bucket is drained,
   a small all-reduce (max) tells which parameters got a gradient on any rank (the others are skipped,
   as torch's AdamW skips ``grad is None``); with clipping the shard's gradient is scaled by the global
   norm (an all-reduce of the shard norms²); the shard's remaining updates run.
3. the updated masters are all-gathered in chunks of ``bucket_bytes`` and written into every rank's
   parameters: when ``step()`` returns, the weights are identical on every rank.

Checkpoints use ``torch.optim.AdamW``'s layout plus an fp32 ``master`` per parameter (as ``OffloadAdamW``):
``state_dict()`` is collective and gathers the full state; ``load_state_dict()`` takes a full state dict on
every rank and keeps each rank's shard, so a checkpoint loads on any number of ranks (or without DP).
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from tidal_stream._adamw_common import (
    adamw_defaults,
    advance_micro,
    check_accumulation_steps,
    check_contiguous,
    match_param_groups,
    moment_dtype_of,
    run_closure,
)
from tidal_stream.adam_kernels import AdamHyper, adam_update
from tidal_stream.errors import StreamError
from tidal_stream.hostmem import HostRequest
from tidal_stream.streams import record_event, stream_context
from tidal_stream.worker import HostWorker

__all__ = ["ShardedHostAdamW"]

log = logging.getLogger(__name__)


@dataclass
class _Bucket:
    """Consecutive parameters whose gradients are all-reduced together."""

    params: list[int]
    """Parameter indices, ascending (the buffer is laid out in flat order)."""
    lo: int
    """First flat element."""
    hi: int
    """One past the last flat element."""
    ready: int = 0
    """Parameters of this bucket whose gradient is ready in this step."""
    buffer: torch.Tensor | None = None
    """[hi - lo] fp32 on the collective device while its all-reduce is in flight."""
    work: Any = None
    """The all-reduce's work handle."""


@dataclass
class _Segment:
    """The part of one parameter inside this rank's shard."""

    index: int
    """Parameter index."""
    shard: slice
    """Range in the shard's host tensors."""
    local: slice
    """Range in the flattened parameter."""
    group: dict = field(repr=False)
    """The parameter's param group (hyper-parameters)."""


class ShardedHostAdamW(torch.optim.Optimizer):
    """Data parallel AdamW: gradients averaged across ranks, each rank updates its shard on the host.

    Created by ``wrap()`` under data parallel (see :mod:`tidal_stream.distributed`). The loop is unchanged:
    ``loss.backward(); opt.step(); opt.zero_grad()``; ``step()`` returns with the new weights in place on
    every rank. ``step()``, ``state_dict()``, ``load_state_dict()`` and ``close()`` are collective.
    As with ``DistributedDataParallel``, every rank runs the same steps, and each backward of the last
    micro-step is followed by ``step()`` (its all-reduces started in backward; updates may have begun).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: moment decays.
        eps: denominator epsilon.
        weight_decay: decoupled weight decay (L2 when ``decoupled_weight_decay=False``).
        decoupled_weight_decay: AdamW (True) or Adam (False) semantics.
        session: the owning ``Session`` (host memory, decision log).
        ctx: the :class:`~tidal_stream.distributed.DPContext` of this rank.
        accumulation_steps: micro-steps per update; gradients accumulate on the device, reduced once.
        max_grad_norm: global-norm clipping, or None.
        moment_dtype: ``"fp32"`` or ``"bf16"`` (stochastic rounding).
        seed: seed of the stochastic-rounding generator (offset by the rank).
        bucket_bytes: fp32 gradient bytes per all-reduce bucket and per all-gather chunk.
        max_inflight_buckets: all-reduces in flight before the oldest is drained.
    """

    #: Streamed trained weights are not updated through host copies here (weights.install checks it).
    host_weight_updates = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        session: Any,
        ctx: Any,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        moment_dtype: str = "fp32",
        seed: int = 0,
        bucket_bytes: int = 25 * 2**20,
        max_inflight_buckets: int = 4,
    ) -> None:
        defaults = adamw_defaults(lr, betas, eps, weight_decay, decoupled_weight_decay, torch_switches=False)
        super().__init__(params, defaults)
        moment = moment_dtype_of("ShardedHostAdamW", moment_dtype)
        check_accumulation_steps("ShardedHostAdamW", accumulation_steps)
        self.session, self.ctx = session, ctx
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.moment_dtype = moment
        self.bucket_numel = max(1, bucket_bytes // 4)
        self.max_inflight_buckets = max_inflight_buckets
        self.last_grad_norm: float | None = None
        self.last_update_s = 0.0  # host AdamW seconds of the last update on this rank (its shard only)
        self._micro = 0
        self._updated_last_step = True
        self._closed = False
        self._after_first_update: Any = None  # set by wrap_distributed(): measure, then keep activations
        self._gen = torch.Generator().manual_seed(seed + ctx.rank)
        self._params: list[nn.Parameter] = []
        self._groups: list[dict] = []
        self._index: dict[int, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in self._index:
                    check_contiguous("ShardedHostAdamW", p, "the flat shard layout needs")
                    self._index[id(p)] = len(self._params)
                    self._params.append(p)
                    self._groups.append(g)
        self._offsets = [0]
        for p in self._params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self.numel = self._offsets[-1]
        w = ctx.world
        self.shard_size = max(1, -(-self.numel // w))  # S = ceil(N / W)
        self.lo = min(ctx.rank * self.shard_size, self.numel)
        self.hi = min(self.lo + self.shard_size, self.numel)
        self.shard_numel = self.hi - self.lo
        self._segments = self._make_segments()
        self._steps = [torch.zeros((), dtype=torch.float32) for _ in self._params]
        self._buckets = self._make_buckets()
        self._bucket_of = {i: b for b in self._buckets for i in b.params}
        self._has_grad = [False] * len(self._params)
        self._next = 0  # next bucket to start, in the fixed order
        self._inflight: collections.deque[_Bucket] = collections.deque()
        self._allocate_host()
        seg_of = {seg.index: seg for seg in self._segments}
        self._bucket_segments = {id(b): [seg_of[i] for i in b.params if i in seg_of] for b in self._buckets}
        # updates start as buckets land (during backward) unless clipping needs the global norm first;
        # bf16 moments wait for step() so the stochastic-rounding stream keeps one order
        self._early_ok = max_grad_norm is None and self.moment_dtype == torch.float32
        self._early: set[int] = set()
        self.last_early_updates = 0  # segments of the last update that ran during backward
        self._update_s = 0.0
        self._worker = HostWorker(session.device, lambda: None)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        session.record(
            "distributed",
            f"optimizer sharded: {self.numel / 1e6:.2f} M parameters in {len(self._buckets)} all-reduce "
            f"buckets; rank {ctx.rank} owns flat [{self.lo}, {self.hi}) and updates it on the host",
            numel=self.numel,
            shard_lo=self.lo,
            shard_hi=self.hi,
            buckets=len(self._buckets),
        )

    # ------------------------------------------------------------------ layout
    def _make_segments(self) -> list[_Segment]:
        out = []
        for i, _p in enumerate(self._params):
            a, b = max(self._offsets[i], self.lo), min(self._offsets[i + 1], self.hi)
            if a < b:
                off = self._offsets[i]
                out.append(
                    _Segment(i, slice(a - self.lo, b - self.lo), slice(a - off, b - off), self._groups[i])
                )
        return out

    def _make_buckets(self) -> list[_Bucket]:
        """Consecutive parameters from the last (first to get gradients in backward) to the first."""
        buckets, cur = [], []
        for i in reversed(range(len(self._params))):
            cur.append(i)
            if self._offsets[max(cur) + 1] - self._offsets[min(cur)] >= self.bucket_numel:
                buckets.append(cur)
                cur = []
        if cur:
            buckets.append(cur)
        return [_Bucket(sorted(c), self._offsets[min(c)], self._offsets[max(c) + 1]) for c in buckets]

    def _allocate_host(self) -> None:
        s = self.shard_size
        reqs = [
            HostRequest("dp_master", torch.float32, s),
            HostRequest("dp_exp_avg", self.moment_dtype, s),
            HostRequest("dp_exp_avg_sq", self.moment_dtype, s),
            HostRequest("dp_grad", torch.float32, s),
        ]
        self._master, self._exp_avg, self._exp_avg_sq, self._grad = self.session.host.reserve(reqs)
        for t in (self._master, self._exp_avg, self._exp_avg_sq, self._grad):
            t.zero_()  # the padded tail stays zero
        with torch.no_grad():
            for seg in self._segments:
                self._master[seg.shard].copy_(self._params[seg.index].detach().reshape(-1)[seg.local])

    # ------------------------------------------------------------------ backward: bucketed all-reduce
    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: on the last micro-step, start the buckets that are complete."""
        if self._micro != self.accumulation_steps - 1:
            return  # gradients accumulate in .grad until the last micro-step
        i = self._index[id(p)]
        if self._has_grad[i]:
            return
        self._has_grad[i] = True
        self._bucket_of[i].ready += 1
        self._start_ready(force=False)

    def _start_ready(self, force: bool) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if not force and b.ready < len(b.params):
                return  # buckets start in one fixed order on every rank: wait for this one
            self._start(b)
            self._next += 1

    def _start(self, b: _Bucket) -> None:
        with record_function("tidal::dp_allreduce"):
            buf = torch.empty(b.hi - b.lo, dtype=torch.float32, device=self.ctx.comm_device)  # [n] fp32
            for i in b.params:
                p = self._params[i]
                part = buf[self._offsets[i] - b.lo : self._offsets[i + 1] - b.lo]
                self._has_grad[i] = self._has_grad[i] or p.grad is not None  # accumulated earlier too
                if p.grad is None:
                    part.zero_()  # no gradient on this rank: contributes zero to the average
                else:
                    part.copy_(p.grad.reshape(-1))
                    p.grad = None  # the packed copy is all that is needed; free the device gradient
            try:
                b.work = dist.all_reduce(buf, group=self.ctx.group, async_op=True)
            except RuntimeError as e:
                raise self.ctx._fail("gradient all-reduce", e) from e
            b.buffer = buf
            self._inflight.append(b)
            while self._inflight and (
                len(self._inflight) > self.max_inflight_buckets or self._inflight[0].work.is_completed()
            ):
                self._drain(self._inflight.popleft())

    def _drain(self, b: _Bucket) -> None:
        """Wait for a bucket's all-reduce; copy the part inside this rank's shard to the host (D2H stream)
        and hand it to the worker (average, and the early updates); the buffer is freed once copied."""
        with record_function("tidal::dp_drain"):
            self.ctx.wait("gradient all-reduce", b.work)
            buf, b.buffer, b.work = b.buffer, None, None
            assert buf is not None
            a, z = max(b.lo, self.lo), min(b.hi, self.hi)
            if a >= z:
                return
            g = self._grad[a - self.lo : z - self.lo]  # [z - a] this rank's part of the bucket
            streams = self.session.streams
            reduced = record_event(streams.compute())  # why: work.wait() ordered the all-reduce before here
            reduced.wait(streams.d2h)  # why: the copy must read the reduced bucket
            with stream_context(streams.d2h):
                g.copy_(buf[a - b.lo : z - b.lo], non_blocking=True)
            landed = record_event(streams.d2h)  # why: host reads of g wait for this copy
            early = []
            if self._early_ok:
                # a gradient present here is present in the average: update now, overlapping backward
                early = [s for s in self._bucket_segments.get(id(b), ()) if self._has_grad[s.index]]
                self._early.update(s.index for s in early)
            hypers = [AdamHyper.from_group(s.group) for s in early]
            self._worker.submit(self._land, g, buf, landed, list(zip(early, hypers)))

    def _land(
        self, g: torch.Tensor, buf: torch.Tensor, landed: Any, early: list[tuple[_Segment, AdamHyper]]
    ) -> None:
        """Worker job: once the copy landed, average the gradient and run the bucket's early updates."""
        landed.synchronize()  # why: the D2H copy into g (reading buf) must have finished
        del buf  # the device buffer may be reused now
        g.div_(self.ctx.world)  # the sum of every rank's gradient -> the average
        for seg, hyper in early:
            self._update_segment(seg, hyper)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One micro-step: on the last of ``accumulation_steps``, reduce, update the shard, gather."""
        loss = run_closure(closure)
        if self._closed:
            raise StreamError(
                "ShardedHostAdamW.step(): this optimizer was closed by unwrap(). Fix: wrap the model again."
            )
        if not advance_micro(self):
            return loss
        with record_function("tidal::dp_step"):
            self._start_ready(force=True)
            while self._inflight:
                self._drain(self._inflight.popleft())
            used = self._used()
            self._worker.join()  # why: every landed gradient averaged, the early updates done
            coef = self._clip_coef() if self.max_grad_norm is not None else None
            self._update(used, coef)
            self._gather()
            for b in self._buckets:
                b.ready = 0
            self._has_grad = [False] * len(self._params)
            self._next = 0
            self.last_early_updates, self._early = len(self._early), set()
            self.last_update_s, self._update_s = self._update_s, 0.0
        if self._after_first_update is not None:
            callback, self._after_first_update = self._after_first_update, None
            callback()
        return loss

    def _used(self) -> list[bool]:
        flags = torch.tensor(self._has_grad, dtype=torch.float32, device=self.ctx.comm_device)  # [P]
        self.ctx.run("gradient presence all-reduce", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        return [bool(f) for f in flags.cpu().tolist()]

    def _clip_coef(self) -> torch.Tensor:
        """Global-norm clip coefficient, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
        sq = self.ctx.to_comm(torch.linalg.vector_norm(self._grad).square().reshape(1))  # [1]
        self.ctx.run("gradient norm all-reduce", dist.all_reduce, sq)
        total = sq.cpu().sqrt()[0]
        self.last_grad_norm = float(total)
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    def _update_segment(self, seg: _Segment, hyper: AdamHyper) -> None:
        """Fused host AdamW on one parameter's part of the shard (on the worker thread or in ``step()``)."""
        t0 = time.perf_counter()
        with record_function("tidal::host_adamw"):
            s = seg.shard
            adam_update(
                self._master[s],
                self._grad[s],
                self._exp_avg[s],
                self._exp_avg_sq[s],
                self._steps[seg.index],
                hyper,
                self._gen,
            )
        self._update_s += time.perf_counter() - t0

    def _update(self, used: list[bool], coef: torch.Tensor | None) -> None:
        """The shard's updates not done during backward; step counts of parameters other ranks update."""
        if coef is not None:
            assert not self._early  # clipping needs the global norm first: no update starts early
            self._grad.mul_(coef)
        mine = set()
        for seg in self._segments:
            mine.add(seg.index)
            if used[seg.index] and seg.index not in self._early:
                self._update_segment(seg, AdamHyper.from_group(seg.group))
        for i, u in enumerate(used):
            if u and i not in mine:
                # updated by another rank: the step count stays the same on every rank
                self._steps[i].add_(1)

    def _gather(self) -> None:
        """All-gather the shards' masters in chunks and write them into every rank's parameters."""
        with record_function("tidal::dp_allgather"):
            for c, chunk in self._gather_chunks(self._master, "weight all-gather"):
                self._write_params(c, chunk)

    def _gather_chunks(self, shard: torch.Tensor, what: str) -> Iterable[tuple[int, torch.Tensor]]:
        """Yield ``(c, out)``: ``out[r*n:(r+1)*n]`` is rank ``r``'s ``shard[c:c+n]`` (fp32)."""
        s, w = self.shard_size, self.ctx.world
        cn = min(self.bucket_numel, s)
        out = torch.empty(w * cn, dtype=torch.float32, device=self.ctx.comm_device)  # [W * C]
        for c in range(0, s, cn):
            n = min(cn, s - c)
            src = self.ctx.to_comm(shard[c : c + n].float())  # [n]
            self.ctx.all_gather_into(out[: w * n], src, what)
            yield c, out[: w * n]

    def _write_params(self, c: int, gathered: torch.Tensor) -> None:
        n = gathered.numel() // self.ctx.world
        for r in range(self.ctx.world):
            lo = r * self.shard_size + c
            hi = min(lo + n, self.numel)
            if lo >= hi:
                continue
            vals = gathered[r * n : r * n + (hi - lo)]  # [hi - lo]
            i = bisect.bisect_right(self._offsets, lo) - 1
            while i < len(self._params) and self._offsets[i] < hi:
                a, z = max(lo, self._offsets[i]), min(hi, self._offsets[i + 1])
                dst = self._params[i].data.view(-1)[a - self._offsets[i] : z - self._offsets[i]]
                dst.copy_(vals[a - lo : z - lo])
                i += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients after an update; a no-op between micro-steps (they accumulate)."""
        if self._updated_last_step:
            super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def _full(self, shard: torch.Tensor, keep: bool) -> torch.Tensor | None:
        """The whole flat tensor (padded to ``W * S``) gathered from every rank's shard (collective)."""
        s, w = self.shard_size, self.ctx.world
        full = torch.empty(w * s, dtype=shard.dtype) if keep else None
        for c, out in self._gather_chunks(shard, "state_dict gather"):
            if full is not None:
                n = out.numel() // w
                for r in range(w):
                    full[r * s + c : r * s + c + n].copy_(out[r * n : (r + 1) * n])
        return full

    def state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """The full state in ``torch.optim.AdamW``'s layout plus an fp32 ``master`` (collective).

        Args:
            rank0_only: only rank 0 builds the full dict (bounded host memory); the others return a dict
                with ``"state": {}``.
        """
        self._check_open()
        keep = not rank0_only or self.ctx.rank == 0
        fulls = {
            k: self._full(t, keep)
            for k, t in (
                ("master", self._master),
                ("exp_avg", self._exp_avg),
                ("exp_avg_sq", self._exp_avg_sq),
            )
        }
        saved = self.state
        state: collections.defaultdict = collections.defaultdict(dict)
        if keep:
            for i, p in enumerate(self._params):
                o, e = self._offsets[i], self._offsets[i + 1]
                state[p] = {"step": self._steps[i].clone()}
                for k, full in fulls.items():
                    assert full is not None
                    dtype = torch.float32 if k == "master" else self.moment_dtype
                    state[p][k] = full[o:e].to(dtype).view(p.shape).clone()
        self.state = state
        try:
            return super().state_dict()
        finally:
            self.state = saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full ``ShardedHostAdamW`` / ``OffloadAdamW`` / ``torch.optim.AdamW`` state dict.

        Every rank must pass the same full dict (any world size saved it); each keeps its shard. Without
        ``master`` entries the masters are taken from the current weights.
        """
        self._check_open()
        id_map = match_param_groups("ShardedHostAdamW", state_dict, self.param_groups)
        for key, st in state_dict["state"].items():
            self.import_param_state(id_map[key], st)
        self.ctx.barrier("load_state_dict")

    @torch.no_grad()
    def import_param_state(self, p: nn.Parameter, st: dict[str, Any]) -> None:
        """Take one parameter's full AdamW state (this rank keeps its shard; the weight is set from
        ``master`` when given)."""
        i = self._index.get(id(p))
        if i is None:
            return  # frozen parameter
        self._steps[i].fill_(float(st.get("step", 0)))
        master = st["master"].reshape(-1) if "master" in st else p.detach().reshape(-1)  # [numel]
        if "master" in st:
            p.data.copy_(master.view(p.shape))
        for seg in (s for s in self._segments if s.index == i):
            for k, dst in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                if k in st:
                    dst[seg.shard].copy_(st[k].reshape(-1)[seg.local])
            self._master[seg.shard].copy_(master[seg.local])

    # ------------------------------------------------------------------ misc
    def shard_report(self) -> dict[str, Any]:
        """Shard facts for ``memory_report()["distributed"]``."""
        return {
            "numel": self.numel,
            "shard_lo": self.lo,
            "shard_hi": self.hi,
            "shard_numel": self.shard_numel,
            "buckets": len(self._buckets),
            "host_adamw_last_s": self.last_update_s,
            "early_updates": self.last_early_updates,
            "optimizer_host_bytes": sum(
                t.nbytes for t in (self._master, self._exp_avg, self._exp_avg_sq, self._grad)
            ),
        }

    def memory_tiers(self) -> dict[str, dict[str, int]]:
        """Optimizer bytes per tier (this rank's shard lives on the host)."""
        return {
            "host": {"params": self.shard_numel, "bytes": self.session.host.stats()["host_bytes"]},
            "device": {"params": 0, "bytes": 0},
        }

    def synchronize(self) -> None:
        """Nothing is pending between steps (``step()`` returns with the weights in place)."""

    def _check_open(self) -> None:
        if self._closed:
            raise StreamError("ShardedHostAdamW: closed by unwrap(). Fix: save state before unwrap().")

    def close(self, barrier: bool = True) -> None:
        """Remove the hooks and stop the worker; with ``barrier`` all ranks meet, so ``unwrap()`` (which
        calls it) is collective."""
        if self._closed:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self._inflight.clear()
        self._worker.close()
        self._closed = True
        if barrier:
            self.ctx.barrier("unwrap()")
