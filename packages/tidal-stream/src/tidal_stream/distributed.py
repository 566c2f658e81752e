"""Data parallel training under ``torch.distributed``: ``wrap()`` on every rank of a process group.

When a process group with more than one rank is initialized (``torchrun --nproc_per_node=N``, then
``torch.distributed.init_process_group``) — or ``distributed=True`` is passed — ``wrap()`` hands over to
:func:`wrap_distributed`:

- trainable weights and buffers are broadcast from rank 0 (every rank starts from the same weights);
- gradients are averaged across ranks by bucketed all-reduces launched from the parameters'
  post-accumulate-grad hooks as backward produces them (see :mod:`tidal_stream.sharded_optimizer`);
- the host optimizer is split ZeRO-style: rank ``r`` of ``W`` owns a contiguous shard of the flattened
  trainable parameters, keeps only that shard's fp32 master and moments in host memory, updates it with
  the fused host AdamW, and the updated weights are all-gathered — host AdamW time per rank is ~1/W;
- frozen weights that live in host memory are shared by the ranks of one machine
  (:mod:`tidal_stream.shared_host`): one copy per node, filled by local rank 0; on CUDA, once resident
  weights have moved to the GPU their pages are given back, and what streamed blocks read is page-locked;
- every collective of tidal runs on a group with ``DistributedConfig.timeout``: a rank that crashes or
  stalls makes the others raise :class:`DistributedError` instead of hanging (gloo; NCCL: see below).

[Note: one logic, two backends] every collective goes through :class:`DPContext`, whose ``comm_device`` is
chosen by the backend: NCCL reduces only CUDA tensors (the rank's own GPU), gloo reduces CPU tensors (and
is used for CPU training and for ranks sharing one GPU). Host tensors (the optimizer shard, checkpoints)
move to ``comm_device`` and back through :meth:`DPContext.to_comm`; nothing else branches on the backend,
except the barrier (gloo's ``monitored_barrier`` names the missing ranks; NCCL's barrier is given the GPU).
Timeouts: gloo raises in the waiting call; under NCCL the group's watchdog aborts the communicator after
``timeout`` (torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` then ends the process with the error), so
a dead peer ends every rank with an error, never a hang; with ``TORCH_NCCL_BLOCKING_WAIT=1`` set before
``init_process_group`` the waiting call raises instead, which tidal turns into :class:`DistributedError`.

[Note: ranks and machines] nothing assumes all ranks are local: the ranks of one machine are found by
exchanging host names (not from ``LOCAL_RANK``), and the planner's host RAM is split between the ranks of
the same machine only.

[Note: peer pooling] with ``DistributedConfig(peer_pooling="auto" | True)`` on CUDA, the frozen streamed
blocks (LoRA bases) that every rank streams are spread once over the local GPUs' spare VRAM — block ``i``
owned by local rank ``i mod L`` — and a rank refills a block from its owner's device copy (CUDA IPC, GPU to
GPU) instead of from host RAM (:mod:`tidal_stream.peer_pool`). ``"auto"`` turns it on only when every
local GPU can read every other's memory, the measured peer copy beats the measured host link by
>= 2x and a block fits its owner's room (owned bytes stay resident and count against the budget:
``peer_pool_bytes`` is taken from the budget the plan is made with); every branch is logged with its
numbers. Default False until measured on a multi-GPU machine.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from tidal_stream.errors import StreamError, option_error

__all__ = [
    "DPContext",
    "DistributedConfig",
    "DistributedError",
    "comm_device_for",
    "dp_context",
    "host_ram_share",
    "local_layout",
    "resolve_distributed",
    "wrap_distributed",
]

log = logging.getLogger(__name__)


class DistributedError(StreamError, RuntimeError):
    """A collective of tidal failed or timed out: a peer rank crashed, stalled or disagrees."""


@dataclass(frozen=True)
class DistributedConfig:
    """How ``wrap()`` trains data parallel (pass as ``wrap(..., distributed=DistributedConfig(...))``)."""

    bucket_bytes: int = 25 * 2**20
    """fp32 gradient bytes per all-reduce bucket (and per all-gather chunk); default 25 MiB."""
    max_inflight_buckets: int = 4
    """All-reduces in flight during backward before the oldest is waited for; default 4."""
    timeout: float | None = 300.0
    """Seconds a collective of tidal waits for the other ranks before every waiting rank raises
    :class:`DistributedError`; None: the default process group's own timeout. Default 300."""
    share_frozen: bool = True
    """Ranks of one machine share one host copy of frozen weights that stay in host memory; default True."""
    shm_dir: str = "/dev/shm"
    """Folder (a tmpfs) holding the shared host copy while local ranks map it; default ``/dev/shm``."""
    peer_pooling: bool | Literal["auto"] = False
    """Spread the frozen streamed blocks over the local GPUs and copy them GPU to GPU (CUDA):
    ``"auto"`` when peer access, the measured rates and the room allow it, True whatever the rates say,
    False never; default False."""
    peer_pool_bytes: int | None = None
    """VRAM per GPU taken from ``vram_budget`` for pooled blocks (the plan is made with the rest);
    None: the room the plan leaves under its budget; default None."""

    def __post_init__(self) -> None:
        for name in ("bucket_bytes", "max_inflight_buckets"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise option_error(f"distributed.{name}", v, "an int >= 1")
        t = self.timeout
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0
        ):
            raise option_error("distributed.timeout", t, "a positive number of seconds, or None")
        if not isinstance(self.share_frozen, bool):
            raise option_error("distributed.share_frozen", self.share_frozen, "True or False")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise option_error("distributed.shm_dir", self.shm_dir, "a folder path on a tmpfs")
        if not (isinstance(self.peer_pooling, bool) or self.peer_pooling == "auto"):
            raise option_error("distributed.peer_pooling", self.peer_pooling, '"auto", True or False')
        v = self.peer_pool_bytes
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise option_error("distributed.peer_pool_bytes", v, "None or an int > 0 (bytes per GPU)")


