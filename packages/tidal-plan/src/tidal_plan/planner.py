"""``plan()``: decide where every byte lives, or refuse with the numbers and the way out."""

from __future__ import annotations

import logging
import math

from tidal_plan.census import ModelCensus
from tidal_plan.config import FORMATS, PlanConfig
from tidal_plan.cost import (
    Context,
    Evaluation,
    State,
    block_weight_bytes,
    evaluate,
    outside_weight_bytes,
    state_bytes_per_param,
)
from tidal_plan.errors import InfeasiblePlan, PlanConfigError
from tidal_plan.hardware import HardwareProfile
from tidal_plan.plan_types import BlockPlan, OptimizerPlan, Plan
from tidal_plan.search import ACT_ORDER, Fixed, fit_host, maximal, minimal, search
from tidal_plan.units import GiB, MiB, format_bytes

__all__ = ["plan"]

logger = logging.getLogger(__name__)

# With quantize="auto" and prefer="speed", a smaller storage format must shorten the step this much.
SPEED_PREFER_MIN_GAIN = 0.10


def _share(value: object, n: int) -> set[int]:
    """Blocks selected by a policy value (True, a fraction of the first blocks, or indices). A fraction
    takes the leading blocks, as ``tidal_stream`` reads the same options."""
    if value is True:
        return set(range(n))
    if isinstance(value, float):
        return set(range(math.ceil(value * n)))
    if isinstance(value, (list, tuple)):
        return {i for i in value}
    return set()


def _fixed(config: PlanConfig, census: ModelCensus) -> Fixed:
    n = len(census.blocks)
    for opt in ("param_offload", "recompute"):
        v = getattr(config, opt)
        if isinstance(v, (list, tuple)) and any(i >= n for i in v):
            raise PlanConfigError(opt, v, f"block indices below {n} (the stack has {n} blocks)")
    resident: list[bool | None] = [None] * n
    if config.param_offload is False:
        resident = [True] * n
    elif config.param_offload != "auto":
        streamed = _share(config.param_offload, n)
        resident = [i not in streamed for i in range(n)]
    offl = _share(config.activation_offload, n) if config.activation_offload != "auto" else None
    reco = _share(config.recompute, n) if config.recompute != "auto" else None
    act_allowed = []
    for i in range(n):
        allowed = list(ACT_ORDER)
        if offl is not None:
            allowed = ["offload"] if i in offl else [a for a in allowed if a != "offload"]
        if reco is not None:
            allowed = (
                [a for a in allowed if a == "recompute"]
                if i in reco
                else [a for a in allowed if a != "recompute"]
            )
        if not allowed:  # offload forced and recompute forced on the same block
            raise PlanConfigError(
                "recompute",
                config.recompute,
                "blocks disjoint from activation_offload's",
                "choose one per block",
            )
        act_allowed.append(allowed)
    opt_gpu = None if config.offload == "auto" else (not config.offload)
    if opt_gpu:
        # [Note: streamed blocks update on the host] a streamed block's weights live in pinned host
        # memory between uses, so its trainable parameters update there (tidal_stream refuses anything
        # else): offload=False keeps every block that trains resident.
        trained = [b.index for b in census.blocks if b.trainable_params]
        forced_out = [i for i in trained if resident[i] is False]
        if forced_out:
            raise PlanConfigError(
                "param_offload",
                config.param_offload,
                "no streamed block that trains when offload=False (every update on the GPU)",
                f"blocks {_ranges(forced_out)} train: streamed blocks update on the host; pass offload='auto' "
                "or offload=True to stream them, or param_offload=False",
            )
        for i in trained:
            resident[i] = True
    return Fixed(resident, act_allowed, opt_gpu)


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _formats(config: PlanConfig, census: ModelCensus, profile: HardwareProfile) -> list[str]:
    has_frozen_linear = (
        census.outside_quantizable_params + sum(b.quantizable_params for b in census.blocks) > 0
    )
    q = config.quantize
    if q is None:
        return ["exact"]
    if q == "auto":
        return ["exact", "int8", "nf4"] if has_frozen_linear else ["exact"]
    if not has_frozen_linear:
        stored = sorted({b.stored_format for b in census.blocks if b.stored_params})
        raise PlanConfigError(
            "quantize",
            q,
            "None when no linear weight is frozen in floating point",
            f"the frozen linear weights are already stored as {'/'.join(stored)}; leave quantize=None"
            if stored
            else "quantization stores frozen weights; use LoRA",
        )
    if q == "fp8" and not profile.has_fp8_tensor_cores:
        raise PlanConfigError(
            "quantize",
            q,
            f"{', '.join(f for f in FORMATS if f != 'fp8')} on {profile.device_name}",
            "fp8 needs FP8 tensor cores (sm_89+); use 'int8' or 'nf4'",
        )
    return [q]


