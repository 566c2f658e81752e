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

import torch

MiB = 1024**2
n = 256 * MiB
host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
dev_out = torch.ones(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()


def gated(up, down, sleep=True):
    """GB/s of both copies queued behind one event (and a device sleep, so both are queued before it)."""
    torch.cuda.synchronize()  # why: nothing else may share the link while timing
    if sleep:
        torch.cuda._sleep(20_000_000)
    gate = torch.cuda.Event(enable_timing=True)
    gate.record()  # why: both copies wait for it, and the time is measured from it
    ends = []
    for stream, dst, src in ((up, dev_in, host_in), (down, host_out, dev_out)):
        stream.wait_event(gate)  # why: see `gate`
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)  # why: this direction's copy finished
        ends.append(e)
    torch.cuda.synchronize()  # why: every event must have completed before reading times
    return 2 * n / (max(gate.elapsed_time(e) for e in ends) / 1e3) / 1e9


def spans(up, down):
    """Each copy's (start, end) in ms after the gate: overlapping spans mean the copies ran at once."""
    torch.cuda.synchronize()  # why: nothing else may share the link while timing
    torch.cuda._sleep(20_000_000)
    gate = torch.cuda.Event(enable_timing=True)
    gate.record()  # why: both copies wait for it, and the spans are measured from it
    out = []
    for stream, dst, src in ((up, dev_in, host_in), (down, host_out, dev_out)):
        stream.wait_event(gate)  # why: see `gate`
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)  # why: this copy's start
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        end.record(stream)  # why: this copy's end
        out.append((start, end))
    torch.cuda.synchronize()  # why: every event must have completed before reading times
    return [(round(gate.elapsed_time(s), 2), round(gate.elapsed_time(e), 2)) for s, e in out]


def host_wall(up, down):
    """GB/s from host time around both copies (no events)."""
    torch.cuda.synchronize()  # why: start from an idle device
    t = time.perf_counter()
    with torch.cuda.stream(up):
        dev_in.copy_(host_in, non_blocking=True)
    with torch.cuda.stream(down):
        host_out.copy_(dev_out, non_blocking=True)
    torch.cuda.synchronize()  # why: both copies finished
    return 2 * n / (time.perf_counter() - t) / 1e9


def show(name, vals):
    print(f"{name:34s} " + " ".join(f"{v:6.1f}" for v in vals), flush=True)


print("MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "argv", sys.argv[1:])
# why: one stream per direction, so the two copy engines can run at once
up, down = torch.cuda.Stream(), torch.cuda.Stream()
for _ in range(2):
    show("gated same streams", [gated(up, down) for _ in range(8)])
    show("gated fresh streams", [gated(torch.cuda.Stream(), torch.cuda.Stream()) for _ in range(8)])
    show("gated no sleep", [gated(up, down, sleep=False) for _ in range(8)])
    hp = torch.cuda.Stream(priority=-1)  # why: a stream from the other priority pool
    show("gated up high-prio", [gated(hp, down) for _ in range(8)])
    show("host wall", [host_wall(up, down) for _ in range(8)])
    print("spans (start,end ms from gate):", [spans(up, down) for _ in range(4)], flush=True)
