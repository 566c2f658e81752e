"""Peer pooling: the frozen streamed blocks spread once over the GPUs of one machine, fetched GPU to GPU.

Under data parallel every rank streams every streamed block's frozen weights from host RAM each step.
Where the local GPUs can read each other's memory (NVLink or PCIe peer access; measured on the GPU machine:
GPU→GPU 354–394 GB/s against 55 GB/s pinned host→GPU), the frozen blocks are instead spread over the local
GPUs' spare VRAM once — streamed block ``i`` owned by local rank ``i mod L`` while it fits that GPU's room —
and a rank refills a block from its owner's device copy (its own, or a peer's through CUDA IPC) rather
than from its host copy. Blocks that do not fit stay host-streamed.

Mechanics (:func:`install_peer_pool`, collective over every rank of the process group):

1. the ranks exchange their GPU's UUID (GPUs are matched by UUID, not by index: ``CUDA_VISIBLE_DEVICES``
   may differ), their frozen streamed blocks' layout and their room (``all_gather_object``); each
   checks peer access to every other local GPU;
2. only where a block fits some owner's room, each rank times a pinned host→GPU copy of
   :data:`PROBE_BYTES` and shares a probe buffer of that size through CUDA IPC (torch's own
   ``torch.multiprocessing.reductions.reduce_tensor``); where every local GPU can read every other's,
   each rank times a copy out of each local peer's probe (all at once, so every direction of every link
   is measured under load) — nothing of a peer is opened otherwise (that creates a context on its GPU);
3. :func:`decide` — a pure function of the gathered facts, so every rank reaches the same answer — turns
   pooling on or off and says why with the numbers (decision log ``"distributed"``);
4. owners allocate one flat device buffer for their blocks, fill it from the host copies once,
   synchronize (IPC gives the readers no stream order) and share it; readers open the owners' buffers
   and point each pooled block's :meth:`~tidal_stream.streamed_blocks.StreamedBlocks.set_source` at
   views of them. Frozen weights never change, so nothing is synchronized after this fill.

A refill from a peer is ``dst.copy_(peer_view, non_blocking=True)`` issued on the H2D stream: torch runs
a cross-device copy on the source GPU's current stream of this process, ordered after the H2D stream's
earlier work and before its later work (two events), so the existing ready/release events keep guarding
it. Each rank opens a CUDA context on every peer GPU it reads (:data:`PEER_CONTEXT_BYTES` each, on that
GPU), counted against the owner's room.

Room per GPU (counted against the budget: owned blocks' bytes stay resident): ``DistributedConfig.
peer_pool_bytes`` when given (the plan is then made with that much less VRAM), otherwise what the plan
leaves under its budget (``vram_budget_bytes - tiers["vram"]``); without a plan, none.

Teardown (:meth:`PeerPool.remove`, collective as ``unwrap()`` is): blocks read their host copies again,
this GPU finishes every copy out of peer memory, the views are dropped, the ranks meet, then owners free.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "MIN_SPEEDUP",
    "PEER_CONTEXT_BYTES",
    "PROBE_BYTES",
    "PeerPool",
    "PoolDecision",
    "assign_blocks",
    "decide",
    "install_peer_pool",
    "pool_room",
]

log = logging.getLogger(__name__)

PeerPoolingOption = bool | Literal["auto"]
PROBE_BYTES = 64 * 2**20
"""Bytes of the timed copies at setup (host→GPU and each peer→GPU)."""
MIN_SPEEDUP = 2.0
"""``"auto"`` pools only when the slowest peer copy is at least this many times the fastest host link."""
PEER_CONTEXT_BYTES = 512 * 2**20
"""VRAM a CUDA context of another process takes on a GPU it reads from (estimate, per reader)."""
_ALIGN = 512  # bytes; every tensor of a pool buffer starts aligned (any dtype's view is legal)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PoolDecision:
    """The outcome of :func:`decide` on one machine."""

    on: bool
    """Pooling is used."""
    reason: str
    """The decision log line, with the numbers."""
    owners: tuple[int | None, ...] = ()
    """Owner local rank of each candidate block (None: stays host-streamed); empty when off."""
    data: dict[str, Any] = field(default_factory=dict)
    """The numbers behind it."""


def assign_blocks(block_bytes: Sequence[int], room: Sequence[int]) -> list[int | None]:
    """Owner of each block: block ``i`` goes to local rank ``i mod L`` when it fits what is left of that
    rank's ``room``, else None (it stays host-streamed). Blocks are taken in order.

    Args:
        block_bytes: device bytes of each candidate block (as its owner's buffer holds it).
        room: spare VRAM of each local rank's GPU, bytes.
    """
    if not room or any(r < 0 for r in room) or any(b < 0 for b in block_bytes):
        raise ValueError(f"assign_blocks({list(block_bytes)}, {list(room)}): invalid arguments")
    left, out = list(room), []
    for i, n in enumerate(block_bytes):
        r = i % len(left)
        if n <= left[r]:
            left[r] -= n
            out.append(r)
        else:
            out.append(None)
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def decide(
    mode: PeerPoolingOption,
    *,
    peer_access: Sequence[Sequence[bool]],
    peer_gbps: Sequence[Sequence[float]],
    host_gbps: Sequence[float],
    block_bytes: Sequence[int],
    room: Sequence[int],
    min_speedup: float = MIN_SPEEDUP,
) -> PoolDecision:
    """Whether the local ranks pool their frozen streamed blocks, and which rank owns which.

    Rules, in order: ``False`` — off. Otherwise off when there is one local rank or no candidate block,
    when a local GPU cannot read another's memory, when no block fits its owner's room, or (``"auto"``
    only) when the slowest measured peer copy is under ``min_speedup`` × the fastest measured host link;
    on otherwise, for the blocks that fit (:func:`assign_blocks`). ``True`` skips the rate rule only.
    (Rates are measured only where access and room allow pooling; before that they are not read.)

    Args:
        mode: ``DistributedConfig.peer_pooling``.
        peer_access: ``[i][j]``: local rank ``i``'s GPU can read local rank ``j``'s (diagonal ignored).
        peer_gbps: ``[i][j]``: GB/s of a copy into rank ``i``'s GPU out of rank ``j``'s (diagonal ignored).
        host_gbps: GB/s of a pinned host→GPU copy on each local rank.
        block_bytes: bytes of each candidate block (frozen, streamed by every local rank).
        room: spare VRAM of each local rank's GPU, bytes.
        min_speedup: the rate rule's factor.
    """
    L = len(room)
    if mode is False:
        return PoolDecision(False, "peer pooling: off (DistributedConfig.peer_pooling=False)")
    if L < 2:
        return PoolDecision(False, "peer pooling: off: one rank on this machine (nothing to pool with)")
    if not block_bytes:
        return PoolDecision(False, "peer pooling: off: no frozen streamed blocks (nothing to pool)")
    pairs = [(i, j) for i in range(L) for j in range(L) if i != j]
    missing = [(i, j) for i, j in pairs if not peer_access[i][j]]
    if missing:
        shown = ", ".join(f"{i}->{j}" for i, j in missing[:4])
        return PoolDecision(
            False,
            f"peer pooling: off: no peer access between the local GPUs (local rank reader->owner: {shown})",
            data={"missing": missing},
        )
    owners = assign_blocks(block_bytes, room)
    pooled = [i for i, o in enumerate(owners) if o is not None]
    rooms = "/".join(_gib(r) for r in room)
    data: dict[str, Any] = {"room": list(room), "block_bytes": list(block_bytes), "owners": owners}
    if not pooled:
        return PoolDecision(
            False,
            f"peer pooling: off: no room: the smallest block ({_gib(min(block_bytes))}) exceeds its owner's "
            f"spare VRAM ({rooms} per local rank)",
            data=data,
        )
    slow = min(peer_gbps[i][j] for i, j in pairs)
    host = max(host_gbps)
    data |= {
        "peer_gbps_min": slow,
        "host_gbps_max": host,
        "speedup": slow / host if host > 0 else float("inf"),
    }
    rate = f"slowest peer copy {slow:.1f} GB/s vs fastest host link {host:.1f} GB/s ({data['speedup']:.1f}x)"
    if mode == "auto" and slow < min_speedup * host:
        return PoolDecision(
            False, f"peer pooling: off: slower than host: {rate} < {min_speedup:g}x", data=data
        )
    per = [sum(block_bytes[i] for i in pooled if owners[i] == r) for r in range(L)]
    why = f"{rate} >= {min_speedup:g}x" if mode == "auto" else f"{rate}; forced (peer_pooling=True)"
    return PoolDecision(
        True,
        f"peer pooling: on: {len(pooled)} of {len(block_bytes)} frozen streamed blocks pooled "
        f"({_gib(sum(per))}; owned per local rank {'/'.join(_gib(p) for p in per)} of spare {rooms}); "
        f"{len(block_bytes) - len(pooled)} stay host-streamed; {why}",
        tuple(owners),
        data,
    )


def pool_room(plan: Any, pool_bytes: int | None, local_world: int) -> tuple[int, str]:
    """Spare VRAM of this rank's GPU for owned blocks, and where the number comes from.

    Args:
        plan: the rank's ``tidal_plan.Plan`` or None.
        pool_bytes: ``DistributedConfig.peer_pool_bytes``.
        local_world: ranks on this machine (each other one opens a context on this GPU).
    """
    contexts = PEER_CONTEXT_BYTES * max(0, local_world - 1)
    if pool_bytes is not None:
        base, src = pool_bytes, "DistributedConfig.peer_pool_bytes"
    elif plan is not None and getattr(plan, "vram_budget_bytes", 0):
        base = plan.vram_budget_bytes - plan.tiers.get("vram", 0)
        src = "the plan's budget minus its planned VRAM"
    else:
        return 0, "no plan and no DistributedConfig.peer_pool_bytes"
    return max(0, base - contexts), f"{src}, less {_gib(contexts)} for peer contexts"


# ----------------------------------------------------------------------------------------------- CUDA side
def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """GB/s of ``dst.copy_(src)`` on ``dst``'s current stream (CUDA events), after one warm-up copy."""
    with torch.cuda.device(dst.device):
        dst.copy_(src, non_blocking=True)  # warm-up: the first peer copy sets the mapping up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # why (both events): on dst's current stream, which the copies are ordered on
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()  # why: the timer is read on the host
    return dst.numel() * dst.element_size() * repeats / (start.elapsed_time(end) * 1e6)


def _probe(dev: torch.device) -> tuple[torch.Tensor, float]:
    """A filled probe buffer on ``dev`` (read by the peers) and the measured host→``dev`` GB/s."""
    probe = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=dev).fill_(7)  # [PROBE_BYTES]
    pinned = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True).fill_(7)  # [PROBE_BYTES]
    gbps = _time_copy(torch.empty_like(probe), pinned)
    torch.cuda.synchronize(dev)  # why: the probe is filled before other processes read it
    return probe, gbps


