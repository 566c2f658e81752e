"""FP8 tensor-core ops: fp8 weights (``tidal_quant::fp8_linear``, ``fp8_grad_input``) and int8 / NF4 / NVFP4
weights recast to e4m3 for ``fp8_compute`` (``recast_fp8``, ``recast_fp8_t``, ``fp8_grad_input_t``).

Each op's default kernel is the reference (an fp32 emulation of the tensor-core path, any device); CUDA runs
Triton and ``torch._scaled_mm`` with rowwise scales.

[Note: fp8 compute] With ``fp8_compute`` an int8 / NF4 / NVFP4 layer multiplies on the FP8 tensor cores.
Each forward recasts the stored weight to e4m3 with one scale per output row (one Triton kernel writing one
byte per weight; what is stored does not change) and then takes the fp8 format's path: per-token e4m3
activations times the recast weight through ``torch._scaled_mm``. The input gradient recasts the weight
again at the forward's row scales, transposes it into the layout ``_scaled_mm`` needs, and multiplies
per-token e4m3 gradients by it. A row's scale comes from its block scales alone
(:func:`tidal_quant.reference.fp8_row_scales`), so no pass over the weight precedes the recast. The recast
rounds every dequantized weight once more, to e4m3's 3 mantissa bits: precision traded for tensor-core
speed, as with the fp8 format.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.library import custom_op

from tidal_quant import _log
from tidal_quant import reference as ref
from tidal_quant.ops import as_bytes, as_f8, capability


def tr():
    """:mod:`tidal_quant._triton_fp8`, the FP8 paths' Triton kernels (imported on first CUDA use)."""
    from tidal_quant import _triton_fp8

    return _triton_fp8


# [Note: fast accumulation] Hopper's FP8 tensor cores accumulate in reduced precision unless the
# kernel promotes partial sums to fp32 every few k-steps; ``use_fast_accum=True`` skips the promotion
# (faster; partial sums keep fewer mantissa bits). As common FP8 training recipes do, the forward
# product uses it and the input gradient (``fp8_backward``) does not. Tests hold the forward to 40 dB
# SQNR against the fp32 emulation (fp8_linear on the CPU).
FP8_FAST_ACCUM_FORWARD = True


