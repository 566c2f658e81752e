"""Activation offload vs keep vs recompute: forward/backward time and the PCIe rate offload sustains.

    python benchmarks/stream/activation_offload.py              # the GPU machine (< 60 s)
    python benchmarks/stream/activation_offload.py --act-mib 50 200 --prefetch 1 2
    python benchmarks/stream/activation_offload.py --smoke      # tiny shapes on the CPU (checks the script)

``--blocks`` (16) bf16 blocks shaped like a Qwen2 MLP half-block (``x + down(silu(gate(n)) * up(n))``,
``n = LayerNorm(x)``, hidden ``--hidden``, intermediate ``--ffn``), all parameters trained. The token
count is chosen so each block saves about ``--act-mib`` MiB for backward (``n`` is saved by both gate
and up: offload sends it once). Per policy, applied to every block with ``install_activation_policy``:

- ``fwd_ms`` / ``bwd_ms``: median forward and backward time (synchronized), after warm-up;
- ``peak_mib``: peak allocated VRAM of a step above the weights and gradients;
- offload only: ``offloaded_mib`` (D2H bytes per step, = H2D bytes), ``d2h_gbps`` / ``h2d_gbps``
  (those bytes over the forward / backward time: the rate the step sustained), ``fwd_eff`` /
  ``bwd_eff`` (the floor ``max(keep time, bytes / raw copy rate)`` over the measured time: 1.0 means the
  copies hide the compute and run at the link's rate), ``host_allocs`` (host-pool allocations during
  the timed steps: 0 after warm-up), ``demand_fetches`` (copies back not prefetched in time: 0);
- ``raw_d2h_gbps`` / ``raw_h2d_gbps``: the same bytes copied alone, one copy per block, pinned host.

Correct first: the offload step's gradients are checked bit-identical to the keep step's (no dropout),
recompute's max abs difference is printed. Prints ``RESULT {...}`` JSON lines and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path[:0] = [str(p) for p in (Path(__file__).resolve().parents[2] / "packages").glob("*/src")]
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import markdown_table, random_blocks, sync  # noqa: E402

from tidal_stream.activations import install_activation_policy  # noqa: E402

PREFIX = "RESULT "


class MLPBlock(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        n = self.norm(x)  # [T, H], saved by gate and up
        return x + self.down(nn.functional.silu(self.gate(n)) * self.up(n))  # [T, H]


def step(blocks: nn.ModuleList, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One training step: (forward seconds, backward seconds), synchronized."""
    for p in blocks.parameters():
        p.grad = None
    sync(device)
    t0 = time.perf_counter()
    h = x
    for b in blocks:
        h = b(h)
    loss = h.float().square().mean()
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def grads(blocks: nn.ModuleList) -> list[torch.Tensor]:
    return [p.grad.clone() for p in blocks.parameters()]


