"""tidal-quant: frozen weights in int8, NF4, FP8 and NVFP4 — reference ops, Triton kernels, QuantLinear.

Quick start::

    import tidal_quant as tq
    tq.quantize_model_(model, "nf4")          # every nn.Linear becomes a frozen QuantLinear
    qw = tq.quantize(weight, "fp8")           # or one tensor: a QuantizedWeight
    w = tq.dequantize(qw, torch.bfloat16)
"""

from tidal_quant.__about__ import __version__
from tidal_quant._log import decisions, path_counts, reset_path_counts
from tidal_quant.api import dequantize, quantize, storage_layout
from tidal_quant.errors import QuantError
from tidal_quant.formats import QuantFormat, QuantizedWeight, bytes_per_weight
from tidal_quant.linear import QuantLinear, quant_linear, quantize_model_
from tidal_quant.rows import nf4_decode_rows, nf4_decode_rows_into, nf4_encode_rows

__all__ = [
    "QuantError",
    "QuantFormat",
    "QuantLinear",
    "QuantizedWeight",
    "__version__",
    "bytes_per_weight",
    "decisions",
    "dequantize",
    "nf4_decode_rows",
    "nf4_decode_rows_into",
    "nf4_encode_rows",
    "path_counts",
    "quant_linear",
    "quantize",
    "quantize_model_",
    "reset_path_counts",
    "storage_layout",
]
