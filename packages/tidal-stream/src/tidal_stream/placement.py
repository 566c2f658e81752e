"""Where each parameter's optimizer state lives: the plan's split, then a measured refinement.

``offload=False``: every parameter on the device (plain fused AdamW); ``offload=True``: every parameter on
the host; ``offload="auto"``: ``tidal_plan.plan`` decides per block (``Plan.optimizer``: "gpu", "host" or
"split" with ``gpu_blocks`` / ``outside_on_gpu``). After the first update on CUDA the measured peak tells
how much room is left, and host-placed parameters move to the device in forward order while it lasts
(:func:`refine_after_first_step`) — the "switch to fused GPU AdamW after measuring" of the design. Room
left after that stops streaming blocks whose streamed weights are all frozen (a LoRA base: no optimizer
moves them), then lets offloaded blocks keep their activations on the device, by their measured bytes
(:func:`keep_offloaded_activations`), then recomputed ones, by their measured input scaled by the census
(:func:`keep_recomputed_activations`): the plan sized all three for its ``batch_tokens``, not the real
batch (512 real tokens against the default 4,096 leave most of what it gave activations unused).

[Note: given plans] a plan passed as ``plan=`` was shown to (or written by) the user: its streamed blocks
keep streaming. The measured refinement then moves only the optimizer of parameters that do not stream;
a plan made by ``wrap()`` itself may also stop streaming blocks when they fit. Either way the decision
log says what moved, and ``memory_report()["weight_streaming"]`` keeps every block that ever streamed.

[Note: no block stack] a model without a layer stack (one Linear and a head) has nothing to plan per
block: no plan, weights resident, and the optimizer on the device when weights, optimizer state and
gradients take at most half of the budget (the rest is for activations), else on the host, with the
measured refinement moving what fits (:func:`_no_plan_placement`).

Which blocks update on the host is the planner's choice: it keeps the host share on the last trained
blocks, whose gradients land first in backward, so their updates overlap the rest of backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal_plan import spread_streamed
from tidal_stream.block_graphs import blocks_within, graphs_reserve_by_block
from tidal_stream.device_share import (
    device_share,
    device_state_bytes,
    promote_to_device,
    widen_workspace,
)
from tidal_stream.kept_activations import (
    activations_of,
    activations_to_refine,
    block_ranges,
    keep_activations,
    keep_offloaded_activations,
    keep_recomputed_activations,
    kept_text,
)
from tidal_stream.options import WrapOptions
from tidal_stream.refined_prediction import blocks_of_params, predicted_step, prediction_text

__all__ = [
    "Placement",
    "activations_to_refine",
    "decide_placement",
    "device_share",
    "device_state_bytes",
    "has_first_step_refinement",
    "host_updated_blocks",
    "keep_activations_after_first_step",
    "keep_offloaded_activations",
    "keep_recomputed_activations",
    "measured_room",
    "model_host_bytes",
    "note_model_host_bytes",
    "offloading_blocks",
    "promote_to_device",
    "refine_after_first_step",
    "streams_weights",
    "unstream_frozen_blocks",
    "widen_workspace",
]

# of the budget (or of the usable memory without one), kept free after the measured refinement for
# fragmentation growth and workspaces the first step did not show; at least _MIN_HEADROOM bytes. 5 % was
# too little: on the GPU machine full1.5b at 24 GiB ran out of memory in the loss backward after it
_HEADROOM = 0.10
_MIN_HEADROOM = 256 * 2**20
# without a plan the optimizer goes on the device when weights + state + gradients take this share of
# the budget at most; the rest is for activations and workspaces
_NO_PLAN_DEVICE_SHARE = 0.5


@dataclass
class Placement:
    """The outcome: which parameters keep state on the device, and the moments' dtype."""

    gpu_params: list[nn.Parameter]
    """Parameters updated by the fused device kernel."""
    moment_dtype: str
    """``"fp32"`` or ``"bf16"``."""
    refine: bool
    """Measure the first step and move more state to the device if it fits."""
    keep_streamed: bool = False
    """The refinement leaves streamed blocks streaming (a plan given as ``plan=``)."""