DistributedOption = bool | Literal["auto"] | DistributedConfig


def check_distributed_option(value: object) -> None:
    """Validate ``WrapOptions.distributed`` (``"auto"``, True, False or a :class:`DistributedConfig`)."""
    if isinstance(value, (bool, DistributedConfig)) or (isinstance(value, str) and value == "auto"):
        return
    raise option_error("distributed", value, '"auto", True, False or a tidal_stream.DistributedConfig')


def resolve_distributed(value: DistributedOption) -> DistributedConfig | None:
    """The config to train data parallel with, or None for single-process training.

    ``"auto"``: data parallel when a process group with more than one rank is initialized;
    True / a config: data parallel (a process group must be initialized, one rank allowed); False: never.
    """
    check_distributed_option(value)
    if value is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if value == "auto":
        return DistributedConfig() if ready and dist.get_world_size() > 1 else None
    if not ready:
        raise option_error(
            "distributed",
            value,
            '"auto" or False when no process group is initialized',
            "call torch.distributed.init_process_group() first (torchrun sets its environment).",
        )
    return value if isinstance(value, DistributedConfig) else DistributedConfig()


@dataclass
class DPContext:
    """The process group facts one rank trains with; every collective goes through its methods."""

    group: Any
    """The process group of tidal's collectives (all ranks, with ``timeout``)."""
    rank: int
    """This rank."""
    world: int
    """Number of ranks."""
    local_rank: int
    """Index of this rank among the ranks of its machine."""
    local_world: int
    """Ranks on this machine."""
    node: int
    """Index of this machine (order of first appearance of its host name among ranks)."""
    backend: str
    """The process group's backend (``"gloo"``, ``"nccl"``)."""
    comm_device: torch.device
    """Where collective tensors live: the CUDA device for NCCL, the CPU otherwise."""
    timeout: float | None
    """Seconds collectives wait (None: the process group's default)."""

    def _fail(self, what: str, e: BaseException) -> DistributedError:
        limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        return DistributedError(
            f"data parallel {what} failed on rank {self.rank} of {self.world} (limit {limit}): {e}. "
            "Another rank crashed, stalled or called a different collective; this rank stops too. "
            "Fix: see the first failing rank's log; every rank must run the same steps."
        )

    def run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a blocking collective, turning its failure into :class:`DistributedError`."""
        try:
            return fn(*args, group=self.group, **kwargs)
        except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
            raise self._fail(what, e) from e

    def wait(self, what: str, work: Any) -> None:
        """Wait for an asynchronous collective, turning its failure into :class:`DistributedError`."""
        try:
            work.wait()
        except RuntimeError as e:
            raise self._fail(what, e) from e

    def barrier(self, what: str) -> None:
        """All ranks meet; gloo names the ranks that did not arrive (``monitored_barrier``)."""
        if self.comm_device.type == "cpu":
            t = datetime.timedelta(seconds=self.timeout) if self.timeout is not None else None
            self.run(what, dist.monitored_barrier, timeout=t, wait_all_ranks=True)
        else:
            # NCCL: name this rank's GPU (otherwise torch guesses it from the global rank)
            self.run(what, dist.barrier, device_ids=[self.comm_device.index])

    def to_comm(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the collective device (itself when already there)."""
        return t if t.device == self.comm_device else t.to(self.comm_device)

    def broadcast_(self, t: torch.Tensor, what: str) -> None:
        """Overwrite ``t`` with rank 0's value."""
        buf = self.to_comm(t.detach())
        self.run(what, dist.broadcast, buf, src=self.group_rank0())
        if buf is not t:
            with torch.no_grad():
                t.copy_(buf)

    def group_rank0(self) -> int:
        """Global rank of the group's first rank (the source of broadcasts)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        """``out[r * n:(r + 1) * n] = inp of rank r`` for every rank (``n = inp.numel()``)."""
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.run(what, fn, out, inp)

    def all_objects(self, obj: Any, what: str) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        out: list[Any] = [None] * self.world
        self.run(what, dist.all_gather_object, out, obj)
        return out


def comm_device_for(backend: str, device: torch.device) -> torch.device:
    """Where the collectives' tensors live: this rank's GPU when the backend is (or includes, as torch's
    default ``"cpu:gloo,cuda:nccl"``) NCCL and training runs on CUDA — NCCL reduces only CUDA tensors;
    the CPU for gloo (CPU training, or ranks sharing one GPU).

    Raises:
        OptionError: NCCL alone without a CUDA training device, or a backend with neither.
    """
    if "nccl" in backend and device.type == "cuda":
        return device
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        raise option_error(
            "device",
            str(device),
            "a CUDA device under the NCCL backend (NCCL reduces only CUDA tensors)",
            'init_process_group("gloo") to train on the CPU, or put the model on cuda:LOCAL_RANK.',
        )
    raise option_error(
        "torch.distributed backend", backend, '"nccl" or "gloo"', "init_process_group with one of them."
    )


def dp_context(config: DistributedConfig, device: torch.device) -> DPContext:
    """Build the context of this rank: a group with the timeout, local ranks by host name."""
    backend = str(dist.get_backend())
    comm = comm_device_for(backend, device)
    if comm.type == "cuda" and torch.cuda.current_device() != comm.index:
        # object collectives (all_gather_object) and NCCL's own setup use the current device
        log.info("data parallel: torch.cuda.set_device(%s) (the training device of this rank)", comm)
        torch.cuda.set_device(comm)
    group = None
    if config.timeout is not None:
        # why a new group: the default group's timeout is fixed at init; tidal's collectives use its own
        group = dist.new_group(timeout=datetime.timedelta(seconds=config.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DPContext(group, rank, world, 0, 1, 0, backend, comm, config.timeout)
    hosts = ctx.all_objects(socket.gethostname(), "host name exchange")
    ctx.local_rank, ctx.local_world, ctx.node = local_layout(hosts, rank)
    return ctx


def local_layout(hosts: list[str], rank: int) -> tuple[int, int, int]:
    """``(local_rank, local_world, node)`` of ``rank`` from every rank's host name (in rank order).

    Ranks need not be grouped by machine (``torchrun`` across machines usually does, nothing here relies
    on it); nodes are numbered by first appearance.
    """
    order = list(dict.fromkeys(hosts))
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return mine.index(rank), len(mine), order.index(hosts[rank])


def host_ram_share(available: int, local_world: int, shared_bytes: int = 0) -> int:
    """Host RAM one rank may plan with: the shared frozen copy (counted once per machine, visible to every
    local rank) plus an equal share of the rest.

    Args:
        available: host RAM of the machine available to training, bytes.
        local_world: ranks on this machine.
        shared_bytes: bytes of the host copy the local ranks share.
    """
    if local_world < 1 or available < 0 or shared_bytes < 0:
        raise ValueError(f"host_ram_share({available}, {local_world}, {shared_bytes}): invalid arguments")
    return shared_bytes + max(0, available - shared_bytes) // local_world


def _measure_first_step(session: Any, model: nn.Module, opt: Any, budget: int | None, pool: Any) -> None:
    """Arm the measured refinement: the plan sized weights and activations for its token count, not the
    real batch; after the first step blocks of frozen weights that fit the measured room stop streaming
    (not with a peer pool: every rank must keep serving the blocks it pools), then offloaded and recomputed
    blocks keep their activations on the device. The peer pool's buffer is this model's (it counts
    against the budget), not foreign."""
    from tidal_stream.placement import foreign_device_bytes, keep_activations_after_first_step

    dev = session.device
    torch.cuda.synchronize(dev)  # why: wrap's copies are done before the foreign bytes are read
    own_pool = pool.own.untyped_storage().nbytes() if pool is not None and pool.own is not None else 0
    foreign = max(0, foreign_device_bytes(opt, model, dev) - own_pool)
    # the refinement reads the first step's peak of RESERVED bytes: blocks cached by wrap's own moves
    # (weights streamed out, resident ones in) would count as this model's use
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    unstream = pool is None or not pool.decision.on  # pooled blocks must keep streaming on every rank
    opt._after_first_update = lambda: keep_activations_after_first_step(session, foreign, budget, unstream)


def _host_reads(session: Any, model: nn.Module) -> list[torch.Tensor]:
    """Host tensors this rank still reads after set-up: weights left on the host and the streamed blocks'
    host copies (the shared copy keeps exactly these)."""
    out = [t for t in model.parameters() if t.device.type == "cpu"]
    for ext in session.extensions:
        sb = getattr(getattr(ext, "weights", None), "sb", None)  # the weight streaming's StreamedBlocks
        if sb is not None:
            out += [t for i in range(len(sb)) for t in sb.host_copies(i)]
    return out


def _check_same_params(ctx: DPContext, trainable: list[nn.Parameter]) -> None:
    mine = [(tuple(p.shape), str(p.dtype)) for p in trainable]
    every = ctx.all_objects(mine, "parameter layout check")
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            raise DistributedError(
                f"data parallel: rank {r} trains {len(theirs)} tensors, rank 0 {len(every[0])} (or shapes / "
                "dtypes differ); every rank must wrap the same model with the same trainable parameters. "
                "Fix: build the model and optimizer identically on every rank."
            )


def _plan_share(
    session: Any, model: nn.Module, opts: Any, ctx: DPContext, shared: int, pool_reserve: int = 0
) -> None:
    """Record this rank's host RAM share and, on CUDA, plan with it (``tidal_plan.PlanConfig.host_ram``)
    and with ``pool_reserve`` bytes of the VRAM budget left to peer pooling."""
    from tidal_plan import PlanConfig, census, plan, profile_hardware

    avail = _host_available()
    share = host_ram_share(avail, ctx.local_world, shared)
    session.record(
        "distributed",
        f"host RAM share: {share / 2**30:.2f} GiB of {avail / 2**30:.2f} GiB for local rank {ctx.local_rank} "
        f"of {ctx.local_world} (shared host copy {shared / 2**20:.1f} MiB counted once)",
        host_ram_share=share,
        host_ram_available=avail,
        local_world=ctx.local_world,
    )
    if session.device.type != "cuda" or opts.plan is not None:
        return
    from tidal_plan import InfeasiblePlan, PlanConfigError
    from tidal_stream.options import mostly_trained

    blocks = opts.blocks
    try:
        c = census(model, blocks=nn.ModuleList(blocks) if isinstance(blocks, (list, tuple)) else blocks)
    except PlanConfigError as e:
        if blocks is not None or e.option != "blocks":
            raise  # blocks= was given and is wrong: the user must fix it
        # no block stack: nothing to stream or recompute per block, and the optimizer is sharded on the
        # host whatever a plan says, so there is nothing to plan (weights.install finds no stack either)
        session.record(
            "plan",
            f"no plan: {type(model).__name__} has no block stack (a ModuleList/Sequential of >= 2 same-type "
            "children); weights stay where wrap() puts them, the optimizer is sharded on the host",
        )
        return
    profile = profile_hardware(session.device, vram_budget=opts.vram_budget, host_ram=share)
    cfg: dict[str, Any] = {"vram_budget": opts.vram_budget, "host_ram": share, "offload": True}
    if pool_reserve:
        budget = profile.vram_budget_bytes - pool_reserve
        if budget <= 0:
            raise option_error(
                "distributed.peer_pool_bytes",
                pool_reserve,
                f"less than the VRAM budget ({profile.vram_budget_bytes} bytes)",
                "lower peer_pool_bytes or raise vram_budget.",
            )
        cfg["vram_budget"] = budget
        session.record(
            "distributed",
            f"peer pooling: {pool_reserve / 2**30:.2f} GiB of the {profile.vram_budget_bytes / 2**30:.2f} GiB "
            "VRAM budget kept for pooled blocks; the plan gets the rest",
            pool_reserve=pool_reserve,
        )
    if opts.batch_tokens is not None:
        cfg["batch_tokens"] = opts.batch_tokens
    trained = sum(b.trainable_bytes for b in c.blocks)  # of all bytes, buffers too (a quantized base's)
    full = mostly_trained(trained, sum(b.trainable_bytes + b.frozen_bytes + b.buffer_bytes for b in c.blocks))
    if full and opts.param_offload == "auto":
        # the sharded optimizer updates trained weights on the device: a plan that streams them cannot run
        cfg["param_offload"] = False
        session.record(
            "plan",
            "data parallel full fine-tuning: trained weights stay on the GPU (the sharded host optimizer "
            "gathers them there), so the plan keeps every block resident",
        )
    try:
        config = PlanConfig(**cfg)
        session.plan = plan(c, profile, config)
        # the measured refinement sizes activations by the census and predicts with the plan's cost model
        session.census, session.profile, session.plan_config = c, profile, config
    except InfeasiblePlan as e:
        if not full:
            raise
        raise InfeasiblePlan(
            e.resource,
            e.needed_bytes,
            e.available_bytes,
            f"{e}. Under data parallel a full fine-tune keeps its {trained / 2**30:.1f} GiB of trained block "
            "weights on each GPU (they cannot stream)",
            ("raise vram_budget", "train LoRA adapters", "train on one GPU without data parallel"),
        ) from e
    session.record("plan", session.plan.explain())


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _DistributedExtension:
    """What ``memory_report()`` shows under ``"distributed"``; releases the shared copy on ``unwrap()``."""

    def __init__(self, ctx: DPContext, shared: Any, opt: Any, pool: Any = None) -> None:
        self.ctx, self.shared, self.opt, self.pool = ctx, shared, opt, pool

    def report(self) -> dict[str, Any]:
        out = {
            "rank": self.ctx.rank,
            "world": self.ctx.world,
            "local_rank": self.ctx.local_rank,
            "local_world": self.ctx.local_world,
            "node": self.ctx.node,
            "backend": self.ctx.backend,
            "peer_pooling": self.pool.summary() if self.pool is not None else {"on": False},
            **self.opt.shard_report(),
        }
        if self.shared is not None:
            out["shared_host"] = self.shared.report()
        return {"distributed": out}

    def remove(self) -> None:
        """Drop the reference to the shared mapping; frozen weights still viewing it keep it alive."""
        if self.shared is not None:
            self.shared.release()


def wrap_distributed(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    opts: Any,
    device: torch.device,
    config: DistributedConfig,
) -> tuple[nn.Module, Any]:
    """``wrap()`` on one rank of a process group (every rank calls it, collectively).

    Args:
        model: the same model on every rank (frozen weights loaded identically: they are not broadcast).
        optimizer: as for ``wrap()``: a ``torch.optim.AdamW`` / ``Adam`` or None.
        opts: the validated ``WrapOptions``.
        device: the training device of this rank.
        config: the data parallel settings.

    Returns:
        ``(model, optimizer)`` with a :class:`~tidal_stream.sharded_optimizer.ShardedHostAdamW`.
    """
    from tidal_stream.peer_pool import install_peer_pool
    from tidal_stream.placement import activations_to_refine, streams_weights
    from tidal_stream.session import Session
    from tidal_stream.sharded_optimizer import ShardedHostAdamW
    from tidal_stream.shared_host import SharedHostCopy
    from tidal_stream.wrap import _ATTR, _move_resident, _part2, _setup_training, _streamed_state_dict_hooks

    if opts.delayed_update:
        raise option_error(
            "delayed_update",
            True,
            "False under data parallel",
            "drop delayed_update=True (not supported with DP).",
        )
    if opts.offload is False:
        raise option_error(
            "offload",
            False,
            '"auto" or True under data parallel (the optimizer is sharded on the host)',
            "drop offload=False, or pass distributed=False to train without data parallel.",
        )
    ctx = dp_context(config, device)
    ctx.barrier("wrap() start (every rank must call wrap())")
    session = Session(model, opts, device)
    session.record(
        "distributed",
        f"data parallel: rank {ctx.rank} of {ctx.world} ({ctx.backend}, collectives on {ctx.comm_device}), "
        f"local rank {ctx.local_rank} of {ctx.local_world} on node {ctx.node}; timeout {ctx.timeout}",
        rank=ctx.rank,
        world=ctx.world,
    )
    groups, decoupled, trainable = _setup_training(session, model, optimizer, opts)
    _check_same_params(ctx, trainable)
    with torch.no_grad():
        for p in trainable:
            ctx.broadcast_(p.data, "broadcast of the trainable weights")
        for b in model.buffers():
            ctx.broadcast_(b, "broadcast of the buffers")
    session.record("distributed", f"{len(trainable)} trainable tensors and the buffers broadcast from rank 0")
    shared = None
    if not config.share_frozen and any(t.is_meta for t in model.parameters()):
        raise option_error(
            "distributed.share_frozen",
            False,
            "True while some weights are meta placeholders (the node's shared host copy fills them)",
            "load every weight on this rank, or leave share_frozen=True.",
        )
    if config.share_frozen:
        token = uuid.uuid4().hex[:16] if ctx.rank == 0 else None
        token = ctx.all_objects(token, "shared copy name exchange")[0]
        shared = SharedHostCopy.share_frozen(model, ctx, config.shm_dir, token, session.record)
        # weights.install reads it: streamed blocks take their frozen host copies from the mapping in place
        session.shared_host = shared
    pooling = config.peer_pooling is not False and device.type == "cuda"
    reserve = config.peer_pool_bytes if pooling and config.peer_pool_bytes is not None else 0
    _plan_share(session, model, opts, ctx, shared.nbytes if shared is not None else 0, reserve)
    moment = "fp32" if opts.moment_dtype == "auto" else opts.moment_dtype
    opt = ShardedHostAdamW(
        groups,
        lr=opts.lr if opts.lr is not None else 1e-3,
        decoupled_weight_decay=decoupled,
        session=session,
        ctx=ctx,
        accumulation_steps=opts.accumulation_steps,
        max_grad_norm=opts.max_grad_norm,
        moment_dtype=moment,
        seed=opts.seed,
        bucket_bytes=config.bucket_bytes,
        max_inflight_buckets=config.max_inflight_buckets,
    )
    session.optimizer = opt
    pool = None
    try:
        _part2(session, model, opts)
        # state_dict() reads streamed weights from their host copies (their device storage is empty)
        session.handles += _streamed_state_dict_hooks(session, model)
        _move_resident(session, model)
        if shared is not None:
            shared.settle(_host_reads(session, model), pin=device.type == "cuda", record=session.record)
        pool = install_peer_pool(session, ctx, config.peer_pooling, config.peer_pool_bytes, session.record)
        if pool is not None:
            session.extensions.insert(0, pool)  # unwrap() stops peer reads before streaming is removed
        if optimizer is not None:
            migrated = [p for p, st in optimizer.state.items() if st]
            for p in migrated:
                opt.import_param_state(p, optimizer.state[p])
            if migrated:
                session.record(
                    "migrate", f"{type(optimizer).__name__} state of {len(migrated)} tensors migrated"
                )
    except BaseException:
        if pool is not None:
            pool.remove(barrier=False)
        opt.close(barrier=False)  # this rank alone may be failing: do not wait for the others
        session.close()
        raise
    session.extensions.append(_DistributedExtension(ctx, shared, opt, pool))
    if (
        device.type == "cuda"
        and opts.plan is None
        and (activations_to_refine(session) or streams_weights(session))
    ):
        _measure_first_step(session, model, opt, opts.vram_budget_bytes, pool)
    setattr(model, _ATTR, session)
    session.record(
        "wrap",
        f"wrapped {type(model).__name__} data parallel: {opt.numel / 1e6:.2f} M trainable parameters, "
        f"this rank updates {opt.shard_numel / 1e6:.2f} M on the host; moments {moment}, "
        f"accumulation {opts.accumulation_steps}, clip {opts.max_grad_norm}",
    )
    return model, opt
