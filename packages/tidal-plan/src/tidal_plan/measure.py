"""Timing probes behind ``profile_hardware``: copy rates, matmul rate, host AdamW rate, memory figures."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def host_ram_total() -> int:
    """Host RAM the kernel reports (MemTotal); ``sysconf`` where /proc is absent."""
    mi = _meminfo()
    if "MemTotal" in mi:
        return mi["MemTotal"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_ram_available() -> int:
    """Host RAM available to a new allocation (MemAvailable), falling back to MemTotal."""
    mi = _meminfo()
    return mi.get("MemAvailable", host_ram_total())


def cpu_name() -> str:
    """The CPU model name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def driver_version() -> str:
    """The NVIDIA driver version, or ``"unknown"``."""
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("\n", 1)[0]
    except OSError:
        return "unknown"


def cuda_usable_bytes(index: int, free: int, total: int, notes: list[str]) -> int:
    """Bytes this process may still allocate: free memory plus torch's cached-but-unused blocks,
    capped by ``torch.cuda.set_per_process_memory_fraction``."""
    reserved = torch.cuda.memory_reserved(index)
    allocated = torch.cuda.memory_allocated(index)
    usable = free + (reserved - allocated)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is None:  # older torch: the fraction cannot be read back
        msg = "torch.cuda.get_per_process_memory_fraction is missing; a per-process fraction is ignored"
        _warn_once(msg)
        notes.append(msg)
        fraction = 1.0
    else:
        fraction = get_fraction(index)
    cap = int(fraction * total) - allocated
    return max(0, min(usable, cap))


def _time_cuda(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        # why: events bracket the device work so host launch time is not counted
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _cuda_rates(dev: torch.device, quick: bool) -> dict[str, float]:
    nbytes = (256 if quick else 1024) * 1024**2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)  # never time on zeros
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)
    gpu2 = gpu.clone()
    reps = 5 if quick else 10
    h2d_s = _time_cuda(lambda: gpu.copy_(host, non_blocking=True), reps)
    d2h_s = _time_cuda(lambda: host2.copy_(gpu2, non_blocking=True), reps)
    # why: two side streams so the H2D and D2H copies run at once on the two copy engines
    s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def both() -> None:
        cur = torch.cuda.current_stream(dev)
        # why: both side streams start after the timing event recorded on the current stream
        s_in.wait_stream(cur)
        s_out.wait_stream(cur)
        with torch.cuda.stream(s_in):
            gpu.copy_(host, non_blocking=True)
        with torch.cuda.stream(s_out):
            host2.copy_(gpu2, non_blocking=True)
        # why: the end event on the current stream must follow both copies
        cur.wait_stream(s_in)
        cur.wait_stream(s_out)

    bidir_s = _time_cuda(both, reps)
    # Device memory: a copy reads and writes every byte (counted both ways, as the roofline does).
    # 1 GiB quick, 4 GiB full (about 0.5 ms / 2 ms on an H200), at most an eighth of the free memory
    big = max(nbytes, min(nbytes * 4, torch.cuda.mem_get_info(dev)[0] // 8))
    src = torch.empty(big, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty_like(src)
    hbm_s = _time_cuda(lambda: dst.copy_(src), reps)
    return {
        "hbm_gbps": 2 * big / hbm_s / 1e9,
        "h2d_gbps": nbytes / h2d_s / 1e9,
        "d2h_gbps": nbytes / d2h_s / 1e9,
        "bidir_gbps": 2 * nbytes / bidir_s / 1e9,
    }


def _cuda_matmul_tflops(dev: torch.device, quick: bool) -> float:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    iters = 10 if quick else 50

    def mm() -> None:
        for _ in range(iters):
            torch.mm(a, b)

    mm_s = _time_cuda(mm, 3) / iters
    return 2 * n**3 / mm_s / 1e12


def _time_host(fn: Callable[[], object], reps: int) -> float:
    """Median wall seconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _cpu_stand_in_rates(quick: bool) -> dict[str, float]:
    """On a CPU profile the 'link' is a host memory copy and the 'matmul' a CPU bf16 matmul."""
    nbytes = (16 if quick else 128) * 1024**2
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    copy_s = _time_host(lambda: dst.copy_(src), 5)
    n = 256 if quick else 1024
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    mm_s = _time_host(lambda: torch.mm(a, b), 5)
    gbps = nbytes / copy_s / 1e9
    return {
        "h2d_gbps": gbps,
        "d2h_gbps": gbps,
        "bidir_gbps": gbps,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
        "hbm_gbps": 2 * gbps,  # the CPU's memory is its "device memory"; a copy reads and writes
    }


def host_adamw_rate(n_params: int, steps: int) -> float:
    """fp32 parameters per second of torch's fused CPU AdamW on one flat tensor (at the current threads)."""
    p = torch.nn.Parameter(torch.randn(n_params))
    p.grad = torch.randn(n_params)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # allocates and first-touches the moments
    secs = _time_host(opt.step, steps)
    return n_params / secs


def measure_rates(dev: torch.device, *, quick: bool) -> tuple[dict[str, float], list[str]]:
    """All timed rates for ``profile_hardware``; returns the rates and notes on anything degraded."""
    notes: list[str] = []
    t0 = time.perf_counter()
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            rates = _cuda_rates(dev, quick)
            rates["matmul_tflops"] = _cuda_matmul_tflops(dev, quick)
            torch.cuda.empty_cache()
    else:
        rates = _cpu_stand_in_rates(quick)
    # 50M params is where the host rate settles on big hosts; a CPU stand-in profile stays small for CI.
    n = (50_000_000 if quick else 200_000_000) if dev.type == "cuda" else (2_000_000 if quick else 20_000_000)
    try:
        rates["host_adamw_params_per_s"] = host_adamw_rate(n, 3 if quick else 10)
    except RuntimeError as e:  # fused CPU AdamW missing in this torch build
        logger.warning("fused CPU AdamW unavailable (%s); timing the foreach implementation", e)
        notes.append(f"fused CPU AdamW unavailable ({e}); host AdamW rate is the foreach one")
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
        rates["host_adamw_params_per_s"] = n / _time_host(opt.step, 3)
    logger.info("profiled %s in %.2f s: %s", dev, time.perf_counter() - t0, rates)
    return rates, notes
