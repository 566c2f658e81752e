"""The memory and time model: bytes per tier and predicted step time of one candidate placement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tidal_plan.census import BlockCensus, ModelCensus
from tidal_plan.hardware import HardwareProfile
from tidal_plan.plan_types import StepPrediction

# Pageable (unpinned) host memory copies at about this share of the pinned rate (15.7 vs 55.4 GB/s on
# the GPU machine); used only for bytes that the page-lock limit pushes out of pinned memory.
PAGEABLE_RATE_SHARE = 0.28
# Weight of hidden costs (overlapped transfer, recompute) in the search objective: with the step time
# tied, the placement that moves and recomputes less wins.
HIDDEN_COST_WEIGHT = 0.1
# Hidden host AdamW weighs more: it competes with the copies for host memory bandwidth, and the share of
# optimizer state that fits on the GPU goes there first ("split" before "host").
HIDDEN_ADAMW_WEIGHT = 0.5


@dataclass
class Context:
    """Everything fixed while the planner searches."""

    census: ModelCensus
    profile: HardwareProfile
    tokens: int
    depth: int
    inflight_cap: int | None
    budget: int
    headroom: int
    host_usable: int
    master: bool
    bytes_per_weight: Callable[[str], float] | None


@dataclass
class State:
    """One candidate placement (mutable while the planner searches)."""

    fmt: str
    moment: str
    resident: list[bool]
    act: list[str]
    opt_gpu: list[bool]
    outside_opt_gpu: bool

    def copy(self) -> State:
        """A copy whose lists can change independently."""
        return State(
            self.fmt,
            self.moment,
            list(self.resident),
            list(self.act),
            list(self.opt_gpu),
            self.outside_opt_gpu,
        )


@dataclass
class Evaluation:
    """Bytes and time of a ``State``."""

    vram: dict[str, int]
    host: dict[str, int]
    pinned: int
    pageable: int
    gpu_state: int
    host_state: int
    window: int
    prediction: StepPrediction
    objective: float

    @property
    def vram_total(self) -> int:
        """All planned VRAM, headroom included."""
        return sum(self.vram.values())

    @property
    def host_total(self) -> int:
        """All planned host RAM."""
        return self.pinned + self.pageable


def state_bytes_per_param(ctx: Context, moment: str) -> int:
    """Optimizer state per trainable element: two moments plus the fp32 master copy if kept."""
    return (8 if moment == "fp32" else 4) + (4 if ctx.master else 0)


def storage_bytes(ctx: Context, fmt: str, total: int, q_params: int, q_bytes: int) -> int:
    """Bytes of weights whose frozen linear part (``q_params`` elements, ``q_bytes`` now) is stored as ``fmt``."""
    if fmt == "exact" or q_params == 0:
        return total
    assert ctx.bytes_per_weight is not None, "PlanConfig validation guarantees bytes_per_weight"
    return total - q_bytes + round(q_params * float(ctx.bytes_per_weight(fmt)))


def block_weight_bytes(ctx: Context, b: BlockCensus, fmt: str) -> int:
    """A block's parameters and buffers in storage ``fmt``."""
    return storage_bytes(
        ctx,
        fmt,
        b.trainable_bytes + b.frozen_bytes + b.buffer_bytes,
        b.quantizable_params,
        b.quantizable_bytes,
    )


def outside_weight_bytes(ctx: Context, fmt: str) -> int:
    """Weights outside the stack (the LM head quantizable when frozen, embeddings exact)."""
    c = ctx.census
    total = c.outside_trainable_bytes + c.outside_frozen_bytes + c.outside_buffer_bytes
    return storage_bytes(ctx, fmt, total, c.outside_quantizable_params, c.outside_quantizable_bytes)


