"""H2D and D2H copies at once, timed by several methods in one process: do the methods agree?

```bash
python3 benchmarks/plan/both_directions.py   # the GPU machine, ~15 s
```

tidal-plan's link test checks the profile's both-directions rate against a direct measurement that gates
both copies behind one event. In some suite runs that direct figure read one direction's rate (~56 GB/s)
while the profile read ~92. This script times 256 MiB each way, eight rounds per method, twice:

- gated, same streams: the test's method (a device sleep, one event both copies wait for);
- gated, fresh streams: a new pair of pool streams per round;
- gated, no sleep: the event without the sleep in front of it;
- gated, high-priority H2D stream: one stream from each of torch's priority pools;
- host wall: no events, host time around the two copies;
- spans: each copy's start and end (ms after the gate), which show whether they overlapped.
"""

import os
import sys
import time
from typing import NamedTuple

import torch

MiB = 1024**2


class Buffers(NamedTuple):
    """Pinned host and device buffers of ``nbytes`` each: one H2D pair, one D2H pair."""

    host_in: torch.Tensor
    host_out: torch.Tensor
    dev_in: torch.Tensor
    dev_out: torch.Tensor

    @classmethod
    def make(cls, nbytes: int) -> "Buffers":
        b = cls(
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
            torch.ones(nbytes, dtype=torch.uint8, device="cuda"),
        )
        torch.cuda.synchronize()  # why: the buffers are filled before anything is timed
        return b


def gated_spans(up, down, bufs: Buffers, sleep_cycles: int = 20_000_000) -> list[tuple[float, float]]:
    """H2D on ``up`` and D2H on ``down``, both queued behind one event (and a device sleep of
    ``sleep_cycles``, so both are queued before it opens): each copy's (start, end) in ms after the gate."""
    torch.cuda.synchronize()  # why: nothing else may share the link while timing
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    gate = torch.cuda.Event(enable_timing=True)
    gate.record()  # why: both copies wait for it, and the spans are measured from it
    events = []
    for stream, dst, src in ((up, bufs.dev_in, bufs.host_in), (down, bufs.host_out, bufs.dev_out)):
        stream.wait_event(gate)  # why: see `gate`
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)  # why: this copy's start
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        end.record(stream)  # why: this copy's end
        events.append((start, end))
    torch.cuda.synchronize()  # why: every event must have completed before reading times
    return [(gate.elapsed_time(s), gate.elapsed_time(e)) for s, e in events]


def gated(up, down, bufs: Buffers, sleep_cycles: int = 20_000_000) -> float:
    """GB/s of both copies of :func:`gated_spans`, from the gate to the later copy's end."""
    later = max(end for _, end in gated_spans(up, down, bufs, sleep_cycles))
    return 2 * bufs.host_in.numel() / (later / 1e3) / 1e9


def host_wall(up, down, bufs: Buffers) -> float:
    """GB/s from host time around both copies (no events)."""
    torch.cuda.synchronize()  # why: start from an idle device
    t = time.perf_counter()
    with torch.cuda.stream(up):
        bufs.dev_in.copy_(bufs.host_in, non_blocking=True)
    with torch.cuda.stream(down):
        bufs.host_out.copy_(bufs.dev_out, non_blocking=True)
    torch.cuda.synchronize()  # why: both copies finished
    return 2 * bufs.host_in.numel() / (time.perf_counter() - t) / 1e9


def show(name, vals):
    print(f"{name:34s} " + " ".join(f"{v:6.1f}" for v in vals), flush=True)


def main() -> None:
    bufs = Buffers.make(256 * MiB)
    print("MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "argv", sys.argv[1:])
    # why: one stream per direction, so the two copy engines can run at once
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(2):
        show("gated same streams", [gated(up, down, bufs) for _ in range(8)])
        show("gated fresh streams", [gated(torch.cuda.Stream(), torch.cuda.Stream(), bufs) for _ in range(8)])
        show("gated no sleep", [gated(up, down, bufs, sleep_cycles=0) for _ in range(8)])
        hp = torch.cuda.Stream(priority=-1)  # why: a stream from the other priority pool
        show("gated up high-prio", [gated(hp, down, bufs) for _ in range(8)])
        show("host wall", [host_wall(up, down, bufs) for _ in range(8)])
        spans = [[(round(s, 2), round(e, 2)) for s, e in gated_spans(up, down, bufs)] for _ in range(4)]
        print("spans (start,end ms from gate):", spans, flush=True)


if __name__ == "__main__":
    main()
