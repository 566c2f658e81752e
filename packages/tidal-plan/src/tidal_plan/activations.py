"""Block tracing helpers for the activation census (:mod:`tidal_plan.act_bytes`): capture a block's inputs, run it on the meta device, count kernels."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)


class _Captured(Exception):
    """Raised from the first block's pre-hook to stop the model's forward once its inputs are known."""


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (flash / memory-efficient) saves: q, k, v, the output and a fp32
    log-sum-exp per head and query. Used only on the meta device, where SDPA would take the math path."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # The kernels write the output token-major and return it transposed, so the caller's
        # transpose(1, 2).reshape(B, T, H * Dv) for the output projection is a view, not a copy.
        b, h, t, _ = q.shape
        out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)  # [B, H, T, Dv], token-major
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # [B, H, T]
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # pragma: no cover - never run
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _meta_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return _FusedAttention.apply(q, k, v)


@contextlib.contextmanager
def _meta_tracing(active: bool) -> Iterator[None]:
    """Make a meta-device forward look like the GPU's for one census trace.

    ``torch.autocast(device_type="meta")`` (rotary embeddings ask for it) acts as the CPU one, and
    ``scaled_dot_product_attention`` saves what the fused GPU kernels save instead of the math path's
    fp32 copies and T x T matrices.

    [Note: torch has no autocast dtype and no fused attention for the meta device; these patches live
    only while one census traces a meta model, and are undone on exit.]
    """
    if not active:
        yield
        return
    orig_init = torch.autocast.__init__
    orig_sdpa = torch.nn.functional.scaled_dot_product_attention

    def init(self: torch.autocast, device_type: str, *args: Any, **kwargs: Any) -> None:
        orig_init(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast.__init__ = init  # type: ignore[method-assign]
    torch.nn.functional.scaled_dot_product_attention = _meta_sdpa
    try:
        yield
    finally:
        torch.autocast.__init__ = orig_init  # type: ignore[method-assign]
        torch.nn.functional.scaled_dot_product_attention = orig_sdpa


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _capture_block_inputs(
    model: nn.Module, first: nn.Module, seq_len: int, example_inputs: dict[str, Any] | None
) -> tuple[tuple, dict[str, Any]]:
    """Run the model until its first block is called; return that call's args and kwargs."""
    captured: dict[str, Any] = {}

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Captured

    device = _model_device(model)
    if example_inputs is None:
        example_inputs = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long, device=device)}
    kwargs = dict(example_inputs)
    if _accepts(model.forward, "use_cache") and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    answers = _PlainBatchAnswers() if device.type == "meta" else None
    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with contextlib.suppress(_Captured), torch.no_grad(), answers or contextlib.nullcontext():
            model(**kwargs)
    finally:
        handle.remove()
    if answers is not None and answers.answered:
        logger.debug(
            "meta forward asked %d yes/no questions of tensor values; answered yes", answers.answered
        )
    if "args" not in captured:
        raise RuntimeError("the model's forward returned without calling its first block")
    return captured["args"], captured["kwargs"]


class _PlainBatchAnswers(TorchDispatchMode):
    """Answer the yes/no questions a model's forward asks of a meta tensor's values with "yes".

    [Note: transformers 5 reads values while it builds the causal mask: "is every position id one
    more than the last" (no packed sequences) and "is every token attended" (no padding). A meta
    tensor has no values, so ``bool()`` / ``.item()`` raise. Meta inputs stand for one unpadded
    sequence with positions 0..T-1, for which the true answer to each such question is yes; that
    leads transformers down the path the GPU takes for the same batch (no mask tensor, SDPA's
    ``is_causal``, grouped k/v). Only boolean scalars are answered, and only while the forward runs
    up to the first block; any other value read still raises.]
    """

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0
        """How many boolean reads were answered."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        t = args[0] if args else None
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and isinstance(t, torch.Tensor)
            and t.device.type == "meta"
            and t.dtype == torch.bool
        ):
            self.answered += 1
            return True
        return func(*args, **(kwargs or {}))


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, bool, Any]:
    """The block's main input (first tensor positional, else ``hidden_states``/``x`` keyword)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a, True, i
    for k in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(k), torch.Tensor):
            return kwargs[k], False, k
    raise RuntimeError("could not find the block's floating-point input tensor")


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples / lists / dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


# Operations that launch no device kernel (allocation, aliasing, metadata) are not counted as kernels.
_NO_KERNEL = frozenset(
    (
        "empty",
        "empty_like",
        "new_empty",
        "empty_strided",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "_local_scalar_dense",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
    )
)


class _KernelCount(TorchDispatchMode):
    """Counts the operations that run a device kernel (views and allocations excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        """Operations counted so far."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _heuristic(block: nn.Module) -> int:
    """Fallback: each linear layer saves its input and its output (ReLU/SiLU/products keep similar)."""
    total = 0
    for m in block.modules():
        if isinstance(m, nn.Linear):
            total += (m.in_features + m.out_features) * m.weight.element_size()
    return total
