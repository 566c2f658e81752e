"""The memory and time model: bytes per tier and predicted step time of one candidate placement."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal_plan.census import BlockCensus, ModelCensus
from tidal_plan.gemm import KERNEL_OVERHEAD_S, block_matmuls_s, gemm_launches, matmul_rate
from tidal_plan.hardware import HardwareProfile
from tidal_plan.param_bytes import adamw_bytes, host_slot_bytes, state_bytes_per_param
from tidal_plan.plan_types import StepPrediction
from tidal_plan.stream_schedule import frozen_blocks, held_blocks, streamed_step_s

# Pageable (unpinned) host memory copies at about this share of the pinned rate (15.7 vs 55.4 GB/s on
# the GPU machine); used only for bytes that the page-lock limit pushes out of pinned memory.
PAGEABLE_RATE_SHARE = 0.28
# Weight of hidden costs (overlapped transfer, recompute) in the search objective: with the step time
# tied, the placement that moves and recomputes less wins.
HIDDEN_COST_WEIGHT = 0.1
# Hidden host AdamW weighs more: it competes with the copies for host memory bandwidth, and the share of
# optimizer state that fits on the GPU goes there first ("split" before "host").
HIDDEN_ADAMW_WEIGHT = 0.5

# ---- GPU time (see gpu_time) ----------------------------------------------------------------------------
# Inside a replayed CUDA graph a kernel follows the previous one after the device's own launch latency,
# about 2 us, with no host dispatch; the host spends about 60 us per replay (copying the inputs in, the
# replay call, copying the outputs out, the autograd node), once per block forward and once per backward.
GRAPH_KERNEL_GAP_S = 2e-6
GRAPH_REPLAY_HOST_S = 60e-6
# Autograd runs about two kernels per forward kernel (a gradient per input, plus the accumulations).
BACKWARD_KERNELS_PER_FORWARD = 2.0
# Host time eager PyTorch spends per kernel of a block (Python module code, autograd recording, the
# backward engine, the launch), forward and backward kernels alike. A block's forward (or backward) takes
# the longer of its GPU time and this host time: the GPU idles while the host falls behind. Calibrated on
# the GPU machine: Qwen2 shapes of 6 and of 28 blocks (~45 M parameters a block, 2048 tokens) both ran
# 3.75 ms per block per step, ~2.9 ms more than their GEMMs at the sustained matmul rate, across
# 45 forward + 90 backward kernels.
HOST_DISPATCH_S = 28e-6
# Memory-bound work (norms, activations, residuals, rotary, casts) in HBM bytes per byte autograd saves:
# counting the passes of a Llama/Qwen2 block (RMSNorm computed in fp32, rotary on q and k, SiLU-gated MLP,
# two residuals) gives about 140 x hidden bytes per token read + written in forward and 2.2 times that in
# backward, against 46 x hidden bytes saved.
ELEMENTWISE_BYTES_PER_SAVED_BYTE = 9.0
ELEMENTWISE_BACKWARD_PER_FORWARD = 2.2
# Fused attention (FlashAttention-2 / torch SDPA) runs at about half the dense matmul rate (softmax
# exponentials between the two matmuls); its backward does 5 matmuls per tile against forward's 2.
ATTENTION_EFFICIENCY = 0.5
ATTENTION_BACKWARD_PER_FORWARD = 2.5
# The loss over the logits: an fp32 copy of the bf16 logits (2 B read + 4 written), log-softmax
# (4 + 4), its backward (4 + 4 read, 4 written), the gradient's bf16 cast (4 + 2) and the scatter of the
# target term (4): about 36 bytes of HBM traffic per logit.
LOSS_BYTES_PER_LOGIT = 36
LOSS_FORWARD_SHARE = 14 / 36
# Device bytes per logit at the peak of a loss over the full [tokens, vocab] logits (Hugging Face's
# ``labels=`` loss): log-softmax's saved fp32 output, the fp32 gradient nll_loss hands it and the fp32
# gradient it returns are alive together when backward starts (4 + 4 + 4); in forward the bf16 logits,
# their fp32 copy and the log-softmax output (2 + 4 + 4) peak lower.
FULL_LOSS_PEAK_BYTES_PER_LOGIT = 12
# tidal_stream.chunked_cross_entropy per logit of one chunk: forward holds the chunk's bf16 logits, their
# fp32 copy and logsumexp's fp32 temporary (2 + 4 + 4); backward the fp32 softmax gradient and its bf16
# cast (4 + 2), beside the head's fp32 weight-gradient accumulator and the chunk's bf16 product (4 + 2
# bytes per head weight).
CHUNKED_LOSS_FORWARD_BYTES_PER_LOGIT = 10
CHUNKED_LOSS_BACKWARD_BYTES_PER_LOGIT = 6
CHUNKED_LOSS_BYTES_PER_HEAD_WEIGHT = 6
# Bytes per parameter of the update the profile's host AdamW rate was measured on: fp32 weight read and
# written, fp32 gradient read, two fp32 moments read and written.
HOST_ADAMW_PROFILED_BYTES = 28
# Bytes per parameter of the profile's whole host update (``host_update_params_per_s``): bf16 gradient
# widened (2 + 4), fused AdamW on fp32 master, gradient and moments (28), new weight narrowed (4 + 2).
HOST_UPDATE_PROFILED_BYTES = 40
# The host update with bf16 moments against the fp32 path, per parameter (benchmarks/stream/host_adamw.py,
# ``bf16_moments_share``). With the noise drawn by generators the GPU machine's host (16 threads) took
# 10.6 s against 0.280 s over 468 M parameters (0.026). The noise is now read from a table at drawn
# offsets, and the bf16 path is bound by memory traffic like the fp32 one: the two-GPU machine's host
# (32 threads) took 210.1 ms against 149.0 ms over the same 468 M parameters (0.709; a 2-core host: 0.49).
HOST_BF16_MOMENTS_RATE_SHARE = 0.1490 / 0.2101
# Dequantizing a stored weight to bf16 before its matmul writes 2 bytes per weight beyond reading it.
DEQUANT_WRITE_BYTES = 2


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
    seq_len: int = 0
    """Tokens per sequence for attention's work (0: all ``tokens`` are one sequence)."""
    loss_chunk: int | None = None
    """Tokens per chunk of a chunked loss, or None when the full logits are built."""
    graphs: bool = False
    """Blocks that qualify replay CUDA graphs (``PlanConfig.cuda_graphs``; see :func:`graphed`)."""
    matmul_cache: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Forward and backward matmul seconds per block index (-1: outside the stack); fixed by the census,
    the profile and the tokens, so computed once per search."""


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
    pinned_overflow: int = 0
    """Bytes meant to be page-locked that the page-lock limit leaves pageable (counted in ``pageable``)."""

    @property
    def vram_total(self) -> int:
        """All planned VRAM, headroom included."""
        return sum(self.vram.values())

    @property
    def host_total(self) -> int:
        """All planned host RAM."""
        return self.pinned + self.pageable


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


def loss_peak_bytes(ctx: Context) -> int:
    """Device bytes the loss over the LM head's logits adds at its peak (0 without an outside matmul).

    The head is the outside 2-D weight with the most output features (the vocabulary). Full logits:
    ``FULL_LOSS_PEAK_BYTES_PER_LOGIT`` per logit of every token. Chunked: the larger of the forward's
    chunk and the backward's chunk beside the head's weight-gradient accumulator (when the head trains).
    """
    shapes = ctx.census.outside_matmul_shapes
    if not shapes:
        return 0
    hidden, vocab, trainable = max(shapes, key=lambda s: s[1])
    if ctx.loss_chunk is None:
        return FULL_LOSS_PEAK_BYTES_PER_LOGIT * ctx.tokens * vocab
    chunk_logits = min(ctx.loss_chunk, ctx.tokens) * vocab
    backward = CHUNKED_LOSS_BACKWARD_BYTES_PER_LOGIT * chunk_logits
    if trainable:
        backward += CHUNKED_LOSS_BYTES_PER_HEAD_WEIGHT * hidden * vocab
    return max(CHUNKED_LOSS_FORWARD_BYTES_PER_LOGIT * chunk_logits, backward)


# fp32 gradient copies the device AdamW of 16-bit weights makes at once (tidal_stream widens its share a
# batch of this many bytes at a time, or one larger tensor).
DEVICE_UPDATE_WIDEN_BYTES = 256 * 2**20


def device_update_workspace(ctx: Context, s: State) -> int:
    """Device bytes the GPU share's AdamW needs beyond its state: fp32 copies of a batch of 16-bit
    gradients, bounded by ``DEVICE_UPDATE_WIDEN_BYTES`` or the largest tensor's copy (the embedding or
    the head in a language model). 0 when nothing updates on the GPU or the weights are fp32."""
    c = ctx.census
    on_gpu = any(s.opt_gpu[b.index] and b.trainable_params for b in c.blocks) or (
        s.outside_opt_gpu and c.outside_trainable_params
    )
    if not on_gpu or c.param_dtype_bytes >= 4:
        return 0
    block_mats = [k * n for b in c.blocks if s.opt_gpu[b.index] for k, n, t in b.matmul_shapes if t]
    largest = max(block_mats, default=0)
    if s.outside_opt_gpu and c.outside_trainable_params:
        head = [k * n for k, n, t in c.outside_matmul_shapes if t]
        # what is not a matmul weight outside the stack (embeddings, norms) taken as one tensor: an upper bound
        largest = max(largest, *head, c.outside_trainable_params - sum(head))
    return max(DEVICE_UPDATE_WIDEN_BYTES, 4 * largest)


@dataclass
class GpuTime:
    """Seconds of GPU work in one step (see :func:`gpu_time`)."""

    total_s: float
    backward_s: float
    recompute_s: float
    parts: dict[str, float]
    head_backward_s: float = 0.0
    """Backward before the first block's: the loss and the layers after the stack (the LM head)."""
    block_backward_s: tuple[float, ...] = ()
    """Backward seconds of each block (host dispatch waits and recompute included), by block index."""
    block_forward_s: tuple[float, ...] = ()
    """Forward seconds of each block (host dispatch waits included), by block index."""
    _prefix: tuple[float, ...] = field(default=(), repr=False, compare=False)  # forward_before's sums

    @property
    def forward_s(self) -> float:
        """Forward seconds (the stack, the head and the loss's forward share)."""
        return self.total_s - self.backward_s - self.parts.get("gpu_adamw", 0.0)

    def forward_before(self, i: int) -> float:
        """Forward seconds before block ``i`` starts (embeddings are a gather: not counted)."""
        if len(self._prefix) != len(self.block_forward_s) + 1:
            self._prefix = (0.0, *itertools.accumulate(self.block_forward_s))
        return self._prefix[i]


