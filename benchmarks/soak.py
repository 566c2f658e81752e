"""Soak run: many steps of a small wrapped model with weight streaming and the host AdamW, sampling the
host arena's (pinned) bytes, device memory and the process RSS, then saying whether each stayed flat.

On the GPU machine (about 3 minutes on the H200)::

    python benchmarks/soak.py                       # 1,000 steps, CUDA
    python benchmarks/soak.py --steps 300 --json benchmarks/results/soak-h200.json

On any machine (a few seconds, CPU standing in for the GPU: the same code paths, pageable memory)::

    python benchmarks/soak.py --smoke

"Flat" means: over the samples after warm-up (the first ``--warmup`` steps, default 10 % of the run),
``(max - min) / max`` stays within ``--tolerance`` (default 1 %). The exit status is 1 when a metric is
not flat (except with ``--smoke``, where the run is too short for the verdict to mean much).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The model is the reliability scenarios' TinyLM (embedding, pre-norm residual MLP blocks that stream,
# final norm, untied head), with 4x-wide MLPs here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests-integration" / "reliability"))
from _common import TinyLM


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(device: torch.device) -> dict[str, int]:
    """Host arena bytes (pinned on CUDA), device memory and RSS right now."""
    from tidal_arena import arena_stats

    a = arena_stats()
    out = {
        "host_arena_bytes": int(a["reserved_bytes"]),
        "pinned_bytes": int(a["pinned_reserved_bytes"]),
        "rss_bytes": rss_bytes(),
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["vram_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["vram_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return out


def flatness(values: list[int], tolerance: float) -> dict[str, Any]:
    """``spread = (max - min) / max`` of the samples, and whether it is within ``tolerance``."""
    lo, hi = min(values), max(values)
    spread = (hi - lo) / hi if hi else 0.0
    return {
        "min": lo,
        "max": hi,
        "first": values[0],
        "last": values[-1],
        "spread": spread,
        "flat": spread <= tolerance,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, sample every ``args.every`` steps, return the figures."""
    from tidal_stream import memory_report, unwrap, wrap

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, mlp_ratio=4).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    t0 = time.perf_counter()
    model, opt = wrap(
        model, opt, offload=True, param_offload=True, blocks=model.blocks, max_grad_norm=1.0, attention=None
    )
    wrap_s = time.perf_counter() - t0
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (16, args.batch, args.seq + 1), generator=g).to(device)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    samples: list[dict[str, int]] = []
    losses: list[float] = []
    t_start = time.perf_counter()
    for step in range(args.steps):
        batch = tokens[step % tokens.shape[0]]
        logits = model(batch[:, :-1])  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            opt.synchronize()
            losses.append(float(loss.detach()))
            samples.append({"step": step + 1, **sample(device)})
    opt.synchronize()
    elapsed = time.perf_counter() - t_start
    report = memory_report(model)
    unwrap(model)
    after = [s for s in samples if s["step"] > warmup] or samples[-1:]
    metrics = [k for k in samples[0] if k != "step"]
    verdict = {k: flatness([s[k] for s in after], args.tolerance) for k in metrics}
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": n_params,
        "steps": args.steps,
        "warmup_steps": warmup,
        "sample_every": args.every,
        "tolerance": args.tolerance,
        "wrap_seconds": wrap_s,
        "seconds": elapsed,
        "step_ms_mean": 1e3 * elapsed / args.steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "h2d_bytes": report.get("h2d_bytes"),
        "d2h_bytes": report.get("d2h_bytes"),
        "verdict": verdict,
        "samples": samples,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny CPU run (30 steps) that exercises the same path"
    )
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--every", type=int, default=10, help="sample every N steps (default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="steps excluded from the verdict (default 10%%)")
    ap.add_argument(
        "--tolerance", type=float, default=0.01, help="flat means (max-min)/max <= this (default 0.01)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the figures (with every sample) here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        ap.error("--steps and --every must be >= 1")
    if args.smoke:
        args.device = args.device or "cpu"
        args.steps = min(args.steps, 30)
        args.dim, args.layers, args.vocab, args.batch, args.seq, args.every = 32, 3, 128, 2, 16, 2
        torch.set_num_threads(1)
    elif args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    res = run(args)
    print(
        f"soak: {res['steps']} steps of a {res['params'] / 1e6:.2f} M-parameter model on {res['device_name']} "
        f"(weights streamed, host AdamW) in {res['seconds']:.1f} s ({res['step_ms_mean']:.1f} ms/step; "
        f"wrap {res['wrap_seconds']:.1f} s); loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}"
    )
    print(
        f"after warm-up ({res['warmup_steps']} steps), flat = (max-min)/max <= {100 * args.tolerance:.1f} %:"
    )
    for k, v in res["verdict"].items():
        print(
            f"  {k:22s} first {_mib(v['first']):>12s}  last {_mib(v['last']):>12s}  min {_mib(v['min']):>12s}  "
            f"max {_mib(v['max']):>12s}  spread {100 * v['spread']:.3f} %  {'FLAT' if v['flat'] else 'NOT FLAT'}"
        )
    if "vram_allocated_bytes" not in res["verdict"]:
        print("  vram: n/a on the CPU")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"figures written to {args.json}")
    all_flat = all(v["flat"] for v in res["verdict"].values())
    return 0 if all_flat or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
