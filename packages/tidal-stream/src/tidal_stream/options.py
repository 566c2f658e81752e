"""The options of ``wrap()``: one frozen dataclass, validated on construction.

Part-1 options (optimizer offload) are acted on by :mod:`tidal_stream.optimizer`; the part-2 options
(weight streaming, activation offload, recompute, attention backend) are validated here and handed to
the part-2 installer (see :func:`tidal_stream.wrap.wrap`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from tidal_stream.distributed import DistributedConfig, check_distributed_option
from tidal_stream.errors import OptionError, option_error

__all__ = ["PART2_OPTIONS", "WrapOptions", "parse_bytes_option"]

MomentDtype = Literal["fp32", "bf16", "auto"]
Fraction = bool | float | Literal["auto"] | Sequence[int]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_ATTENTION = ("auto", "flash", "efficient", "cudnn", "math")

#: Names of the options acted on by the part-2 installer (weights, activations, recompute, attention).
PART2_OPTIONS = (
    "param_offload",
    "activation_offload",
    "recompute",
    "prefetch_depth",
    "max_inflight_bytes",
    "blocks",
    "attention",
)


def parse_bytes_option(name: str, value: object) -> int | None:
    """Parse a byte count given as an int or a string such as ``"24GiB"`` / ``"1.5 GB"``.

    Args:
        name: the option's name, for the error message.
        value: ``None``, a positive int, or a string with an optional unit (B, KB, MB, GB, TB, KiB … TiB).

    Returns:
        The number of bytes, or None when ``value`` is None.

    Raises:
        OptionError: for anything else.
    """
    accepted = "a positive int of bytes or a string like '24GiB', '1.5GB', '512MiB'"
    if value is None:
        return None
    if isinstance(value, bool):
        raise option_error(name, value, accepted)
    if isinstance(value, int):
        if value <= 0:
            raise option_error(name, value, accepted, "give a positive number of bytes.")
        return value
    if isinstance(value, str):
        m = _BYTES_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if n > 0:
                return n
    raise option_error(name, value, accepted)


def _check_fraction(name: str, value: object, allow_list: bool) -> None:
    """Validate an ``"auto" | bool | fraction [| list of block indices]`` option."""
    forms = '"auto", True, False, a fraction in [0, 1]' + (
        ", or a list of block indices" if allow_list else ""
    )
    if (value == "auto" and isinstance(value, str)) or isinstance(value, bool):
        return
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return
    if (
        allow_list
        and isinstance(value, (list, tuple))
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return
    raise option_error(name, value, forms)


@dataclasses.dataclass(frozen=True)
class WrapOptions:
    """Every option of ``wrap()``, validated in ``__post_init__`` (errors name option, value, accepted)."""

    vram_budget: int | str | None = None
    """Device memory tidal may use, bytes or a string like ``"24GiB"``; None: what the device allows minus headroom."""
    device: torch.device | str | None = None
    """Device the model trains on; None: the device of the model's first parameter."""
    threads: int | None = None
    """Host threads (``torch.set_num_threads``, process-wide: the host optimizer's worker thread runs its
    updates on as many); None: leave torch's setting."""
    verbose: bool = False
    """Print each decision as it is made (it is always logged and recorded in the decision log)."""
    accumulation_steps: int = 1
    """Micro-steps per optimizer update; gradients accumulate on the host in fp32; default 1."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this value (reduced on the host as gradients land); None: no clipping."""
    moment_dtype: MomentDtype = "fp32"
    """Adam moments in ``"fp32"``, ``"bf16"`` (stochastic rounding) or ``"auto"`` (the plan decides); default fp32."""
    offload: bool | Literal["auto"] = "auto"
    """``"auto"``: the plan splits optimizer state between GPU and host by the budget (all on GPU when it
    fits); True: all optimizer state on the host; False: plain fused AdamW on the device. Default ``"auto"``."""
    delayed_update: bool = False
    """Host update of step t overlaps forward/backward of step t+1 (weights one step stale); default False."""
    rollback: bool = False
    """Undo a failed step exactly (parameters, masters, moments as before it); costs one more master and
    pair of moments of (pageable) host memory per host-updated parameter, a copy of each before its update
    (host AdamW time about doubles) and a transient copy of the device-placed state in ``step()``. False
    (default): a failed step raises its own exception and never hangs, and the parameters it had already
    updated keep their update (see docs/reliability.md)."""
    lr: float | None = None
    """Learning rate of the AdamW created when no optimizer is given (default 1e-3 then); invalid with one."""
    seed: int = 0
    """Seed of the stochastic-rounding generator of bf16 moments; default 0."""
    plan: Any = None
    """A ``tidal_plan.Plan`` to follow instead of planning (``offload="auto"`` only); default None."""
    host_ram: int | str | None = None
    """(plan) Host RAM the plan may use, bytes or a string like ``"200GiB"``; None: what is available when
    ``wrap()`` plans. The model's own weights in host memory are not available then, yet ``wrap()`` frees
    them as it moves them to the device or into pinned copies: a model built in host RAM larger than what
    is left (a 110B base on a 256 GiB host) is planned by passing them in here."""
    batch_tokens: int | None = None
    """Tokens per micro-batch the plan sizes activations for; None: the plan's default."""
    loss_chunk_tokens: int | None = None
    """``chunk_size`` of the ``chunked_cross_entropy`` the loop computes its loss with, so the plan counts
    one chunk of logits; None: the loop builds the full logits (e.g. ``model(..., labels=)``). Default None."""
    param_offload: Fraction = "auto"
    """(part 2) Stream block weights: ``"auto"``, True (every block), False, a fraction, or block indices."""
    activation_offload: bool | float | Literal["auto"] = "auto"
    """(part 2) Offload saved activations to host: ``"auto"``, True, False or a fraction of blocks."""
    recompute: Fraction = "auto"
    """(part 2) Recompute blocks in backward: ``"auto"``, True, False, a fraction, or block indices."""
    prefetch_depth: int | None = None
    """(part 2) Streamed blocks prefetched ahead of the one computing (resident blocks between are skipped);
    None: the plan's choice."""
    max_inflight_bytes: int | str | None = None
    """(part 2) Bound on bytes in flight over PCIe; None: the plan's choice."""
    blocks: Any = None
    """(part 2) The layer stack (a ModuleList, a list of modules, or an attribute path); None: auto-detect."""
    attention: str | None = "auto"
    """(part 2) SDPA backend: ``"auto"`` (time once, use the fastest), a backend name, or None (untouched)."""
    cuda_graphs: bool | Literal["auto"] = "auto"
    """Replay CUDA graphs of the blocks that stay on the device and keep or recompute their activations,
    from the second step (``tidal_stream.block_graphs``): ``"auto"`` (default: on CUDA devices, single GPU;
    released at the first change of input shape), True (a CUDA device needed; kept for the first shape) or
    False (for blocks whose forward depends on more than its arguments). Either way they go on as many
    blocks as the measured room holds, and are released when the step that captured them left less than
    half the headroom under the budget, then tried once more on the blocks their measured cost fits
    (``tidal_stream.graph_fit``)."""
    distributed: bool | Literal["auto"] | DistributedConfig = "auto"
    """Data parallel (``tidal_stream.distributed``): ``"auto"`` when an initialized process group has more
    than one rank, True (needs one), False (never), or a ``DistributedConfig``; default ``"auto"``."""

    def __post_init__(self) -> None:
        parse_bytes_option("vram_budget", self.vram_budget)
        parse_bytes_option("host_ram", self.host_ram)
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise option_error("device", self.device, '"cpu", "cuda", "cuda:N" or a torch.device') from e
        if self.threads is not None and (
            not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1
        ):
            raise option_error("threads", self.threads, "a positive int, or None")
        if not isinstance(self.verbose, bool):
            raise option_error("verbose", self.verbose, "True or False")
        if (
            not isinstance(self.accumulation_steps, int)
            or isinstance(self.accumulation_steps, bool)
            or self.accumulation_steps < 1
        ):
            raise option_error("accumulation_steps", self.accumulation_steps, "an int >= 1")
        if self.max_grad_norm is not None and (
            isinstance(self.max_grad_norm, bool)
            or not isinstance(self.max_grad_norm, (int, float))
            or not math.isfinite(self.max_grad_norm)
            or self.max_grad_norm <= 0
        ):
            raise option_error("max_grad_norm", self.max_grad_norm, "a positive finite float, or None")
        if self.moment_dtype not in ("fp32", "bf16", "auto"):
            raise option_error("moment_dtype", self.moment_dtype, '"fp32", "bf16" or "auto"')
        if not (isinstance(self.offload, bool) or self.offload == "auto"):
            raise option_error("offload", self.offload, '"auto", True or False')
        if not isinstance(self.delayed_update, bool):
            raise option_error("delayed_update", self.delayed_update, "True or False")
        if not isinstance(self.rollback, bool):
            raise option_error("rollback", self.rollback, "True or False")
        if self.lr is not None and (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not math.isfinite(self.lr)
            or self.lr < 0
        ):
            raise option_error("lr", self.lr, "a finite float >= 0, or None")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise option_error("seed", self.seed, "an int")
        if self.plan is not None:
            from tidal_plan import Plan

            if not isinstance(self.plan, Plan):
                raise option_error("plan", self.plan, "a tidal_plan.Plan, or None")
        if self.batch_tokens is not None and (
            not isinstance(self.batch_tokens, int)
            or isinstance(self.batch_tokens, bool)
            or self.batch_tokens < 1
        ):
            raise option_error("batch_tokens", self.batch_tokens, "an int >= 1, or None")
        if self.loss_chunk_tokens is not None and (
            not isinstance(self.loss_chunk_tokens, int)
            or isinstance(self.loss_chunk_tokens, bool)
            or self.loss_chunk_tokens < 1
        ):
            raise option_error(
                "loss_chunk_tokens", self.loss_chunk_tokens, "an int >= 1 (the loss's chunk_size), or None"
            )
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise option_error("cuda_graphs", self.cuda_graphs, '"auto", True or False')
        self._check_part2()
        check_distributed_option(self.distributed)

    def _check_part2(self) -> None:
        _check_fraction("param_offload", self.param_offload, allow_list=True)
        _check_fraction("activation_offload", self.activation_offload, allow_list=False)
        _check_fraction("recompute", self.recompute, allow_list=True)
        if self.prefetch_depth is not None and (
            not isinstance(self.prefetch_depth, int)
            or isinstance(self.prefetch_depth, bool)
            or self.prefetch_depth < 0
        ):
            raise option_error("prefetch_depth", self.prefetch_depth, "an int >= 0, or None")
        parse_bytes_option("max_inflight_bytes", self.max_inflight_bytes)
        b = self.blocks
        if not (
            b is None
            or isinstance(b, (str, nn.ModuleList))
            or (isinstance(b, (list, tuple)) and b and all(isinstance(m, nn.Module) for m in b))
        ):
            raise option_error(
                "blocks",
                b,
                "None, an nn.ModuleList, a non-empty list of modules, or an attribute path string",
            )
        if self.attention is not None and self.attention not in _ATTENTION:
            raise option_error("attention", self.attention, f"None or one of {list(_ATTENTION)}")

    @property
    def vram_budget_bytes(self) -> int | None:
        """``vram_budget`` in bytes (None when not given)."""
        return parse_bytes_option("vram_budget", self.vram_budget)

    def part2_non_default(self) -> list[str]:
        """Names of part-2 options whose value differs from the default."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [
            n
            for n in PART2_OPTIONS
            if getattr(self, n) is not defaults[n] and getattr(self, n) != defaults[n]
        ]

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> WrapOptions:
        """Build from ``wrap(**options)``; unknown names raise an error listing the accepted ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise OptionError(
                f"wrap(): unknown option {unknown[0]}={options[unknown[0]]!r}; accepted options: {names}. "
                "Fix: check the spelling (see help(tidal_stream.WrapOptions))."
            )
        return cls(**options)


def mostly_trained(trainable_bytes: int, total_bytes: int) -> bool:
    """Full fine-tuning rather than LoRA-like: trained bytes are more than half of the blocks' bytes (then
    trained weights stream with the frozen ones and the host optimizer updates their host copies)."""
    return trainable_bytes > 0.5 * total_bytes
