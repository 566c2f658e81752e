"""The plan's data: ``Plan`` and its parts, ``explain()`` and the JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal_plan.errors import PlanConfigError
from tidal_plan.units import format_bytes

_TOLERANCE = 0.25
"""The cost model's target: predicted step time within +-25 % of the measured one."""

__all__ = ["BlockPlan", "OptimizerPlan", "Plan", "StepPrediction", "compare_prediction"]


@dataclass(frozen=True)
class OptimizerPlan:
    """Where AdamW runs and how big its state is."""

    placement: Literal["gpu", "host", "split"]
    """``"gpu"``: plain fused GPU AdamW; ``"host"``: every update on the host; ``"split"``: both."""
    moment_dtype: Literal["fp32", "bf16"]
    """dtype of the two AdamW moments."""
    gpu_blocks: tuple[int, ...]
    """Blocks whose optimizer state and update stay on the GPU: in plans of :func:`tidal_plan.plan`, the
    first trained blocks, so the host updates the last ones, whose gradients land first in backward."""
    outside_on_gpu: bool
    """Whether the trainable parameters outside the stack (if any) update on the GPU."""
    gpu_state_bytes: int
    """Optimizer state (moments + master weights) on the GPU."""
    host_state_bytes: int
    """Optimizer state (moments + master weights) on the host."""
    master_weights: bool = False
    """Whether fp32 master weights are kept for 16-bit trainable parameters."""


@dataclass(frozen=True)
class BlockPlan:
    """What happens to one block."""

    index: int
    """Position in the stack."""
    name: str
    """Qualified module name."""
    weights: Literal["resident", "streamed"]
    """``"resident"``: lives on the GPU; ``"streamed"``: fetched from pinned host memory before each use."""
    storage: Literal["exact", "int8", "nf4", "fp8", "nvfp4"]
    """Storage format of the block's frozen linear weights."""
    activations: Literal["keep", "offload", "recompute"]
    """Saved tensors: kept on the GPU, offloaded to the host, or recomputed in backward."""
    optimizer: Literal["gpu", "host", "none"]
    """Where this block's parameters update (``"none"``: nothing in it trains)."""
    weight_bytes: int = 0
    """Bytes of the block's parameters and buffers in its storage format."""
    activation_bytes: int = 0
    """Bytes the block's activations take on the GPU under this plan, for ``batch_tokens``."""


@dataclass(frozen=True)
class StepPrediction:
    """Predicted time of one optimizer step and what bounds it."""

    compute_s: float
    """GPU work (recompute included): matmuls by a roofline of their GEMM shapes at the measured matmul
    rate and HBM bandwidth, attention, memory-bound elementwise work, the loss, kernel overheads and the
    AdamW update of parameters kept on the GPU (see ``parts``)."""
    transfer_s: float
    """All PCIe traffic of a step at the measured rates."""
    exposed_transfer_s: float
    """The part of the transfers that compute cannot hide: streamed weights and gradients against the
    step's compute, offloaded activations against the phase they cross in (to the host in forward, back
    in backward), never less than the link's time for all of it beyond the compute; plus the first
    streamed block's fetch where the forward before it cannot hide it."""
    host_adamw_s: float
    """Host AdamW time for the host-updated parameters."""
    exposed_optimizer_s: float
    """The part of the host AdamW that backward cannot hide."""
    step_s: float
    """Predicted seconds of one steady-state training step: ``compute_s + exposed_transfer_s +
    exposed_optimizer_s``. A step is forward, backward (recompute included) and the optimizer
    update for ``Plan.batch_tokens`` tokens, after warm-up (first-use compilation, pinned-memory
    reservation and the first fetches are not in it), without data loading. Compare it with the
    median wall time of several such steps, each bracketed by ``torch.cuda.synchronize()``, using
    :func:`compare_prediction`."""
    bound: Literal["compute", "pcie", "host_adamw", "host_ram"]
    """The resource that bounds the step."""
    parts: dict[str, float] = field(default_factory=dict)
    """``compute_s`` by kind, seconds: ``matmul`` (kernel overheads of the GEMMs included),
    ``attention``, ``elementwise``, ``launch`` (other kernels' overheads), ``dequant``, ``loss``,
    ``gpu_adamw``. Empty in plans saved before it existed."""


