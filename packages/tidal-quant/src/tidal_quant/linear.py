"""``quant_linear`` (autograd: gradient for the input only), ``QuantLinear`` and ``quantize_model_``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from tidal_quant import _log, linear_ops, ops
from tidal_quant.api import (
    block_scales,
    check_double_quant,
    check_quantized,
    check_shape,
    quantize,
    storage_layout,
)
from tidal_quant.errors import bad_arg
from tidal_quant.formats import QuantFormat, QuantizedWeight, as_format, resolve_block_size

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CFG = ("block_size", "double_quant", "outliers", "fp8_backward", "fp8_compute")  # from_linear's options
_BUFFER = {"data": "weight_data", "scales": "weight_scales", "scales2": "weight_scales2"}
_BUFFER.update({"offset": "weight_offset", "global_scale": "weight_global_scale"})


def check_outliers(fmt: QuantFormat, outliers: object) -> float:
    """Validate ``outliers``: a fraction in [0, 0.5); > 0 only for fp8 (the format that quantizes inputs)."""
    if isinstance(outliers, bool) or not isinstance(outliers, (int, float)):
        raise bad_arg("outliers", outliers, "a float fraction in [0, 0.5)", "e.g. outliers=0.01")
    if not 0.0 <= float(outliers) < 0.5:
        raise bad_arg("outliers", outliers, "a float fraction in [0, 0.5)", "e.g. outliers=0.01")
    if outliers and fmt is not QuantFormat.FP8:
        raise bad_arg(
            "outliers",
            outliers,
            "0 for formats that keep activations exact (int8, nf4, nvfp4); > 0 only with fmt='fp8'",
            "drop outliers or use fmt='fp8'",
        )
    return float(outliers)


def check_fp8_backward(fmt: QuantFormat, fp8_backward: object) -> bool:
    """Validate ``fp8_backward``: a bool, True only for fp8."""
    if not isinstance(fp8_backward, bool):
        raise bad_arg("fp8_backward", fp8_backward, "True or False")
    if fp8_backward and fmt is not QuantFormat.FP8:
        raise bad_arg("fp8_backward", fp8_backward, "False unless fmt='fp8'", "drop fp8_backward")
    return fp8_backward


def check_fp8_compute(fmt: QuantFormat, fp8_compute: object) -> bool:
    """Validate ``fp8_compute``: a bool, True only for int8, nf4 and nvfp4 (fp8 weights already use FP8 tensor cores)."""
    if not isinstance(fp8_compute, bool):
        raise bad_arg("fp8_compute", fp8_compute, "True or False")
    if fp8_compute and fmt is QuantFormat.FP8:
        raise bad_arg(
            "fp8_compute",
            fp8_compute,
            "False for fmt='fp8' (its forward already runs on FP8 tensor cores); True for int8, nf4, nvfp4",
            "drop fp8_compute; pass fp8_backward=True for the input gradient",
        )
    return fp8_compute


def n_outlier_channels(outliers: float, in_features: int) -> int:
    """Input channels multiplied in high precision per call: ``round(outliers * in_features)``, ≥ 1 if > 0."""
    return 0 if outliers <= 0 else max(1, round(outliers * in_features))


def quant_linear(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    outliers: float = 0.0,
    fp8_backward: bool = False,
    fp8_compute: bool = False,
) -> torch.Tensor:
    """``x @ dequantize(qw)ᵀ + bias`` without materializing the weight where a kernel can avoid it.

    Autograd gives a gradient for ``x`` (and ``bias`` if it requires one), never for ``qw``.
    FP8 on CUDA compute capability ≥ 8.9 runs on FP8 tensor cores (``torch._scaled_mm``, per-token
    activation scales); elsewhere the weight is dequantized to ``x.dtype``.

    Args:
        x: activations ``[..., in_features]`` (bf16, fp16 or fp32) on ``qw``'s device.
        qw: the quantized weight ``[out_features, in_features]``.
        bias: optional ``[out_features]``.
        outliers: fp8 only: fraction of input channels (largest |x| of this call) kept in ``x.dtype``.
        fp8_backward: fp8 only: compute the input gradient on FP8 tensor cores too (per-token e4m3
            gradients; faster, less precise). Default: ``grad @ dequantize(W)`` in ``grad.dtype``.
        fp8_compute: int8 / nf4 / nvfp4 only: recast the weight to e4m3 (one scale per output row) on
            each call and run the forward and the input gradient on FP8 tensor cores (compute capability
            ≥ 8.9, at least ``fp8_ops.FP8_COMPUTE_MIN_TOKENS`` tokens; otherwise, or for shapes
            ``torch._scaled_mm`` cannot take, the bf16 path). The stored bytes do not change. Faster at
            many tokens; each weight is rounded once more (to e4m3), which costs NF4 / NVFP4 little and
            int8 much of its precision.

    Returns:
        ``[..., out_features]`` in ``x.dtype``.
    """
    return _run(x, _plan_of(check_quantized(qw), outliers, fp8_backward, fp8_compute), bias)


def _plan_of(
    qw: QuantizedWeight, outliers: object, fp8_backward: object, fp8_compute: object
) -> linear_ops.LinearPlan:
    """A :class:`~tidal_quant.linear_ops.LinearPlan` of an already validated ``qw``, the options checked."""
    return linear_ops.LinearPlan(
        _op_args(qw),
        n_outlier_channels(check_outliers(qw.fmt, outliers), qw.shape[1]),
        check_fp8_backward(qw.fmt, fp8_backward),
        check_fp8_compute(qw.fmt, fp8_compute),
    )


def _run(x: torch.Tensor, plan: linear_ops.LinearPlan, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ Wᵀ + bias`` for the weight of ``plan``, after checking ``x`` and ``bias`` against it."""
    data, n, k = plan.args[0], plan.args[4][0], plan.args[4][1]
    if not isinstance(x, torch.Tensor):
        raise bad_arg("x", type(x).__name__, "a torch.Tensor")
    if x.dtype not in _ACT_DTYPES:
        raise bad_arg("x.dtype", x.dtype, "bfloat16, float16 or float32", "cast the input")
    if x.dim() < 1 or x.shape[-1] != k:
        raise bad_arg("x.shape", tuple(x.shape), f"[..., {k}] (in_features of the weight)")
    if x.device != data.device:
        raise bad_arg("x.device", str(x.device), f"the weight's device {data.device}", "move x or the module")
    if bias is not None and (bias.shape != (n,) or bias.device != data.device):
        raise bad_arg("bias", (tuple(bias.shape), str(bias.device)), f"[{n}] on {data.device}")
    # the profiler range only while a profiler records: entering one costs a dispatcher call per layer
    with record_function("tidal::quant_linear") if ops.profiling() else contextlib.nullcontext():
        y = linear_ops.linear_fast(x.reshape(-1, k), plan)  # [T, N]
    y = y.view(*x.shape[:-1], n)  # [..., N]
    return y if bias is None else y + bias.to(y.dtype)