def graphed(ctx: Context, s: State, b: BlockCensus) -> bool:
    """Block ``b`` replays CUDA graphs under ``s``: graphs asked for, on a GPU, its weights resident, its
    activations kept or recomputed, and its optimizer (if it trains anything) on the GPU."""
    i = b.index
    return (
        ctx.graphs
        and ctx.profile.device_kind == "cuda"
        and s.resident[i]
        and s.act[i] != "offload"
        and (s.opt_gpu[i] or not b.trainable_params)
    )


def gpu_time(ctx: Context, s: State) -> GpuTime:
    """GPU seconds of one step under ``s``: matmuls by the roofline of their GEMM shapes, attention's
    T x T work, memory-bound elementwise work, the loss over the logits, kernel overheads, dequantizing
    stored weights, and the AdamW update of the parameters kept on the GPU."""
    c, prof, t = ctx.census, ctx.profile, ctx.tokens
    hbm = prof.hbm_gbps * 1e9
    peak = matmul_rate(ctx)
    ctx_avg = (min(ctx.seq_len or t, t) + 1) / 2  # causal: each query attends to half the sequence
    ew_fwd_share = 1 / (1 + ELEMENTWISE_BACKWARD_PER_FORWARD)
    dequant = s.fmt != "exact" and not (s.fmt == "fp8" and prof.has_fp8_tensor_cores)
    bpw = float(ctx.bytes_per_weight(s.fmt)) if dequant and ctx.bytes_per_weight else 0.0
    bpw_fp8 = float(ctx.bytes_per_weight("fp8")) if s.fmt == "fp8" and ctx.bytes_per_weight else 1.0
    parts = dict.fromkeys(
        ("matmul", "attention", "elementwise", "launch", "dispatch", "dequant", "loss", "gpu_adamw"), 0.0
    )
    fwd_total = bwd_total = recompute = 0.0
    block_bwd = [0.0] * len(c.blocks)
    block_fwd = [0.0] * len(c.blocks)
    # A GPU runs kernels while the host dispatches the next ones: the longer of the two bounds a block's
    # pass. A CPU stand-in runs each kernel on the dispatching thread: the two add up.
    overlapped = prof.device_kind == "cuda"
    for b in c.blocks:
        passes = 2 if s.act[b.index] == "recompute" else 1  # recompute repeats the forward in backward
        mm_f, mm_b = block_matmuls_s(ctx, b.index)
        att = 4 * t * b.attention_width * ctx_avg / (ATTENTION_EFFICIENCY * peak)  # QK^T and AV
        ew = ELEMENTWISE_BYTES_PER_SAVED_BYTE * b.activation_bytes_per_token * t / hbm
        gap = GRAPH_KERNEL_GAP_S if graphed(ctx, s, b) else KERNEL_OVERHEAD_S
        if gap != KERNEL_OVERHEAD_S:  # the GEMMs' launches are graph launches too
            n_f, n_b = gemm_launches(ctx, b.index)
            mm_f, mm_b = mm_f - n_f * (KERNEL_OVERHEAD_S - gap), mm_b - n_b * (KERNEL_OVERHEAD_S - gap)
        other = max(0, b.forward_kernels - len(b.matmul_shapes)) * gap
        # a stored (quantized) weight is dequantized for each use: forward, recompute, input gradient
        dq = b.quantizable_params * (bpw + DEQUANT_WRITE_BYTES) / hbm if dequant else 0.0
        stored_dq = (b.stored_bytes + b.stored_params * DEQUANT_WRITE_BYTES) / hbm  # stored in the model
        fp8_grad = 0.0  # FP8 tensor cores multiply fp8 weights as they are; the input gradient dequantizes
        if b.stored_params and not (b.stored_format == "fp8" and prof.has_fp8_tensor_cores):
            dq += stored_dq
        elif b.stored_params:
            fp8_grad += stored_dq
        if s.fmt == "fp8" and prof.has_fp8_tensor_cores:
            fp8_grad += b.quantizable_params * (bpw_fp8 + DEQUANT_WRITE_BYTES) / hbm
        f = mm_f + att + ew * ew_fwd_share + other + dq
        parts["matmul"] += mm_f * passes + mm_b
        parts["attention"] += att * (passes + ATTENTION_BACKWARD_PER_FORWARD)
        parts["elementwise"] += ew * (1 + (passes - 1) * ew_fwd_share)
        parts["launch"] += other * (passes + BACKWARD_KERNELS_PER_FORWARD)
        parts["dequant"] += dq * (passes + 1) + fp8_grad
        b_gpu = (passes - 1) * f + mm_b + att * ATTENTION_BACKWARD_PER_FORWARD
        b_gpu += ew * (1 - ew_fwd_share) + other * BACKWARD_KERNELS_PER_FORWARD + dq + fp8_grad
        host_f = b.forward_kernels * HOST_DISPATCH_S  # 0 when the census could not count kernels
        host_b = host_f * (passes - 1 + BACKWARD_KERNELS_PER_FORWARD)
        if gap != KERNEL_OVERHEAD_S:
            host_f = host_b = GRAPH_REPLAY_HOST_S  # the recompute replays inside the backward graph
        wait_f = max(0.0, host_f - f) if overlapped else host_f
        wait_b = max(0.0, host_b - b_gpu) if overlapped else host_b
        parts["dispatch"] += wait_f + wait_b
        fwd_total += f + wait_f
        bwd_total += b_gpu + wait_b
        block_bwd[b.index] = b_gpu + wait_b
        block_fwd[b.index] = f + wait_f
        recompute += (passes - 1) * f
    out_frozen = c.outside_quantizable_params
    mm_f, mm_b = block_matmuls_s(ctx, -1)
    vocab = max((n for _, n, _ in c.outside_matmul_shapes), default=0)
    loss = LOSS_BYTES_PER_LOGIT * t * vocab / hbm
    dq = out_frozen * (bpw + DEQUANT_WRITE_BYTES) / hbm if dequant else 0.0  # a stored LM head
    parts["matmul"] += mm_f + mm_b
    parts["loss"] = loss
    parts["dequant"] += 2 * dq
    fwd_total += mm_f + loss * LOSS_FORWARD_SHARE + dq
    head_bwd = mm_b + loss * (1 - LOSS_FORWARD_SHARE) + dq
    bwd_total += head_bwd
    on_gpu = sum(b.trainable_params for b in c.blocks if s.opt_gpu[b.index])
    on_gpu += c.outside_trainable_params if s.outside_opt_gpu else 0
    parts["gpu_adamw"] = on_gpu * adamw_bytes(ctx, s.moment) / hbm
    total = fwd_total + bwd_total + parts["gpu_adamw"]
    return GpuTime(
        total_s=total,
        backward_s=bwd_total,
        recompute_s=recompute,
        parts=parts,
        head_backward_s=head_bwd,
        block_backward_s=tuple(block_bwd),
        block_forward_s=tuple(block_fwd),
    )


