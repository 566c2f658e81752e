"""Inside one engine's process: filler first, then the engine's setup, the timed steps, one result record.

The record is printed as a JSON line prefixed with ``@bench`` (progress events too), which the parent
(``compare.py``) parses; anything else the engine prints is passed through untouched.
"""

from __future__ import annotations

import importlib
import json
import platform
import resource
import sys
import time
from typing import Any

import torch

from engines import RunContext, get_engine, memtrace
from engines.common import (
    BUILD_NOTES,
    DevicePeak,
    Filler,
    NotApplicable,
    Timing,
    first_line,
    is_oom,
    run_steps,
)
from engines.scenarios import GiB, get_scenario

PREFIX = "@bench "


def emit(event: dict[str, Any]) -> None:
    """Print one protocol line (flushed: the parent streams it with ``--live``)."""
    print(PREFIX + json.dumps(event, default=str), flush=True)


def _missing_package(exc: BaseException, package: str | None) -> bool:
    # only the package itself missing: a missing submodule of an installed package is an error row
    return isinstance(exc, ModuleNotFoundError) and package is not None and exc.name == package


def run_engine(
    engine_name: str,
    scenario_name: str,
    *,
    device: str,
    vram_gb: float | None,
    warmup: int,
    steps: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Run one engine on one scenario in this process and return its result record (never raises)."""
    engine, scenario = get_engine(engine_name), get_scenario(scenario_name)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # set_device and the filler need an index
    budget = int(vram_gb * GiB) if vram_gb else None
    rec: dict[str, Any] = {
        "event": "result",
        "scenario": scenario.name,
        "engine": engine.name,
        "label": engine.label,
        "mode": scenario.mode,
        "budget_gib": vram_gb,
        "warmup": warmup,
        "steps": steps,
        "tokens_per_step": scenario.tokens_per_step,
        "params": scenario.param_count(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    timing = Timing()
    filler = peak = None
    recording = False
    t_start = time.perf_counter()

    def progress(event: dict[str, Any]) -> None:
        emit(event)
        if recording and event.get("event") == "step" and event.get("step") == warmup - 1:
            memtrace.stop(dev)  # the timed steps run without allocation stacks

    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            recording = memtrace.start(dev, memtrace.history_entries())
            if budget is not None:
                filler = Filler(budget, dev)
                rec.update(filler.describe())
            torch.cuda.reset_peak_memory_stats(dev)
            peak = DevicePeak(dev)
        emit({"event": "phase", "engine": engine.name, "phase": "setup"})
        module = importlib.import_module(f"engines.{engine.module}")
        ctx = RunContext(scenario, dev, budget, seed, progress)
        step = module.setup(ctx, **engine.variant)
        rec["version"] = module.version()
        rec["setup_s"] = time.perf_counter() - t_start
        emit({"event": "phase", "engine": engine.name, "phase": "steps", "setup_s": rec["setup_s"]})
        if recording and warmup == 0:
            memtrace.stop(dev)
        run_steps(step, warmup=warmup, steps=steps, device=dev, progress=progress, timing=timing)
        rec["outcome"], rec["detail"] = "ok", ""
        if hasattr(module, "notes"):
            rec["engine_notes"] = module.notes()  # what the engine decided (tidal: its plan and refinement)
    except NotApplicable as exc:
        rec["outcome"], rec["detail"] = "n/a", str(exc)
    except Exception as exc:
        if _missing_package(exc, engine.package):
            rec["outcome"], rec["detail"] = "not installed", first_line(exc)
        else:
            rec["outcome"] = "OOM" if is_oom(exc) else "error"
            rec["detail"] = first_line(exc)
            if rec["outcome"] == "OOM" and recording:
                # here, while the traceback still holds the failed frames and what they allocated
                rec["detail_extra"] = memtrace.oom_report(dev)
    if BUILD_NOTES:
        rec["build_notes"] = list(BUILD_NOTES)
    rec["wall_s"] = time.perf_counter() - t_start
    rec["step_times"] = timing.times
    rec["losses"] = timing.losses
    rec["gc_s"] = timing.gc_s  # per step: seconds in the garbage collector, and its full collections
    rec["gc_full_collections"] = timing.gc_full
    med = timing.median(warmup)
    rec["step_s"] = med if rec["outcome"] == "ok" else None
    rec["tokens_per_s"] = scenario.tokens_per_step / med if med and rec["outcome"] == "ok" else None
    if dev.type == "cuda":
        own = filler.nbytes if filler is not None and filler.tensor is not None else 0
        rec["peak_alloc_gib"] = (torch.cuda.max_memory_allocated(dev) - own) / GiB
        rec["peak_reserved_gib"] = (torch.cuda.max_memory_reserved(dev) - own) / GiB
        rec["peak_vram_gib"] = (peak.stop() / GiB) if peak is not None else None
        rec["peak_reserved_after_step_gib"] = [(b - own) / GiB for b in timing.peak_reserved]
    else:
        rec["peak_alloc_gib"] = rec["peak_reserved_gib"] = rec["peak_vram_gib"] = None
    rec["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    return rec


def main(argv: list[str]) -> int:
    """``compare.py --worker``: parse the worker's arguments, run, print the record."""
    import argparse

    ap = argparse.ArgumentParser(prog="compare.py --worker")
    ap.add_argument("--worker", required=True)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vram-gb", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rec = run_engine(
        a.worker, a.scenario, device=a.device, vram_gb=a.vram_gb, warmup=a.warmup, steps=a.steps, seed=a.seed
    )
    emit(rec)
    sys.stdout.flush()
    return 0