def _op_args(qw: QuantizedWeight) -> tuple:
    """(data, scales, global_scale, fmt, shape, block_size) as the custom ops take them."""
    scales = ops.as_bytes(block_scales(qw))
    return ops.as_bytes(qw.data), scales, qw.global_scale, qw.fmt.value, list(qw.shape), qw.block_size or 0


class QuantLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored quantized (packed data + scales as buffers).

    The buffers are ordinary module buffers, so they move with ``.to()``, stream like any tensor and
    round-trip through ``state_dict``. Only the input (and a trainable bias) get gradients.

    Args:
        in_features: input size.
        out_features: output size.
        fmt: "int8", "nf4", "fp8" or "nvfp4".
        bias: whether the layer has a bias (a frozen Parameter).
        block_size: see :func:`tidal_quant.quantize`.
        double_quant: see :func:`tidal_quant.quantize`.
        outliers: fp8 only: see :func:`quant_linear`.
        fp8_backward: fp8 only: see :func:`quant_linear`.
        fp8_compute: int8 / nf4 / nvfp4: see :func:`quant_linear`.
        device: where to allocate the (uninitialized) buffers.
        dtype: dtype of the bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: QuantFormat | str,
        *,
        bias: bool = True,
        block_size: int | None = None,
        double_quant: bool = False,
        outliers: float = 0.0,
        fp8_backward: bool = False,
        fp8_compute: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_arg(name, v, "a positive int")
        self.fmt = as_format(fmt)
        self.block_size = resolve_block_size(self.fmt, block_size)
        self.double_quant = check_double_quant(self.fmt, double_quant)
        self.outliers = check_outliers(self.fmt, outliers)
        self.fp8_backward = check_fp8_backward(self.fmt, fp8_backward)
        self.fp8_compute = check_fp8_compute(self.fmt, fp8_compute)
        self.in_features = in_features
        self.out_features = out_features
        check_shape(self.fmt, (out_features, in_features), "(out_features, in_features)")
        layout = storage_layout(self.fmt, (out_features, in_features), self.block_size, self.double_quant)
        for field, (shape, dt) in layout.items():
            self.register_buffer(_BUFFER[field], torch.zeros(shape, dtype=dt, device=device))
        self._fields = tuple(layout)
        b = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        self.bias = nn.Parameter(b, requires_grad=False) if b is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat | str, **cfg: Any) -> QuantLinear:
        """Quantize ``linear``'s weight (on its device) into a new QuantLinear; ``linear`` is not changed.

        Args:
            linear: the layer.
            fmt: the format.
            **cfg: ``block_size``, ``double_quant``, ``outliers``, ``fp8_backward``, ``fp8_compute``.
        """
        if not isinstance(linear, nn.Linear):
            raise bad_arg("linear", type(linear).__name__, "a torch.nn.Linear")
        unknown = set(cfg) - set(_CFG)
        if unknown:
            raise bad_arg("cfg", sorted(unknown), ", ".join(_CFG))
        w = linear.weight.detach()
        qw = quantize(w, fmt, block_size=cfg.get("block_size"), double_quant=cfg.get("double_quant", False))
        bias_dtype = linear.bias.dtype if linear.bias is not None else torch.bfloat16
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.fmt, mod.block_size, mod.double_quant = qw.fmt, qw.block_size, qw.double_quant
        mod.outliers = check_outliers(qw.fmt, cfg.get("outliers", 0.0))
        mod.fp8_backward = check_fp8_backward(qw.fmt, cfg.get("fp8_backward", False))
        mod.fp8_compute = check_fp8_compute(qw.fmt, cfg.get("fp8_compute", False))
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        for field, t in qw.tensors().items():
            mod.register_buffer(_BUFFER[field], t)
        mod._fields = tuple(qw.tensors())
        b = linear.bias
        mod.bias = None if b is None else nn.Parameter(b.detach().to(bias_dtype).clone(), requires_grad=False)
        return mod

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantLinear:
        # [Note: dtype casts] model.half() / .to(torch.bfloat16) cast every floating buffer, fp8 codes and
        # fp32 scales included; the stored format must survive them, so such buffers only change device.
        before = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    @property
    def qweight(self) -> QuantizedWeight:
        """The weight as a :class:`QuantizedWeight` viewing this module's buffers."""
        t = {f: getattr(self, _BUFFER[f]) for f in self._fields}
        shape = (self.out_features, self.in_features)
        return QuantizedWeight(
            self.fmt, shape, block_size=self.block_size, double_quant=self.double_quant, **t
        )

    def dequantize_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense weight ``[out_features, in_features]`` (allocates it)."""
        from tidal_quant.api import dequantize

        return dequantize(self.qweight, dtype)

    def _plan(self) -> linear_ops.LinearPlan:
        """The eager calls' :class:`~tidal_quant.linear_ops.LinearPlan`, made again when a buffer is replaced
        or an option changes (the weight is validated each time one is made).

        The plan holds the buffers themselves, never data derived from their bytes, so bytes written in
        place (``load_state_dict``, a streamed block's refill) need no new plan. Double-quantized layers
        derive their block scales, so they keep no plan (see :meth:`forward`).
        """
        bufs = tuple(self._buffers[_BUFFER[f]] for f in self._fields)
        options = (self.outliers, self.fp8_backward, self.fp8_compute)
        cached = self.__dict__.get("_plan_cache")
        if cached is not None and cached[0] == options and all(a is b for a, b in zip(cached[1], bufs)):
            return cached[2]
        qw = check_quantized(self.qweight)
        plan = _plan_of(qw, *options)
        self.__dict__["_plan_cache"] = (options, bufs, plan)  # the buffers themselves: no extra memory
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # traced (every check in the graph's guards) or double-quantized (block scales derived per call,
        # so that a streamed layer keeps none of them resident): no cached plan
        if self.double_quant or torch.compiler.is_compiling():
            qw = check_quantized(self.qweight)
            return _run(x, _plan_of(qw, self.outliers, self.fp8_backward, self.fp8_compute), self.bias)
        return _run(x, self._plan(), self.bias)

    def extra_repr(self) -> str:
        extra = f", block_size={self.block_size}" if self.block_size else ""
        extra += ", double_quant=True" if self.double_quant else ""
        extra += f", outliers={self.outliers}" if self.outliers else ""
        extra += ", fp8_backward=True" if self.fp8_backward else ""
        extra += ", fp8_compute=True" if self.fp8_compute else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fmt={self.fmt.value}{extra}"
        )


def quantize_model_(
    model: nn.Module,
    fmt: QuantFormat | str,
    *,
    filter: Callable[[str, nn.Module], bool] | None = None,
    **cfg: Any,
) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers by :class:`QuantLinear`, in place, one layer at a time.

    Each layer is quantized and swapped before the next is touched, so peak memory grows by about one
    layer's temporaries, not by a second copy of the model (the original weight is freed when nothing
    else references it).

    Args:
        model: the model.
        fmt: the format.
        filter: ``filter(qualified_name, linear) -> bool``; only layers it accepts are quantized
            (default: every ``nn.Linear``, e.g. pass ``lambda n, m: n != "lm_head"`` to keep the head).
        **cfg: ``block_size``, ``double_quant``, ``outliers``, ``fp8_backward``, ``fp8_compute`` (see
            :class:`QuantLinear`).

    Returns:
        ``model`` itself.
    """
    if not isinstance(model, nn.Module):
        raise bad_arg("model", type(model).__name__, "a torch.nn.Module")
    if filter is not None and not callable(filter):
        raise bad_arg("filter", filter, "a callable (name, module) -> bool, or None")
    f = as_format(fmt)
    # names only: holding module references here would keep every original weight alive to the end
    names = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and (filter is None or filter(n, m))
    ]
    with record_function("tidal::quantize_model"):
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            try:
                q = QuantLinear.from_linear(getattr(parent, attr), f, **cfg)
            except ValueError as e:
                raise type(e)(f"layer {name!r}: {e}") from e
            setattr(parent, attr, q)
            del q
    _log.record("quantize_model", f"tidal_quant: quantized {len(names)} linear layers to {f.value}", level=20)
    return model