def evaluate(ctx: Context, s: State) -> Evaluation:
    """Bytes per tier and predicted step time of ``s``."""
    c, prof, n_tok = ctx.census, ctx.profile, ctx.tokens
    spp = state_bytes_per_param(ctx, s.moment)
    wb = [block_weight_bytes(ctx, b, s.fmt) for b in c.blocks]
    streamed = [i for i, r in enumerate(s.resident) if not r]
    # [Note: parameters that update on the GPU stay on the GPU; a "streamed" block whose optimizer runs
    # on the GPU streams only its frozen part (a LoRA base), its trainable part is resident.]
    pinned_train = [c.blocks[i].trainable_bytes if s.opt_gpu[i] else 0 for i in range(len(wb))]
    sb = {i: wb[i] - pinned_train[i] for i in streamed}  # streamed bytes per streamed block
    max_streamed = max(sb.values(), default=0)
    window = min(ctx.depth + 1, len(streamed)) * max_streamed
    if ctx.inflight_cap is not None and streamed:
        window = min(window, ctx.inflight_cap + max_streamed)
    host_opt = [b for b in c.blocks if b.trainable_params and not s.opt_gpu[b.index]]
    gpu_opt = [b for b in c.blocks if b.trainable_params and s.opt_gpu[b.index]]
    acts_keep = sum(b.activation_bytes_per_token * n_tok for b in c.blocks if s.act[b.index] == "keep")
    acts_ckpt = sum(b.input_bytes_per_token * n_tok for b in c.blocks if s.act[b.index] == "recompute")
    recompute_peak = max(
        (b.activation_bytes_per_token * n_tok for b in c.blocks if s.act[b.index] == "recompute"), default=0
    )
    offloaded = [b for b in c.blocks if s.act[b.index] == "offload"]
    offload_window = min(ctx.depth + 1, len(offloaded)) * max(
        (b.activation_bytes_per_token * n_tok for b in offloaded), default=0
    )
    out_train = c.outside_trainable_params
    gpu_state = sum(b.trainable_params for b in gpu_opt) * spp + (out_train * spp if s.outside_opt_gpu else 0)
    host_state = sum(b.trainable_params for b in host_opt) * spp + (
        0 if s.outside_opt_gpu else out_train * spp
    )
    vram = {
        "outside weights": outside_weight_bytes(ctx, s.fmt),
        "resident weights": sum(wb[i] for i, r in enumerate(s.resident) if r)
        + sum(pinned_train[i] for i in sb),
        "stream window": window,
        "gradients": sum(b.trainable_bytes for b in gpu_opt)
        + 2 * max((b.trainable_bytes for b in host_opt), default=0)
        + c.outside_trainable_bytes,
        "optimizer state": gpu_state,
        "activations": acts_keep
        + acts_ckpt
        + recompute_peak
        + offload_window
        + c.outside_activation_bytes_per_token * n_tok,
        "headroom": ctx.headroom,
    }
    # Host: streamed weights and gradient landing buffers and offloaded activations are pinned; the
    # optimizer's moments and master weights are read only by the CPU, so they stay pageable.
    host_grads = sum(b.trainable_bytes for b in host_opt) + (
        0 if s.outside_opt_gpu else c.outside_trainable_bytes
    )
    offload_bytes = sum(b.activation_bytes_per_token * n_tok for b in offloaded)
    host = {
        "AdamW state": host_state,
        "streamed weights": sum(sb.values()),
        "gradient buffers": host_grads,
        "offloaded activations": offload_bytes,
    }
    pinned = sum(sb.values()) + host_grads + offload_bytes
    pageable = host_state
    overflow = max(0, pinned - prof.pagelock_limit_bytes)
    pinned -= overflow
    pageable += overflow

    # Time. Forward: 2 FLOP per weight per token; backward: 2 for the input gradient, 2 more for the
    # weight gradient of trainable weights; recompute repeats the forward.
    fwd = bwd = 0.0
    for b in c.blocks:
        trainable_mm = b.matmul_params - b.quantizable_params
        fwd += 2 * b.matmul_params * n_tok * (2 if s.act[b.index] == "recompute" else 1)
        bwd += (2 * b.matmul_params + 2 * trainable_mm) * n_tok
    out_trainable_mm = c.outside_matmul_params - c.outside_quantizable_params
    fwd += 2 * c.outside_matmul_params * n_tok
    bwd += (2 * c.outside_matmul_params + 2 * out_trainable_mm) * n_tok
    rate = prof.matmul_tflops * 1e12
    compute_s, bwd_s = (fwd + bwd) / rate, bwd / rate
    recompute_s = sum(2 * b.matmul_params * n_tok for b in c.blocks if s.act[b.index] == "recompute") / rate

    h2d = 2 * sum(sb.values()) + offload_bytes
    h2d += sum(b.trainable_bytes for b in host_opt if s.resident[b.index])  # updated weights return
    h2d += 0 if s.outside_opt_gpu else c.outside_trainable_bytes
    d2h = offload_bytes + host_grads
    slow = overflow / max(1, pinned + overflow)  # share of host traffic from pageable memory
    h2d_rate = prof.h2d_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    d2h_rate = prof.d2h_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    bidir_rate = prof.bidir_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    transfer_s = max(h2d / h2d_rate, d2h / d2h_rate, (h2d + d2h) / bidir_rate)
    fill_s = (sb[streamed[0]] / h2d_rate) if streamed else 0.0
    exposed_transfer_s = max(0.0, transfer_s - compute_s) + min(fill_s, transfer_s)

    hosted = sum(b.trainable_params for b in host_opt) + (0 if s.outside_opt_gpu else out_train)
    adamw_rate = prof.host_adamw_params_per_s
    host_adamw_s = hosted / adamw_rate
    # Backward hides the host updates except the last block's (block 0 and the embeddings finish last).
    tail = max((b.trainable_params for b in host_opt), default=0) + (0 if s.outside_opt_gpu else out_train)
    exposed_opt_s = max(0.0, host_adamw_s - bwd_s) + min(host_adamw_s, tail / adamw_rate)
    step_s = compute_s + exposed_transfer_s + exposed_opt_s
    costs = {"compute": compute_s, "pcie": transfer_s, "host_adamw": host_adamw_s}
    bound = max(costs, key=lambda k: costs[k])
    if bound == "pcie" and overflow:
        bound = "host_ram"
    pred = StepPrediction(
        compute_s=compute_s,
        transfer_s=transfer_s,
        exposed_transfer_s=exposed_transfer_s,
        host_adamw_s=host_adamw_s,
        exposed_optimizer_s=exposed_opt_s,
        step_s=step_s,
        bound=bound,  # type: ignore[arg-type]
    )
    objective = step_s + HIDDEN_COST_WEIGHT * (transfer_s + recompute_s) + HIDDEN_ADAMW_WEIGHT * host_adamw_s
    return Evaluation(vram, host, pinned, pageable, gpu_state, host_state, window, pred, objective)
