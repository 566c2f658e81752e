"""The ``tidal_quant::linear`` op, its autograd (gradient for the input only) and the eager fast path.

``linear`` picks the compute path per call: fp8 weights on FP8 tensor cores, ``fp8_compute`` layers recast
to e4m3 (see [Note: fp8 compute] in :mod:`tidal_quant.fp8_ops`), everything else dequantize + matmul or the
fused dequant-matmul (:func:`tidal_quant.ops.qmatmul`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.library import custom_op

from tidal_quant.fp8_ops import (
    fp8_grad_cols_cuda,
    fp8_grad_cuda,
    fp8_grad_input,
    fp8_grad_input_t,
    fp8_linear,
    fp8_linear_cuda,
    fp8_row_scales,
    recast_cuda,
    recast_fp8,
    recast_fp8_t,
    recast_t_cuda,
    uses_recast,
    uses_scaled_mm,
)
from tidal_quant.ops import as_f8, dequant_eager, dequant_launch, dequantize, qmatmul, qmatmul_eager


@custom_op("tidal_quant::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: Sequence[int],
    block_size: int,
    n_outliers: int,
    fp8_grad: bool,
    fp8_compute: bool,
) -> torch.Tensor:
    """``x [T, K] @ Wᵀ`` for a quantized ``W [N, K]``; autograd gives the gradient of ``x`` only.

    With ``fp8_grad`` (fp8 weights on FP8 tensor cores) the input gradient runs on ``torch._scaled_mm``
    too, with per-token e4m3 gradients; with ``fp8_compute`` an int8 / NF4 / NVFP4 weight is recast to e4m3
    and both products run there; otherwise the input gradient is ``grad @ dequantize(W)``.
    """
    if uses_scaled_mm(x, fmt, shape):
        return fp8_linear(x.contiguous(), data, scales, n_outliers)
    if fp8_compute and uses_recast(x, fmt, shape, block_size):
        codes, row_scales = recast_fp8(data, scales, global_scale, fmt, shape, block_size)  # [N, K], [2, N]
        return fp8_linear(x.contiguous(), codes, row_scales[0], 0)
    return qmatmul(x, data, scales, global_scale, fmt, shape, block_size)


@linear.register_fake
def _(x, data, scales, global_scale, fmt, shape, block_size, n_outliers, fp8_grad, fp8_compute):
    return x.new_empty((x.shape[0], shape[0]))


def _grad_ops(grad, data, scales, global_scale, fmt, shape, block_size, fp8_grad, fp8_compute):
    # through the registered ops, so torch.compile traces them
    if fp8_grad and uses_scaled_mm(grad, fmt, shape):
        return fp8_grad_input(grad.contiguous(), data, scales)  # [T, K]
    if fp8_compute and uses_recast(grad, fmt, shape, block_size):
        rs = fp8_row_scales(scales, global_scale, fmt, shape, block_size)  # [2, N]
        codes_t = recast_fp8_t(data, scales, global_scale, rs, fmt, shape, block_size)  # [K, N]
        return fp8_grad_input_t(grad.contiguous(), codes_t, rs[0])  # [T, K]
    w = dequantize(data, scales, global_scale, fmt, shape, block_size, grad.dtype)  # [N, K]
    return grad @ w  # [T, K]


def _linear_setup(ctx, inputs, output):
    _, data, scales, global_scale, fmt, shape, block_size, _, fp8_grad, fp8_compute = inputs
    ctx.save_for_backward(data, scales, global_scale)
    ctx.meta = (fmt, list(shape), block_size, fp8_grad, fp8_compute)


def _linear_backward(ctx, grad):
    """The gradient of ``x``; the other nine inputs get none."""
    gx = _grad_ops(grad, *ctx.saved_tensors, *ctx.meta) if ctx.needs_input_grad[0] else None  # [T, K]
    return gx, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("tidal_quant::linear", _linear_backward, setup_context=_linear_setup)


# ------------------------------------------------------------------------------- eager fast path
# See [Note: eager path] in tidal_quant.ops: outside torch.compile one autograd.Function calls the
# per-device implementations of the ops above, with what a weight's calls share worked out once (LinearPlan).
class LinearPlan:
    """One quantized weight's eager calls, worked out once: the op arguments, the compute-path options and,
    on CUDA, one dequantize launch per activation dtype (:class:`tidal_quant._triton.DequantLaunch`).

    ``QuantLinear`` keeps one per set of buffers and options; the functional ``quant_linear`` makes one per
    call. It holds the weight's own tensors (no copy), so it lives no longer than they would.
    """

    __slots__ = ("_launches", "args", "fp8_compute", "fp8_grad", "n_outliers")

    def __init__(self, args: tuple, n_outliers: int, fp8_grad: bool, fp8_compute: bool) -> None:
        self.args = args  # (data, scales, global_scale, fmt, shape, block_size) as the custom ops take them
        self.n_outliers, self.fp8_grad, self.fp8_compute = n_outliers, fp8_grad, fp8_compute
        self._launches: dict[torch.dtype, object] = {}  # CUDA: activation dtype → its dequantize launch

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight ``[N, K]`` in ``dtype`` (allocated per call)."""
        if self.args[0].device.type != "cuda":
            return dequant_eager(*self.args, dtype)
        launch = self._launches.get(dtype)
        if launch is None:
            launch = self._launches[dtype] = dequant_launch(*self.args, dtype)
        return launch()