@dataclass(frozen=True)
class Plan:
    """Where every byte lives, and the predicted step time. Built by :func:`tidal_plan.plan`."""

    training: Literal["full", "lora"]
    """Full fine-tune or a frozen base with adapters."""
    optimizer: OptimizerPlan
    """Optimizer placement and state."""
    blocks: tuple[BlockPlan, ...]
    """Per-block decisions."""
    prefetch_depth: int
    """Streamed blocks fetched ahead."""
    max_inflight_bytes: int
    """Cap on streamed bytes in flight."""
    tiers: dict[str, int]
    """Bytes planned per tier: ``"vram"``, ``"pinned_host"``, ``"pageable_host"``."""
    prediction: StepPrediction
    """Predicted step time (``prediction.step_s``) and its parts and bound; see :class:`StepPrediction`."""
    vram_budget_bytes: int = 0
    """The device budget planned against (headroom included)."""
    host_ram_bytes: int = 0
    """The host RAM planned against (after a reserve of 5 %, at least 1 GiB, for the process and the OS)."""
    batch_tokens: int = 0
    """Tokens per step planned for."""
    quantize: str | None = None
    """Format chosen for frozen linear weights (``None``: exact)."""
    outside_weight_bytes: int = 0
    """Bytes of weights outside the stack (always resident)."""
    vram_breakdown: dict[str, int] = field(default_factory=dict)
    """VRAM by component (weights, gradients, optimizer, activations, stream window, headroom)."""
    notes: tuple[str, ...] = ()
    """Why each non-default decision was made, one line each."""

    def __post_init__(self) -> None:
        both = [b.index for b in self.blocks if b.weights == "streamed" and b.optimizer == "gpu"]
        if both:
            raise PlanConfigError(
                "Plan.blocks",
                f"blocks {both} streamed with their optimizer on the GPU",
                "a streamed block's trainable parameters update on the host (optimizer 'host' or 'none')",
                "make those blocks resident or move their optimizer to the host; plans from "
                "tidal_plan.plan() never combine the two",
            )

    @property
    def streamed_blocks(self) -> tuple[int, ...]:
        """Indices of streamed blocks."""
        return tuple(b.index for b in self.blocks if b.weights == "streamed")

    def explain(self) -> str:
        """A readable table: bytes per tier, per-block decisions, predicted step time and its bound."""
        p, o = self.prediction, self.optimizer
        lines = [
            f"tidal plan: {self.training} training, {len(self.blocks)} blocks, {self.batch_tokens} tokens/step",
            f"  budget: VRAM {format_bytes(self.vram_budget_bytes)}, host RAM {format_bytes(self.host_ram_bytes)} usable",
            "  tier            bytes",
        ]
        for tier in ("vram", "pinned_host", "pageable_host"):
            lines.append(f"  {tier:<14}  {format_bytes(self.tiers.get(tier, 0)):>10}")
        if self.vram_breakdown:
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.vram_breakdown.items() if v)
            lines.append(f"  vram = {parts}")
        lines.append(
            f"  optimizer: {o.placement} AdamW, moments {o.moment_dtype}"
            f"{', fp32 master' if o.master_weights else ''}; state on GPU {format_bytes(o.gpu_state_bytes)},"
            f" on host {format_bytes(o.host_state_bytes)}; {len(o.gpu_blocks)}/{len(self.blocks)} blocks on GPU"
        )
        stored = sorted({b.storage for b in self.blocks} - {"exact"})
        storage = self.quantize or (f"{'/'.join(stored)} (as the model holds it)" if stored else "exact")
        lines.append(
            f"  weights: storage {storage}; {len(self.streamed_blocks)} streamed, prefetch "
            f"{self.prefetch_depth}, in flight <= {format_bytes(self.max_inflight_bytes)}"
        )
        lines.append("  blocks      weights   storage  activations  optimizer      bytes   act bytes")
        for group in _runs(self.blocks):
            first, last = group[0], group[-1]
            idx = f"{first.index}" if first is last else f"{first.index}-{last.index}"
            lines.append(
                f"  {idx:<10}  {first.weights:<8}  {first.storage:<7}  {first.activations:<11}  "
                f"{first.optimizer:<9}  {format_bytes(first.weight_bytes):>9}  {format_bytes(first.activation_bytes):>10}"
            )
        lines.append(
            f"  step: {p.step_s * 1e3:.1f} ms predicted = compute {p.compute_s * 1e3:.1f} ms + exposed transfer "
            f"{p.exposed_transfer_s * 1e3:.1f} ms (of {p.transfer_s * 1e3:.1f}) + exposed host AdamW "
            f"{p.exposed_optimizer_s * 1e3:.1f} ms (of {p.host_adamw_s * 1e3:.1f}); bound: {p.bound}"
        )
        if p.parts:
            lines.append(
                "  compute = " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.parts.items() if v) + " ms"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        """JSON text; :meth:`from_json` reads it back to an equal ``Plan``."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        o = d["optimizer"]
        o["gpu_blocks"] = tuple(o["gpu_blocks"])
        d["optimizer"] = OptimizerPlan(**o)
        d["blocks"] = tuple(BlockPlan(**b) for b in d["blocks"])
        d["prediction"] = StepPrediction(**d["prediction"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def compare_prediction(plan: Plan, measured_step_s: float) -> dict[str, Any]:
    """Set a measured step time beside the plan's prediction (for benchmarks to print and check).

    Args:
        plan: The plan the run was made with.
        measured_step_s: Median seconds of steady-state steps (see :attr:`StepPrediction.step_s`).

    Returns:
        A JSON-ready dict: ``predicted_step_s``, ``measured_step_s``; ``ratio`` = measured / predicted;
        ``error`` = (predicted - measured) / measured (negative: the model is optimistic);
        ``within_25pct`` = ``abs(error) <= 0.25``; ``bound``, the predicted parts (``compute_s``,
        ``exposed_transfer_s``, ``exposed_optimizer_s``), ``batch_tokens``; and ``summary``, one line.

    Raises:
        PlanConfigError: ``measured_step_s`` is not a positive finite number.
    """
    if (
        isinstance(measured_step_s, bool)
        or not isinstance(measured_step_s, (int, float))
        or not math.isfinite(measured_step_s)
        or measured_step_s <= 0
    ):
        raise PlanConfigError(
            "measured_step_s",
            measured_step_s,
            "positive finite seconds",
            "pass the median step time in seconds",
        )
    p = plan.prediction
    measured = float(measured_step_s)
    error = (p.step_s - measured) / measured
    within = abs(error) <= _TOLERANCE
    return {
        "predicted_step_s": p.step_s,
        "measured_step_s": measured,
        "ratio": measured / p.step_s if p.step_s > 0 else math.inf,
        "error": error,
        "within_25pct": within,
        "bound": p.bound,
        "compute_s": p.compute_s,
        "exposed_transfer_s": p.exposed_transfer_s,
        "exposed_optimizer_s": p.exposed_optimizer_s,
        "batch_tokens": plan.batch_tokens,
        "summary": (
            f"step predicted {p.step_s * 1e3:.1f} ms ({p.bound}-bound), measured {measured * 1e3:.1f} ms: "
            f"measured/predicted {measured / p.step_s if p.step_s > 0 else math.inf:.2f}, "
            f"error {error:+.0%} ({'within' if within else 'outside'} +-25 %)"
        ),
    }


def _key(b: BlockPlan) -> tuple:
    return (b.weights, b.storage, b.activations, b.optimizer, b.weight_bytes, b.activation_bytes)


def _runs(blocks: tuple[BlockPlan, ...]) -> list[list[BlockPlan]]:
    """Consecutive blocks with the same decisions, grouped for the table."""
    out: list[list[BlockPlan]] = []
    for b in blocks:
        if out and _key(out[-1][-1]) == _key(b):
            out[-1].append(b)
        else:
            out.append([b])
    return out
