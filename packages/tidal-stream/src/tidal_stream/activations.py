"""Per-block activation policies: keep, offload to host memory, or recompute in backward.

:func:`install_activation_policy` ``(blocks, policies, *, device, arena=None, ...)`` installs forward
pre/post hooks on each block (never a patched ``forward``) and returns an :class:`ActivationHandle`
(``.remove()``, ``.stats()``, ``.set_policy(i, policy)`` for adaptation between steps).

- ``"keep"`` — nothing changes: saved tensors stay on the device.
- ``"offload"`` — while the block's forward runs, ``torch.autograd.graph.saved_tensors_hooks`` send each
  saved tensor of at least ``min_offload_bytes`` to host memory on the D2H stream; the device tensor is
  dropped once its copy has landed. Host memory comes from an ``hostmem.ActivationHostPool``: each
  block carves its tensors from its own slabs, which the next step reuses byte for byte, so nothing is
  page-locked after warm-up. Slabs come from the arena when given; else, on CUDA, from an arena page-locked
  once at exact size when the first block's bytes are known (torch's pinned memory, which rounds to
  powers of two, for that first block and when CuPy is absent). A tensor saved
  several times in one block (the normed input of the q, k and v projections) travels once. When the
  block's output gradient arrives (its backward is next) the block's tensors and those of the
  ``prefetch_ahead`` blocks before it are copied back on the H2D stream, one copy per block slab into
  one device buffer, so unpacking rarely waits. Copies preserve shape, strides and bytes, so backward
  is bit-identical. Not offloaded: parameters, buffers and views of them (they stream with the
  weights, see ``streamed_blocks``), tensors smaller than the threshold, and tensors that are not
  dense and non-overlapping (counted in ``stats()``). Under saved-tensor hooks torch no longer checks
  saved tensors' versions: a block that modifies a saved tensor in place (an error under plain
  autograd) must not be offloaded.
- ``"recompute"`` — non-reentrant activation checkpointing of the block
  (``torch.utils.checkpoint``'s non-reentrant generator driven from the hooks, as torch's composable
  ``checkpoint(module)`` does) with the CPU and CUDA RNG states preserved, so dropout masks match.
  Results match the un-checkpointed model exactly when the recomputed kernels are deterministic (all of
  them on the CPU; on CUDA, atomics-based kernels such as some SDPA backward paths may differ in the
  last bits, as they do between two plain runs).

A recomputed forward runs the block again: state it updates must not be updated twice — run training
without a KV cache (``use_cache=False``, as Hugging Face's own checkpointing does).

Install activation policies *after* weight streaming on the same blocks, so that the weights are
resident when a block's saved tensors are classified (hooks run in registration order).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from tidal_stream._host_buffers import HostBuffers
from tidal_stream.hostmem import ActivationHostPool, HostSlab
from tidal_stream.streamed_blocks import StreamingError, _tensors_of
from tidal_stream.streams import NullStream, StreamEvent, device_streams, record_event, stream_context

__all__ = ["ActivationHandle", "ActivationPolicy", "install_activation_policy"]

logger = logging.getLogger(__name__)

ActivationPolicy = Literal["keep", "offload", "recompute"]
_POLICIES = ("keep", "offload", "recompute")


def _dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` elements without overlap (any stride order)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _checkpoint_generator(
    module: nn.Module, context_fn: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch's non-reentrant checkpoint generator, its leading parameters bound by name: their list
    differs between torch releases (``early_stop`` came later) and the tensors must stay in ``*args``
    so that their devices' RNG states are saved."""
    gen_fn = ckpt._checkpoint_without_reentrant_generator
    values = {
        "fn": module,
        "function": module,
        "preserve_rng_state": True,  # dropout in the recompute draws the same masks
        "context_fn": context_fn,
        "determinism_check": "default",  # recomputed tensors' shapes and dtypes are checked
        "debug": False,
        "early_stop": True,
    }
    lead = []
    for p in inspect.signature(gen_fn).parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        if p.name not in values and p.default is inspect.Parameter.empty:
            raise StreamingError(
                f"recompute: torch {torch.__version__}'s checkpoint generator needs an unknown argument "
                f"{p.name!r}; accepted: the torch releases tidal supports. Fix: use activation offload instead."
            )
        lead.append(values.get(p.name, p.default))
    return gen_fn(*lead, *args, **kwargs)


def _main_input_nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of a block's main input (hidden states): its first tensor argument, else ``hidden_states``."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
    return first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0


