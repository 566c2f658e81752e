"""Timing probes behind ``profile_hardware``: copy rates, matmul rates, host AdamW and host update rates,
memory figures."""

from __future__ import annotations

import itertools
import logging
import math
import os
import platform
import threading
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


def _cuda_matmul_tflops(dev: torch.device, quick: bool) -> tuple[float, float, str]:
    """bf16 8192³ matmul rates on random data, TFLOP/s: the peak and the sustained one, and a note.

    An idle GPU clocks low (345 MHz on the H200) and ramps up under load; after a fraction of a second
    of full load the power limit pulls the clocks down again (about 12 % on the H200). So products are
    timed in pairs, each pair between CUDA events, in bursts of 8 pairs until a burst no longer beats
    the best pair so far: the best pair is the peak (what the chip does, the machine README's figure).
    Then the load continues (0.3 s quick, 1.5 s full) and the median pair of its second half is the
    sustained rate a training run sees.
    """
    n = 8192  # 1.1 TFLOP a product, ~1.4 ms on an H200: event resolution and launch gaps vanish
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    per, burst, sustain_s = 2, 8, (0.3 if quick else 1.5)

    def run(pairs: int) -> list[float]:
        # why: one event between pairs times each pair on the device, with no host gap in between
        events = [torch.cuda.Event(enable_timing=True) for _ in range(pairs + 1)]
        events[0].record()
        for e in events[1:]:
            for _ in range(per):
                torch.mm(a, b, out=out)
            e.record()
        events[-1].synchronize()
        return [x.elapsed_time(y) / 1e3 for x, y in itertools.pairwise(events)]

    flop = 2 * n**3 * per
    # bursts until the best pair stops improving (the clocks have ramped); the best pair of all is the peak
    best, bursts, t0 = math.inf, 0, time.perf_counter()
    while True:
        fastest = min(run(burst))
        bursts += 1
        improved = fastest < 0.995 * best
        best = min(best, fastest)
        if (bursts >= 3 and not improved) or time.perf_counter() - t0 > 1.0:
            break
    peak = flop / best / 1e12
    tail: list[float] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < sustain_s:
        times = run(8)
        if time.perf_counter() - t0 >= sustain_s / 2:
            tail += times
    sustained = flop / _median(sorted(tail)) / 1e12
    return peak, sustained, f"bf16 matmul peak {peak:.0f} TFLOP/s, sustained {sustained:.0f} TFLOP/s"


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


def _fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused AdamW kernel, called as ``torch.optim.AdamW(fused=True)`` and tidal-stream's host
    update call it (without torch.optim's first-use import of torch._dynamo, ~1 s)."""
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=1e-4,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.01,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
    )


def host_adamw_rate(n_params: int, steps: int) -> float:
    """fp32 parameters per second of torch's fused CPU AdamW on one flat pageable tensor (current threads)."""
    p, g = _host_values(n_params, 0), _host_values(n_params, 1)
    m, v = torch.zeros(n_params), torch.zeros(n_params)
    st = [torch.zeros(())]
    return n_params / _time_host(lambda: _fused_adamw([p], [g], [m], [v], st), steps)