def _training(config: PlanConfig, census: ModelCensus) -> str:
    if census.trainable_params == 0:
        raise PlanConfigError(
            "model",
            "no trainable parameters",
            "a model with requires_grad parameters",
            "unfreeze the parameters to train (or add LoRA adapters)",
        )
    inferred = "full" if census.frozen_params == 0 else "lora"
    if config.training == "lora" and census.frozen_params == 0:
        raise PlanConfigError(
            "training",
            "lora",
            "'full' for a model without frozen parameters",
            "freeze the base or pass 'full'",
        )
    return inferred if config.training == "auto" else config.training


def _context(census: ModelCensus, profile: HardwareProfile, config: PlanConfig) -> Context:
    budget = config.bytes_or_none("vram_budget")
    if budget is None:
        budget = profile.vram_budget_bytes
    elif profile.device_kind == "cuda" and budget > profile.device_total_bytes:
        raise PlanConfigError(
            "vram_budget",
            config.vram_budget,
            f"at most {format_bytes(profile.device_total_bytes)} ({profile.device_name})",
            "lower the budget",
        )
    if budget <= 0:
        raise PlanConfigError(
            "vram_budget",
            budget,
            "a positive budget",
            f"{profile.device_name} reports no free memory; pass one",
        )
    host = config.bytes_or_none("host_ram")
    host = profile.host_ram_bytes if host is None else host
    headroom = config.bytes_or_none("headroom_bytes")
    headroom = max(256 * MiB, budget // 20) if headroom is None else headroom
    if headroom >= budget:
        raise PlanConfigError(
            "headroom_bytes",
            config.headroom_bytes,
            f"less than the budget {format_bytes(budget)}",
            "lower the headroom or raise vram_budget",
        )
    master = (
        config.master_weights if isinstance(config.master_weights, bool) else census.param_dtype_bytes < 4
    )
    return Context(
        census=census,
        profile=profile,
        tokens=config.batch_tokens,
        depth=config.prefetch_depth,
        inflight_cap=config.bytes_or_none("max_inflight_bytes"),
        budget=budget,
        headroom=headroom,
        host_usable=max(0, host - max(GiB, host // 20)),
        master=master,
        bytes_per_weight=config.bytes_per_weight,
        seq_len=config.seq_len or 0,
        loss_chunk=config.loss_chunk_tokens,
        graphs=config.cuda_graphs,
    )


def plan(census: ModelCensus, profile: HardwareProfile, config: PlanConfig | None = None) -> Plan:
    """Decide where every byte lives: optimizer placement, moments, weight residency, storage, activations.

    Args:
        census: The model's census (:func:`tidal_plan.census`).
        profile: The machine (:func:`tidal_plan.profile_hardware` or ``HardwareProfile.synthetic``).
        config: What to plan for; default ``PlanConfig()``.

    Returns:
        The plan, with its predicted step time. Plain GPU AdamW with every block resident when everything
        fits; otherwise the cheapest placement found by a search over the cost model
        (:mod:`tidal_plan.search`): the host share of the optimizer and the streamed blocks on the last
        blocks (see [Note: overlap order]), and per block the cheapest of keep / recompute / offload.

    Raises:
        InfeasiblePlan: When no placement fits the VRAM budget or host RAM, with the numbers and ways out.
        PlanConfigError: For options that contradict the model or the machine.
    """
    config = config if config is not None else PlanConfig()
    if not isinstance(config, PlanConfig):
        raise PlanConfigError("config", type(config).__name__, "a PlanConfig", "build one: PlanConfig(...)")
    if not isinstance(census, ModelCensus):
        raise PlanConfigError(
            "census", type(census).__name__, "a ModelCensus", "call tidal_plan.census(model)"
        )
    if not isinstance(profile, HardwareProfile):
        raise PlanConfigError(
            "profile", type(profile).__name__, "a HardwareProfile", "call tidal_plan.profile_hardware()"
        )
    training = _training(config, census)
    ctx = _context(census, profile, config)
    fx = _fixed(config, census)
    formats = _formats(config, census, profile)
    moments = ["fp32", "bf16"] if config.moment_dtype == "auto" else [config.moment_dtype]
    failures: list[tuple[str, str, str, Evaluation]] = []  # (fmt, moment, resource, evaluation)
    chosen: tuple[State, Evaluation, list[str]] | None = None
    for fmt in formats:
        for moment in moments:
            found = _try(ctx, fx, config, fmt, moment, failures)
            if found is not None:
                chosen = found
                break
        if chosen is not None:
            break
    if chosen is None:
        raise _infeasible(ctx, config, failures)
    state, ev, notes = chosen
    if state.fmt != "exact" and config.quantize == "auto":
        notes.append(
            f"quantize='auto': exact storage did not fit; frozen linear weights stored as {state.fmt}"
        )
    if config.quantize == "auto" and config.prefer == "speed" and not all(state.resident):
        state, ev, notes = _faster_format(ctx, fx, config, formats, (state, ev, notes))
    if state.fmt == "nvfp4" and not profile.has_fp4_tensor_cores:
        notes.append("nvfp4 without FP4 tensor cores: weights are dequantized before each matmul")
    return _build(ctx, config, training, state, ev, notes)


def _faster_format(
    ctx: Context,
    fx: Fixed,
    config: PlanConfig,
    formats: list[str],
    found: tuple[State, Evaluation, list[str]],
) -> tuple[State, Evaluation, list[str]]:
    """With ``quantize="auto"`` and ``prefer="speed"``: a smaller format whose plan (free, or with every
    block resident) predicts a step at least ``SPEED_PREFER_MIN_GAIN`` shorter replaces a streaming plan."""
    best = found
    first = found[0]
    all_resident = Fixed([True if r is None else r for r in fx.resident], fx.act_allowed, fx.opt_gpu)
    for fmt in formats[formats.index(first.fmt) + 1 :]:
        for fixed in (fx, all_resident):
            alt = _try(ctx, fixed, config, fmt, first.moment, [])
            if (
                alt is None
                or alt[1].prediction.step_s >= (1 - SPEED_PREFER_MIN_GAIN) * best[1].prediction.step_s
            ):
                continue
            streams = len(first.resident) - sum(first.resident)
            best = (
                alt[0],
                alt[1],
                [
                    *(n for n in found[2] if not n.startswith("moments")),
                    *alt[2],
                    f"quantize='auto', prefer='speed': {fmt} predicts {alt[1].prediction.step_s * 1e3:.0f} ms/step, "
                    f"{first.fmt} {found[1].prediction.step_s * 1e3:.0f} ms streaming {streams} blocks",
                ],
            )
    return best


def _try(
    ctx: Context, fx: Fixed, config: PlanConfig, fmt: str, moment: str, failures: list
) -> tuple[State, Evaluation, list[str]] | None:
    n = len(ctx.census.blocks)
    notes: list[str] = []
    full = maximal(n, fmt, moment, fx)
    ev_full = evaluate(ctx, full)
    if ev_full.vram_total <= ctx.budget and ev_full.host_total <= ctx.host_usable:
        return full, ev_full, notes
    # Two starting points (recompute everywhere, offload everywhere): a greedy search from one alone can
    # spend the budget on weights before it sees that recomputing every block frees the link.
    results, smallest = [], None
    for floor in ("recompute", "offload"):
        low = minimal(n, fmt, moment, fx, floor)
        ev_low = evaluate(ctx, low)
        if smallest is None or ev_low.vram_total < smallest.vram_total:
            smallest = ev_low
        if ev_low.vram_total <= ctx.budget:
            # fit host RAM first (a start past it trades speed for it while VRAM is free); the search
            # then spends the VRAM left without taking host RAM past what is usable
            low, ev_low = fit_host(ctx, low, ev_low, fx)
            results.append(search(ctx, low, fx, config.prefer))
    if not results:
        assert smallest is not None
        failures.append((fmt, moment, "vram", smallest))
        return None
    # the fastest that fits host RAM; when none does, the one needing the least is reported
    fitting = [r for r in results if r[1].host_total <= ctx.host_usable]
    if not fitting:
        failures.append((fmt, moment, "host_ram", min(results, key=lambda r: r[1].host_total)[1]))
        return None
    s, ev = min(fitting, key=lambda r: r[1].objective)
    if moment == "bf16" and config.moment_dtype == "auto":
        notes.append("moments bf16: fp32 moments would not fit host RAM")
    return s, ev, notes


def _infeasible(ctx: Context, config: PlanConfig, failures: list) -> InfeasiblePlan:
    vram = [f for f in failures if f[2] == "vram"]
    host = [f for f in failures if f[2] == "host_ram"]
    if host:
        fmt, moment, _, ev = host[-1]
        need, avail = ev.host_total, ctx.host_usable
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in ev.host.items() if v)
        state = ev.host["AdamW state"]
        if state > need // 4:
            what = f"host AdamW needs {format_bytes(state)} for {moment} moments{' + fp32 master' if ctx.master else ''}"
            msg = f"{what}; host RAM needs {format_bytes(need)} in all ({parts}), {format_bytes(avail)} available"
        else:
            msg = f"host RAM needs {format_bytes(need)} ({parts}), {format_bytes(avail)} available"
        ways = []
        if moment == "fp32" and state > need // 4:
            bf = state * state_bytes_per_param(ctx, "bf16") // state_bytes_per_param(ctx, moment)
            ways.append(f"use moment_dtype='bf16' ({format_bytes(bf)})")
        if ctx.master and state > need // 4 and config.master_weights != False:  # noqa: E712 - "auto"/True
            ways.append("master_weights=False (bf16 updates without an fp32 copy)")
        if (
            fmt == "exact"
            and ev.host["streamed weights"] > need // 4
            and sum(b.quantizable_params for b in ctx.census.blocks)
        ):
            ways.append("quantize='int8' (frozen weights in about 1 byte each)")
        if ev.host["offloaded activations"] > need // 4:
            ways.append("activation_offload=False or fewer batch_tokens")
        if ctx.census.frozen_params == 0:
            ways.append("train adapters (LoRA) instead of every parameter")
        ways.append(f"host_ram >= {format_bytes(need + max(GiB, need // 20))} if the machine has it")
        return InfeasiblePlan("host_ram", need, avail, msg, tuple(ways))
    fmt, moment, _, ev = vram[-1]
    need = ev.vram_total
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in ev.vram.items() if v)
    msg = f"the smallest placement needs {format_bytes(need)} of VRAM ({parts}), budget {format_bytes(ctx.budget)}"
    ways = []
    if config.quantize is None and ctx.census.frozen_params:
        ways.append("quantize='auto' (int8, else nf4 frozen weights)")
    # activations and full logits both grow in proportion to the tokens (one chunk of logits does not)
    act = ev.vram["activations"] + (ev.vram["loss"] if config.loss_chunk_tokens is None else 0)
    if act > need - ctx.budget and config.batch_tokens > 1:
        over = need - ctx.budget
        fit_tokens = max(1, int(config.batch_tokens * (1 - over / act)))
        ways.append(f"batch_tokens <= {fit_tokens} (activations and logits take {format_bytes(act)})")
    if ev.vram["loss"] > need - ctx.budget and config.loss_chunk_tokens is None:
        chunk = min(1024, max(1, config.batch_tokens // 4))
        ways.append(
            f"tidal_stream.chunked_cross_entropy and loss_chunk_tokens={chunk} (full logits take "
            f"{format_bytes(ev.vram['loss'])})"
        )
    if outside_weight_bytes(ctx, fmt) > ctx.budget // 2:
        ways.append(
            f"a model whose embeddings/head ({format_bytes(outside_weight_bytes(ctx, fmt))}) fit the budget"
        )
    ways.append(f"vram_budget >= {format_bytes(need)}")
    return InfeasiblePlan("vram", need, ctx.budget, msg, tuple(ways))


def _build(
    ctx: Context, config: PlanConfig, training: str, s: State, ev: Evaluation, notes: list[str]
) -> Plan:
    c = ctx.census
    blocks = []
    streamed_bytes: list[int] = []
    for b in c.blocks:
        act = s.act[b.index]
        seq = min(ctx.seq_len or ctx.tokens, ctx.tokens)
        act_bytes = {
            "keep": b.keep_bytes(ctx.tokens, seq),
            "recompute": b.recompute_bytes(ctx.tokens),
            "offload": 0,
        }[act]
        has_frozen_linear = b.quantizable_params > 0
        wbytes = block_weight_bytes(ctx, b, s.fmt)
        streamed = not s.resident[b.index] and wbytes > 0  # a block without bytes has nothing to stream
        streamed_bytes.append(wbytes if streamed else 0)
        blocks.append(
            BlockPlan(
                index=b.index,
                name=b.name,
                weights="streamed" if streamed else "resident",
                # already-quantized linears keep the format the model holds them in
                storage=b.stored_format if b.stored_params else (s.fmt if has_frozen_linear else "exact"),  # type: ignore[arg-type]
                activations=act,  # type: ignore[arg-type]
                optimizer="none" if not b.trainable_params else ("gpu" if s.opt_gpu[b.index] else "host"),
                weight_bytes=wbytes,
                activation_bytes=act_bytes,
            )
        )
    gpu_blocks = tuple(b.index for b in c.blocks if b.trainable_params and s.opt_gpu[b.index])
    trained_blocks = [b for b in c.blocks if b.trainable_params]
    outside_gpu = s.outside_opt_gpu or c.outside_trainable_params == 0
    on_gpu = len(gpu_blocks) == len(trained_blocks) and outside_gpu
    on_host = not gpu_blocks and (not s.outside_opt_gpu or c.outside_trainable_params == 0)
    placement = "gpu" if on_gpu else ("host" if on_host else "split")
    opt = OptimizerPlan(
        placement=placement,  # type: ignore[arg-type]
        moment_dtype=s.moment,  # type: ignore[arg-type]
        gpu_blocks=gpu_blocks,
        outside_on_gpu=outside_gpu,
        gpu_state_bytes=ev.gpu_state,
        host_state_bytes=ev.host_state,
        master_weights=ctx.master,
    )
    if ev.pinned_overflow:
        notes.append(
            f"page-lock limit {format_bytes(ctx.profile.pagelock_limit_bytes)}: "
            f"{format_bytes(ev.pinned_overflow)} of streamed data stays pageable (slower copies); "
            "raise `ulimit -l`"
        )
    inflight = config.bytes_or_none("max_inflight_bytes")
    if inflight is None:
        inflight = ctx.depth * max(streamed_bytes, default=0)
    result = Plan(
        training=training,  # type: ignore[arg-type]
        optimizer=opt,
        blocks=tuple(blocks),
        prefetch_depth=ctx.depth,
        max_inflight_bytes=inflight,
        tiers={"vram": ev.vram_total, "pinned_host": ev.pinned, "pageable_host": ev.pageable},
        prediction=ev.prediction,
        vram_budget_bytes=ctx.budget,
        host_ram_bytes=ctx.host_usable,
        batch_tokens=ctx.tokens,
        quantize=None if s.fmt == "exact" else s.fmt,
        outside_weight_bytes=outside_weight_bytes(ctx, s.fmt),
        vram_breakdown=dict(ev.vram),
        notes=tuple(notes),
    )
    logger.info("plan:\n%s", result.explain())
    return result
