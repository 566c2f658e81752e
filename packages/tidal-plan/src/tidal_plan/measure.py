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


def _time_cuda(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Sorted seconds of ``fn`` over ``reps`` runs, timed with CUDA events after ``warmup`` runs."""
    for _ in range(warmup):
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
    return sorted(times)


def _median(times: list[float]) -> float:
    return times[len(times) // 2]


def _random_device_bytes(nbytes: int, dev: torch.device) -> torch.Tensor:
    """``nbytes`` random bytes on ``dev`` (never time on zeros); filled by the device, which is quick."""
    return torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)


def _cuda_link_rates(dev: torch.device, quick: bool) -> dict[str, float]:
    """Pinned H2D, D2H and both-at-once copy rates, GB/s."""
    # 64 MiB takes ~1.2 ms at 55 GB/s, far past the per-copy overhead (µs); page-locking costs
    # ~0.6 s/GiB and a CPU random fill ~4 s/GiB, so the quick buffers stay small and are filled by the device
    nbytes = (64 if quick else 1024) * 1024**2
    gpu = _random_device_bytes(nbytes, dev)
    gpu2 = _random_device_bytes(nbytes, dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(gpu2)  # random host bytes without a slow CPU random fill
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    reps = 10
    h2d_s = _median(_time_cuda(lambda: gpu.copy_(host, non_blocking=True), reps))
    d2h_s = _median(_time_cuda(lambda: host2.copy_(gpu2, non_blocking=True), reps))
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

    bidir_s = _median(_time_cuda(both, reps))
    return {
        "h2d_gbps": nbytes / h2d_s / 1e9,
        "d2h_gbps": nbytes / d2h_s / 1e9,
        "bidir_gbps": 2 * nbytes / bidir_s / 1e9,
    }


def _cuda_hbm_gbps(dev: torch.device, quick: bool) -> float:
    """Device memory bandwidth: a copy reads and writes every byte (counted both ways, as the roofline does)."""
    # 256 MiB (quick) or 1 GiB, at most an eighth of the free memory; one timing covers 8 copies
    # (~1 ms quick on an H200) so launch gaps and event resolution stay well under 1 %
    big = max(16 * 1024**2, min((256 if quick else 1024) * 1024**2, torch.cuda.mem_get_info(dev)[0] // 8))
    src = _random_device_bytes(big, dev)
    dst = torch.empty_like(src)
    copies = 8

    def run() -> None:
        for _ in range(copies):
            dst.copy_(src)

    return 2 * big * copies / _median(_time_cuda(run, 5 if quick else 10)) / 1e9


def _cuda_matmul_tflops(dev: torch.device, quick: bool) -> tuple[float, str]:
    """bf16 8192³ matmul rate on random data, TFLOP/s, and a note on its spread over the timed batches.

    The device first runs products for a fixed time (0.25 s quick, 1 s full) so its clocks leave idle
    before anything is timed; then the median batch of ``iters`` back-to-back products counts.
    """
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    iters, reps, warm_s = (10, 5, 0.25) if quick else (20, 10, 1.0)

    def mm() -> None:
        for _ in range(iters):
            torch.mm(a, b)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        mm()
        torch.cuda.synchronize()  # why: the warm-up is measured in device time actually spent
    times = _time_cuda(mm, reps, warmup=0)
    rate = [2 * n**3 * iters / t / 1e12 for t in (times[0], _median(times), times[-1])]
    return rate[1], f"bf16 matmul batches {rate[2]:.0f}-{rate[0]:.0f} TFLOP/s (median {rate[1]:.0f})"


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


def _host_values(n: int, seed: int) -> torch.Tensor:
    """``n`` normal fp32 values: a 1M-value random block repeated (CPU ``randn`` runs on one core at
    ~0.2 G/s; AdamW's arithmetic does not depend on the values, as long as they are finite and nonzero)."""
    block = torch.randn(min(n, 1_000_000), generator=torch.Generator().manual_seed(seed))
    return block.repeat(-(-n // block.numel()))[:n]


def host_adamw_rate(n_params: int, steps: int) -> float:
    """fp32 parameters per second of torch's fused CPU AdamW on one flat tensor (at the current threads)."""
    p = torch.nn.Parameter(_host_values(n_params, 0))
    p.grad = _host_values(n_params, 1)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # allocates and first-touches the moments
    secs = _time_host(opt.step, steps)
    return n_params / secs


class _Stages:
    """Wall seconds of each profiling stage, for one note (where the profile's time goes)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.parts: list[str] = []

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.append(f"{name} {now - self.last:.2f}")
        self.last = now

    def note(self) -> str:
        return f"profiled in {self.last - self.t0:.2f} s: " + ", ".join(self.parts) + " (s)"


def measure_rates(dev: torch.device, *, quick: bool) -> tuple[dict[str, float], list[str]]:
    """All timed rates for ``profile_hardware``; returns the rates and notes (anything degraded, the
    matmul spread, and the seconds each stage took)."""
    notes: list[str] = []
    stages = _Stages()
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            rates = _cuda_link_rates(dev, quick)
            stages.done("link")
            rates["hbm_gbps"] = _cuda_hbm_gbps(dev, quick)
            stages.done("device memory")
            rates["matmul_tflops"], spread = _cuda_matmul_tflops(dev, quick)
            notes.append(spread)
            stages.done("matmul")
            torch.cuda.empty_cache()
    else:
        rates = _cpu_stand_in_rates(quick)
        stages.done("copy and matmul")
    # A process's first torch.optim optimizer imports torch._dynamo (~1 s): timed as its own stage
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1e-4)
    stages.done("torch.optim first use")
    # 50M params is where the host rate settles on big hosts; a CPU stand-in profile stays small for CI.
    n = (50_000_000 if quick else 200_000_000) if dev.type == "cuda" else (2_000_000 if quick else 20_000_000)
    try:
        rates["host_adamw_params_per_s"] = host_adamw_rate(n, 3 if quick else 10)
    except RuntimeError as e:  # fused CPU AdamW missing in this torch build
        logger.warning("fused CPU AdamW unavailable (%s); timing the foreach implementation", e)
        notes.append(f"fused CPU AdamW unavailable ({e}); host AdamW rate is the foreach one")
        p = torch.nn.Parameter(_host_values(n, 0))
        p.grad = _host_values(n, 1)
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
        rates["host_adamw_params_per_s"] = n / _time_host(opt.step, 3)
    stages.done("host AdamW")
    notes.append(stages.note())
    logger.info("profiled %s: %s; %s", dev, rates, notes[-1])
    return rates, notes