def _host_slab(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked through CUDA when ``pin`` (as tidal-stream's arena is)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def host_update_rate(n_params: int, steps: int, *, pin: bool, pieces: int = 8) -> tuple[float, str]:
    """Parameters per second of tidal-stream's host update of 16-bit weights, and a note on its stages.

    Per parameter, as ``OffloadAdamW``'s worker thread runs it: widen the landed bf16 gradient into the
    fp32 gradient, torch's fused AdamW on the fp32 master and moments, narrow the new master into the bf16
    weight that goes back (40 bytes read + written). The buffers are views of one host slab (page-locked
    when ``pin``, as the optimizer's arena is on CUDA), cut into ``pieces`` tensors like per-parameter
    slots, and the steps run on a separate thread with the current torch thread count, as the worker does.
    """
    n = max(pieces, n_params // pieces * pieces)
    slab = _host_slab(20 * n, pin)  # [20 n] bytes: 4 fp32 arrays, then 2 bf16 arrays
    f32 = slab[: 16 * n].view(torch.float32).view(4, pieces, n // pieces)  # [4, pieces, n / pieces]
    b16 = slab[16 * n :].view(torch.bfloat16).view(2, pieces, n // pieces)  # [2, pieces, n / pieces]
    bufs = (*f32.unbind(0), *b16.unbind(0))  # master, grad, exp_avg, exp_avg_sq, landing, staging
    bufs[0].view(-1).copy_(_host_values(n, 0))
    bufs[4].view(-1).copy_(_host_values(n, 1))
    bufs[2].zero_()
    bufs[3].zero_()
    step_counts = [torch.zeros(()) for _ in range(pieces)]
    stages = [0.0, 0.0, 0.0]  # widen, AdamW, narrow seconds over the timed steps
    times: list[float] = []
    failure: list[BaseException] = []

    def one_step(timed: bool) -> None:
        master, grad, exp_avg, exp_avg_sq, landing, staging = bufs
        t0 = time.perf_counter()
        for i in range(pieces):
            a = time.perf_counter()
            grad[i].copy_(landing[i])  # widen bf16 -> fp32
            b = time.perf_counter()
            _fused_adamw([master[i]], [grad[i]], [exp_avg[i]], [exp_avg_sq[i]], [step_counts[i]])
            c = time.perf_counter()
            staging[i].copy_(master[i])  # narrow fp32 -> bf16
            if timed:
                stages[0] += b - a
                stages[1] += c - b
                stages[2] += time.perf_counter() - c
        if timed:
            times.append(time.perf_counter() - t0)

    def worker() -> None:
        try:  # a new thread takes torch's process-wide thread count, as the optimizer's worker does
            one_step(False)  # first touch of the moments' pages and the kernels' first use
            for _ in range(steps):
                one_step(True)
        except BaseException as e:  # re-raised on the calling thread
            failure.append(e)

    t = threading.Thread(target=worker, name="tidal-profile-host-update", daemon=True)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    bufs = ()
    del slab, f32, b16
    if pin and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give the probe's page-locked slab back (torch caches freed pinned blocks)
    rate = n / _median(sorted(times))
    total = sum(stages)
    note = (
        f"host update {rate / 1e9:.2f} G params/s ({'pinned' if pin else 'pageable'}, {n / 1e6:.0f} M params, "
        f"worker thread): widen {stages[0] / total:.0%}, AdamW {stages[1] / total:.0%}, "
        f"narrow {stages[2] / total:.0%} of its time"
    )
    return rate, note


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
    peak and sustained matmul rates, the host update's stages, and the seconds each stage took)."""
    notes: list[str] = []
    stages = _Stages()
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            rates = _cuda_link_rates(dev, quick)
            stages.done("link")
            rates["hbm_gbps"] = _cuda_hbm_gbps(dev, quick)
            stages.done("device memory")
            peak, sustained, note = _cuda_matmul_tflops(dev, quick)
            rates["matmul_tflops"], rates["matmul_sustained_tflops"] = peak, sustained
            notes.append(note)
            stages.done("matmul")
            torch.cuda.empty_cache()
    else:
        rates = _cpu_stand_in_rates(quick)
        stages.done("copy and matmul")
    cuda = dev.type == "cuda"
    # 50M params (800 MB) is far past any last-level cache, where the host rate settles; a CPU stand-in
    # profile stays small for CI.
    n = (50_000_000 if quick else 200_000_000) if cuda else (2_000_000 if quick else 20_000_000)
    rates["host_adamw_params_per_s"] = host_adamw_rate(n, 3 if quick else 10)
    stages.done("host AdamW")
    # The whole update: one 1 GiB slab quick (4 GiB full) at 20 bytes a parameter (54 M parameters, a
    # working set past the largest last-level caches); torch's pinned allocator rounds to powers of two,
    # so the slab stays just under one. Page-locking 1 GiB takes ~0.6 s on the GPU machine.
    n = ((1 if quick else 4) * 2**30 // 20) if cuda else (1_000_000 if quick else 10_000_000)
    rate, note = host_update_rate(n, 3 if quick else 8, pin=cuda)
    rates["host_update_params_per_s"] = rate
    notes.append(note)
    stages.done("host update")
    notes.append(stages.note())
    logger.info("profiled %s: %s; %s", dev, rates, notes[-1])
    return rates, notes
