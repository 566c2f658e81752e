"""Where each parameter's optimizer state lives: the plan's split, then a measured refinement.

``offload=False``: every parameter on the device (plain fused AdamW); ``offload=True``: every parameter on
the host; ``offload="auto"``: ``tidal_plan.plan`` decides per block (``Plan.optimizer``: "gpu", "host" or
"split" with ``gpu_blocks`` / ``outside_on_gpu``). After the first update on CUDA the measured peak tells
how much room is left, and host-placed parameters move to the device in forward order while it lasts
(:func:`refine_after_first_step`) — the "switch to fused GPU AdamW after measuring" of the design.

[Note: overlap order] backward lands the gradients of the last blocks first. A host update can only hide
behind the backward (and, for late blocks, the next forward) that is still to run after its gradient
lands, so a plan made by ``wrap()`` keeps the host share on the LAST trained blocks and the device share
on the first ones (:func:`overlap_order`); on a stack of equal blocks this moves no byte of VRAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal_stream.options import WrapOptions

__all__ = [
    "Placement",
    "decide_placement",
    "device_share",
    "device_state_bytes",
    "overlap_order",
    "promote_to_device",
    "refine_after_first_step",
]

# of the budget (or of the free memory without one), kept free after the measured refinement for
# allocator fragmentation and workspaces the first step did not show
_HEADROOM = 0.05


@dataclass
class Placement:
    """The outcome: which parameters keep state on the device, and the moments' dtype."""

    gpu_params: list[nn.Parameter]
    """Parameters updated by the fused device kernel."""
    moment_dtype: str
    """``"fp32"`` or ``"bf16"``."""
    refine: bool
    """Measure the first step and move more state to the device if it fits."""


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
    if opts.loss_chunk_tokens is not None:
        cfg["loss_chunk_tokens"] = opts.loss_chunk_tokens
    return c, plan(c, profile, PlanConfig(**cfg))


def overlap_order(p: Any) -> tuple[Any, str | None]:
    """The plan with its host-optimizer (and streamed) blocks moved to the last trained blocks.

    The host share keeps its size: the ``k`` host blocks become the last ``k`` trained blocks, whose
    gradients land first in backward, and the ``j``-th streamed block becomes the ``j``-th new host block.
    Done only when it moves no VRAM: a "split" plan whose trained blocks all have the same weight bytes
    and whose streamed blocks all update on the host. Activation policies are untouched.

    Returns:
        ``(plan, note)``: the reordered plan and a sentence for the decision log, or the plan unchanged
        and None (nothing to move, or the stack is not uniform).
    """
    import dataclasses

    o = p.optimizer
    if o.placement != "split":
        return p, None
    trained = [b for b in p.blocks if b.optimizer != "none"]
    host = [b.index for b in trained if b.optimizer == "host"]
    streamed = [b.index for b in p.blocks if b.weights == "streamed"]
    k = len(host)
    new_host = [b.index for b in trained][len(trained) - k :]
    if not k or new_host == host:
        return p, None
    if len({b.weight_bytes for b in trained}) != 1 or not set(streamed) <= set(host):
        return p, None
    moved = dict(zip(host, new_host))  # old host block -> the block that takes its role
    new_streamed = {moved[i] for i in streamed}
    blocks = tuple(
        dataclasses.replace(
            b,
            optimizer=b.optimizer if b.optimizer == "none" else ("host" if b.index in new_host else "gpu"),
            weights="streamed" if b.index in new_streamed else "resident",
        )
        for b in p.blocks
    )
    gpu_blocks = tuple(b.index for b in blocks if b.optimizer == "gpu")
    note = (
        f"host optimizer moved from blocks {_ranges(host)} to {_ranges(new_host)} (their gradients land "
        f"first in backward, so their host updates overlap the rest of backward and the next forward); "
        f"streamed blocks {_ranges(streamed) or 'none'} -> {_ranges(sorted(new_streamed)) or 'none'}; "
        "same bytes per tier"
    )
    out = dataclasses.replace(
        p,
        blocks=blocks,
        optimizer=dataclasses.replace(o, gpu_blocks=gpu_blocks),
        notes=(*p.notes, note),
    )
    return out, note


