"""Formats, their parameters and the :class:`QuantizedWeight` container.

[Note: block layout] int8 and NF4 blocks run over the row-major flattened weight (as bitsandbytes does),
so a block may straddle two rows when ``in_features`` is not a multiple of the block size; the tail is
padded with zeros, which changes neither a block's absmax nor the stored codes of real elements.
NVFP4 needs ``in_features % 16 == 0`` (its 16-value blocks never straddle rows); FP8 has one scale per
output row.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from tidal_quant.errors import QuantError, bad_arg


class QuantFormat(str, enum.Enum):
    """Storage formats for frozen weights."""

    INT8 = "int8"
    """Symmetric blockwise absmax int8, fp32 scale per block (default block 64)."""
    NF4 = "nf4"
    """4-bit NormalFloat, bitsandbytes-compatible bytes, fp32 absmax per block (default block 64)."""
    FP8 = "fp8"
    """float8 e4m3 with one fp32 scale per output channel; FP8 tensor cores on compute capability ≥ 8.9."""
    NVFP4 = "nvfp4"
    """e2m1 codes two per byte, e4m3 scale per 16 values, fp32 tensor scale."""

    def __str__(self) -> str:
        return self.value


FORMATS: tuple[str, ...] = tuple(f.value for f in QuantFormat)
DEFAULT_BLOCK: dict[QuantFormat, int | None] = {
    QuantFormat.INT8: 64,
    QuantFormat.NF4: 64,
    QuantFormat.FP8: None,
    QuantFormat.NVFP4: 16,
}
NVFP4_BLOCK = 16
DOUBLE_QUANT_BLOCK = 256
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # dtypes the dequantizers write
FP8_MAX = 448.0
E2M1_MAX = 6.0
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def as_format(fmt: object) -> QuantFormat:
    """Parse ``fmt`` (a :class:`QuantFormat` or its string) or raise :class:`QuantError`."""
    if isinstance(fmt, QuantFormat):
        return fmt
    if isinstance(fmt, str):
        try:
            return QuantFormat(fmt.lower())
        except ValueError:
            pass
    raise bad_arg("fmt", fmt, f"one of {list(FORMATS)}", "pass a QuantFormat or its string value")


def resolve_block_size(fmt: QuantFormat, block_size: object) -> int | None:
    """Validate ``block_size`` for ``fmt``; ``None`` gives the format's default."""
    if block_size is None:
        return DEFAULT_BLOCK[fmt]
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise bad_arg("block_size", block_size, "an int or None", "pass e.g. block_size=64")
    if fmt is QuantFormat.INT8:
        if block_size < 2 or block_size % 2:
            raise bad_arg("block_size", block_size, "an even int >= 2 for int8", "e.g. 64 (the default)")
    elif fmt is QuantFormat.NF4:
        if block_size < 16 or block_size > 4096 or block_size & (block_size - 1):
            raise bad_arg(
                "block_size",
                block_size,
                "a power of two in [16, 4096] for nf4",
                "use 64 (the default, bitsandbytes-compatible)",
            )
    elif fmt is QuantFormat.NVFP4:
        if block_size != NVFP4_BLOCK:
            raise bad_arg("block_size", block_size, "16 (fixed by NVFP4) or None", "drop block_size")
    elif fmt is QuantFormat.FP8:
        raise bad_arg(
            "block_size", block_size, "None for fp8 (one scale per output channel)", "drop block_size"
        )
    return block_size


def bytes_per_weight(
    fmt: QuantFormat | str, block_size: int | None = None, *, double_quant: bool = False
) -> float:
    """Storage bytes per weight element of ``fmt``, scales included.

    FP8 counts only the codes (1.0): its fp32 scale is per output row (4 bytes per ``in_features``
    weights), which this per-element figure leaves out. Double quantization (NF4/int8) stores each
    block scale as one int8 plus an fp32 scale per 256 blocks.

    Args:
        fmt: the format.
        block_size: the block size (None: the format's default).
        double_quant: whether block scales are themselves quantized.

    Returns:
        Bytes per weight as a float (e.g. 0.5625 for NF4 with block 64).
    """
    f = as_format(fmt)
    bs = resolve_block_size(f, block_size)
    if f is QuantFormat.FP8:
        return 1.0
    if f is QuantFormat.NVFP4:
        return 0.5 + 1.0 / NVFP4_BLOCK
    assert bs is not None
    code = 1.0 if f is QuantFormat.INT8 else 0.5
    scale = (1.0 + 4.0 / DOUBLE_QUANT_BLOCK) / bs if double_quant else 4.0 / bs
    return code + scale


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized 2-D weight ``[out_features, in_features]``: packed codes plus scales.

    Attributes:
        fmt: the format.
        shape: the original ``(out_features, in_features)``.
        data: codes: int8 ``[n_pad]`` (int8), uint8 ``[n_pad // 2]`` (nf4: high nibble first),
            float8_e4m3fn ``[out, in]`` (fp8), uint8 ``[out, in // 2]`` (nvfp4).
        scales: fp32 per block (int8/nf4), int8 per block when ``double_quant``, fp32 ``[out]`` (fp8),
            float8_e4m3fn ``[out, in // 16]`` (nvfp4).
        block_size: elements per block (None for fp8).
        double_quant: whether ``scales`` are int8 codes of ``scales - offset`` (int8/nf4 only).
        scales2: fp32 scale per 256 blocks when ``double_quant``, else None.
        offset: fp32 ``[1]`` added back to the dequantized block scales when ``double_quant``, else None.
        global_scale: fp32 ``[1]`` tensor scale (nvfp4), else None.
    """

    fmt: QuantFormat
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor
    block_size: int | None = None
    double_quant: bool = False
    scales2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Device of the packed data."""
        return self.data.device

    @property
    def numel(self) -> int:
        """Number of weights represented."""
        return self.shape[0] * self.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that make up this weight, by field name (None fields left out)."""
        out = {"data": self.data, "scales": self.scales}
        for k in ("scales2", "offset", "global_scale"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    def nbytes(self) -> int:
        """Bytes held by all tensors of this weight."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """A copy on ``device``."""
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return dataclasses.replace(self, **moved)


def n_blocks(numel: int, block_size: int) -> int:
    """Blocks covering ``numel`` flattened elements."""
    return math.ceil(numel / block_size)


def check_weight(tensor: object, name: str = "tensor") -> torch.Tensor:
    """Validate a weight to quantize: a finite 2-D fp32/fp16/bf16 tensor on cpu or cuda."""
    if not isinstance(tensor, torch.Tensor):
        raise bad_arg(name, type(tensor).__name__, "a torch.Tensor", "pass the weight tensor")
    if tensor.dim() != 2:
        raise bad_arg(
            f"{name}.shape", tuple(tensor.shape), "a 2-D [out_features, in_features] tensor", "reshape it"
        )
    if tensor.numel() == 0:
        raise bad_arg(f"{name}.shape", tuple(tensor.shape), "a non-empty 2-D tensor")
    if tensor.dtype not in WEIGHT_DTYPES:
        raise bad_arg(f"{name}.dtype", tensor.dtype, "float32, float16 or bfloat16", "cast with .float()")
    if tensor.device.type not in ("cpu", "cuda"):
        raise bad_arg(f"{name}.device", str(tensor.device), "cpu or cuda", "materialize the weight first")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise QuantError(
            f"{name}: contains {bad} NaN/inf values; accepted: finite values only. "
            "Fix: repair or skip this weight (see quantize_model_(filter=...))"
        )
    return tensor
