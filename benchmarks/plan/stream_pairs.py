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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from both_directions import Buffers, MiB, gated


def main() -> None:
    bufs = Buffers.make(64 * MiB)

    def lower(up, down):
        return min(gated(up, down, bufs, sleep_cycles=5_000_000) for _ in range(2))

    # why: every stream of both pools (torch hands them out round-robin, 32 per priority)
    low = [torch.cuda.Stream() for _ in range(32)]
    high = [torch.cuda.Stream(priority=-1) for _ in range(32)]
    lower(low[0], low[1])  # warm-up
    print("low[0] with low[j]: ", " ".join(f"{j}:{lower(low[0], low[j]):.0f}" for j in range(1, 32)))
    print("low[0] with high[j]:", " ".join(f"{j}:{lower(low[0], high[j]):.0f}" for j in range(32)))
    print("low[j] with low[j+1]:", " ".join(f"{j}:{lower(low[j], low[(j + 1) % 32]):.0f}" for j in range(32)))
    default = torch.cuda.current_stream()
    print("default with low[j]:", " ".join(f"{j}:{lower(default, low[j]):.0f}" for j in range(32)))


if __name__ == "__main__":
    main()