def _ranges(idx: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in sorted(idx):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


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
        c, p = _make_plan(model, opts, session.device)
        p, note = overlap_order(p)  # a plan given by the user is followed as it is
        if note is not None:
            session.record("placement", note)
    else:
        from tidal_plan import census

        blocks = opts.blocks
        c = census(model, blocks=nn.ModuleList(blocks) if isinstance(blocks, (list, tuple)) else blocks)
    session.plan = p
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
    return Placement(gpu, moment, refine=session.device.type == "cuda" and n_gpu < n_all)


def device_state_bytes(t: torch.Tensor, moment_itemsize: int) -> int:
    """Device bytes that keeping ``t``'s optimizer there costs: moments, a gradient, an fp32 master if 16-bit."""
    n = t.numel()
    return 2 * n * moment_itemsize + n * t.element_size() + (0 if t.dtype == torch.float32 else 4 * n)


def device_share(
    slots: list[Any], room: float, moment_itemsize: int, streaming: Any = None
) -> tuple[list[nn.Parameter], int]:
    """Host slots to move to the device within ``room`` bytes, in forward (parameter) order.

    The earliest parameters are chosen: their updates are needed first by the next forward, while the
    host updates the later ones as their gradients land first in backward. A streamed weight moves only
    with its whole block, which then stops streaming (its weight bytes count too); that needs
    ``streaming`` (the weight-streaming extension, ``streamed_block_of`` / ``block_nbytes``), without it
    streamed weights stay.

    Returns:
        The parameters and their total device bytes.
    """
    units: list[tuple[list[Any], int]] = []  # (slots, extra weight bytes), in forward order
    of_block: dict[int, list[Any]] = {}
    for s in sorted(slots, key=lambda s: s.index):
        if s.host_weight is None:
            units.append(([s], 0))
            continue
        blk = streaming.streamed_block_of(s.param) if streaming is not None else None
        if blk is None:
            continue  # streamed by something that cannot stop streaming it: its optimizer stays on the host
        if blk in of_block:
            of_block[blk].append(s)
        else:
            of_block[blk] = [s]
            units.append((of_block[blk], streaming.weights.block_nbytes(blk)))
    chosen, total = [], 0
    for unit, extra in units:
        cost = extra + sum(device_state_bytes(s.param, moment_itemsize) for s in unit)
        if total + cost > room:
            break
        chosen += [s.param for s in unit]
        total += cost
    return chosen, total


def promote_to_device(opt: Any, params: list[nn.Parameter], streaming: Any = None) -> tuple[int, list[int]]:
    """Move the optimizer of host-placed ``params`` to the device; streamed blocks among them stop streaming.

    Pending updates finish first, so the host copies the un-streamed blocks are filled from are current.

    Returns:
        The number of tensors moved and the stack indices of the blocks that stopped streaming.
    """
    opt.synchronize()  # why: an un-streamed block is filled from its host copy; pending updates write it
    wanted = {id(p) for p in params}
    slots = [s for s in opt.host_slots() if id(s.param) in wanted]
    blocks = sorted(
        {
            b
            for s in slots
            if s.host_weight is not None and (b := streaming.streamed_block_of(s.param)) is not None
        }
        if streaming is not None
        else set()
    )
    if blocks:
        streaming.unstream(blocks)
        for s in opt.host_slots():  # every slot of those blocks, also any not moved to the device
            if s.host_weight is not None and streaming.streamed_block_of(s.param) is None:
                # the weight is on the device for good now: its updates go there, not to the host copy
                s.host_weight = None
    return opt.move_to_device(params), blocks


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


def refine_after_first_step(session: Any, opt: Any, foreign: int, budget: int | None) -> None:
    """After the first update: measure the step's peak and move to the device the host share that fits.

    The room is what the next steps can add to the device for good with the first step's peak still
    fitting: under the budget (``budget`` minus ``_HEADROOM`` of it, minus this model's measured peak)
    and under the memory actually free (minus ``_HEADROOM`` of this model's usable memory).

    Args:
        session: the wrapping session.
        opt: the ``OffloadAdamW``.
        foreign: device bytes allocated at wrap time that are not this model's
            (:func:`foreign_device_bytes`); excluded from the measured peak.
        budget: the VRAM budget in bytes, or None (then only the free memory bounds it).
    """
    dev = session.device
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    allocated = torch.cuda.memory_allocated(dev)
    # memory the caching allocator holds but does not use counts as free: it serves our allocations first
    avail = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - allocated
    # the next steps reach `peak` again: what stays allocated from now on must leave that much free
    room = avail - (peak - allocated) - _HEADROOM * (avail + allocated - foreign)
    mine = peak - foreign  # this model's peak: weights, device state, activations, gradients, workspaces
    if budget is not None:
        room = min(room, budget * (1 - _HEADROOM) - mine)
    streaming = _streaming_of(session)
    chosen, total = device_share(opt.host_slots(), room, opt.moment_dtype.itemsize, streaming)
    moved, unstreamed = promote_to_device(opt, chosen, streaming)
    host_left = sum(s.param.numel() for s in opt.host_slots())
    session.record(
        "placement",
        f"measured first step: peak {mine / 2**30:.2f} GiB"
        + (f" of a {budget / 2**30:.2f} GiB budget" if budget is not None else "")
        + f", room {max(0.0, room) / 2**30:.2f} GiB after {_HEADROOM:.0%} headroom; moved the optimizer of "
        f"{moved} tensors ({total / 2**30:.2f} GiB) to the device"
        + (f", blocks {_ranges(unstreamed)} no longer stream" if unstreamed else "")
        + f"; {host_left / 1e6:.1f} M parameters stay on the host"
        + ("" if host_left else " (plain fused AdamW on the device from now on)"),
        peak=mine,
        room=room,
        budget=budget,
        device_bytes=total,
        unstreamed=unstreamed,
        host_params=host_left,
    )