def _forward_impl(x: torch.Tensor, plan: LinearPlan):
    """``(y, row scales)``: the ``[2, N]`` row scales and inverses of the recast weight when ``fp8_compute``
    recast it, else None."""
    data, scales, global_scale, fmt, shape, block_size = plan.args
    if uses_scaled_mm(x, fmt, shape):
        return fp8_linear_cuda(x.contiguous(), data, scales, plan.n_outliers), None
    if plan.fp8_compute and uses_recast(x, fmt, shape, block_size):
        codes, row_scales = recast_cuda(data, scales, global_scale, fmt, shape, block_size)  # [N, K], [2, N]
        return fp8_linear_cuda(x.contiguous(), codes, row_scales[0], 0), row_scales
    return qmatmul_eager(x, *plan.args, weight=plan.dequant), None


def _grad_impl(grad: torch.Tensor, plan: LinearPlan, row_scales: torch.Tensor | None) -> torch.Tensor:
    data, scales, global_scale, fmt, shape, block_size = plan.args
    if plan.fp8_grad and uses_scaled_mm(grad, fmt, shape):
        return fp8_grad_cuda(grad.contiguous(), data, scales)  # [T, K]
    if row_scales is not None:  # the forward recast the weight: the gradient multiplies its transpose
        codes_t = recast_t_cuda(data, scales, global_scale, row_scales, fmt, shape, block_size)  # [K, N]
        return fp8_grad_cols_cuda(grad.contiguous(), as_f8(codes_t).t(), row_scales[0])  # [T, K]
    return grad @ plan.dequant(grad.dtype)  # [T, N] @ [N, K]


class _EagerLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan):
        y, row_scales = _forward_impl(x, plan)
        # saved (not just held by the plan) so that autograd refuses a weight changed in place before backward
        ctx.save_for_backward(*plan.args[:3], row_scales)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, grad):
        row_scales = ctx.saved_tensors[3]
        gx = _grad_impl(grad, ctx.plan, row_scales) if ctx.needs_input_grad[0] else None
        return gx, None


def linear_fast(x: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """:func:`linear` with the least host overhead: the custom op under torch.compile, else one
    autograd.Function over the same implementations (see [Note: eager path] in :mod:`tidal_quant.ops`)."""
    if torch.compiler.is_compiling():
        return linear(x, *plan.args, plan.n_outliers, plan.fp8_grad, plan.fp8_compute)
    if not (x.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate: skip autograd
        return _forward_impl(x, plan)[0]
    return _EagerLinear.apply(x, plan)