def host_update_rate(ctx: Context, moment: str) -> float:
    """Parameters per second the host updates under ``moment`` moments: the profile's whole-update rate
    (or, without one, its fp32 fused AdamW rate) scaled by the bytes each update moves; bf16 moments at
    the measured share of the fp32 path (:data:`HOST_BF16_MOMENTS_RATE_SHARE`)."""
    prof = ctx.profile
    if moment == "bf16":
        return host_update_rate(ctx, "fp32") * HOST_BF16_MOMENTS_RATE_SHARE
    nbytes = adamw_bytes(ctx, moment)
    if prof.host_update_params_per_s:
        return prof.host_update_params_per_s * HOST_UPDATE_PROFILED_BYTES / nbytes
    return prof.host_adamw_params_per_s * HOST_ADAMW_PROFILED_BYTES / nbytes


def exposed_host_update_s(
    ctx: Context, s: State, gpu: GpuTime, rate: float, d2h_rate: float, h2d_rate: float | None = None
) -> float:
    """Seconds the host update adds to the step: how long the next forward waits for it.

    Backward runs the LM head first, then the blocks from last to first, then the embeddings. Each
    host-updated block's gradient crosses the link when its backward ends (one copy stream, in order);
    the host worker updates the blocks one after another as their gradients land. After backward the GPU
    runs its own AdamW, then the next forward, which reads a host-updated weight only when it reaches its
    module: a resident block ``i`` waits for its update and the new weight's copy back (``h2d_rate``)
    at the forward time of blocks ``0..i-1``; a streamed block's refill, issued ``prefetch_depth`` blocks
    ahead, waits for its update on the host; the embeddings (and a head tied to them) are read first,
    an untied head last. The largest lateness is exposed. Host-updated blocks at the top of the stack
    thus overlap nearly all of backward and the next forward up to them; at the bottom, neither.
    """
    c, n_blocks = ctx.census, len(ctx.census.blocks)
    h2d = h2d_rate or ctx.profile.h2d_gbps * 1e9
    # (gradient ready on the GPU, parameters, gradient bytes, needed at in the next forward, bytes back)
    jobs: list[tuple[float, int, int, float, int]] = []
    t = gpu.head_backward_s
    early = 0
    if not s.outside_opt_gpu and c.outside_trainable_params:
        # an untied trainable LM head gets its gradient first; tied to the embeddings it lands last
        tied_outside = any(all(c.param_to_block.get(n) is None for n in group) for group in c.tied)
        if not tied_outside:
            early = min(
                sum(k * n for k, n, trains in c.outside_matmul_shapes if trains), c.outside_trainable_params
            )
        if early:
            nbytes = early * c.param_dtype_bytes
            jobs.append((t, early, nbytes, gpu.forward_before(n_blocks), nbytes))
    for b in reversed(c.blocks):
        t += gpu.block_backward_s[b.index] if gpu.block_backward_s else 0.0
        if b.trainable_params and not s.opt_gpu[b.index]:
            if s.resident[b.index]:
                need, back = gpu.forward_before(b.index), b.trainable_bytes
            else:  # the refill copies the host copy the update wrote; its time is the link's
                need, back = gpu.forward_before(max(0, b.index - ctx.depth)), 0
            jobs.append((t, b.trainable_params, b.trainable_bytes, need, back))
    rest = 0 if s.outside_opt_gpu else c.outside_trainable_params - early
    if rest:
        nbytes = rest * c.param_dtype_bytes
        jobs.append((gpu.backward_s, rest, nbytes, 0.0, nbytes))
    forward_starts = gpu.backward_s + gpu.parts["gpu_adamw"]
    link = done = late = 0.0
    for ready, params, nbytes, need, back in jobs:
        link = max(link, ready) + nbytes / d2h_rate  # the gradient on the host
        done = max(done, link) + params / rate  # the worker takes the jobs in landing order
        late = max(late, done + back / h2d - (forward_starts + need))
    return late


