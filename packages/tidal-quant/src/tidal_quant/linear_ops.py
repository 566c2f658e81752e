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
from tidal_quant.ops import as_f8, dequant_eager, dequantize, qmatmul, qmatmul_eager


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


def _save_for_grad(ctx, data, scales, global_scale, row_scales, meta) -> None:
    """Keep what the input gradient needs (shared by the custom op and the eager path).

    ``row_scales``: the recast weight's row scales when the forward recast it (eager path), else None;
    ``meta``: (fmt, shape, block_size, fp8_grad, fp8_compute).
    """
    ctx.save_for_backward(data, scales, global_scale, row_scales)
    ctx.meta = meta


def _input_grad_only(ctx, grad, grad_fn):
    """The backward of ``linear``'s 10 inputs: ``grad_fn`` gives ``x``'s gradient, the rest get none."""
    data, scales, global_scale, row_scales = ctx.saved_tensors
    gx = None
    if ctx.needs_input_grad[0]:
        gx = grad_fn(grad, data, scales, global_scale, row_scales, *ctx.meta)  # [T, K]
    return gx, None, None, None, None, None, None, None, None, None


def _grad_ops(grad, data, scales, global_scale, row_scales, fmt, shape, block_size, fp8_grad, fp8_compute):
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
    _save_for_grad(
        ctx, data, scales, global_scale, None, (fmt, list(shape), block_size, fp8_grad, fp8_compute)
    )


def _linear_backward(ctx, grad):
    return _input_grad_only(ctx, grad, _grad_ops)


torch.library.register_autograd("tidal_quant::linear", _linear_backward, setup_context=_linear_setup)


# ------------------------------------------------------------------------------- eager fast path
# See [Note: eager path] in tidal_quant.ops: outside torch.compile one autograd.Function calls the
# per-device implementations of the ops above.
def _forward_impl(x, data, scales, global_scale, fmt, shape, block_size, n_outliers, fp8_compute):
    """``(y, row scales)``: the ``[2, N]`` row scales and inverses of the recast weight when ``fp8_compute``
    recast it, else None."""
    if uses_scaled_mm(x, fmt, shape):
        return fp8_linear_cuda(x.contiguous(), data, scales, n_outliers), None
    if fp8_compute and uses_recast(x, fmt, shape, block_size):
        codes, row_scales = recast_cuda(data, scales, global_scale, fmt, shape, block_size)  # [N, K], [2, N]
        return fp8_linear_cuda(x.contiguous(), codes, row_scales[0], 0), row_scales
    return qmatmul_eager(x, data, scales, global_scale, fmt, shape, block_size), None


def _grad_impl(grad, data, scales, global_scale, row_scales, fmt, shape, block_size, fp8_grad, fp8_compute):
    if fp8_grad and uses_scaled_mm(grad, fmt, shape):
        return fp8_grad_cuda(grad.contiguous(), data, scales)  # [T, K]
    if row_scales is not None:  # the forward recast the weight: the gradient multiplies its transpose
        codes_t = recast_t_cuda(data, scales, global_scale, row_scales, fmt, shape, block_size)  # [K, N]
        return fp8_grad_cols_cuda(grad.contiguous(), as_f8(codes_t).t(), row_scales[0])  # [T, K]
    w = dequant_eager(data, scales, global_scale, fmt, shape, block_size, grad.dtype)  # [N, K]
    return grad @ w  # [T, K]


class _EagerLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, data, scales, global_scale, fmt, shape, block_size, n_outliers, fp8_grad, fp8_compute
    ):
        y, row_scales = _forward_impl(
            x, data, scales, global_scale, fmt, shape, block_size, n_outliers, fp8_compute
        )
        _save_for_grad(
            ctx, data, scales, global_scale, row_scales, (fmt, shape, block_size, fp8_grad, fp8_compute)
        )
        return y

    @staticmethod
    def backward(ctx, grad):
        return _input_grad_only(ctx, grad, _grad_impl)


def linear_fast(
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
    """:func:`linear` with the least host overhead: the custom op under torch.compile, else one
    autograd.Function over the same implementations (see [Note: eager path] in :mod:`tidal_quant.ops`)."""
    args = (x, data, scales, global_scale, fmt, shape, block_size, n_outliers)
    if torch.compiler.is_compiling():
        return linear(*args, fp8_grad, fp8_compute)
    if not (x.requires_grad and torch.is_grad_enabled()):  # nothing to differentiate: skip autograd
        return _forward_impl(*args, fp8_compute)[0]
    return _EagerLinear.apply(*args, fp8_grad, fp8_compute)
