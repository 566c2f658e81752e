"""NF4 over the rows of activations (tidal-kv's K/V pages): ``[..., D]`` tensors with blocks inside each row.

Unlike :func:`tidal_quant.quantize`, made for weights, these take any leading shape and do not check for
non-finite values (that would read the tensor back to the host on every call); the bytes are the same
format: two codes per byte, the even element in the high nibble, one absmax per block, kept here in the
rows' own dtype (an absmax is the magnitude of one of the block's values, so that dtype holds it exactly, in
half the bytes of fp32 for bf16 / fp16 rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal_quant import ops


def nf4_encode_rows(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes of ``x`` ``[..., D]`` (``D`` a multiple of ``block_size``; fp32 / fp16 / bf16).

    Returns:
        ``(data, scales)``: uint8 ``[..., D / 2]`` and ``[..., D / block_size]`` in ``x``'s dtype (the same
        values as the fp32 absmax :func:`tidal_quant.quantize` gives), on ``x``'s device (Triton on CUDA, the
        reference elsewhere).
    """
    d = x.shape[-1]
    data, scales = ops.quantize_blockwise(x.reshape(-1, d).contiguous(), block_size, True)
    return data.view(*x.shape[:-1], d // 2), scales.to(x.dtype).view(*x.shape[:-1], d // block_size)


def nf4_decode_rows(
    data: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`nf4_encode_rows`: a new ``[..., D]`` tensor of ``dtype``."""
    d = data.shape[-1] * 2
    shape = (data.numel() * 2 // d, d)
    flat = ops.dequant_eager(data.reshape(-1), scales.reshape(-1), None, "nf4", shape, block_size, dtype)
    return flat.view(*data.shape[:-1], d)


def nf4_decode_rows_into(
    dst: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, block_size: int
) -> Callable[[], None]:
    """A reusable :func:`nf4_decode_rows` straight into ``dst``, a strided ``[..., T, D]`` view (a token range
    of a K/V buffer): each call rewrites ``dst`` with one kernel launch on CUDA.

    Args:
        dst: bf16 / fp16 / fp32, contiguous ``[T, D]`` rows whose leading dims collapse to one stride.
        data: Contiguous codes of ``dst``'s elements in row-major order (``[..., T, D / 2]`` uint8).
        scales: Contiguous absmax (fp32, bf16 or fp16), one per ``block_size`` of those elements.
        block_size: Elements per scale.

    Raises:
        QuantError: a layout the launch cannot write (what was given and what is accepted).
    """
    return ops.dequant_rows_launch(data.view(-1), scales.view(-1), "nf4", block_size, dst)
