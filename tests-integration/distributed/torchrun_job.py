"""A data parallel job as users write it, started by ``torchrun``: plain ``tidal.wrap`` (the process group
is detected), a LoRA-like model with a frozen base, a few steps, a checkpoint from rank 0."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn

import tidal_stream


class Adapted(nn.Module):
    """A frozen 128x128 base with a rank-4 adapter, then a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(128, 128).requires_grad_(False)
        self.down = nn.Linear(128, 4, bias=False)
        self.up = nn.Linear(4, 128, bias=False)
        self.head = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.up(self.down(x))))  # [B, 8]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 128, generator=g), torch.randint(0, 8, (4 * world,), generator=g)
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]  # this rank's rows


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    torch.set_num_threads(1)
    backend = os.environ.get("TIDAL_TEST_BACKEND", "gloo")  # "nccl": one GPU per rank
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: NCCL binds each rank to its GPU
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Adapted().to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = tidal_stream.wrap(model, opt)  # data parallel: detected from the process group
    for step in range(3):
        x, y = (t.to(device) for t in batch(step, rank, world))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    rep = tidal_stream.memory_report(model)
    state = opt.state_dict(rank0_only=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": state}, out / "ckpt.pt")
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / f"weights{rank}.pt")
    shared = rep["distributed"].get("shared_host")  # None on CUDA: the frozen base is resident on the GPU
    result = {
        "rank": rank,
        "local_rank_env": int(os.environ["LOCAL_RANK"]),
        "dist": {k: v for k, v in rep["distributed"].items() if k != "shared_host"},
        "shared_counted": shared["counted_bytes"] if shared else None,
        "shared_bytes": shared["bytes"] if shared else None,
        "base_device": str(model.base.weight.device),
        "optimizer": type(opt).__name__,
        "events": [e["message"] for e in rep["events"]],
    }
    tidal_stream.unwrap(model)
    (out / f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
