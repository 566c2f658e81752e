"""Does any pair of torch's pool streams run an H2D and a D2H copy one after the other?

```bash
python3 benchmarks/plan/stream_pairs.py   # the GPU machine, ~10 s
```

Two streams that share one of the device's hardware queues run their work in order, so their copies
cannot overlap. This takes every stream of both of torch's priority pools and times 64 MiB each way, both
copies behind one event, the lower of two rounds (a pair that serialized in either shows): against
stream 0, pair by pair around the pool, and against the default stream. A pair that serializes reads one
direction's rate (~55 GB/s) instead of ~90-100.
"""

import torch

MiB = 1 << 20
n = 64 * MiB
host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
dev_out = torch.ones(n, dtype=torch.uint8, device="cuda")


def rate(up, down):
    """GB/s of both copies queued behind one event on ``up`` (H2D) and ``down`` (D2H)."""
    torch.cuda.synchronize()  # why: nothing else may share the link while timing
    torch.cuda._sleep(5_000_000)  # why: both copies are queued before the gate opens
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


def lower(up, down):
    return min(rate(up, down) for _ in range(2))


# why: every stream of both pools (torch hands them out round-robin, 32 per priority)
low = [torch.cuda.Stream() for _ in range(32)]
high = [torch.cuda.Stream(priority=-1) for _ in range(32)]
rate(low[0], low[1])  # warm-up
print("low[0] with low[j]: ", " ".join(f"{j}:{lower(low[0], low[j]):.0f}" for j in range(1, 32)))
print("low[0] with high[j]:", " ".join(f"{j}:{lower(low[0], high[j]):.0f}" for j in range(32)))
print("low[j] with low[j+1]:", " ".join(f"{j}:{lower(low[j], low[(j + 1) % 32]):.0f}" for j in range(32)))
default = torch.cuda.current_stream()
print("default with low[j]:", " ".join(f"{j}:{lower(default, low[j]):.0f}" for j in range(32)))
