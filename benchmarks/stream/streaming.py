"""Weight-streaming efficiency: a forward with every block streamed vs the same blocks resident.

    python benchmarks/stream/streaming.py                 # the GPU machine: the crossover grid
    python benchmarks/stream/streaming.py --smoke         # tiny shapes on the CPU (checks the script only)
    python benchmarks/stream/streaming.py --hidden 4096 --tokens 2048 8192 --prefetch 1 2

For each hidden size H, ``--blocks`` bf16 MLP blocks (``H -> 4H -> H``, 16·H² bytes each: the weight
volume of a transformer block's MLP) are built on the device (random weights, ``normal_``), then per
token count T (one batch of T tokens):

- ``t_resident``: median forward time with every block in VRAM;
- ``t_streamed``: median forward time with every block streamed by ``StreamedBlocks`` (prefetch k), in a
  loop of forwards as inference runs them: with ``hold_turns`` each forward's last blocks prefetch the
  next one's first, so the copies of every block (the next forward's first included) overlap compute;
- ``t_h2d``: median time to copy all blocks' weights host -> device back to back (no compute);
- ``GB/s``: bytes streamed / ``t_streamed`` (sustained rate of the streamed forward) and the copy
  engine's own rate over the H2D stream's copies (``StreamedBlocks.stats()["h2d_gbps"]``);
- ``overlap = 1 - (t_streamed - t_resident) / t_h2d`` (1: the copies hide entirely behind compute);
- ``compute>=transfer`` marks rows where ``t_resident >= t_h2d`` (the acceptance range of the overlap).

The output is correct-first: each configuration first checks the streamed forward bit-identical to the
resident one. Prints ``RESULT {...}`` JSON lines, then a Markdown table, and the crossover per H (the
smallest T where compute covers the transfer). ``--out FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path[:0] = [str(p) for p in (Path(__file__).resolve().parents[2] / "packages").glob("*/src")]
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import markdown_table, random_blocks, time_calls  # noqa: E402

from tidal_stream.streamed_blocks import StreamedBlocks  # noqa: E402

PREFIX = "RESULT "


class MLPBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def median_time(fn: Any, device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` synchronized calls of ``fn`` after one warm-up call."""
    return statistics.median(time_calls(fn, device, reps, warmup=1))


def forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for b in blocks:
            x = b(x)
    return x


def run_hidden(
    h: int, tokens: list[int], prefetch: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks = random_blocks(lambda: MLPBlock(h), args.blocks, device, dtype)
    xs = {t: torch.randn(t, h, device=device, dtype=dtype) for t in tokens}
    resident = {t: median_time(lambda t=t: forward(blocks, xs[t]), device, args.reps) for t in tokens}
    expect = {t: forward(blocks, xs[t]) for t in tokens}
    rows = []
    # frozen inference blocks: each forward's last blocks prefetch the next forward's first (hold_turns)
    blocks.requires_grad_(False)
    sb = StreamedBlocks(blocks, device, prefetch_ahead=prefetch[0], hold_turns=True)
    total = sum(sb.block_bytes())

    def copy_all() -> None:
        with sb.gathered(writeback=False):
            pass

    t_h2d = median_time(copy_all, device, args.reps)
    for k in prefetch:
        sb.prefetch_ahead = k
        for t in tokens:
            got = forward(blocks, xs[t])
            if not torch.equal(got, expect[t]):
                raise SystemExit(f"streamed forward differs from resident at H={h} T={t} k={k}")
            sb.reset_stats()
            t_str = median_time(lambda t=t: forward(blocks, xs[t]), device, args.reps)
            st = sb.stats()
            row = {
                "hidden": h,
                "tokens": t,
                "prefetch": k,
                "blocks": args.blocks,
                "block_mib": round(total / args.blocks / 2**20, 1),
                "t_resident_ms": round(resident[t] * 1e3, 3),
                "t_streamed_ms": round(t_str * 1e3, 3),
                "t_h2d_ms": round(t_h2d * 1e3, 3),
                "sustained_gbps": round(total / t_str / 1e9, 2),
                "copy_gbps": round(st["h2d_gbps"], 2),
                "overlap": round(1 - (t_str - resident[t]) / t_h2d, 3),
                "compute_ge_transfer": resident[t] >= t_h2d,
                "stall_ms_per_fwd": round(st["stall_ms"] / (args.reps + 1), 3),
                "resident_peak_blocks": st["resident_peak_blocks"],
            }
            print(PREFIX + json.dumps(row), flush=True)
            rows.append(row)
    sb.remove()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


TABLE_COLUMNS = [
    "hidden",
    "tokens",
    "prefetch",
    "block_mib",
    "t_resident_ms",
    "t_streamed_ms",
    "t_h2d_ms",
    "sustained_gbps",
    "copy_gbps",
    "overlap",
    "compute_ge_transfer",
    "stall_ms_per_fwd",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--prefetch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.tokens, args.prefetch, args.blocks, args.reps, args.device = (
            [64],
            [16, 64],
            [1],
            3,
            2,
            "cpu",
        )
    torch.manual_seed(0)
    rows = []
    for h in args.hidden:
        rows += run_hidden(h, args.tokens, args.prefetch, args)
    print(markdown_table(rows, TABLE_COLUMNS))
    for h in args.hidden:
        for k in args.prefetch:
            cross = [
                r["tokens"]
                for r in rows
                if r["hidden"] == h and r["prefetch"] == k and r["compute_ge_transfer"]
            ]
            print(
                f"crossover H={h} prefetch={k}: compute >= transfer from T={min(cross) if cross else 'none'}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
