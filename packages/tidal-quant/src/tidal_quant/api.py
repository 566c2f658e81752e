"""``quantize`` / ``dequantize``: validated entry points over the custom ops."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.profiler import record_function

from tidal_quant import ops
from tidal_quant import reference as ref
from tidal_quant.errors import bad_arg
from tidal_quant.formats import (
    DOUBLE_QUANT_BLOCK,
    NVFP4_BLOCK,
    OUT_DTYPES,
    QuantFormat,
    QuantizedWeight,
    as_format,
    check_weight,
    n_blocks,
    resolve_block_size,
)


def check_double_quant(fmt: QuantFormat, double_quant: object) -> bool:
    """Validate ``double_quant`` (a bool; True only for int8 / nf4)."""
    if not isinstance(double_quant, bool):
        raise bad_arg("double_quant", double_quant, "True or False")
    if double_quant and fmt not in (QuantFormat.INT8, QuantFormat.NF4):
        raise bad_arg(
            "double_quant",
            double_quant,
            "False for fp8 / nvfp4 (their scales are already compact)",
            "drop it",
        )
    return double_quant


def check_shape(fmt: QuantFormat, shape: tuple[int, int], name: str = "tensor.shape") -> None:
    """Shape rules that depend on the format (NVFP4 blocks of 16 along ``in_features``)."""
    if fmt is QuantFormat.NVFP4 and shape[1] % NVFP4_BLOCK:
        raise bad_arg(
            name,
            tuple(shape),
            "in_features (dim 1) divisible by 16 for nvfp4",
            "pick int8/nf4/fp8 for this layer (quantize_model_(filter=...))",
        )


def storage_layout(
    fmt: QuantFormat | str, shape: tuple[int, int], block_size: int | None = None, double_quant: bool = False
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the tensors a quantized ``shape`` weight is stored in, by field name."""
    f = as_format(fmt)
    bs = resolve_block_size(f, block_size)
    out_f, in_f = shape
    numel = out_f * in_f
    if f is QuantFormat.FP8:
        return {"data": ((out_f, in_f), torch.float8_e4m3fn), "scales": ((out_f,), torch.float32)}
    if f is QuantFormat.NVFP4:
        return {
            "data": ((out_f, in_f // 2), torch.uint8),
            "scales": ((out_f, in_f // NVFP4_BLOCK), torch.float8_e4m3fn),
            "global_scale": ((1,), torch.float32),
        }
    assert bs is not None
    nb = n_blocks(numel, bs)
    data = ((out_f, in_f), torch.int8) if f is QuantFormat.INT8 else (((numel + 1) // 2,), torch.uint8)
    if not double_quant:
        return {"data": data, "scales": ((nb,), torch.float32)}
    return {
        "data": data,
        "scales": ((nb,), torch.int8),
        "scales2": ((n_blocks(nb, DOUBLE_QUANT_BLOCK),), torch.float32),
        "offset": ((1,), torch.float32),
    }


def quantize(
    tensor: torch.Tensor,
    fmt: QuantFormat | str,
    *,
    block_size: int | None = None,
    double_quant: bool = False,
) -> QuantizedWeight:
    """Quantize a 2-D weight ``[out_features, in_features]``.

    Runs the Triton kernels on CUDA and the pure-torch reference elsewhere; both give the same bytes.

    Args:
        tensor: finite fp32/fp16/bf16 weight on cpu or cuda.
        fmt: "int8", "nf4", "fp8" or "nvfp4".
        block_size: elements per scale (int8: even ≥ 2, default 64; nf4: power of two in [16, 4096],
            default 64; nvfp4: 16; fp8: None — one scale per output channel).
        double_quant: store the int8/nf4 block scales as int8 (blocks of 256) plus an offset.

    Returns:
        The :class:`QuantizedWeight` (tensors on ``tensor``'s device).

    Raises:
        QuantError: bad format, block size, shape, dtype, device or non-finite values.
    """
    f = as_format(fmt)
    bs = resolve_block_size(f, block_size)
    dq = check_double_quant(f, double_quant)
    w = check_weight(tensor)
    shape = (int(w.shape[0]), int(w.shape[1]))
    check_shape(f, shape)
    with record_function("tidal::quantize"):
        extra: dict[str, torch.Tensor] = {}
        if f is QuantFormat.FP8:
            data, scales = ref.quantize_fp8(w)
        elif f is QuantFormat.NVFP4:
            scales, g, eff = ref.nvfp4_scales(w)
            data = ops.quantize_nvfp4_codes(w.contiguous(), eff)
            extra["global_scale"] = g
        else:
            assert bs is not None
            data, scales = ops.quantize_blockwise(w.contiguous(), bs, f is QuantFormat.NF4)
            if dq:
                scales, extra["scales2"], extra["offset"] = ref.compress_scales(scales)
    return QuantizedWeight(f, shape, data, scales, bs, dq, **extra)


def block_scales(qw: QuantizedWeight) -> torch.Tensor:
    """The scales the dequantizer multiplies by (double-quantized ones decompressed to fp32)."""
    if qw.double_quant:
        assert qw.scales2 is not None and qw.offset is not None
        return ref.decompress_scales(qw.scales, qw.scales2, qw.offset)
    return qw.scales


def check_quantized(qw: object, name: str = "qw") -> QuantizedWeight:
    """Validate that ``qw`` is a :class:`QuantizedWeight` whose tensors match its declared layout."""
    if not isinstance(qw, QuantizedWeight):
        raise bad_arg(name, type(qw).__name__, "a QuantizedWeight (from quantize())")
    layout = storage_layout(qw.fmt, qw.shape, qw.block_size, qw.double_quant)
    have = qw.tensors()
    for field, (shape, dtype) in layout.items():
        t = have.get(field)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise bad_arg(f"{name}.{field}", got, f"{(shape, dtype)} for {qw.fmt.value} {qw.shape}")
        if t.device != qw.data.device:
            raise bad_arg(f"{name}.{field}.device", str(t.device), f"the data's device {qw.data.device}")
    return qw


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize ``qw`` to a dense ``[out_features, in_features]`` tensor of ``dtype``.

    Args:
        qw: the quantized weight.
        dtype: bfloat16 (default), float16 or float32.

    Raises:
        QuantError: ``qw`` is not a valid QuantizedWeight, or ``dtype`` is not accepted.
    """
    check_quantized(qw)
    if dtype not in OUT_DTYPES:
        raise bad_arg("dtype", dtype, "torch.bfloat16, torch.float16 or torch.float32")
    with record_function("tidal::dequantize") if ops.profiling() else contextlib.nullcontext():
        return ops.dequantize_fast(
            ops.as_bytes(qw.data),
            ops.as_bytes(block_scales(qw)),
            qw.global_scale,
            qw.fmt.value,
            list(qw.shape),
            qw.block_size or 0,
            dtype,
        )


def replace_tensors(qw: QuantizedWeight, **tensors: torch.Tensor) -> QuantizedWeight:
    """A copy of ``qw`` with some tensors replaced (used by modules that own the storage)."""
    return dataclasses.replace(qw, **tensors)