def _peer_rate(view: torch.Tensor, dev: torch.device) -> float:
    """GB/s of a copy out of a peer's probe (opened here) into ``dev``."""
    return _time_copy(torch.empty(view.shape, dtype=view.dtype, device=dev), view)


def _share(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """A picklable CUDA IPC handle of ``t`` (torch's own reduction)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(t)


def _open(handle: tuple[Any, tuple[Any, ...]], local_index: int) -> torch.Tensor:
    """The tensor another process shared, opened here on ``cuda:local_index`` (its GPU in this process's
    numbering: device indices are not the same in every process)."""
    fn, args = handle
    names = list(inspect.signature(fn).parameters)
    args = list(args)
    args[names.index("storage_device")] = local_index
    return fn(*args)


def _gpu_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", f"index-{index}"))


def _streamed(session: Any) -> Any:
    """The ``StreamedBlocks`` of the session's weight streaming, or None."""
    for ext in session.extensions:
        sb = getattr(getattr(ext, "weights", None), "sb", None)
        if sb is not None:
            return sb
    return None


class PeerPool:
    """The pool one rank takes part in: its own buffer, the peers' opened buffers, the sources set."""

    def __init__(self, ctx: Any, sb: Any, decision: PoolDecision, candidates: list[int]) -> None:
        self.ctx, self.sb, self.decision = ctx, sb, decision
        self.candidates = candidates
        self.own: torch.Tensor | None = None  # [owned bytes] uint8 on this GPU
        self.views: dict[int, torch.Tensor] = {}  # owner local rank -> its flat buffer, opened here
        self.sourced: list[int] = []  # StreamedBlocks positions refilled from the pool

    def summary(self) -> dict[str, Any]:
        """What ``memory_report()["distributed"]["peer_pooling"]`` shows: the decision, blocks, numbers."""
        owners = self.decision.owners
        sizes = self.decision.data.get("block_bytes", [])
        mine = [k for k, o in enumerate(owners) if o == self.ctx.local_rank]
        return {
            "on": self.decision.on and bool(self.sourced),
            "reason": self.decision.reason,
            "pooled_blocks": [self.candidates[k] for k, o in enumerate(owners) if o is not None],
            "owned_blocks": [self.candidates[k] for k in mine],
            "owned_bytes": sum(sizes[k] for k in mine),
            **{
                k: v for k, v in self.decision.data.items() if k in ("peer_gbps_min", "host_gbps_max", "room")
            },
        }

    def remove(self, barrier: bool = True) -> None:
        """Blocks read their host copies again; the ranks meet before owners free (collective)."""
        for k in self.sourced:
            self.sb.set_source(k, None)
        self.sourced = []
        if self.views or self.own is not None:
            torch.cuda.synchronize(self.sb.device)  # why: copies out of peer memory finish before views go
        self.views.clear()
        if barrier:
            self.ctx.barrier("peer pool teardown (every reader dropped its views)")
        self.own = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # why: release buffers the readers held through IPC


def install_peer_pool(
    session: Any, ctx: Any, mode: PeerPoolingOption, pool_bytes: int | None, record: Callable[..., None]
) -> PeerPool | None:
    """Measure, decide and (when on) build the pool; collective over every rank of ``ctx``.

    Returns:
        The :class:`PeerPool` (also when off, for its summary), or None when nothing was attempted.
    """
    dev = session.device
    if mode is False or dev.type != "cuda":
        why = "DistributedConfig.peer_pooling=False" if mode is False else f"training on {dev}: needs CUDA"
        record("distributed", f"peer pooling: off ({why})", peer_pooling=False)
        return None
    sb = _streamed(session)
    cands = (
        []
        if sb is None or sb.stream_trainable
        else [k for k in range(len(sb)) if k not in sb.kept_resident()]
    )
    layout = [[(tuple(h.shape), str(h.dtype)) for h in sb.host_copies(k)] for k in cands]
    sizes = [sum(_aligned(h.numel() * h.element_size()) for h in sb.host_copies(k)) for k in cands]
    room, room_src = pool_room(session.plan, pool_bytes, ctx.local_world)
    mine = {
        "node": ctx.node,
        "lr": ctx.local_rank,
        "gpu": _gpu_uuid(dev.index),
        "layout": layout,
        "room": room,
    }
    local = _local_objects(ctx, mine, "peer pool facts")
    same = all(f["layout"] == layout for f in local)
    rooms = [f["room"] for f in local]
    # probes and timed copies only where a block could be pooled (opening a peer's memory costs a context)
    fits = len(local) > 1 and same and any(o is not None for o in assign_blocks(sizes, rooms))
    visible = {_gpu_uuid(i): i for i in range(torch.cuda.device_count())}
    idx = [visible.get(f["gpu"]) for f in local]
    access = [
        j != ctx.local_rank
        and i is not None
        and (i == dev.index or torch.cuda.can_device_access_peer(dev.index, i))
        for j, i in enumerate(idx)
    ]
    probe, host_gbps = _probe(dev) if fits else (None, None)
    facts = {"access": access, "host_gbps": host_gbps, "probe": _share(probe) if probe is not None else None}
    seen = _local_objects(ctx, {"node": ctx.node, "lr": ctx.local_rank, **facts}, "peer pool access")
    every = all(m["access"][j] for i, m in enumerate(seen) for j in range(len(seen)) if i != j)
    gbps, err = [0.0] * len(local), None
    for j, m in enumerate(seen):
        if fits and every and j != ctx.local_rank:
            try:
                view = _open(m["probe"], idx[j])
                gbps[j] = _peer_rate(view, dev)
                del view
            except RuntimeError as e:  # an IPC handle that does not open here: pooling is off, say why
                err = f"local rank {ctx.local_rank} could not read local rank {j}'s GPU: {e}"
    rated = _local_objects(
        ctx, {"node": ctx.node, "lr": ctx.local_rank, "gbps": gbps, "err": err}, "peer pool rates"
    )
    if probe is not None:
        del probe  # every reader is done with it (the exchange above came after their timed copies)
        torch.cuda.ipc_collect()  # why: free the probes the readers opened and closed
        torch.cuda.empty_cache()  # why: the probe and its timed copies' buffers leave no cached VRAM
    decision = decide(
        mode,
        peer_access=[m["access"] for m in seen],
        peer_gbps=[m["gbps"] for m in rated],
        host_gbps=[m["host_gbps"] or 0.0 for m in seen],
        block_bytes=sizes if same else [],
        room=rooms,
    )
    errors = [m["err"] for m in rated if m["err"]]
    if errors or not same:
        why = errors[0] if errors else "the local ranks stream different blocks (plans differ)"
        decision = PoolDecision(False, f"peer pooling: off: {why}", data=decision.data)
    pool = PeerPool(ctx, sb, decision, cands)
    if any(ctx.all_objects(decision.on, "peer pool decisions")):  # every rank takes part (nodes decide apart)
        _build(pool, local, visible, sizes)
    rec = pool.decision
    record("distributed", f"{rec.reason}; room from {room_src}", peer_pooling=pool.summary())
    if rec.on:
        log.info(rec.reason)
    elif mode is True:
        log.warning("%s (peer_pooling=True was asked for)", rec.reason)
    return pool


def _local_objects(ctx: Any, obj: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """Every rank's ``obj`` (with ``node`` and ``lr`` keys), those of this machine in local rank order."""
    got = [o for o in ctx.all_objects(obj, what) if o["node"] == ctx.node]
    return sorted(got, key=lambda o: o["lr"])


def _build(pool: PeerPool, local: list[dict[str, Any]], visible: dict[str, int], sizes: list[int]) -> None:
    """Owners fill and share their buffers; readers open them; each pooled block gets its sources."""
    ctx, sb, d = pool.ctx, pool.sb, pool.decision
    dev, me = sb.device if sb is not None else None, ctx.local_rank
    offsets: dict[int, int] = {}  # candidate position -> byte offset in its owner's buffer
    used = [0] * len(local)
    for k, o in enumerate(d.owners):
        if o is not None:
            offsets[k], used[o] = used[o], used[o] + sizes[k]
    handle, err = None, None
    if d.on and used[me]:
        try:
            pool.own = torch.empty(used[me], dtype=torch.uint8, device=dev)  # [owned bytes]
            for k, o in enumerate(d.owners):
                if o == me:
                    hosts = sb.host_copies(pool.candidates[k])
                    for v, h in zip(_slot_views(pool.own, offsets[k], hosts), hosts):
                        v.copy_(h)  # the one fill of this frozen block's pooled copy
            torch.cuda.synchronize(dev)  # why: readers in other processes see the buffer with no stream order
            handle = _share(pool.own)
        except RuntimeError as e:
            err = f"local rank {me} could not build or share its pool buffer: {e}"
    shared = ctx.all_objects({"node": ctx.node, "lr": me, "h": handle, "err": err}, "peer pool handles")
    shared = {s["lr"]: s for s in shared if s["node"] == ctx.node}
    if d.on and err is None:
        try:
            for o in {o for o in d.owners if o is not None and o != me}:
                pool.views[o] = _open(shared[o]["h"], visible[local[o]["gpu"]])
        except (RuntimeError, KeyError, TypeError) as e:
            err = f"local rank {me} could not open a peer's pool buffer: {e}"
    errs = [
        m
        for m in ctx.all_objects({"node": ctx.node, "err": err}, "peer pool opened")
        if m["node"] == ctx.node
    ]
    errs = [m["err"] for m in errs if m["err"]] + [s["err"] for s in shared.values() if s["err"]]
    if errs or not d.on:
        if d.on:
            pool.decision = PoolDecision(False, f"peer pooling: off: {errs[0]}", data=d.data)
        pool.remove(barrier=False)
        return
    for k, o in enumerate(d.owners):
        if o is not None:
            pos = pool.candidates[k]
            buf = pool.own if o == me else pool.views[o]
            sb.set_source(pos, _slot_views(buf, offsets[k], sb.host_copies(pos)))
            pool.sourced.append(pos)


def _slot_views(buf: torch.Tensor, off: int, hosts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat byte buffer shaped as ``hosts``, each starting :data:`_ALIGN`-aligned at ``off``."""
    out = []
    for h in hosts:
        n = h.numel() * h.element_size()
        out.append(buf[off : off + n].view(h.dtype).view(h.shape))
        off += _aligned(n)
    return out