def _link_s(h2d: float, d2h: float, rates: tuple[float, float, float]) -> float:
    """Seconds the link needs for ``h2d`` and ``d2h`` bytes at (H2D, D2H, both-ways) rates."""
    return max(h2d / rates[0], d2h / rates[1], (h2d + d2h) / rates[2])


def activation_offload_exposed_s(
    ctx: Context,
    s: State,
    gpu: GpuTime,
    streamed_bytes: int,
    grad_bytes: int,
    rates: tuple[float, float, float],
) -> float:
    """Seconds offloaded activations add to the step, on top of the weights' and gradients' transfers.

    Unlike streamed weights, whose copies the pooled link count spreads over the whole step, an
    offloaded activation crosses in a fixed phase: to the host during forward (beside the first fetch of
    each streamed block) and back during backward (beside the second fetch and the gradients going to
    the host). Each phase's link time beyond its compute is exposed; the activations' share is the
    exposure with them minus the exposure without them. Backward also starts with a fetch: the last
    offloaded block's activations return while the head and the blocks above it run backward.
    """
    c = ctx.census
    off = [b for b in c.blocks if s.act[b.index] == "offload"]
    if not off:
        return 0.0
    seq = min(ctx.seq_len or ctx.tokens, ctx.tokens)
    act = sum(b.offload_bytes(ctx.tokens, seq) for b in off)
    fwd, bwd = gpu.forward_s, gpu.backward_s

    def exposed(a: int) -> float:
        return max(0.0, _link_s(streamed_bytes, a, rates) - fwd) + max(
            0.0, _link_s(streamed_bytes + a, grad_bytes, rates) - bwd
        )

    last = off[-1]
    before = gpu.head_backward_s + sum(gpu.block_backward_s[last.index + 1 :])
    fill = max(0.0, last.offload_bytes(ctx.tokens, seq) / rates[0] - before)
    return exposed(act) - exposed(0) + fill


