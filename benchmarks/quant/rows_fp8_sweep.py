"""Device time of the per-row e4m3 quantization kernel over tile widths and warps (the GPU machine, ~1 min).

    python3 benchmarks/quant/rows_fp8_sweep.py        # with packages/*/src on PYTHONPATH

The FP8 linear quantizes its activations (forward) and, with ``fp8_backward``, its output gradient times
the weight's row scales (backward) once per call, rows of 5120 or 13824 at Qwen2.5-14B shapes. Each config
must give the bytes of the current default (checked before timing); its device time comes from a CUDA graph
of 10 calls, against the bytes the kernel must move (bf16 read, e4m3 and one scale per row written).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

from tidal_quant import _triton_fp8

SHAPES = [(512, 5120), (2048, 5120), (512, 13824), (2048, 13824)]  # (tokens, row width)
CONFIGS = [(b, w) for b in (1024, 2048, 4096, 8192, 16384) for w in (4, 8, 16)]


def sweep(tokens: int, k: int, with_col: bool, copy_gbps: float) -> list[str]:
    """Table rows of every config for ``[tokens, k]`` rows (``x``, or a gradient times column scales)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    col = torch.rand(k, device="cuda", generator=g) + 0.5 if with_col else None
    label = f"{tokens}x{k} | {'grad·col' if with_col else 'x'}"
    return qbench.config_sweep(
        label,
        CONFIGS,
        _triton_fp8.rows_fp8_config(k),
        lambda cfg: _triton_fp8.quantize_rows_fp8(x, col, config=cfg),
        x.numel() * 3 + tokens * 4,  # bf16 read, e4m3 and one fp32 scale per row written
        copy_gbps,
    )


def main() -> None:
    copy = qbench.copy_gbps()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy {copy:.0f} GB/s\n")
    print("| rows | input | tile | warps | device µs | GB/s | of copy bw |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for tokens, k in SHAPES:
        for with_col in (False, True):
            print("\n".join(sweep(tokens, k, with_col, copy)), flush=True)


if __name__ == "__main__":
    main()