def model_host_bytes(model: nn.Module) -> int:
    """Host bytes of ``model``'s parameters and buffers, each storage once."""
    tensors = (*model.parameters(), *model.buffers())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t.device.type == "cpu"
    }
    return sum(storages.values())


def note_model_host_bytes(e: Exception, model: nn.Module, opts: WrapOptions, device: torch.device) -> None:
    """A plan refused for host RAM while the model's own weights sit in host memory: add a note that
    ``wrap()`` frees them as it installs a plan, and the ``host_ram`` that lets the plan count them."""
    held = model_host_bytes(model) if device.type == "cuda" else 0
    if getattr(e, "resource", None) != "host_ram" or opts.host_ram is not None or not held:
        return
    available = getattr(e, "available_bytes", 0)
    note = (
        f"tidal: the model's own weights hold {held / 2**30:.2f} GiB of host memory now, not counted as "
        "available; wrap() frees them as it moves them to the device or into pinned copies. If nothing else "
        f"holds them, wrap(..., host_ram='{(available + held) // 2**30}GiB') plans with them counted."
    )
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:  # pragma: no cover - Python 3.10: the note joins the message
        e.args = (f"{e}\n{note}", *e.args[1:])


def _make_plan(model: nn.Module, opts: WrapOptions, device: torch.device) -> Any:
    from tidal_plan import PlanConfig, census, plan, profile_hardware

    blocks = opts.blocks
    if isinstance(blocks, (list, tuple)):
        blocks = nn.ModuleList(blocks)
    c = census(model, blocks=blocks)
    profile = profile_hardware(device, vram_budget=opts.vram_budget)
    budget = opts.vram_budget
    if budget is None and device.type == "cuda":
        # the derived budget is the memory still free; the weights already on the device are counted by
        # the plan too, so they belong inside its budget
        held = sum(
            t.numel() * t.element_size()
            for t in (*model.parameters(), *model.buffers())
            if t.device == device
        )
        budget = min(profile.device_total_bytes, profile.vram_budget_bytes + held)
    cfg = {
        "vram_budget": budget,
        "moment_dtype": opts.moment_dtype,
        "param_offload": opts.param_offload,
        "activation_offload": opts.activation_offload,
        "recompute": opts.recompute,
    }
    if opts.batch_tokens is not None:
        cfg["batch_tokens"] = opts.batch_tokens
    if opts.host_ram is not None:
        cfg["host_ram"] = opts.host_ram  # the plan's host RAM instead of what the profile measured
    if opts.loss_chunk_tokens is not None:
        cfg["loss_chunk_tokens"] = opts.loss_chunk_tokens
    config = PlanConfig(**cfg)
    return c, plan(c, profile, config), profile, config