def _bytes_as(buf: torch.Tensor, off: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s dtype, shape and strides over ``buf`` (``uint8``) from byte ``off`` (aligned)."""
    nbytes = like.numel() * like.element_size()
    return buf.narrow(0, off, nbytes).view(like.dtype).as_strided(like.shape, like.stride())


class _Packed:
    """A saved tensor sent to host memory; ``dev`` is held until the D2H copy has landed."""

    __slots__ = (
        "__weakref__",
        "block",
        "d2h",
        "dev",
        "host",
        "offset",
        "pool",
        "ready",
        "refs",
        "restored",
        "restored_on",
        "seq",
        "slab",
        "unpacked",
    )

    def __init__(
        self,
        block: int,
        seq: int,
        dev: torch.Tensor,
        host: torch.Tensor,
        slab: HostSlab,
        offset: int,
        d2h: StreamEvent,
        pool: ActivationHostPool,
    ) -> None:
        self.block = block
        self.seq = seq  # D2H issue order: the copies complete in this order (one stream)
        self.dev: torch.Tensor | None = dev
        self.host = host  # view of ``slab`` at ``offset``
        self.slab: HostSlab | None = slab
        self.offset = offset
        self.pool = pool
        self.d2h = d2h
        self.refs = 1  # saved-tensor slots of the graph packed to this object
        self.unpacked = 0  # of them, unpacked since the last device copy was handed out
        self.restored: torch.Tensor | None = None  # prefetched device copy
        self.ready: StreamEvent | None = None  # guards ``restored``
        self.restored_on: Any = None  # the stream ``restored``'s buffer was allocated on

    def __del__(self) -> None:
        if self.restored is not None and self.ready is not None:
            # why: a copy back never unpacked (partial backward, a failed step) may still be writing the
            # buffer that frees with this view; the stream it was allocated on reuses that memory next
            self.ready.wait(self.restored_on)
        # the graph holding this saved tensor is gone: its bytes in the slab are free once the last copy
        # touching them (the copy back, which itself waited for the copy out; else the copy out) is done
        if self.slab is not None:
            self.pool.release(self.slab, self.ready if self.ready is not None else self.d2h)
            self.slab = None


class _Recomputing:
    """Context of one recompute of block ``i`` (re-enterable: torch may recompute a block several times)."""

    __slots__ = ("handle", "i")

    def __init__(self, handle: ActivationHandle, i: int) -> None:
        self.handle = handle
        self.i = i

    def __enter__(self) -> None:
        self.handle._recomputing[self.i] = True  # the block's pre-hook must not checkpoint the recompute
        self.handle._stats["recomputed_forwards"] += 1

    def __exit__(self, *exc: object) -> None:
        self.handle._recomputing[self.i] = False


class ActivationHandle:
    """Installed activation policies of a block list; see the module docstring."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        policies: Sequence[str],
        *,
        device: torch.device | str,
        arena: Any | None = None,
        min_offload_bytes: int = 1 << 16,
        prefetch_ahead: int = 1,
        streams: Any | None = None,
        pin: bool = True,
    ) -> None:
        self.blocks = list(blocks)
        if len(policies) != len(self.blocks):
            raise StreamingError(
                f"install_activation_policy: {len(policies)} policies for {len(self.blocks)} blocks; "
                "accepted: one policy per block. Fix: pass a list as long as blocks."
            )
        for i, p in enumerate(policies):
            self._check(i, p)
        if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise StreamingError(
                f"install_activation_policy: min_offload_bytes={min_offload_bytes!r} is invalid; accepted: "
                "an int >= 0. Fix: pass e.g. 65536 to keep small tensors on the device."
            )
        if not isinstance(prefetch_ahead, int) or isinstance(prefetch_ahead, bool) or prefetch_ahead < 0:
            raise StreamingError(
                f"install_activation_policy: prefetch_ahead={prefetch_ahead!r} is invalid; accepted: an "
                "int >= 0. Fix: pass 1."
            )
        self.policies: list[str] = list(policies)
        self.device = torch.device(device)
        self.streams = streams if streams is not None else device_streams(self.device)
        self.host = HostBuffers(self.device, arena, pin)
        self.pool = ActivationHostPool(self._alloc_slab, self.host.free)
        self._own_arena_tried = arena is not None
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_ahead = prefetch_ahead
        self._packed: list[weakref.WeakSet[_Packed]] = [weakref.WeakSet() for _ in self.blocks]
        # D2H copies in issue order, device source held until polled; they share one stream, so they
        # complete in this order and polling stops at the first one still running
        self._inflight: deque[_Packed] = deque()
        self._seq = 0
        self._ctx: list[list[Any]] = [[] for _ in self.blocks]  # entered contexts, per block
        self._recomputing = [False] * len(self.blocks)
        self._delegated: set[int] = set()  # blocks whose forward another mechanism runs (delegate())
        self._block_bytes = [0] * len(self.blocks)  # offloaded bytes of each block's latest forward
        self._input_bytes = [0] * len(self.blocks)  # bytes of each block's main input, latest forward
        self._stats = dict.fromkeys(
            (
                "offloaded_tensors",
                "offloaded_bytes",
                "deduplicated",
                "kept_small",
                "kept_weights",
                "kept_not_dense",
                "prefetched",
                "demand_fetches",
                "restore_copies",
                "recomputed_forwards",
            ),
            0,
        )
        self._hooks: list[Any] = []
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(self._make_pre(i), with_kwargs=True))
            self._hooks.append(b.register_forward_hook(self._make_post(i), always_call=True))

    @staticmethod
    def _check(i: int, p: Any) -> None:
        if p not in _POLICIES:
            raise StreamingError(
                f"install_activation_policy: policies[{i}]={p!r} is invalid; accepted: {', '.join(_POLICIES)}. "
                "Fix: pick one per block."
            )

    # ----------------------------------------------------------------------------------- policy
    def delegate(self, i: int, delegated: bool = True) -> None:
        """Block ``i``'s recompute is left to whoever runs its forward (its CUDA graph replays recompute in
        backward, ``tidal_stream.block_graphs``), who calls :meth:`checkpointed` when it runs eagerly;
        ``delegated=False`` gives it back to the hooks."""
        (self._delegated.add if delegated else self._delegated.discard)(i)

    def checkpointed(
        self, i: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``fn(*args, **kwargs)`` as block ``i``'s forward under the recompute policy (what the hooks do)."""
        gen = _checkpoint_generator(
            self.blocks[i], lambda: (contextlib.nullcontext(), _Recomputing(self, i)), args, kwargs
        )
        next(gen)
        try:
            return fn(*args, **kwargs)
        finally:
            with contextlib.suppress(StopIteration):
                next(gen)

    def set_policy(self, i: int, policy: ActivationPolicy) -> None:
        """Change block ``i``'s policy for the next forwards (not while its forward runs)."""
        self._check(i, policy)
        self.policies[i] = policy

    def _make_pre(self, i: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._recomputing[i] or torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
                return
            self._input_bytes[i] = _main_input_nbytes(args, kwargs)
            if i in self._delegated:
                return
            policy = self.policies[i]
            if policy == "offload":
                self._block_bytes[i] = 0
                weights = {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())}
                cursor, waits = self.pool.begin(i)
                for ev in waits:
                    # why: the slabs are about to be overwritten by D2H copies; last step's H2D copies
                    # that read them back must be done (device-side wait, the host runs on)
                    ev.wait(self.streams.d2h)
                seen: dict[tuple[Any, ...], tuple[_Packed, torch.Tensor]] = {}
                hooks = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(i, t, weights, cursor, seen), self._unpack
                )
                hooks.__enter__()
                self._ctx[i].append((hooks, cursor, seen))
            elif policy == "recompute":
                # torch calls context_fn once per checkpointed forward but enters the recompute context
                # once per backward that unpacks (each autograd.grad / retain_graph pass): it must be
                # re-enterable, which a @contextmanager object is not
                gen = _checkpoint_generator(
                    module, lambda: (contextlib.nullcontext(), _Recomputing(self, i)), args, kwargs
                )
                next(gen)
                self._ctx[i].append(gen)

        return pre

    def _make_post(self, i: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self._ctx[i]:
                return
            ctx = self._ctx[i].pop()
            if isinstance(ctx, tuple):
                hooks, cursor, seen = ctx
                hooks.__exit__(None, None, None)
                self.pool.end(cursor)
                seen.clear()  # the block's saved tensors can no longer be saved again by it
                self._backpressure(i - self.prefetch_ahead)
                outs = _tensors_of(output)
                if outs:
                    # the handle lives as long as the graph does
                    torch.autograd.graph.register_multi_grad_hook(
                        outs, lambda _g: self._prefetch_from(i), mode="any"
                    )
            else:
                with contextlib.suppress(StopIteration):
                    next(ctx)

        return post

    # ----------------------------------------------------------------------------------- offload
    def _alloc_slab(self, nbytes: int, tag: str) -> tuple[torch.Tensor, Any]:
        """A host slab of ``nbytes`` for the pool (arena block, else pinned ``torch.empty``)."""
        with torch.profiler.record_function("tidal::act.host_alloc"):
            if self.host.arena is None and self.host.pin and self.pool.hint > 0 and not self._own_arena_tried:
                # once one block's bytes are known, page-lock every offloaded block's share at exact size
                # (torch's pinned pool would round each slab up to a power of two)
                self._own_arena_tried = True
                self.host.reserve_own_arena(self.pool.hint * max(1, self.policies.count("offload")))
            return self.host.alloc_like(torch.empty(nbytes, dtype=torch.uint8, device="meta"), tag)

    def _pack(
        self,
        i: int,
        t: torch.Tensor,
        weights: set[int],
        cursor: Any,
        seen: dict[tuple[Any, ...], tuple[_Packed, torch.Tensor]],
    ) -> Any:
        nbytes = t.numel() * t.element_size()
        if isinstance(t, nn.Parameter) or t.untyped_storage()._cdata in weights:
            self._stats["kept_weights"] += 1
            return t
        if nbytes < self.min_offload_bytes or t.device.type != self.device.type:
            self._stats["kept_small"] += 1
            return t
        if not _dense(t):
            self._stats["kept_not_dense"] += 1
            return t
        # the same bytes saved again in this forward (one input of several projections): share the copy;
        # ``seen`` holds ``t`` until the block's forward ends, so its storage cannot be recycled meanwhile
        key = (
            t.untyped_storage()._cdata,
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            t._version,
        )
        hit = seen.get(key)
        if hit is not None:
            hit[0].refs += 1
            self._stats["deduplicated"] += 1
            return hit[0]
        with torch.profiler.record_function("tidal::act.offload"):
            slab, offset = self.pool.carve(cursor, nbytes)
            host = _bytes_as(slab.tensor, offset, t)
            compute = self.streams.compute()
            d2h = self.streams.d2h
            with stream_context(d2h):
                record_event(compute).wait(d2h)  # why: the copy reads what the compute stream just wrote
                host.copy_(t, non_blocking=not isinstance(d2h, NullStream))
                done = record_event(d2h)  # why: the device source may be dropped only after this
        p = _Packed(i, self._seq, t, host, slab, offset, done, self.pool)
        self._seq += 1
        seen[key] = (p, t)
        self._inflight.append(p)
        self._packed[i].add(p)
        self._stats["offloaded_tensors"] += 1
        self._stats["offloaded_bytes"] += nbytes
        self._block_bytes[i] += nbytes
        self._poll()
        return p

    def _poll(self, below: int | None = None) -> None:
        """Drop device sources whose D2H copy has completed (frees their memory), oldest first; with
        ``below``, stop at the first of a block not before it (those are about to be used by backward:
        no round trip). O(1) per completed copy: the copies share one stream and finish in order."""
        q = self._inflight
        while q:
            p = q[0]
            if p.dev is not None:
                if below is not None and p.block >= below:
                    break
                if not p.d2h.query():
                    break
                p.dev = None
            q.popleft()

    def _backpressure(self, below: int) -> None:
        """Block the host until the D2H copies of blocks before ``below`` have landed, then poll."""
        last = None
        for p in self._inflight:
            if p.block >= below:
                break
            last = p
        if last is not None and last.dev is not None:
            # why: the host may run ahead of the copies by at most prefetch_ahead + 1 blocks of saved
            # tensors, else their device sources pile up un-freed; the newest suffices (FIFO stream)
            last.d2h.synchronize()
        self._poll()

    def _restore_block(self, j: int, packs: list[_Packed]) -> None:
        """Copy ``packs`` (of block ``j``) back to the device: one H2D copy per host slab, covering the
        slab's bytes from the first to the last of them, into one device buffer carved into views."""
        by_slab: dict[int, list[_Packed]] = {}
        for p in sorted(packs, key=lambda p: p.seq):
            assert p.slab is not None, "a packed tensor alive in the graph keeps its slab"
            by_slab.setdefault(id(p.slab), []).append(p)
        compute = self.streams.compute()
        h2d = self.streams.h2d
        spans = []
        with stream_context(compute):
            for group in by_slab.values():
                lo = min(p.offset for p in group)
                hi = max(p.offset + p.host.numel() * p.host.element_size() for p in group)
                buf = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)  # [hi - lo]
                spans.append((group, lo, hi, buf))
            alloc_done = record_event(compute)  # why: the new bytes may still be read by queued kernels
        with stream_context(h2d):
            alloc_done.wait(h2d)  # why: write only after those kernels are done
            # why: the host copies must have landed; they share one D2H stream, so the newest suffices
            max(packs, key=lambda p: p.seq).d2h.wait(h2d)
            for group, lo, hi, buf in spans:
                buf.copy_(group[0].slab.tensor[lo:hi], non_blocking=not isinstance(h2d, NullStream))
            ready = record_event(h2d)  # why: backward reads the buffers only after the copies
        for group, lo, _hi, buf in spans:
            for p in group:
                p.restored = _bytes_as(buf, p.offset - lo, p.host)
                p.ready = ready
                p.restored_on = compute
        self._stats["restore_copies"] += len(spans)

    def _prefetch_from(self, i: int) -> None:
        with torch.profiler.record_function("tidal::act.prefetch"):
            self._poll(below=i - self.prefetch_ahead)
            # block i first: it is needed first, and the H2D stream runs copies in issue order
            for j in range(i, max(-1, i - 1 - self.prefetch_ahead), -1):
                packs = [p for p in self._packed[j] if p.dev is None and p.restored is None]
                if packs:
                    self._restore_block(j, packs)
                    self._stats["prefetched"] += len(packs)

    def _unpack(self, p: Any) -> torch.Tensor:
        if not isinstance(p, _Packed):
            return p
        p.unpacked += 1
        last = p.unpacked >= p.refs  # every slot sharing this copy has now been unpacked in this pass
        if last:
            p.unpacked = 0
        if p.dev is not None:  # D2H still pending or not yet polled: the original is still here
            out = p.dev
            if last and p.d2h.query():
                p.dev = None  # its host copy has landed: a later backward pass restores from there
            return out
        if p.restored is None:
            packs = [q for q in self._packed[p.block] if q.dev is None and q.restored is None]
            self._stats["demand_fetches"] += len(packs)
            self._restore_block(p.block, packs)
        assert p.restored is not None and p.ready is not None
        p.ready.wait(self.streams.compute())  # why: the kernel reading it runs on the compute stream
        out = p.restored
        if last:
            p.restored = None  # the graph's nodes hold it now: the block buffer frees after their backward
        return out

    # ----------------------------------------------------------------------------------- public
    def stats(self) -> dict[str, Any]:
        """Counters: offloaded tensors/bytes, deduplicated (saves served by a copy already made), kept
        (small, weights, not dense), prefetched, demand fetches (copy-back not prefetched in time),
        restore copies (H2D copies issued: one per block slab), recomputed forwards,
        ``block_offloaded_bytes`` and ``block_input_bytes`` (per block, its latest forward in grad mode;
        the input: the first tensor argument, else ``hidden_states``), ``host_pool`` (the pool's
        ``stats()``: allocations flat after warm-up) and the current policies."""
        return {
            **self._stats,
            "host_pool": self.pool.stats(),
            "block_offloaded_bytes": list(self._block_bytes),
            "block_input_bytes": list(self._input_bytes),
            "policies": list(self.policies),
            "degraded": list(self.host.degraded),
        }

    def remove(self) -> None:
        """Remove the hooks and free the host pool; graphs already built keep working (slabs they still
        use are freed when those graphs are)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        live = self.pool.stats()["live"]
        self.pool.close()
        if live == 0:
            self.host.free_all()  # the arena this handle page-locked itself, if any (no graph uses it)


def install_activation_policy(
    blocks: Sequence[nn.Module],
    policies: Sequence[ActivationPolicy],
    *,
    device: torch.device | str,
    arena: Any | None = None,
    min_offload_bytes: int = 1 << 16,
    prefetch_ahead: int = 1,
    streams: Any | None = None,
) -> ActivationHandle:
    """Install one activation policy per block (``"keep"``, ``"offload"`` or ``"recompute"``).

    Args:
        blocks: The blocks, in execution order.
        policies: One policy per block.
        device: The device the blocks compute on (``"cpu"`` runs the same logic synchronously).
        arena: Optional ``tidal_arena.PinnedArena`` for offloaded tensors (else pinned ``torch.empty``).
        min_offload_bytes: Saved tensors smaller than this stay on the device.
        prefetch_ahead: Blocks before the one in backward whose tensors are copied back early.
        streams: Optional ``DeviceStreams`` (default: the shared ones of ``device``).

    Returns:
        An :class:`ActivationHandle`.

    Raises:
        StreamingError: a policy or option is invalid.
    """
    return ActivationHandle(
        blocks,
        policies,
        device=device,
        arena=arena,
        min_offload_bytes=min_offload_bytes,
        prefetch_ahead=prefetch_ahead,
        streams=streams,
    )