def raw_copy_gbps(nbytes: int, n: int, device: torch.device) -> tuple[float, float]:
    """D2H and H2D GB/s of ``n`` copies of ``nbytes`` between one device buffer and pinned host ones."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    dev = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)  # [nbytes / 2]
    hosts = [torch.empty_like(dev, device="cpu").pin_memory() for _ in range(n)]
    side = torch.cuda.Stream(device)  # a copy stream, as the offload path uses

    def run(d2h: bool) -> float:
        samples = []
        for _ in range(4):
            sync(device)
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                for hb in hosts:
                    if d2h:
                        hb.copy_(dev, non_blocking=True)
                    else:
                        dev.copy_(hb, non_blocking=True)
            side.synchronize()
            samples.append(time.perf_counter() - t0)
        return n * nbytes / statistics.median(samples[1:]) / 1e9

    return run(True), run(False)


def run(args: argparse.Namespace, act_mib: float) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, f = args.hidden, args.ffn
    per_token = dtype.itemsize * (2 * h + 4 * f)  # x, n, gate, silu(gate), up, product: bytes saved
    tokens = args.tokens or max(64, int(act_mib * 2**20 / per_token) // 64 * 64)
    torch.manual_seed(0)
    blocks = random_blocks(lambda: MLPBlock(h, f), args.blocks, device, dtype)
    x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)  # [T, H]
    step(blocks, x, device)  # warm-up (allocator, kernels)
    ref = grads(blocks)
    rows: list[dict[str, Any]] = []
    keep: dict[str, float] = {}
    for policy, prefetch in [("keep", 0), *(("offload", k) for k in args.prefetch), ("recompute", 0)]:
        handle = None
        if policy != "keep":
            handle = install_activation_policy(
                blocks,
                [policy] * args.blocks,
                device=device,
                prefetch_ahead=prefetch,
                min_offload_bytes=args.min_offload_bytes,
            )
        for _ in range(2):  # warm-up: the host pool takes its slabs here
            step(blocks, x, device)
        got = grads(blocks)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, got))
        if policy == "offload" and not all(torch.equal(a, b) for a, b in zip(ref, got)):
            raise SystemExit(f"offload gradients differ from keep (max abs diff {diff}) at T={tokens}")
        st0 = handle.stats() if handle is not None else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times = [step(blocks, x, device) for _ in range(args.reps)]
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
        fwd = statistics.median(t[0] for t in times)
        bwd = statistics.median(t[1] for t in times)
        row: dict[str, Any] = {
            "policy": policy,
            "prefetch": prefetch,
            "hidden": h,
            "ffn": f,
            "tokens": tokens,
            "blocks": args.blocks,
            "fwd_ms": round(fwd * 1e3, 2),
            "bwd_ms": round(bwd * 1e3, 2),
            "peak_mib": round(peak / 2**20, 1),
            "max_abs_diff_vs_keep": diff,
        }
        if policy == "keep":
            keep = {"fwd": fwd, "bwd": bwd}
        if policy == "offload":
            assert handle is not None and st0 is not None
            st = handle.stats()
            nbytes = (st["offloaded_bytes"] - st0["offloaded_bytes"]) / args.reps
            raw_d2h, raw_h2d = raw_copy_gbps(int(nbytes / args.blocks) // 2 * 2, args.blocks, device)
            row |= {
                "offloaded_mib": round(nbytes / 2**20, 1),
                "block_mib": round(nbytes / args.blocks / 2**20, 1),
                "d2h_gbps": round(nbytes / fwd / 1e9, 2),
                "h2d_gbps": round(nbytes / bwd / 1e9, 2),
                "raw_d2h_gbps": round(raw_d2h, 2),
                "raw_h2d_gbps": round(raw_h2d, 2),
                "fwd_eff": round(max(keep["fwd"], nbytes / (raw_d2h * 1e9)) / fwd, 3),
                "bwd_eff": round(max(keep["bwd"], nbytes / (raw_h2d * 1e9)) / bwd, 3),
                "host_allocs": st["host_pool"]["allocations"] - st0["host_pool"]["allocations"],
                "demand_fetches": st["demand_fetches"] - st0["demand_fetches"],
                "deduplicated_per_step": (st["deduplicated"] - st0["deduplicated"]) // args.reps,
                "restore_copies_per_step": (st["restore_copies"] - st0["restore_copies"]) // args.reps,
            }
        if handle is not None:
            handle.remove()
        print(PREFIX + json.dumps(row), flush=True)
        rows.append(row)
    del blocks, x, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


TABLE_COLUMNS = [
    "policy",
    "prefetch",
    "tokens",
    "block_mib",
    "fwd_ms",
    "bwd_ms",
    "peak_mib",
    "d2h_gbps",
    "h2d_gbps",
    "raw_d2h_gbps",
    "raw_h2d_gbps",
    "fwd_eff",
    "bwd_eff",
    "host_allocs",
    "demand_fetches",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--act-mib", type=float, nargs="+", default=[200.0], help="saved MiB per block")
    ap.add_argument("--tokens", type=int, default=None, help="override the token count")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--prefetch", type=int, nargs="+", default=[2])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--min-offload-bytes", type=int, default=1 << 16, help="smaller saved tensors stay")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.act_mib, args.hidden, args.ffn, args.blocks, args.reps, args.device = [0.25], 32, 96, 4, 2, "cpu"
        args.min_offload_bytes = 256
        torch.set_num_threads(1)
    rows = []
    for mib in args.act_mib:
        rows += run(args, mib)
    print(markdown_table(rows, TABLE_COLUMNS))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