def _from_plan(model: nn.Module, p: Any, c: Any, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters whose state the plan keeps on the device."""
    o = p.optimizer
    if o.placement == "gpu":
        return list(trainable)
    if o.placement == "host":
        return []
    gpu_blocks = set(o.gpu_blocks)
    block_of = {id(t): c.param_to_block.get(n) for n, t in model.named_parameters(remove_duplicate=False)}
    return [
        t
        for t in trainable
        if (block_of.get(id(t)) in gpu_blocks) or (block_of.get(id(t)) is None and o.outside_on_gpu)
    ]


def decide_placement(
    session: Any, model: nn.Module, opts: WrapOptions, trainable: list[nn.Parameter]
) -> Placement:
    """Apply ``offload`` / the plan; every decision goes to the session's decision log."""
    moment = "fp32" if opts.moment_dtype == "auto" else opts.moment_dtype
    n_all = sum(t.numel() for t in trainable)
    if opts.offload is False:
        session.record("placement", "plain fused AdamW on the device (offload=False)", host_params=0)
        return Placement(list(trainable), moment, refine=False)
    if opts.offload is True:
        session.record("placement", "all optimizer state on the host (offload=True)", host_params=n_all)
        return Placement([], moment, refine=False)
    if opts.plan is None and session.device.type == "cpu":
        session.record(
            "placement",
            "plain fused AdamW: the device is the host itself (cpu, offload='auto')",
            host_params=0,
        )
        return Placement(list(trainable), moment, refine=False)
    c = None
    p = opts.plan
    if p is None:
        from tidal_plan import InfeasiblePlan, PlanConfigError

        try:
            c, p, session.profile, session.plan_config = _make_plan(model, opts, session.device)
        except PlanConfigError as e:
            if opts.blocks is not None or e.option != "blocks":
                raise  # blocks= was given and is wrong: the user must fix it
            return _no_plan_placement(session, model, opts, trainable, moment)
        except InfeasiblePlan as e:
            note_model_host_bytes(e, model, opts, session.device)
            raise
    else:
        from tidal_plan import census

        blocks = opts.blocks
        c = census(model, blocks=nn.ModuleList(blocks) if isinstance(blocks, (list, tuple)) else blocks)
    session.plan = p
    session.census = c
    session.record("plan", p.explain())
    if opts.moment_dtype == "auto":
        moment = p.optimizer.moment_dtype
    gpu = _from_plan(model, p, c, trainable)
    n_gpu = sum(t.numel() for t in gpu)
    session.record(
        "placement",
        f"plan: optimizer {p.optimizer.placement}: {n_gpu / 1e6:.1f} M parameters updated on the device, "
        f"{(n_all - n_gpu) / 1e6:.1f} M on the host; moments {moment}",
        host_params=n_all - n_gpu,
        device_params=n_gpu,
    )
    given = opts.plan is not None
    refine = (
        session.device.type == "cuda"
    )  # wrap() refines when some state is on the host or activations offload
    if given and p.streamed_blocks:
        session.record(
            "placement",
            f"plan given (plan=): followed as given; its streamed blocks {block_ranges(list(p.streamed_blocks))} "
            "keep streaming"
            + (
                "; the measured refinement moves only the optimizer of weights that do not stream"
                if refine
                else ""
            ),
            streamed=list(p.streamed_blocks),
        )
    return Placement(gpu, moment, refine=refine, keep_streamed=given)


def _no_plan_placement(
    session: Any, model: nn.Module, opts: WrapOptions, trainable: list[nn.Parameter], moment: str
) -> Placement:
    """No block stack, so no plan: weights resident; the optimizer by size (see [Note: no block stack])."""
    dev = session.device
    itemsize = 2 if moment == "bf16" else 4
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    state = sum(device_state_bytes(t, itemsize) for t in trainable)
    budget = opts.vram_budget_bytes
    source = "the budget"
    if budget is None:
        free, total = torch.cuda.mem_get_info(dev)
        held = sum(
            t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.device == dev
        )
        budget, source = min(total, free + held), "the free device memory"
    fits = weights + state <= _NO_PLAN_DEVICE_SHARE * budget
    n_all = sum(t.numel() for t in trainable)
    session.record(
        "plan",
        f"no plan: {type(model).__name__} has no block stack (a ModuleList/Sequential of >= 2 same-type "
        "children), so there is nothing to stream or recompute per block; weights stay resident",
    )
    session.record(
        "placement",
        f"no plan: weights {weights / 2**20:.1f} MiB + optimizer state and gradients {state / 2**20:.1f} MiB "
        + ("<=" if fits else ">")
        + f" {_NO_PLAN_DEVICE_SHARE:.0%} of {source} ({budget / 2**20:.1f} MiB): optimizer "
        + (
            "on the device (plain fused AdamW)"
            if fits
            else "on the host; the first step's measurement moves to the device what fits"
        ),
        host_params=0 if fits else n_all,
        device_params=n_all if fits else 0,
        budget=budget,
    )
    if fits:
        return Placement(list(trainable), moment, refine=False)
    return Placement([], moment, refine=True)


def _streaming_of(session: Any) -> Any:
    """The session's weight-streaming extension (None when no block streams)."""
    for ext in session.extensions:
        if getattr(ext, "weights", None) is not None and hasattr(ext, "unstream"):
            return ext
    return None


def foreign_device_bytes(opt: Any, model: nn.Module, device: torch.device) -> int:
    """Allocated device bytes that are not this model's (a benchmark's filler, other models), at wrap time:
    ``memory_allocated`` minus the model's device weights and the optimizer's device state."""
    mine = sum(
        t.untyped_storage().nbytes()
        for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
        if t.device == device
    )
    return max(0, torch.cuda.memory_allocated(device) - mine - opt.memory_tiers()["device"]["bytes"])


def refine_after_first_step(
    session: Any, opt: Any, foreign: int, budget: int | None, keep_streamed: bool = False
) -> None:
    """After the first update: measure the step's peak and move to the device the host share that fits,
    then stop streaming blocks of frozen weights that fit (:func:`unstream_frozen_blocks`), then keep on
    the device the offloaded and recomputed activations that fit in what is left
    (:func:`~tidal_stream.kept_activations.keep_activations`).

    [Note: measured room] the device really holds what the caching allocator RESERVED, not what is
    allocated: at the peak of a step the difference (fragmentation, cached blocks of other sizes) is
    memory nobody else can use. So the measured use is the step's peak of reserved bytes (never below
    the allocated peak), and the room is what the next steps can add for good with that use still fitting:

    - under the budget: ``budget - headroom - used`` (``headroom``: ``_HEADROOM`` of the budget, at
      least ``_MIN_HEADROOM``: fragmentation grows as the new state is carved out of the pool);
    - under the device: the memory not reserved by anyone now, minus the same headroom of the usable
      memory (cached-unused bytes are already part of the measured use).

    A moved parameter costs its moments, fp32 master and its gradient (kept on the device until
    ``step()``), a block that stops streaming its whole weights (as if the stream window stayed), and
    the device update's widening workspace grows with the largest moved tensor (:func:`device_share`).
    Activations are kept in what is left after the buffers of the CUDA graphs that follow this
    refinement, on as many blocks as fit with half the headroom
    (:func:`~tidal_stream.block_graphs.graphs_reserve_by_block`, :func:`~tidal_stream.graph_fit.graphs_room`).

    Args:
        session: the wrapping session.
        opt: the ``OffloadAdamW``.
        foreign: device bytes allocated at wrap time that are not this model's
            (:func:`foreign_device_bytes`); excluded from the measured peaks (a filler's segment is
            reserved exactly as it is allocated).
        budget: the VRAM budget in bytes, or None (then only the device memory bounds it).
        keep_streamed: leave streamed blocks streaming (a plan given as ``plan=``).
    """
    peak_alloc, used, room, headroom = measured_room(session.device, foreign, budget)
    streaming = None if keep_streamed else _streaming_of(session)
    on_device = [p for p, _ in getattr(opt, "_gpu", {}).values()]  # updated on the device already
    chosen, total = device_share(opt.host_slots(), room, opt.moment_dtype.itemsize, streaming, on_device)
    moved, unstreamed = promote_to_device(opt, chosen, streaming)
    frozen, frozen_bytes = unstream_frozen_blocks(
        streaming, room - total, host_updated_blocks(opt, streaming), offloading_blocks(session)
    )
    unstreamed = sorted(unstreamed + frozen)
    total += frozen_bytes
    # CUDA graphs installed after this refinement hold buffers of their own, on the blocks they fit (graph_fit)
    reserve = graphs_reserve_by_block(session, opt)
    graphs = sum(reserve[i] for i in blocks_within(reserve, room - total + headroom // 2))
    # a given plan's activation choices stand, as its streamed blocks do
    kept, kept_bytes = ([], 0) if keep_streamed else keep_activations(session, room - total - graphs)
    host_left = sum(s.param.numel() for s in opt.host_slots())
    streamed_left = [] if _streaming_of(session) is None else _streaming_of(session).weights.streamed
    session.record(
        "placement",
        f"measured first step: peak {peak_alloc / 2**30:.2f} GiB allocated, {used / 2**30:.2f} GiB reserved"
        + _room_text(budget, room, headroom)
        + f"; moved the optimizer of {moved} tensors to the device ({total / 2**30:.2f} GiB with gradients, "
        "workspace and the weights of blocks that stop streaming)"
        + (
            f"; blocks {block_ranges(unstreamed)} STOP STREAMING (their weights stay on the device)"
            if unstreamed
            else ""
        )
        + (
            f"; blocks {block_ranges(streamed_left)} keep streaming"
            + (" (plan given: streamed blocks are kept)" if keep_streamed else "")
            if streamed_left
            else ""
        )
        + f"; {host_left / 1e6:.1f} M parameters stay on the host"
        + ("" if host_left else " (plain fused AdamW on the device from now on)")
        + kept_text(kept, kept_bytes)
        + (f"; {graphs / 2**30:.2f} GiB left for the CUDA graphs' buffers" if graphs else "")
        + prediction_text(predicted := predicted_step(session, streamed_left, _host_blocks(session, opt))),
        peak=peak_alloc,
        peak_reserved=used,
        room=room,
        headroom=headroom,
        budget=budget,
        predicted_step_s=predicted[1] if predicted else None,
        device_bytes=total,
        unstreamed=unstreamed,
        streamed=streamed_left,
        host_params=host_left,
        activations_kept=kept,
        activations_kept_bytes=kept_bytes,
        graphs_reserve_bytes=graphs,
    )


def _streamed_now(session: Any) -> list[int]:
    """The blocks streaming their weights now."""
    streaming = _streaming_of(session)
    return [] if streaming is None else list(streaming.weights.streamed)


def _host_blocks(session: Any, opt: Any) -> set[Any]:
    """The census blocks whose parameters the host optimizer updates (None: outside the stack); asked only
    for the cost model's prediction (a plan made by wrap())."""
    if getattr(session, "plan_config", None) is None:
        return set()
    return blocks_of_params(session, [s.param for s in opt.host_slots()])


def _trained_blocks(session: Any) -> set[Any]:
    """The census blocks with trained parameters (data parallel updates them all on the host); asked only
    for the cost model's prediction (a plan made by wrap())."""
    if getattr(session, "plan_config", None) is None:
        return set()
    return blocks_of_params(session, [p for p in session.model.parameters() if p.requires_grad])


def measured_room(dev: torch.device, foreign: int, budget: int | None) -> tuple[int, int, int, int]:
    """The first step's measured peak and the room the next steps may add (see [Note: measured room]).

    Returns:
        ``(peak allocated, peak held = max(allocated, reserved), room, headroom)`` in bytes, this
        model's only (``foreign`` bytes left out); the room may be negative.
    """
    torch.cuda.synchronize(dev)  # why: the step's kernels are done before its peaks are read
    peak_alloc = torch.cuda.max_memory_allocated(dev) - foreign
    peak_reserved = torch.cuda.max_memory_reserved(dev) - foreign
    used = max(peak_alloc, peak_reserved)  # this model's peak: what the device held for it
    reserved = torch.cuda.memory_reserved(dev)
    unreserved = torch.cuda.mem_get_info(dev)[0]
    usable = unreserved + reserved - foreign
    room = unreserved - (torch.cuda.max_memory_reserved(dev) - reserved) - _headroom(usable)
    if budget is not None:
        room = min(room, budget - _headroom(budget) - used)
    return peak_alloc, used, room, _headroom(budget) if budget is not None else _headroom(usable)


def keep_activations_after_first_step(
    session: Any, foreign: int, budget: int | None, unstream: bool = True
) -> None:
    """After the first step under data parallel (the optimizer is sharded on the host whatever the room):
    in the measured room (:func:`measured_room`), blocks streaming frozen weights stop streaming
    (``unstream``; every weight a data-parallel rank streams is frozen: trained ones stay resident), then
    offloaded and recomputed blocks keep their activations on the device."""
    peak_alloc, used, room, headroom = measured_room(session.device, foreign, budget)
    frozen, frozen_bytes = unstream_frozen_blocks(
        _streaming_of(session) if unstream else None, room, busy=offloading_blocks(session)
    )
    kept, kept_bytes = keep_activations(session, room - frozen_bytes)
    session.record(
        "placement",
        f"measured first step: peak {peak_alloc / 2**30:.2f} GiB allocated, {used / 2**30:.2f} GiB reserved"
        + _room_text(budget, room, headroom)
        + (
            f"; blocks {block_ranges(frozen)} STOP STREAMING ({frozen_bytes / 2**30:.2f} GiB of frozen weights "
            "stay on the device)"
            if frozen
            else ""
        )
        + (kept_text(kept, kept_bytes) if kept else "; every offloaded or recomputed block stays so")
        + prediction_text(
            predicted := predicted_step(session, _streamed_now(session), _trained_blocks(session))
        ),
        peak=peak_alloc,
        peak_reserved=used,
        room=room,
        budget=budget,
        unstreamed=frozen,
        predicted_step_s=predicted[1] if predicted else None,
        activations_kept=kept,
        activations_kept_bytes=kept_bytes,
    )


def _room_text(budget: int | None, room: int, headroom: int) -> str:
    return (f" of a {budget / 2**30:.2f} GiB budget" if budget is not None else "") + (
        f"; room {max(0.0, room) / 2**30:.2f} GiB after {headroom / 2**30:.2f} GiB headroom"
    )


def has_first_step_refinement(session: Any, opt: Any) -> bool:
    """The measured refinement has something to move: host optimizer state, offloaded or recomputed
    activations, or streamed blocks."""
    return bool(opt.host_slots() or activations_to_refine(session) or streams_weights(session))


def streams_weights(session: Any) -> bool:
    """Some block of the session streams its weights now."""
    streaming = _streaming_of(session)
    return streaming is not None and bool(streaming.weights.streamed)


def unstream_frozen_blocks(
    streaming: Any, room: int, updated: frozenset[int] = frozenset(), busy: frozenset[int] = frozenset()
) -> tuple[list[int], int]:
    """Stop streaming as many of the blocks whose streamed weights are all frozen as ``room`` holds,
    choosing them so the blocks that keep streaming spread through the stack.

    A LoRA base streams without any optimizer state of its own, so :func:`device_share` never reaches it;
    with no host update to wait for, its host copy is current and the block can stay on the device. Which
    ones stay matters for speed, not memory: a streamed block between resident ones is fetched while they
    compute, where a run of streamed blocks leaves the host link alone on the critical path
    (``tidal_plan.stream_schedule.spread_streamed``). Blocks whose activations cross the link
    (``busy``) already keep it occupied while they compute, so the streamed blocks spread among the others
    when there are enough of them.

    Args:
        streaming: the weight-streaming extension, or None (nothing streams, or it must keep streaming).
        room: device bytes the blocks may take.
        updated: blocks whose streamed weights the host optimizer updates (:func:`host_updated_blocks`):
            they keep streaming.
        busy: blocks whose activations are offloaded (:func:`offloading_blocks`).

    Returns:
        The blocks that stopped streaming, and their weight bytes.
    """
    if streaming is None or room <= 0:
        return [], 0
    movable = [i for i in streaming.weights.streamed if i not in updated]
    size = {i: streaming.weights.block_nbytes(i) for i in movable}
    fit, total = 0, 0
    for nbytes in sorted(size.values()):  # the most blocks the room holds: the smallest ones
        if total + nbytes > room:
            break
        fit, total = fit + 1, total + nbytes
    n_blocks = len(streaming.weights.blocks)
    quiet = [i for i in movable if i not in busy]
    for keep_count in range(len(movable) - fit, len(movable) + 1):
        pool = quiet if len(quiet) >= keep_count else movable
        keep = set(spread_streamed(pool, keep_count, n_blocks))
        chosen = [i for i in movable if i not in keep]
        total = sum(size[i] for i in chosen)
        if total <= room:  # blocks of unequal sizes: a spread may need one more kept streaming
            break
    if chosen:
        streaming.unstream(chosen)
    return chosen, total


def offloading_blocks(session: Any) -> frozenset[int]:
    """Blocks whose saved activations go to the host and back (policy "offload")."""
    acts = activations_of(session)
    if acts is None:
        return frozenset()
    return frozenset(i for i, p in enumerate(acts.stats()["policies"]) if p == "offload")


def host_updated_blocks(opt: Any, streaming: Any) -> frozenset[int]:
    """Streamed blocks with a weight the host optimizer updates (its host copy is the one written)."""
    if streaming is None:
        return frozenset()
    return frozenset(
        b
        for s in opt.host_slots()
        if s.host_weight is not None and (b := streaming.streamed_block_of(s.param)) is not None
    )


def _headroom(nbytes: int) -> int:
    return max(int(_HEADROOM * nbytes), _MIN_HEADROOM)
