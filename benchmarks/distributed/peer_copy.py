"""Copy rate between two GPUs (peer access) against the host link, the measurement peer pooling is
decided on: GPU0→GPU1 device copies and pinned host→GPU copies of the same sizes, timed with CUDA events.

Run on a machine with two GPUs: ``python benchmarks/distributed/peer_copy.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

import torch


def _time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Seconds per copy of src into dst, timed on dst's device (the copy runs on its current stream)."""
    with torch.cuda.device(dst.device):
        for _ in range(2):  # warm-up: first copies set up peer mappings
            dst.copy_(src, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)  # the source GPU's fill is done before timing starts
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()  # wait for the copies before reading the timer
    return start.elapsed_time(end) / 1e3 / repeats


def measure(sizes_mib: list[int], repeats: int = 10) -> dict:
    """Rates in GB/s for each size: ``peer`` (GPU0→GPU1) and ``host`` (pinned host→GPU1)."""
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    rows = []
    for mib in sizes_mib:
        n = mib << 20
        a = torch.empty(n, dtype=torch.uint8, device=d0).fill_(1)
        b = torch.empty(n, dtype=torch.uint8, device=d1)
        h = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
        rows.append(
            {
                "mib": mib,
                "peer_gbs": n / _time_copy(b, a, repeats) / 1e9,
                "host_gbs": n / _time_copy(b, h, repeats) / 1e9,
            }
        )
        del a, b, h
    return {
        "can_access_peer": torch.cuda.can_device_access_peer(0, 1),
        "device": torch.cuda.get_device_name(0),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = measure([int(s) for s in args.sizes_mib.split(",")])
    print(f"peer access 0->1: {res['can_access_peer']} ({res['device']})")
    print(f"{'MiB':>6} {'peer GB/s':>10} {'host GB/s':>10}")
    for r in res["rows"]:
        print(f"{r['mib']:>6} {r['peer_gbs']:>10.1f} {r['host_gbs']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
