"""Do TidalCache's page gathers overlap the decode step? A torch.profiler look at a few decode8b steps.

```bash
python3 benchmarks/kv/overlap.py --context 32768 --batch 1     # the GPU machine, decode8b shape, ~1 min
python3 benchmarks/kv/overlap.py --smoke                       # tiny Llama on the CPU (checks the script)
```

decode8b's table shows TidalCache's step at or above DynamicCache's step *plus* the copy time of the
offloaded layers' pages (4k×1: 80.2 ms against 62.0 + 4.9; 32k×1: 117.8 against 60.6 + 39), where the prefetch is meant to hide the copies behind the host-bound decode. This
probe builds the decode8b model once (random bf16 weights on the GPU), fills each engine's cache to
``--context`` tokens as decode8b does, runs ``--warmup`` steps, then profiles ``--steps`` steps (each
synchronized, as ``generate()`` is) and reports per step:

- ``step_ms``: wall time; ``kernel_ms`` / ``h2d_ms``: time the GPU spent in kernels / host-to-device
  copies (union of their intervals); ``h2d_under_kernels_ms``: copy time that ran while a kernel ran;
  ``gpu_idle_ms``: neither kernels nor copies;
- ``pageable_h2d``: host-to-device copies the driver saw from pageable memory (each blocks the host);
- ``h2d_queue_ms``: median and max delay from the host's ``cudaMemcpyAsync`` to the copy's start on the
  GPU (a long delay: the copy waits in its stream, e.g. for a slot the attention still reads);
- ``runtime_ms``: host time inside the CUDA runtime calls that can block (synchronizations, memcpys,
  event waits), the largest first;
- ``top_kernels``: the kernels with the most device time per step, with their calls per step (where the
  engines' kernel time differs).

One JSON line per engine on stdout (``RESULT {...}``) and a short table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from trace_intervals import Ev, kineto_events, merged, overlap, total  # noqa: E402

__all__ = ["Ev", "kineto_events", "main", "merged", "overlap", "summarize", "total"]

#: kernels listed by their device time per step, the largest first
TOP_KERNELS = 8
#: host-side CUDA runtime calls that may block the calling thread
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaEventQuery", "cudaStreamQuery", "cudaHostRegister", "cudaFree")


def summarize(events: Sequence[Ev], steps: int, wall_ms: float) -> dict[str, Any]:
    """Per-step figures of the profiled window (see the module docstring)."""
    dev = [e for e in events if e.device]
    copies = [e for e in dev if e.name.startswith("Memcpy HtoD")]
    # tidal's annotations also appear on the GPU's timeline (spanning the work they queued): not kernels
    kernels = [e for e in dev if not e.name.startswith(("Memcpy", "Memset", "tidal::"))]
    k_iv, c_iv = merged((e.start, e.end) for e in kernels), merged((e.start, e.end) for e in copies)
    busy = merged([*k_iv, *c_iv])
    span = (min(e.start for e in dev), max(e.end for e in dev)) if dev else (0.0, 0.0)
    host_calls = {e.corr: e for e in events if not e.device and e.name.startswith("cudaMemcpy") and e.corr}
    queue = [c.start - host_calls[c.corr].start for c in copies if c.corr in host_calls]
    runtime: dict[str, float] = {}
    for e in events:
        if not e.device and e.name.startswith("cuda") and any(b in e.name for b in BLOCKING):
            runtime[e.name] = runtime.get(e.name, 0.0) + (e.end - e.start)
    n = max(steps, 1)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.end - e.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    return {
        "steps": steps,
        "step_ms": wall_ms / n,
        "kernel_ms": total(k_iv) / 1e3 / n,
        "h2d_ms": total(c_iv) / 1e3 / n,
        "h2d_under_kernels_ms": overlap(c_iv, k_iv) / 1e3 / n,
        "gpu_idle_ms": max(0.0, (span[1] - span[0]) - total(busy)) / 1e3 / n,
        "h2d_copies": len(copies) / n,
        "pageable_h2d": sum("Pageable" in e.name for e in copies) / n,
        "h2d_queue_ms": {
            "median": statistics.median(queue) / 1e3 if queue else None,
            "max": max(queue) / 1e3 if queue else None,
        },
        "runtime_ms": {k: v / 1e3 / n for k, v in sorted(runtime.items(), key=lambda kv: -kv[1])[:6]},
        "top_kernels": [{"name": name[:120], "ms": sum(d) / 1e3 / n, "calls": len(d) / n} for name, d in top],
    }


def profile_engine(engine: str, model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fill ``engine``'s cache to the context, warm up, profile ``args.steps`` synchronized decode steps."""
    import torch
    from decode_worker import fill, make_cache, release, step
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx, batch = args.context, args.batch
    cache = make_cache(engine, model, ctx + 1, args.page_tokens, args.slots)
    fill(cache, model, batch, ctx - args.warmup - args.steps, seed=1)
    tok = torch.randint(1, model.config.vocab_size, (batch, 1), device=model.device)
    for _ in range(args.warmup):
        tok = step(model, cache, tok)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = step(model, cache, tok)
            sync()  # why: each step ends as generate()'s does, on the host reading the token
        wall_ms = 1e3 * (time.perf_counter() - t0)
    row = {
        "engine": engine,
        "context": ctx,
        "batch": batch,
        **summarize(kineto_events(prof), args.steps, wall_ms),
    }
    del cache
    release(cuda)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    cols = ("step_ms", "kernel_ms", "h2d_ms", "h2d_under_kernels_ms", "gpu_idle_ms", "pageable_h2d")
    lines = ["engine      " + " ".join(f"{c:>20}" for c in cols) + "  h2d queue med/max ms"]
    for r in rows:
        q = r["h2d_queue_ms"]
        qs = "-" if q["median"] is None else f"{q['median']:.2f}/{q['max']:.2f}"
        lines.append(f"{r['engine']:<12}" + " ".join(f"{r[c]:>20.2f}" for c in cols) + f"  {qs}")
        lines.append(
            f"{'':<12}runtime ms/step: {json.dumps({k: round(v, 2) for k, v in r['runtime_ms'].items()})}"
        )
        for k in r["top_kernels"]:
            lines.append(f"{'':<12}{k['ms']:8.3f} ms {k['calls']:6.0f} calls  {k['name']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engines", default="dynamic,tidal", help="comma-separated: dynamic, tidal, tidal-fp8, tidal-nf4"
    )
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 64-token context")
    args = ap.parse_args(argv)
    import engines  # noqa: F401 - puts packages/*/src on the path
    import torch
    from decode import model_config
    from decode_worker import build_model

    if args.smoke:
        args.context, args.page_tokens = 64, 16
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = build_model(model_config(args.smoke), device, torch.float32 if args.smoke else torch.bfloat16)
    rows = []
    for engine in args.engines.split(","):
        with torch.no_grad():  # why: decoding as generate() does (the cache keeps no autograd history)
            row = profile_engine(engine.strip(), model, args)
        print("RESULT " + json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
