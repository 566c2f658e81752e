"""Copy streams and events: CPU stand-ins, and real CUDA ordering on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from tidal_stream.streams import (
    CompletedEvent,
    DeviceStreams,
    NullStream,
    device_streams,
    record_event,
    stream_context,
    wait_stream,
)


def test_cpu_stand_ins():
    s = device_streams("cpu")
    assert s is device_streams(torch.device("cpu"))  # shared per device
    assert isinstance(s.h2d, NullStream) and isinstance(s.d2h, NullStream)
    assert isinstance(s.compute(), NullStream)
    ev = record_event(s.d2h)
    assert isinstance(ev, CompletedEvent) and ev.query()
    ev.wait(s.h2d)
    ev.synchronize()
    wait_stream(s.h2d, s.d2h)
    x = torch.arange(6.0)
    y = torch.empty(6)
    with stream_context(s.h2d):
        y.copy_(x, non_blocking=True)
    assert torch.equal(x, y)  # synchronous on the CPU
    s.synchronize()


@pytest.mark.gpu
def test_cuda_copy_ordering():
    """An H2D copy waiting on an event sees the data written before the event on the compute stream."""
    s = DeviceStreams("cuda")
    assert s.device.index is not None and s.is_cuda
    host = torch.randn(1 << 20).pin_memory()  # [N]
    dev = torch.empty_like(host, device="cuda")
    with stream_context(s.h2d):
        dev.copy_(host, non_blocking=True)
    ev = record_event(s.h2d)
    ev.wait()  # compute waits for the copy
    out = (dev * 2).cpu()
    assert torch.equal(out, host * 2)
    ev.synchronize()
    assert ev.query()
    back = torch.empty_like(host).pin_memory()
    done = record_event(s.compute())
    done.wait(s.d2h)
    with stream_context(s.d2h):
        back.copy_(dev, non_blocking=True)
    landed = record_event(s.d2h)
    landed.wait(NullStream())  # a CPU consumer blocks until it landed
    assert torch.equal(back, host)


@pytest.mark.gpu
def test_cuda_copy_streams_are_distinct_and_overlap():
    """H2D and D2H run on their own streams (not the compute stream, not each other), so a copy each
    way at once can use both copy engines; the test prints both timings (about 94 GB/s together vs 55)."""
    import time

    s = DeviceStreams("cuda")
    assert s.h2d != s.d2h and s.compute() not in (s.h2d, s.d2h)
    n = 256 << 20
    dev_a, dev_b = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    up, down = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8).pin_memory()

    def timed(both: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with stream_context(s.h2d):
            dev_a.copy_(up, non_blocking=True)
        if not both:
            s.h2d.synchronize()
        with stream_context(s.d2h):
            down.copy_(dev_b, non_blocking=True)
        s.synchronize()
        return time.perf_counter() - t0

    timed(True), timed(False)  # warm-up
    together = min(timed(True) for _ in range(3))
    apart = min(timed(False) for _ in range(3))
    # printed, not asserted: speed is measured by benchmarks (benchmarks/stream/streaming.py), not unit tests
    print(f"H2D+D2H together {together * 1e3:.2f} ms, back to back {apart * 1e3:.2f} ms")
