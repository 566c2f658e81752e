"""Where each parameter's optimizer state lives: the plan's split, then a measured refinement.

``offload=False``: every parameter on the device (plain fused AdamW); ``offload=True``: every parameter on
the host; ``offload="auto"``: ``tidal_plan.plan`` decides per block (``Plan.optimizer``: "gpu", "host" or
"split" with ``gpu_blocks`` / ``outside_on_gpu``). After the first update on CUDA the measured peak tells
how much room is left, and host-placed parameters move to the device in forward order while it lasts
(:func:`refine_after_first_step`) — the "switch to fused GPU AdamW after measuring" of the design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal_stream.options import WrapOptions

__all__ = ["Placement", "decide_placement", "device_share", "device_state_bytes", "refine_after_first_step"]

_HEADROOM = 0.05  # of the budget, kept free for allocator fragmentation and workspaces


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


def device_share(slots: list[Any], room: float, moment_itemsize: int) -> tuple[list[nn.Parameter], int]:
    """Host slots to move to the device within ``room`` bytes, in forward (parameter) order.

    The earliest parameters are chosen: their updates are needed first by the next forward, while the
    host updates the later ones as their gradients land first in backward. Streamed weights stay.

    Returns:
        The parameters and their total device bytes.
    """
    chosen, total = [], 0
    for s in sorted(slots, key=lambda s: s.index):
        if s.host_weight is not None:
            continue  # a streamed weight keeps its optimizer on the host
        cost = device_state_bytes(s.param, moment_itemsize)
        if total + cost > room:
            break
        chosen.append(s.param)
        total += cost
    return chosen, total


def refine_after_first_step(session: Any, opt: Any, baseline: int, weights: int, budget: int | None) -> None:
    """After the first update: measure the step's peak and move to the device the host share that fits.

    Args:
        session: the wrapping session.
        opt: the ``OffloadAdamW``.
        baseline: ``torch.cuda.memory_allocated`` when wrapping (weights, plus anything else resident).
        weights: bytes of the model's parameters and buffers.
        budget: the VRAM budget in bytes, or None (then only the free memory bounds it).
    """
    dev = session.device
    torch.cuda.synchronize(dev)
    peak_extra = max(0, torch.cuda.max_memory_allocated(dev) - baseline)  # activations, grads, device state
    # memory the caching allocator holds but does not use counts as free: it serves our allocations first
    free = (
        torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    )
    # the next steps need peak_extra again on top of what stays allocated; keep 5 % headroom
    room = free * (1 - _HEADROOM) - peak_extra
    if budget is not None:
        resident = weights + opt.memory_tiers()["device"]["bytes"]  # weights + state already on the device
        room = min(room, budget * (1 - _HEADROOM) - resident - peak_extra)
    chosen, total = device_share(opt.host_slots(), room, opt.moment_dtype.itemsize)
    moved = opt.move_to_device(chosen)
    host_left = sum(s.param.numel() for s in opt.host_slots())
    session.record(
        "placement",
        f"measured first step: peak {peak_extra / 2**30:.2f} GiB above {weights / 2**30:.2f} GiB of weights; "
        f"moved the optimizer of {moved} tensors ({total / 2**30:.2f} GiB) to the device; "
        f"{host_left / 1e6:.1f} M parameters stay on the host"
        + ("" if host_left else " (plain fused AdamW on the device from now on)"),
        peak_extra=peak_extra,
        weights=weights,
        budget=budget,
        device_bytes=total,
        host_params=host_left,
    )
