"""tidal through its public API: ``tidal_stream.wrap`` on a host-resident model, frozen base exact or quantized.

- ``fmt=None`` (exact bf16): the model is filled block by block on the device and left in host RAM;
  ``wrap(model, optimizer, vram_budget=…, device=…)`` plans what streams.
- ``fmt="nf4" | "fp8" | "nvfp4"``: each block's frozen base linears are quantized with
  ``tidal_quant.quantize_model_`` while the block is on the device, then the block goes to host RAM;
  LoRA adapters (PEFT) sit on top of the quantized layers.
- ``fmt="auto"``: ``tidal_hf.load_model(config_dir, quantize="auto", random_weights=True)`` decides
  exact vs quantized by the budget, then the same ``wrap``.
Every variant passes ``moment_dtype="auto"``: fp32 moments when the plan fits them in host RAM, else bf16;
and ``cuda_graphs="auto"`` (the default): from the second step the blocks that stay on the device replay CUDA graphs.
Any missing name shows as an ``error`` row with the import message (the table never loses the row).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engines import RunContext
from engines.common import (
    NotApplicable,
    adamw,
    add_lora,
    build_meta_model,
    decoder_layers,
    materialize,
    train_step,
)
from engines.scenarios import Scenario, hf_config


def version() -> str:
    """tidal-stream (and tidal-quant) versions."""
    import tidal_stream

    try:
        import tidal_quant

        return f"tidal-stream {tidal_stream.__version__}, tidal-quant {tidal_quant.__version__}"
    except ImportError:
        return f"tidal-stream {tidal_stream.__version__}"


def quantize_base_(block: nn.Module, fmt: str, **cfg: Any) -> None:
    """Quantize the frozen base linears of one block (LoRA adapters, when present, are left alone).

    ``cfg`` goes to ``tidal_quant.quantize_model_`` (e.g. ``fp8_backward=True``).
    """
    from tidal_quant import quantize_model_

    for parent in list(block.modules()):
        base = getattr(parent, "base_layer", None)
        if isinstance(base, nn.Linear):
            # a holder makes the base linear a child quantize_model_ can replace; the adapters are not in it
            holder = nn.Module()
            holder.base_layer = base
            quantize_model_(holder, fmt, **cfg)
            parent.base_layer = holder.base_layer
    if not any(hasattr(m, "base_layer") for m in block.modules()):
        quantize_model_(block, fmt, **cfg)


def _load_auto(ctx: RunContext) -> nn.Module:
    """``tidal_hf.load_model`` with random weights of the scenario's exact shape, quantize="auto".

    The budget goes along, so the loader's plan decides both the format and which blocks it leaves in
    host memory for ``wrap`` to stream (a 14B bf16 base at 24 GiB is never built on the device).
    """
    from tidal_hf import load_model

    with tempfile.TemporaryDirectory() as d:
        hf_config(ctx.scenario).save_pretrained(d)
        return load_model(
            d,
            quantize="auto",
            dtype=torch.bfloat16,
            random_weights=True,
            device=ctx.device,
            vram_budget=ctx.budget_bytes,
            progress=False,
            seed=ctx.seed,
        )


def _allocatable(budget: int, device: torch.device) -> int:
    """``budget``, or less when this process can no longer allocate all of it on the simulated card.

    The filler leaves the budget free when the engine starts; the CUDA context's later growth (kernel
    modules loaded, cuBLAS workspaces) takes a little of it, and ``wrap`` refuses a budget above what is
    allocatable. On the H200 about 0.1 GiB went between this call and ``wrap``'s check, so 256 MiB of
    margin is kept for it: tidal plans with slightly less than the card the other engines get.
    """
    if device.type != "cuda":
        return budget
    from tidal_plan.measure import cuda_usable_bytes

    free, total = torch.cuda.mem_get_info(device)
    can = torch.cuda.memory_allocated(device) + cuda_usable_bytes(device.index or 0, free, total, [])
    context_growth = 256 * 2**20  # bytes the CUDA context may still take before wrap() checks the budget
    return min(budget, can - context_growth)


def build_model(
    scenario: Scenario,
    fmt: str | None,
    device: torch.device,
    seed: int,
    on_block: Callable[[nn.Module], None] | None = None,
    frozen_meta: bool = False,
) -> nn.Module:
    """The model ``wrap`` gets: blocks filled (and quantized to ``fmt``) on ``device``, then kept in host RAM.

    LoRA adapters are added on the meta device first when the scenario trains adapters. On the CPU the
    host is the device, so the model stays where it was built. ``on_block`` sees each block after its
    hook, before it moves. ``frozen_meta``: frozen weights stay meta placeholders (a data-parallel rank
    other than local rank 0, which reads them from the machine's shared host copy).
    """
    model = build_meta_model(scenario, torch.bfloat16)
    if scenario.mode == "lora":
        model = add_lora(model, seed)  # on meta: materialize fills the adapters with the same values

    def hook(block: nn.Module) -> None:
        if fmt:
            quantize_base_(block, fmt)
        if on_block is not None:
            on_block(block)

    where = "device" if device.type == "cpu" else "cpu"
    materialize(model, where, device=device, seed=seed, block_hook=hook, frozen_meta=frozen_meta)
    return model


def setup(ctx: RunContext, fmt: str | None) -> Callable[[], float]:
    """Build (or load) the model, add LoRA when the scenario trains adapters, ``tidal_stream.wrap`` it."""
    sc = ctx.scenario
    if fmt not in (None, "auto") and sc.mode != "lora":
        raise NotApplicable(f"{fmt} stores frozen weights; {sc.mode} fine-tuning trains every weight")
    if fmt == "auto":
        model = _load_auto(ctx)
        if sc.mode == "lora":
            from tidal_hf import enable_peft_quant

            model = add_lora(model, ctx.seed, enable_peft_quant)  # the loader may have quantized the base
    else:
        model = build_model(sc, fmt, ctx.device, ctx.seed)
    model.config.use_cache = False
    model.train()
    opt = adamw(model, ctx.lr)
    # moments follow the plan: fp32 when they fit host RAM, else bf16 (full8b on a 128 GB host)
    # CUDA graphs of the resident blocks: wrap()'s default, named so the benchmark does not follow a change of it
    options = {
        "device": ctx.device,
        "blocks": decoder_layers(model),
        "moment_dtype": "auto",
        "cuda_graphs": "auto",
    }
    if ctx.budget_bytes is not None:
        options["vram_budget"] = _allocatable(ctx.budget_bytes, ctx.device)
    options.update(_batch_tokens(sc))
    model, opt = _wrap_as_the_note_says(model, opt, options)
    _WRAPPED[:] = [model]
    ids = ctx.batch()  # [B, T]
    return train_step(model, opt, ids)


def _wrap_as_the_note_says(model: nn.Module, opt: torch.optim.Optimizer, options: dict) -> tuple:
    """``wrap``; when its plan is refused for host RAM while the model built in host memory holds it,
    ``wrap`` again with ``host_ram`` counting those bytes, as the refusal's note tells a user to (lora110b:
    a 207 GiB exact base built on a 256 GiB host). Other refusals stand."""
    from tidal_plan import InfeasiblePlan
    from tidal_stream import wrap
    from tidal_stream.placement import model_host_bytes

    try:
        return wrap(model, opt, **options)
    except InfeasiblePlan as e:
        held = model_host_bytes(model)
        if e.resource != "host_ram" or "host_ram" in options or not held:
            raise
        print(
            f"tidal: {e}; wrapping again with host_ram counting the model's {held / 2**30:.1f} GiB",
            flush=True,
        )
        return wrap(model, opt, **options, host_ram=e.available_bytes + held)


def _batch_tokens(sc: Scenario) -> dict[str, int]:
    """``batch_tokens`` for ``wrap`` when the scenario's step is larger than the plan's default (full8b:
    8,192 tokens), as its out-of-memory note tells a user to do. A smaller step is left to the default: the
    plan then sizes activations and the loss for more tokens than come, and the measured first step
    hands the difference to resident blocks and kept activations."""
    from tidal_plan import PlanConfig

    default = PlanConfig().batch_tokens
    return {"batch_tokens": sc.tokens_per_step} if sc.tokens_per_step > default else {}


_WRAPPED: list[nn.Module] = []  # the model of this engine process's run, for notes()


def host_work_note(work: dict[str, Any]) -> str:
    """The host optimizer's own seconds per step (over the steps whose updates all ran: the last step's
    may still be running), against which a full fine-tune's step is judged; where a host-bound step's time
    goes besides: the waits on both sides, and when in the last step the worker had nothing to do."""
    n = max(work["steps"], 1)
    idle = work["last_step_idle"]
    largest = sorted(idle, key=lambda g: -g[1])[:6]
    gaps = ", ".join(f"{d:.3f} s at +{t:.3f} s" for t, d in sorted(largest))
    return (
        f"host optimizer: {work['updates']} parameter updates in {work['steps']} steps; over the "
        f"{work['steps_done']} whose updates all ran, {work['update_s_per_step']:.3f} s of AdamW per step on "
        f"its worker thread, busy {work['worker_busy_s_per_step']:.3f} s per step in all; per step (mean of "
        f"{work['steps']}) it waited {work['land_wait_s'] / n:.3f} s for gradients' D2H copies and the "
        f"forward {work['update_wait_s'] / n:.3f} s for updates; last step idle "
        f"{sum(d for _, d in idle):.3f} s in {len(idle)} gaps{' (largest: ' + gaps + ')' if idle else ''}"
    )


def notes() -> list[str]:
    """The wrapped run's plan, its measured refinement and its CUDA graphs, as tidal's decision log has them,
    the host optimizer's own seconds (:func:`host_work_note`) when it updated anything, then the hardware profile the plan was made
    with (its rates reproduce the plan on another machine)."""
    from tidal_stream import memory_report, session_of

    if not _WRAPPED:
        return []
    events = memory_report(_WRAPPED[0])["events"]
    out = [
        e["message"]
        for e in events
        if e["kind"] in ("plan", "graphs") or e["message"].startswith("measured first step")
    ]
    work = memory_report(_WRAPPED[0]).get("host_optimizer")
    if work and work["updates"]:
        out.append(host_work_note(work))
    profile = session_of(_WRAPPED[0]).profile
    if profile is not None:
        out.append(f"profile: {dataclasses.asdict(profile)}")
    return out
