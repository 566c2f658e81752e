"""decode8b's engines stepped in turn in one process: ratios that the host's drift between processes cannot move.

```bash
python3 benchmarks/kv/interleaved.py --context 4096 32768 --batch 1   # the GPU machine, ~1 min
python3 benchmarks/kv/interleaved.py --smoke                           # tiny Llama on the CPU (checks the script)
```

``decode.py`` runs each engine in its own process, one after the other. At batch 1 the decode step is
bound by the host (Python and kernel launches), and on the GPU machine the same engine's step moved by
tens of milliseconds between processes (DynamicCache 62-70 ms, TidalCache 76-122 ms at 4k x 1). Here one
model serves every engine's cache (each filled as decode.py fills it), and each round runs one
synchronized decode step of every engine, in an order that rotates round by round, so drift reaches
every engine alike. Per engine: the median step, its tokens/s against DynamicCache's in the same
rounds, and the median of the round-by-round ratios with a 95 % bootstrap interval (`paired_ratio`: the
spread that decides whether a 0.9x goal is met). ``tidal-resident`` (TidalCache, every layer resident) is the cache's own cost without a copy.

Attention runs without cuDNN's backend by default (``--sdpa no-cudnn``): cuDNN builds a graph for each new
sequence length and K/V stride, tens of milliseconds of host time per step, and engines in one process
share those graphs when their lengths and strides match (the TidalCache engines do, DynamicCache does
not), so with it the ratios would measure the order of the engines in each round.

One JSON line per engine and context on stdout (``RESULT {...}``) and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from decode_worker import SDPA_BACKENDS, report, sdpa_backends  # noqa: E402

__all__ = [
    "StepClock",
    "host_ops",
    "main",
    "ops_table",
    "paired_ratio",
    "ratio_cells",
    "rounds",
    "run_contexts",
    "split",
    "step_stats",
]


class StepClock:
    """Per call of each stepper: wall time, host time to issue it, time waiting for the device, GC time.

    A batch-1 decode step is bound by the host, and the same engine's step moved between a fast and a slow
    regime within one run. The split says which side a slow step lost its time on: issuing (Python, launches,
    blocking runtime calls), the final synchronization (copies or kernels still running), or Python's cyclic
    garbage collector, which pauses whichever step happens to allocate past its threshold.
    """

    def __init__(self, names: list[str]) -> None:
        self.wall: dict[str, list[float]] = {k: [] for k in names}
        self.issue: dict[str, list[float]] = {k: [] for k in names}
        self.gc: dict[str, list[float]] = {k: [] for k in names}
        self._gc_s = 0.0
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_t0

    def time(self, name: str, call: Any, sync: Any) -> None:
        """Time one call of ``call`` (``sync`` before and after) under ``name``."""
        import gc

        sync()  # why: each call starts on an idle device, as each generate() step does
        self._gc_s = 0.0
        gc.callbacks.append(self._on_gc)
        try:
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            sync()  # why: the step ends when its token is on the host
            t2 = time.perf_counter()
        finally:
            gc.callbacks.remove(self._on_gc)
        self.wall[name].append(t2 - t0)
        self.issue[name].append(t1 - t0)
        self.gc[name].append(self._gc_s)


def rounds(steppers: dict[str, Any], n: int, sync: Any) -> StepClock:
    """``n`` rounds of one timed call of every stepper, the order rotated by one each round."""
    names = list(steppers)
    clock = StepClock(names)
    for r in range(n):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            clock.time(name, steppers[name], sync)
    return clock


def split(clock: StepClock, name: str) -> dict[str, float]:
    """Median issue / wait / GC ms of ``name``'s steps, over all steps and over its slower half."""
    wall, issue, gcs = clock.wall[name], clock.issue[name], clock.gc[name]
    med = statistics.median(wall)
    slow = [i for i, w in enumerate(wall) if w > med] or list(range(len(wall)))

    def ms(values: list[float], idx: list[int]) -> float:
        return 1e3 * statistics.median([values[i] for i in idx])

    every = list(range(len(wall)))
    wait = [w - i for w, i in zip(wall, issue)]
    return {
        "issue_ms": ms(issue, every),
        "wait_ms": ms(wait, every),
        "gc_ms_total": 1e3 * sum(gcs),
        "slow_half_issue_ms": ms(issue, slow),
        "slow_half_wait_ms": ms(wait, slow),
    }