def _split_outliers(x: torch.Tensor, n_outliers: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero the ``n_outliers`` input channels of largest |x| (found on device, no sync); return their ids."""
    if n_outliers <= 0:
        return x, None
    idx = x.abs().amax(dim=0).topk(n_outliers).indices  # [k]
    return x.index_fill(1, idx, 0), idx


def _outlier_term(
    x: torch.Tensor, idx: torch.Tensor, data: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    w_out = (as_f8(data.index_select(1, idx)).float() * scales[:, None]).to(x.dtype)  # [N, k]
    return x.index_select(1, idx) @ w_out.t()  # [M, N]


def fp8_linear_ref(x, data, scales, n_outliers):
    x_in, idx = _split_outliers(x, n_outliers)
    q, sa = ref.quantize_rows_fp8(x_in)
    y = (q.float() * sa) @ (as_f8(data).float() * scales[:, None]).t()
    if idx is not None:
        y = y + _outlier_term(x, idx, data, scales).float()
    return y.to(x.dtype)


def fp8_linear_cuda(x, data, scales, n_outliers):
    # one activation-quantization kernel + one _scaled_mm (+ the outlier term when asked for)
    _log.record_path("fp8_scaled_mm")
    x_in, idx = _split_outliers(x, n_outliers)
    q, sa = tr().quantize_rows_fp8(x_in)  # [M, K] e4m3, [M, 1] fp32 (bit-exact with the reference)
    y = torch._scaled_mm(
        q,
        as_f8(data).t(),
        scale_a=sa,
        scale_b=scales.view(1, -1),
        out_dtype=torch.bfloat16,
        use_fast_accum=FP8_FAST_ACCUM_FORWARD,
    )  # [M, N]; data.t() is the column-major [K, N] operand _scaled_mm wants, no copy
    y = y if x.dtype == torch.bfloat16 else y.to(x.dtype)
    if idx is not None:
        y = y + _outlier_term(x, idx, data, scales)
    return y


@custom_op("tidal_quant::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, n_outliers: int) -> torch.Tensor:
    """FP8 forward: per-token e4m3 activations × per-channel e4m3 weights (+ outlier channels in x.dtype).

    This default kernel emulates the tensor-core path in fp32 (the reference); CUDA runs
    ``torch._scaled_mm`` with rowwise scales.
    """
    return fp8_linear_ref(x, data, scales, n_outliers)


fp8_linear.register_kernel("cuda")(fp8_linear_cuda)


@fp8_linear.register_fake
def _(x, data, scales, n_outliers):
    return x.new_empty((x.shape[0], data.shape[0]))


def fp8_grad_ref(grad, data, scales):
    q, sg = ref.quantize_rows_fp8(grad.float() * scales)  # [T, N] e4m3, [T, 1]
    return ((q.float() * sg) @ as_f8(data).float()).to(grad.dtype)


_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}


def fp8_grad_cols_cuda(grad, w_col, scales):
    """``grad [T, N] @ W [N, K]`` on FP8 tensor cores, ``W`` given as its e4m3 column-major ``[N, K]`` operand
    (the ``.t()`` of a row-major ``[K, N]``) with row scales ``scales [N]`` folded into the gradient."""
    q, sg = tr().quantize_rows_fp8(grad, col_scale=scales)  # [T, N] e4m3 of grad * scales, [T, 1]
    key = (w_col.shape[1], grad.device)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones(1, w_col.shape[1], device=grad.device, dtype=torch.float32)
    gx = torch._scaled_mm(q, w_col, scale_a=sg, scale_b=ones, out_dtype=torch.bfloat16)  # [T, K]
    return gx if grad.dtype == torch.bfloat16 else gx.to(grad.dtype)


def fp8_grad_cuda(grad, data, scales):
    w_col = tr().transpose_bytes(as_f8(data)).t()  # [N, K] column-major (one tiled transpose kernel)
    return fp8_grad_cols_cuda(grad, w_col, scales)


@custom_op("tidal_quant::fp8_grad_input", mutates_args=())
def fp8_grad_input(grad: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``grad [T, N] @ W [N, K]`` with per-token e4m3 gradients (weight row scales folded into them).

    This default kernel emulates the tensor-core path in fp32; CUDA runs ``torch._scaled_mm``.
    """
    return fp8_grad_ref(grad, data, scales)


fp8_grad_input.register_kernel("cuda")(fp8_grad_cuda)


@fp8_grad_input.register_fake
def _(grad, data, scales):
    return grad.new_empty((grad.shape[0], data.shape[1]))


_TENSOR_CORES: dict[torch.device, bool] = {}


def fp8_tensor_cores(device: torch.device) -> bool:
    """True when ``device`` runs ``torch._scaled_mm`` (CUDA compute capability ≥ 8.9); cached per device."""
    hit = _TENSOR_CORES.get(device)
    if hit is None:
        hit = _TENSOR_CORES[device] = (
            device.type == "cuda" and hasattr(torch, "_scaled_mm") and capability(device) >= (8, 9)
        )
    return hit


def uses_scaled_mm(x: torch.Tensor, fmt: str, shape: Sequence[int]) -> bool:
    """Whether an fp8 forward on ``x``'s device runs on FP8 tensor cores; logs + records why not, once."""
    if fmt != "fp8" or x.device.type != "cuda":
        return False
    if not fp8_tensor_cores(x.device):
        _log.record(
            "degraded",
            f"tidal_quant: {torch.cuda.get_device_name(x.device)} has no FP8 tensor cores "
            "(compute capability < 8.9): fp8 weights are dequantized to the activation dtype",
            once_key="fp8-no-tensor-cores",
            level=30,
        )
        return False
    if shape[0] % 16 or shape[1] % 16:
        _log.record(
            "degraded",
            f"tidal_quant: fp8 weight {tuple(shape)} is not a multiple of 16 in both dims, which "
            "torch._scaled_mm needs; it is dequantized instead",
            once_key=f"fp8-shape-{tuple(shape)}",
            level=30,
        )
        return False
    return True


# -------------------------------------------------------------------------------- fp8 compute
RECAST_FORMATS = ("int8", "nf4", "nvfp4")
#: Fewer tokens per call than this keep the bf16 path (the fused dequant-matmul or dequantize + cuBLAS)
#: under ``fp8_compute``: the two recasts cost about what the FP8 products save until the products are
#: large. On the H200 (quant/fp8_compute_sweep.py, table.py) forward + input gradient at Qwen2.5-14B's
#: shapes took longer recast than on the bf16 path at 512 tokens and less at 2048.
FP8_COMPUTE_MIN_TOKENS = 1024


def fp8_row_scales(
    scales: torch.Tensor, global_scale: torch.Tensor | None, fmt: str, shape: Sequence[int], block_size: int
) -> torch.Tensor:
    """fp32 ``[2, N]``: the recast weight's row scales and their inverses (torch ops, any device; e4m3 block
    scales as uint8 bytes). The scales multiply the products; the inverses enter the recast."""
    s = as_f8(scales) if fmt == "nvfp4" else scales
    rs = ref.fp8_row_scales(s, global_scale, fmt, (shape[0], shape[1]), block_size)
    return torch.stack([rs, ref.inverse_row_scales(rs)])


def _recast_codes_ref(data, scales, global_scale, row_scales, fmt, shape, block_size):
    """uint8 e4m3 codes ``[N, K]`` of the reference recast at ``row_scales [2, N]``."""
    s = as_f8(scales) if fmt == "nvfp4" else scales
    vals, blk = ref.code_values(data, s, global_scale, fmt, (shape[0], shape[1]), block_size)  # [N, K] each
    return as_bytes(ref.recast_fp8(vals, blk, row_scales[0]))


def _recast_ref(data, scales, global_scale, fmt, shape, block_size):
    rs = fp8_row_scales(scales, global_scale, fmt, shape, block_size)
    return _recast_codes_ref(data, scales, global_scale, rs, fmt, shape, block_size), rs


def recast_cuda(data, scales, global_scale, fmt, shape, block_size):
    """:func:`recast_fp8` on CUDA: the row scales (a small kernel), then the codes (the dequantize kernel's
    e4m3 output)."""
    _log.record_path("fp8_recast")
    q, rs = tr().recast_rows(fmt, data, scales, global_scale, (shape[0], shape[1]), block_size)
    return as_bytes(q), rs


@custom_op("tidal_quant::recast_fp8", mutates_args=())
def recast_fp8(
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: Sequence[int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 / NF4 / NVFP4 weight ``[N, K]`` recast to e4m3: (codes ``[N, K]`` as uint8, fp32 ``[2, N]``
    row scales and their inverses, :func:`fp8_row_scales`).

    See [Note: fp8 compute]; ``scales`` are the decompressed block scales (e4m3 ones as uint8 bytes).
    """
    return _recast_ref(data, scales, global_scale, fmt, shape, block_size)


recast_fp8.register_kernel("cuda")(recast_cuda)


@recast_fp8.register_fake
def _(data, scales, global_scale, fmt, shape, block_size):
    n, k = shape[0], shape[1]
    return data.new_empty((n, k), dtype=torch.uint8), data.new_empty((2, n), dtype=torch.float32)


def _recast_t_ref(data, scales, global_scale, row_scales, fmt, shape, block_size):
    return _recast_codes_ref(data, scales, global_scale, row_scales, fmt, shape, block_size).t().contiguous()


def recast_t_cuda(data, scales, global_scale, row_scales, fmt, shape, block_size):
    """:func:`recast_fp8_t` on CUDA: the row-major recast at the given scales, then a byte transpose."""
    shp = (shape[0], shape[1])
    return as_bytes(tr().recast_cols(fmt, data, scales, global_scale, row_scales[1], shp, block_size))


@custom_op("tidal_quant::recast_fp8_t", mutates_args=())
def recast_fp8_t(
    data: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    row_scales: torch.Tensor,
    fmt: str,
    shape: Sequence[int],
    block_size: int,
) -> torch.Tensor:
    """The transpose ``[K, N]`` (uint8) of :func:`recast_fp8`'s codes, at the given ``[2, N]`` row scales and
    inverses."""
    return _recast_t_ref(data, scales, global_scale, row_scales, fmt, shape, block_size)


recast_fp8_t.register_kernel("cuda")(recast_t_cuda)


@recast_fp8_t.register_fake
def _(data, scales, global_scale, row_scales, fmt, shape, block_size):
    return data.new_empty((shape[1], shape[0]), dtype=torch.uint8)


@custom_op("tidal_quant::fp8_grad_input_t", mutates_args=())
def fp8_grad_input_t(grad: torch.Tensor, data_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_grad_input` with the e4m3 weight given transposed, ``data_t [K, N]`` (uint8); ``scales [N]``."""
    return fp8_grad_ref(grad, data_t.t(), scales)


@fp8_grad_input_t.register_kernel("cuda")
def _(grad, data_t, scales):
    return fp8_grad_cols_cuda(grad, as_f8(data_t).t(), scales)


@fp8_grad_input_t.register_fake
def _(grad, data_t, scales):
    return grad.new_empty((grad.shape[0], data_t.shape[0]))


def uses_recast(x: torch.Tensor, fmt: str, shape: Sequence[int], block_size: int) -> bool:
    """Whether ``fp8_compute`` recasts this weight for FP8 tensor cores for ``x [T, K]``: on CUDA with FP8
    tensor cores, for a shape ``torch._scaled_mm`` takes, at ``T ≥`` :data:`FP8_COMPUTE_MIN_TOKENS`. A device
    or shape that cannot is logged and recorded once (the layer then takes the bf16 path)."""
    if fmt not in RECAST_FORMATS or x.device.type != "cuda" or x.shape[0] < FP8_COMPUTE_MIN_TOKENS:
        return False
    if not fp8_tensor_cores(x.device):
        _log.record(
            "degraded",
            f"tidal_quant: {torch.cuda.get_device_name(x.device)} has no FP8 tensor cores "
            "(compute capability < 8.9): fp8_compute layers dequantize to the activation dtype",
            once_key="fp8-compute-no-tensor-cores",
            level=30,
        )
        return False
    n, k = shape[0], shape[1]
    if n % 16 or k % 16 or (fmt != "nvfp4" and k % block_size):
        _log.record(
            "degraded",
            f"tidal_quant: {fmt} weight {(n, k)} (block {block_size}) cannot be recast for fp8_compute: it "
            "needs both dims multiples of 16 and whole blocks per row; it is dequantized instead",
            once_key=f"fp8-compute-shape-{fmt}-{(n, k)}-{block_size}",
            level=30,
        )
        return False
    return True