def _streamed_weights_s(
    ctx: Context, gpu: GpuTime, sb: dict[int, int], window: int, frozen: list[bool], h2d_rate: float
) -> float:
    """Seconds of a step as the streamed blocks' refills let the compute run (see stream_schedule)."""
    turn_s = gpu.total_s - sum(gpu.block_forward_s) - sum(gpu.block_backward_s)
    refill_s = [sb[i] / h2d_rate if i in sb else None for i in range(len(gpu.block_forward_s))]
    args = (gpu.block_forward_s, gpu.block_backward_s, turn_s, refill_s, ctx.depth, window)
    return streamed_step_s(*args, frozen)


def evaluate(ctx: Context, s: State) -> Evaluation:
    """Bytes per tier and predicted step time of ``s``."""
    c, prof, n_tok = ctx.census, ctx.profile, ctx.tokens
    spp = state_bytes_per_param(ctx, s.moment)
    wb = [block_weight_bytes(ctx, b, s.fmt) for b in c.blocks]
    streamed = [i for i, r in enumerate(s.resident) if not r]
    # A streamed block streams all its bytes, trainable ones included, and updates them on the host
    # (see the planner's [Note: streamed blocks update on the host]).
    assert not any(s.opt_gpu[i] and c.blocks[i].trainable_params for i in streamed), "streamed + GPU AdamW"
    sb = {i: wb[i] for i in streamed}  # streamed bytes per streamed block
    max_streamed = max(sb.values(), default=0)
    window = min(ctx.depth + 1, len(streamed)) * max_streamed
    if ctx.inflight_cap is not None and streamed:
        window = min(window, ctx.inflight_cap + max_streamed)
    host_opt = [b for b in c.blocks if b.trainable_params and not s.opt_gpu[b.index]]
    gpu_opt = [b for b in c.blocks if b.trainable_params and s.opt_gpu[b.index]]
    seq = min(ctx.seq_len or n_tok, n_tok)
    acts_keep = sum(b.keep_bytes(n_tok, seq) for b in c.blocks if s.act[b.index] == "keep")
    acts_ckpt = sum(b.recompute_bytes(n_tok) for b in c.blocks if s.act[b.index] == "recompute")
    # a recomputed block's backward holds its full saved set again, one block at a time
    recompute_peak = max(
        (b.keep_bytes(n_tok, seq) for b in c.blocks if s.act[b.index] == "recompute"), default=0
    )
    offloaded = [b for b in c.blocks if s.act[b.index] == "offload"]
    offload_window = min(ctx.depth + 1, len(offloaded)) * max(
        (b.keep_bytes(n_tok, seq) for b in offloaded), default=0
    )
    out_train = c.outside_trainable_params
    gpu_state = sum(b.trainable_params for b in gpu_opt) * spp + (out_train * spp if s.outside_opt_gpu else 0)
    vram = {
        "outside weights": outside_weight_bytes(ctx, s.fmt),
        "resident weights": sum(wb[i] for i, r in enumerate(s.resident) if r),
        "stream window": window,
        "gradients": sum(b.trainable_bytes for b in gpu_opt)
        + 2 * max((b.trainable_bytes for b in host_opt), default=0)
        + c.outside_trainable_bytes,
        "optimizer state": gpu_state,
        "activations": acts_keep
        + acts_ckpt
        + recompute_peak
        + offload_window
        + c.outside_activation_bytes(n_tok, seq),
        "loss": loss_peak_bytes(ctx),
        "headroom": ctx.headroom,
    }
    # The update runs after backward freed the activations and the loss: only its excess counts.
    vram["update workspace"] = max(0, device_update_workspace(ctx, s) - vram["activations"] - vram["loss"])
    # Host: streamed weights, offloaded activations and the optimizer's buffers that device copies read or
    # write are pinned; what only the CPU touches stays pageable (host_slot_bytes).
    host_params = sum(b.trainable_params for b in host_opt) + (0 if s.outside_opt_gpu else out_train)
    slot_pinned, slot_pageable = host_slot_bytes(ctx, s.moment)
    w, m = c.param_dtype_bytes, (4 if s.moment == "fp32" else 2)
    master = 4 if (w >= 4 or ctx.master) else 0
    offload_bytes = sum(b.offload_bytes(n_tok, seq) for b in offloaded)
    host_grads = host_params * w  # gradients copied to the host each step
    host = {
        "AdamW state": host_params * (master + 2 * m),
        "streamed weights": sum(sb.values()),
        # fp32: the gradient; 16-bit: the landing buffer, which also carries the new weight back
        "gradient buffers": host_params * (4 if w >= 4 else w),
        "offloaded activations": offload_bytes,
    }
    host_state = host["AdamW state"]
    pinned = sum(sb.values()) + offload_bytes + host_params * slot_pinned
    pageable = host_params * slot_pageable
    overflow = max(0, pinned - prof.pagelock_limit_bytes)
    pinned -= overflow
    pageable += overflow

    gpu = gpu_time(ctx, s)
    compute_s, recompute_s = gpu.total_s, gpu.recompute_s

    # each streamed block is refilled for its forward and its backward, but for those turn holds keep
    window_blocks, frozen = (round(window / max_streamed) if streamed else 0), frozen_blocks(c.blocks)
    tail, head = held_blocks(streamed, window_blocks, frozen)
    h2d = 2 * sum(sb.values()) - sum(sb[i] for i in tail + head) + offload_bytes
    h2d += sum(b.trainable_bytes for b in host_opt if s.resident[b.index])  # updated weights return
    h2d += 0 if s.outside_opt_gpu else c.outside_trainable_bytes
    d2h = offload_bytes + host_grads
    slow = overflow / max(1, pinned + overflow)  # share of host traffic from pageable memory
    h2d_rate = prof.h2d_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    d2h_rate = prof.d2h_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    bidir_rate = prof.bidir_gbps * 1e9 * (1 - slow + slow * PAGEABLE_RATE_SHARE)
    rates = (h2d_rate, d2h_rate, bidir_rate)
    transfer_s = _link_s(h2d, d2h, rates)
    # Gradients and returning weights: their copies spread over the step. Streamed weights: the step as
    # their refills allow, block by block (tidal_plan.stream_schedule). Offloaded activations cross in
    # fixed phases (see their function); all traffic together never hides in less than the link's time.
    pooled_s = _link_s(h2d - offload_bytes, d2h - offload_bytes, rates)
    weights_s = _streamed_weights_s(ctx, gpu, sb, window_blocks, frozen, h2d_rate) if streamed else 0.0
    offload_s = activation_offload_exposed_s(ctx, s, gpu, sum(sb.values()), host_grads, rates)
    exposed_transfer_s = max(
        transfer_s - compute_s, max(0.0, max(pooled_s, weights_s) - compute_s) + offload_s
    )

    hosted = sum(b.trainable_params for b in host_opt) + (0 if s.outside_opt_gpu else out_train)
    adamw_rate = host_update_rate(ctx, s.moment)
    host_adamw_s = hosted / adamw_rate
    exposed_opt_s = exposed_host_update_s(ctx, s, gpu, adamw_rate, d2h_rate, h2d_rate) if hosted else 0.0
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
        parts=gpu.parts,
    )
    objective = step_s + HIDDEN_COST_WEIGHT * (transfer_s + recompute_s) + HIDDEN_ADAMW_WEIGHT * host_adamw_s
    return Evaluation(vram, host, pinned, pageable, gpu_state, host_state, window, pred, objective, overflow)