def paired_ratio(
    clock: StepClock, name: str, base: str, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``base``'s step time over ``name``'s, round by round: the median and a 95 % bootstrap interval of it.

    Both engines step once in every round, so each round gives one ratio that the host's drift between rounds
    reaches alike; resampling the rounds (with replacement, ``resamples`` times, seeded) gives the interval of
    their median. A goal like ">= 0.9x DynamicCache" is met only when the interval's low end clears it.
    """
    import random

    ratios = [b / e for b, e in zip(clock.wall[base], clock.wall[name])]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def step_stats(steps: dict[str, list[float]], clock: Any, name: str, batch: int) -> dict[str, Any]:
    """``name``'s step times in ms and tokens/s, and its speed against DynamicCache's: over all steps
    (``x_dynamic``) and round by round (:func:`paired_ratio` over ``clock.wall``, one time per engine and
    round).

    Args:
        steps: Every engine's step times (seconds).
        clock: The rounds (``clock.wall``: engine -> one time per round), a :class:`StepClock` or alike.
        name: The engine.
        batch: Sequences per step.
    """
    times = steps[name]
    med = statistics.median(times)
    base = statistics.median(steps["dynamic"]) if "dynamic" in steps else None
    row: dict[str, Any] = {
        "steps": len(times),
        "ms_per_step": 1e3 * med,
        "ms_min": 1e3 * min(times),
        "ms_max": 1e3 * max(times),
        "tokens_per_s": batch / med,
        "x_dynamic": base / med if base else None,
    }
    if base:
        paired, lo, hi = paired_ratio(clock, name, "dynamic")
        row.update(x_dynamic_paired=paired, x_dynamic_ci95=[lo, hi])
    return row


def ratio_cells(row: dict[str, Any], digits: int = 2) -> tuple[str, str]:
    """A row's two table cells against DynamicCache: over all steps, and round by round with its interval."""
    if row["engine"] == "dynamic" or row["x_dynamic"] is None:
        return "-", "-"
    paired = "-"
    if row.get("x_dynamic_paired") is not None:
        lo, hi = row["x_dynamic_ci95"]
        paired = f"{row['x_dynamic_paired']:.3f} [{lo:.3f}, {hi:.3f}]"
    return f"{row['x_dynamic']:.{digits}f}", paired


def run_contexts(args: argparse.Namespace, run_context: Any) -> list[dict[str, Any]]:
    """decode8b's model (the tiny Llama on the CPU with ``--smoke``) and ``run_context(model, engines, ctx, args)``
    for every ``--context``, without autograd and with ``--sdpa``'s backends; each row printed as it comes."""
    import engines  # noqa: F401 - puts packages/*/src on the path
    import torch
    from decode import model_config
    from decode_worker import build_model

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = build_model(model_config(args.smoke), device, torch.float32 if args.smoke else torch.bfloat16)
    names = [e.strip() for e in args.engines.split(",")]
    rows = []
    for ctx in args.context:
        # why: decoding as generate() does (the cache keeps no autograd history)
        with torch.no_grad(), sdpa_backends(args.sdpa):
            for row in run_context(model, names, ctx, args):
                row["sdpa"] = args.sdpa
                print("RESULT " + json.dumps(row), flush=True)
                rows.append(row)
    return rows


def host_ops(steppers: dict[str, Any], n: int, sync: Any) -> dict[str, dict[str, float]]:
    """Per engine: each op's self host time per step (µs) over ``n`` steps under torch.profiler (CPU only).

    The profiler adds its own cost to every op, so compare engines with each other, not with timed steps.
    Engines are profiled in turn, forward then backward (each ``n`` steps per pass), after one discarded pass,
    so the profiler's own warm-up and the host's drift reach every engine alike.
    """
    from torch.profiler import ProfilerActivity, profile

    names = list(steppers)
    out: dict[str, dict[str, float]] = {e: {} for e in names}
    for order, keep in ((names, False), (names, True), (names[::-1], True)):
        for name in order:
            sync()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    steppers[name]()
                    sync()  # why: steps start on an idle device, as in the timed rounds
            if keep:
                for e in prof.key_averages():
                    out[name][e.key] = out[name].get(e.key, 0.0) + e.self_cpu_time_total / (2 * n)
    return out


def ops_table(ops: dict[str, dict[str, float]], top: int = 15) -> str:
    """The ``top`` ops by their largest spread in self host µs per step between engines, as markdown."""
    names = list(ops)
    keys = set().union(*(o.keys() for o in ops.values()))
    spread = {
        k: max(o.get(k, 0.0) for o in ops.values()) - min(o.get(k, 0.0) for o in ops.values()) for k in keys
    }
    lines = [
        "| op (self host µs per step) | " + " | ".join(names) + " |",
        "|---" + "|---:" * len(names) + "|",
    ]
    for k in sorted(keys, key=spread.get, reverse=True)[:top]:
        lines.append(f"| {k} | " + " | ".join(f"{ops[e].get(k, 0.0):.0f}" for e in names) + " |")
    totals = " | ".join(f"{sum(ops[e].values()):.0f}" for e in names)
    lines.append(f"| (all ops) | {totals} |")
    return "\n".join(lines)


def run_context(model: Any, engines: list[str], ctx: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every engine's cache filled to ``ctx`` tokens, stepped in turn; one row per engine."""
    import torch
    from decode_worker import fill, make_cache, release, step

    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    caches = {e: make_cache(e, model, ctx + 1, args.page_tokens, args.slots) for e in engines}
    toks = {}
    for e, cache in caches.items():
        fill(cache, model, args.batch, ctx - args.warmup - args.steps, seed=1)
        toks[e] = torch.randint(1, model.config.vocab_size, (args.batch, 1), device=model.device)

    def stepper(e: str) -> Any:
        def one() -> None:
            toks[e] = step(model, caches[e], toks[e])

        return one

    steppers = {e: stepper(e) for e in engines}
    rounds(steppers, args.warmup, sync)
    clock = rounds(steppers, args.steps, sync)
    if args.profile_steps:
        print(f"context {ctx}: host ops that differ most between engines")
        print(ops_table(host_ops(steppers, args.profile_steps, sync)), flush=True)
    rows = [
        {
            "engine": e,
            "context": ctx,
            "batch": args.batch,
            **step_stats(clock.wall, clock, e, args.batch),
            **split(clock, e),
        }
        for e in engines
    ]
    caches.clear()  # why: the K/V go before the next context is filled
    steppers.clear()
    release(cuda)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| engine | context | batch | ms/step (median) | min-max ms | tokens/s | x dynamic, same rounds "
        "| x dynamic, round by round [95 % CI] "
        "| issue / wait ms (median) | slower half: issue / wait ms | GC ms (all steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x, paired = ratio_cells(r)
        lines.append(
            f"| {r['engine']} | {r['context']} | {r['batch']} | {r['ms_per_step']:.1f} | "
            f"{r['ms_min']:.1f}-{r['ms_max']:.1f} | {r['tokens_per_s']:.1f} | {x} | {paired} | "
            f"{r['issue_ms']:.1f} / {r['wait_ms']:.1f} | {r['slow_half_issue_ms']:.1f} / {r['slow_half_wait_ms']:.1f} "
            f"| {r['gc_ms_total']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="dynamic,tidal,tidal-resident", help="comma-separated (decode.py's)")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    ap.add_argument("--steps", type=int, default=25, help="timed rounds")
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument(
        "--sdpa",
        choices=list(SDPA_BACKENDS),
        default="no-cudnn",
        help="attention backends torch may pick from; 'default' is torch's own order (cuDNN first on Hopper)",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed rounds, profile this many steps per engine and print the host ops that differ",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 64-token context")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.context, args.page_tokens = [64], 16
    rows = run_contexts(args, run_context)
    return report(rows, table(rows), args.json)


if __name__ == "__main__":
    main()
