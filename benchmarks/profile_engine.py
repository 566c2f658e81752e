"""Where one engine's training step spends its time: torch.profiler over a few steps of a harness scenario.

    python3 benchmarks/profile_engine.py --engine tidal-nf4 --scenario lora14b --vram-gb 24
    python3 benchmarks/profile_engine.py --engine stock --scenario smoke --device cpu   # checks the script

The engine is built exactly as ``compare.py`` builds it (same filler, same setup), warmed up, then
``--steps`` steps run under the profiler. Printed: the step times, the GPU's busy share (kernel time over
wall time: low means the host, not the GPU, sets the pace), the top kernels by device time and the top
operators by host time, and the decisions tidal logged while setting up (its plan).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import RunContext, get_engine
from engines.common import Filler, sync
from engines.scenarios import GiB, get_scenario


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="tidal-nf4")
    p.add_argument("--scenario", default="lora14b")
    p.add_argument("--vram-gb", type=float, default=None, help="simulated card; default: the whole device")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # tidal's plan and decisions
    engine, scenario = get_engine(a.engine), get_scenario(a.scenario)
    dev = torch.device(a.device)
    on_cuda = dev.type == "cuda"
    if on_cuda:
        dev = torch.device("cuda", torch.cuda.current_device())
    filler = Filler(int(a.vram_gb * GiB), dev) if on_cuda and a.vram_gb else None  # noqa: F841 (held)
    module = importlib.import_module(f"engines.{engine.module}")
    step = module.setup(
        RunContext(scenario, dev, int(a.vram_gb * GiB) if a.vram_gb else None, 0), **engine.variant
    )
    for _ in range(a.warmup):
        step()
    sync(dev)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if on_cuda else []
    )
    times = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            sync(dev)
            times.append(time.perf_counter() - t0)
    events = prof.key_averages()
    wall_us = sum(times) * 1e6
    # kernels and copies only, as torch's own table totals them: a record_function range (tidal's
    # quant_linear, act.offload ...) also carries device time, which would count its kernels twice
    device_us = (
        sum(
            e.self_device_time_total
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        if on_cuda
        else 0.0
    )
    print(f"\n{engine.label} on {scenario.name}: steps {', '.join(f'{t:.3f}' for t in times)} s")
    if on_cuda:
        print(
            f"GPU busy {device_us / wall_us:.0%} of the wall time ({device_us / 1e3:.1f} of {wall_us / 1e3:.1f} ms)"
        )
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=70))
    return {"steps_s": times, "gpu_busy": device_us / wall_us if on_cuda else None}


if __name__ == "__main__":
    main()
