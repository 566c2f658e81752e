"""Device time of the NF4 dequantize kernel over bytes per program and warps (the GPU machine, ~1 min).

    python3 benchmarks/quant/dequant_sweep.py        # with packages/*/src on PYTHONPATH

At Qwen2.5-14B's layer shapes, against the HBM copy bandwidth (packed codes and absmax read, bf16 written):
the issue's goal is 70 %. Each config must give the default's bytes (checked before it is timed); times come
from a CUDA graph of 10 calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

from tidal_quant import _triton, ops

CONFIGS = [(b, w) for b in (1024, 2048, 4096, 8192, 16384) for w in (2, 4, 8, 16) if b // (32 * w) >= 4]


def main() -> None:
    copy = qbench.copy_gbps()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy {copy:.0f} GB/s\n")
    print("| layer | weight | bytes per program | warps | device µs | GB/s | of copy bw |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, in_f, out_f in qbench.QWEN14B_LAYERS:
        qw = qbench.nf4_weight(in_f, out_f)
        data, scales = ops.as_bytes(qw.data), ops.as_bytes(qw.scales)

        def run(cfg: tuple[int, int], qw=qw, data=data, scales=scales) -> tuple[torch.Tensor]:
            return (
                _triton._dequant_4bit(
                    False, data, scales, None, qw.shape, qw.block_size, torch.bfloat16, cfg
                ),
            )

        rows = qbench.config_sweep(
            f"{name} | {out_f}x{in_f}",
            CONFIGS,
            _triton.DEQUANT_4BIT_CONFIG,
            run,
            qbench.dequant_bytes(qw),
            copy,
        )
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
