"""``PlanConfig``: what the user asks of the planner. Validated on construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tidal_plan.errors import PlanConfigError
from tidal_plan.units import parse_bytes

__all__ = ["FORMATS", "PlanConfig"]

FORMATS = ("int8", "nf4", "fp8", "nvfp4")
"""Quantized storage formats of frozen weights."""

Fraction = bool | float | list[int] | str


def _check_choice(option: str, value: object, accepted: tuple) -> None:
    if isinstance(value, bool) and not any(isinstance(a, bool) for a in accepted):
        raise PlanConfigError(option, value, " | ".join(repr(a) for a in accepted))
    if value not in accepted:
        raise PlanConfigError(option, value, " | ".join(repr(a) for a in accepted))


def _check_policy(option: str, value: object, *, allow_list: bool, allow_float: bool) -> None:
    """``"auto" | True | False`` plus, where allowed, a fraction in [0, 1] or a list of block indices."""
    accepted = "'auto', True, False" + (", a float in [0, 1]" if allow_float else "")
    accepted += ", a list of block indices" if allow_list else ""
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool):
        return
    if allow_float and isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise PlanConfigError(option, value, accepted, "a fraction is the share of blocks, 0.0 to 1.0")
        return
    if allow_list and isinstance(value, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
            raise PlanConfigError(option, value, accepted, "block indices are non-negative ints")
        return
    raise PlanConfigError(option, value, accepted)


@dataclass(frozen=True)
class PlanConfig:
    """What to plan for. Every field has a default; sizes accept ints or strings like ``"24GiB"``."""

    vram_budget: int | str | None = None
    """Device bytes tidal may use; default ``None`` takes the profile's budget."""
    host_ram: int | str | None = None
    """Host RAM tidal may use; default ``None`` takes the profile's figure."""
    batch_tokens: int = 4096
    """Tokens per optimizer step (batch x sequence length); default 4096."""
    training: Literal["full", "lora", "auto"] = "auto"
    """``"full"`` (every parameter trains), ``"lora"`` (a frozen base plus adapters); default ``"auto"``
    infers it from ``requires_grad``."""
    quantize: Literal["auto", "int8", "nf4", "fp8", "nvfp4"] | None = None
    """Storage of frozen linear weights; default ``None`` keeps them exact, ``"auto"`` quantizes only when
    exact storage does not fit (int8 before nf4)."""
    prefer: Literal["memory", "speed"] = "speed"
    """``"speed"`` spends the budget to shorten the step; ``"memory"`` stops once gains drop under 2 %."""
    moment_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """AdamW moment dtype; default ``"auto"``: fp32, or bf16 when fp32 moments would not fit host RAM."""
    offload: Literal["auto"] | bool = "auto"
    """Optimizer on the host: ``True`` all, ``False`` none (GPU AdamW), default ``"auto"`` only what does
    not fit on the GPU."""
    param_offload: Fraction = "auto"
    """Weights streamed from the host: ``True``/``False``, a share of blocks, or block indices; default
    ``"auto"`` streams only what does not fit."""
    activation_offload: Literal["auto"] | bool | float = "auto"
    """Saved activations sent to the host: ``True``/``False`` or a share of blocks; default ``"auto"``."""
    recompute: Literal["auto"] | bool | float | list[int] = "auto"
    """Blocks recomputed in backward: ``True``/``False``, a share of blocks, or indices; default ``"auto"``."""
    prefetch_depth: int = 2
    """Blocks fetched ahead of the one computing; default 2."""
    max_inflight_bytes: int | str | None = None
    """Cap on streamed bytes in flight; default ``None`` = ``prefetch_depth`` of the largest blocks."""
    bytes_per_weight: Callable[[str], float] | None = None
    """``fmt -> bytes per weight`` of quantized formats (scales included), given by the caller (e.g.
    ``tidal_quant.bytes_per_weight``); needed whenever ``quantize`` is not None. Default None."""
    headroom_bytes: int | str | None = None
    """Device bytes left unplanned (workspaces, fragmentation); default ``None`` = 5 % of the budget,
    at least 256 MiB."""
    master_weights: Literal["auto"] | bool = "auto"
    """Keep fp32 master weights for 16-bit trainable parameters; default ``"auto"`` = yes for 16-bit."""
    seq_len: int | None = None
    """Tokens per sequence (attention's work grows with it); default ``None`` = ``batch_tokens`` (one
    sequence)."""
    cuda_graphs: bool = False
    """The blocks that stay on the device, do not offload their activations and update their optimizer
    there replay CUDA graphs (tidal-stream's ``cuda_graphs``): their kernels run without host dispatch.
    Default False."""
    loss_chunk_tokens: int | None = None
    """How the loss reads the LM head's logits: ``None`` = the full ``[batch_tokens, vocab]`` logits are
    built (Hugging Face's ``labels=`` loss: about 12 bytes per logit at its peak); an int = the tokens per
    chunk of ``tidal_stream.chunked_cross_entropy``. Default ``None`` (the conservative count)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise PlanConfigError("cuda_graphs", self.cuda_graphs, "True or False")
        for name in ("vram_budget", "host_ram", "max_inflight_bytes", "headroom_bytes"):
            v = getattr(self, name)
            if v is not None:
                parse_bytes(v, option=name)
        if self.vram_budget is not None and parse_bytes(self.vram_budget, option="vram_budget") == 0:
            raise PlanConfigError("vram_budget", self.vram_budget, "a positive size", "e.g. '24GiB'")
        if (
            isinstance(self.batch_tokens, bool)
            or not isinstance(self.batch_tokens, int)
            or self.batch_tokens < 1
        ):
            raise PlanConfigError("batch_tokens", self.batch_tokens, "an int >= 1 (tokens per step)")
        _check_choice("training", self.training, ("full", "lora", "auto"))
        _check_choice("quantize", self.quantize, (None, "auto", *FORMATS))
        _check_choice("prefer", self.prefer, ("memory", "speed"))
        _check_choice("moment_dtype", self.moment_dtype, ("auto", "fp32", "bf16"))
        _check_policy("offload", self.offload, allow_list=False, allow_float=False)
        _check_policy("master_weights", self.master_weights, allow_list=False, allow_float=False)
        _check_policy("param_offload", self.param_offload, allow_list=True, allow_float=True)
        _check_policy("activation_offload", self.activation_offload, allow_list=False, allow_float=True)
        _check_policy("recompute", self.recompute, allow_list=True, allow_float=True)
        if (
            isinstance(self.prefetch_depth, bool)
            or not isinstance(self.prefetch_depth, int)
            or self.prefetch_depth < 1
        ):
            raise PlanConfigError("prefetch_depth", self.prefetch_depth, "an int >= 1")
        if self.seq_len is not None and (
            isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1
        ):
            raise PlanConfigError("seq_len", self.seq_len, "an int >= 1 (tokens per sequence) or None")
        if self.loss_chunk_tokens is not None and (
            isinstance(self.loss_chunk_tokens, bool)
            or not isinstance(self.loss_chunk_tokens, int)
            or self.loss_chunk_tokens < 1
        ):
            raise PlanConfigError(
                "loss_chunk_tokens",
                self.loss_chunk_tokens,
                "an int >= 1 (the chunked loss's chunk_size) or None (full logits)",
            )
        if self.bytes_per_weight is not None and not callable(self.bytes_per_weight):
            raise PlanConfigError("bytes_per_weight", self.bytes_per_weight, "a callable fmt -> float")
        if self.quantize is not None and self.bytes_per_weight is None:
            raise PlanConfigError(
                "bytes_per_weight",
                None,
                "a callable fmt -> bytes per weight when quantize is set",
                f"quantize={self.quantize!r} needs it: pass bytes_per_weight=tidal_quant.bytes_per_weight",
            )
        if self.recompute is True and self.activation_offload is True:
            raise PlanConfigError(
                "recompute", True, "not True together with activation_offload=True", "choose one of the two"
            )

    def bytes_or_none(self, name: str) -> int | None:
        """A size field parsed to bytes (``None`` stays ``None``)."""
        v = getattr(self, name)
        return None if v is None else parse_bytes(v, option=name)
