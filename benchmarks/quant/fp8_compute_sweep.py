"""``fp8_compute`` on the GPU machine (~1 min): the recast kernels' launch configs, and where it pays off.

    python3 benchmarks/quant/fp8_compute_sweep.py     # with packages/*/src on PYTHONPATH

1. The e4m3 recast of NF4 and NVFP4 weights at Qwen2.5-14B's layer shapes: the row-major operand (the
   row-scales kernel and the dequantize kernel's e4m3 output) over its launch configs (packed bytes per
   program, warps) against the HBM copy bandwidth (packed codes and scales read, one byte per weight
   written), and the transposed operand (the same recast, then a byte transpose). Each config must give
   the default's bytes (checked before it is timed); times come from a CUDA graph of 10 calls.
2. Forward, and forward + input gradient, of NF4 layers with and without ``fp8_compute`` (the recast forced
   at every token count) from 16 to 2048 tokens: device time from a CUDA graph and eager back-to-back
   time, which sets :data:`tidal_quant.fp8_ops.FP8_COMPUTE_MIN_TOKENS`.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

from tidal_quant import _triton, _triton_fp8, fp8_ops, ops
from tidal_quant.api import block_scales

ROWS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # packed bytes per program, warps (4-bit formats)
TOKENS = [16, 128, 512, 1024, 2048]


def _weights():
    """(label, fmt, data, scales, global scale, shape, block size, bytes a recast moves) per case."""
    for fmt in ("nf4", "nvfp4"):
        for _name, in_f, out_f in qbench.QWEN14B_LAYERS:
            qw = qbench.nf4_weight(in_f, out_f, fmt)
            data, scales = ops.as_bytes(qw.data), ops.as_bytes(block_scales(qw))
            nbytes = qw.nbytes() + qw.numel  # codes + scales read, one e4m3 byte per weight written
            yield f"{fmt} {out_f}x{in_f}", fmt, data, scales, qw.global_scale, qw.shape, qw.block_size, nbytes


def recast_tables(copy: float) -> list[str]:
    rows_t = ["| row-major recast, weight | bytes per program | warps | device µs | GB/s | of copy bw |"]
    rows_t.append("|---|---:|---:|---:|---:|---:|")
    cols_t = ["| transposed operand (recast + byte transpose), weight | device µs |", "|---|---:|"]
    for label, fmt, data, scales, g, shape, bs, nbytes in _weights():
        rows = functools.partial(_triton_fp8.recast_rows, fmt, data, scales, g, shape, bs)
        default = _triton.DEQUANT_4BIT_CONFIG
        rows_t += qbench.config_sweep(label, ROWS, default, rows, nbytes, copy)
        _, rs = rows(None)
        cols = functools.partial(_triton_fp8.recast_cols, fmt, data, scales, g, rs[1], shape, bs)
        cols_t.append(f"| {label} | {qbench.graph_ms(cols) * 1e3:.1f} |")
        torch.cuda.empty_cache()
    return [*rows_t, "", *cols_t]


def crossover_table() -> list[str]:
    rows = [
        "| shape | tokens | nf4 fwd µs (graph / b2b) | nf4-fp8 fwd µs (graph / b2b) "
        "| nf4 fwd+bwd µs (graph / b2b) | nf4-fp8 fwd+bwd µs (graph / b2b) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    saved, fp8_ops.FP8_COMPUTE_MIN_TOKENS = fp8_ops.FP8_COMPUTE_MIN_TOKENS, 0  # the recast at every count
    try:
        for in_f, out_f in ((5120, 13824), (5120, 5120)):
            w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
            layers = {k: qbench.make_layer(k, in_f, out_f, w) for k in ("nf4", "nf4-fp8")}
            for tokens in TOKENS:
                x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
                cells = [f"{in_f}→{out_f}", str(tokens)]
                timed = {}
                for k, layer in layers.items():

                    def fwd(layer=layer, x=x):
                        with torch.no_grad():
                            return layer(x)

                    step = qbench.input_grad(layer, x, g)
                    timed[k] = [
                        (qbench.graph_ms(fn), qbench.cuda_ms_pipelined(fn, reps=20)) for fn in (fwd, step)
                    ]
                for part in (0, 1):
                    for k in ("nf4", "nf4-fp8"):
                        dev, b2b = timed[k][part]
                        cells.append(f"{dev * 1e3:.0f} / {b2b * 1e3:.0f}")
                # columns in header order: nf4 fwd, nf4-fp8 fwd, nf4 fwd+bwd, nf4-fp8 fwd+bwd
                rows.append("| " + " | ".join(cells) + " |")
            del layers
            torch.cuda.empty_cache()
    finally:
        fp8_ops.FP8_COMPUTE_MIN_TOKENS = saved
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("fp8_compute_sweep.py needs CUDA (run it on the GPU machine)")
    t0 = time.perf_counter()
    copy = qbench.copy_gbps()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy {copy:.0f} GB/s\n")
    print("\n".join(recast_tables(copy)) + "\n", flush=True)
    print("Where fp8_compute pays off (recast forced at every token count)\n")
    print("\n".join(crossover_table()), flush=True)
    print(f"\nsweep in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
