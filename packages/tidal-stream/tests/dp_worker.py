"""One rank of the data parallel tests: ``python dp_worker.py SCENARIO OUTDIR JSON`` under torchrun-style
environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Also imported by the tests (by path)
for the shared model, data and single-process reference.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("tidal_stream_tinygpt_dp", HERE / "tinygpt.py")
tinygpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tinygpt)

GLOBAL_BATCH = 6  # rows per optimizer step: divisible by 2 and by 3 ranks
LR, WD = 1e-3, 0.01


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    idx = torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=g)  # [B, T]
    return idx, torch.roll(idx, -1, 1)


def loss_on(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention on CUDA too: runs compare bit for bit
        logits = model(idx)  # [b, T, V]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def make_model() -> nn.Module:
    return tinygpt.make_model(seed=0)


class LoraLike(nn.Module):
    """A frozen fp32 base (two 256x256 linears, 512 KiB) with small trainable adapters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(256, 4, bias=False) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(4, 256, bias=False) for _ in range(2))
        for m in self.base:
            m.requires_grad_(False)
        for m in self.up:
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, d, u in zip(self.base, self.down, self.up):
            x = torch.tanh(b(x) + u(d(x)))  # [B, 256]
        return x


LORA_LR, LORA_STEPS = 1e-2, 5


class PoolBlock(nn.Module):
    """A frozen 256x256 linear (257 KiB streamed) with a trainable rank-4 adapter (resident)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(256, 256).requires_grad_(False)
        self.down = nn.Linear(256, 4, bias=False)
        self.up = nn.Linear(4, 256, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))  # [B, 256]


class PoolNet(nn.Module):
    """Four LoRA-like blocks (the frozen bases stream, the adapters stay resident); returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.blocks = nn.ModuleList(PoolBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _pool_run(cfg: dict, rank: int, world: int, dcfg: object, outdir: pathlib.Path) -> dict:
    """Train the pool model a few steps: losses, final weights and the streaming counters."""
    import torch.distributed as dist

    from tidal_stream import memory_report, unwrap, wrap

    device = (
        f"cuda:{os.environ['LOCAL_RANK']}" if cfg.get("backend") == "nccl" else cfg.get("device", "cuda:0")
    )
    # model_device "cpu": the model is on the host at wrap() (as a model larger than the GPU would be)
    model = PoolNet().to(cfg.get("model_device", device))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LORA_LR)
    # every base streams by default, activations stay (so runs fetch the same blocks the same number of times)
    options = {"recompute": False, "activation_offload": False, "blocks": "blocks"}
    options["param_offload"] = cfg.get("param_offload", True)
    if "model_device" in cfg:
        options["device"] = device  # the model is elsewhere: wrap() moves what stays resident here
    model, opt = wrap(model, opt, distributed=dcfg, **options)
    if cfg.get("keep_streaming"):
        # the baseline streams every block every step, as a pooled run must (its blocks never stop
        # streaming), so both runs fetch the same blocks; without pooling the first step's room would
        # otherwise stop streaming them
        opt._after_first_update = None
    per, losses = GLOBAL_BATCH // world, []
    for step in range(LORA_STEPS):
        x = lora_batch(step)[rank * per : (rank + 1) * per].to(device)  # [per, 256]
        loss = model(x)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    dist.barrier()
    rep = memory_report(model)
    ws = rep["weight_streaming"]
    out = {
        "losses": losses,
        "h2d_bytes": ws["h2d_bytes"],
        "source_bytes": ws["source_bytes"],
        "block_bytes": ws["block_bytes"],
        "fetches": ws["fetches"],
        "block_fetches": ws["block_fetches"],
        "peer_pooling": rep["distributed"]["peer_pooling"],
        "events": [e["message"] for e in rep["events"]],
        "adopted_host_bytes": ws["adopted_host_bytes"],
        "shared": rep["distributed"].get("shared_host"),
    }
    exts = model._tidal_session.extensions
    shared = next(e.shared for e in exts if hasattr(e, "shared")) if out["shared"] is not None else None
    if shared is not None:
        # every streamed frozen tensor's host copy is a view of the machine's shared mapping
        sb = next(e.weights.sb for e in exts if hasattr(e, "weights"))
        out["host_copies_in_mapping"] = all(shared.owns(t) for i in range(len(sb)) for t in sb.host_copies(i))
        out["host_copies_pinned"] = all(t.is_pinned() for i in range(len(sb)) for t in sb.host_copies(i))
    torch.save(
        {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        outdir / f"params{rank}.pt",
    )
    dist.barrier()  # keep every mapping alive until all ranks have read their smaps
    unwrap(model)  # collective: readers drop the peers' buffers before owners free them
    if shared is not None:
        del shared, sb, exts
        gc.collect()
        with open("/proc/self/smaps") as f:
            out["mapped_after_unwrap"] = out["shared"]["path"] in f.read()
    return out


def lora_batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 256, generator=torch.Generator().manual_seed(3000 + step))  # [B, 256]


def lora_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def lora_reference(split: int = 1) -> dict:
    """Single-process AdamW on the global batches of the shared-copy scenario (``split``: see
    :func:`backward_as_split`)."""
    model = LoraLike()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LORA_LR, fused=True)
    for step in range(LORA_STEPS):
        x = lora_batch(step)
        backward_as_split(model, lambda rows, x=x: lora_loss(model, x[rows]), split)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def backward_as_split(model: nn.Module, loss_of_rows: Callable[[slice], torch.Tensor], split: int) -> None:
    """Leave in ``model``'s ``.grad`` the gradient of the global batch's loss as data parallel over ``split``
    ranks computes it: one backward per rank's rows, summed in rank order and divided by ``split`` (the
    arithmetic of the all-reduce of 2 ranks); ``split == 1``: one backward over the whole batch."""
    if split == 1:
        loss_of_rows(slice(None)).backward()
        return
    per = GLOBAL_BATCH // split
    total: dict[int, torch.Tensor] = {}
    for r in range(split):
        model.zero_grad()
        loss_of_rows(slice(r * per, (r + 1) * per)).backward()
        for p in model.parameters():
            if p.grad is not None:
                total[id(p)] = total[id(p)] + p.grad if id(p) in total else p.grad.clone()
    for p in model.parameters():
        if id(p) in total:
            p.grad = total[id(p)] / split


def reference(
    steps: int,
    clip: float | None = None,
    state: dict | None = None,
    first: int = 0,
    split: int = 1,
    device: str = "cpu",
    host_adamw: bool = False,
) -> dict:
    """Single-process training on the same global batches: torch.optim.AdamW(fused=True), the kernel the
    host optimizer runs (torch's single-tensor path differs from it in the last bit).

    ``split > 1`` computes the gradient as data parallel does: one backward per rank's rows, summed in
    rank order and divided by ``split`` (the same arithmetic as the all-reduce of 2 ranks).

    ``host_adamw``: forward and backward on ``device``, the update by the CPU fused AdamW on fp32 host
    copies written back after each step — the arithmetic of the host optimizer. On CUDA the fused CUDA
    AdamW rounds differently from the CPU one (see the test module), so parity on CUDA compares like
    with like this way.
    """
    model = make_model().to(device)
    params = list(model.parameters())
    masters = [p.detach().cpu().clone().requires_grad_(p.requires_grad) for p in params]
    opt = torch.optim.AdamW(masters if host_adamw else params, lr=LR, weight_decay=WD, fused=True)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        with torch.no_grad():
            for m, p in zip(masters, params):
                m.copy_(p)
    for step in range(first, first + steps):
        idx, tgt = (t.to(device) for t in global_batch(step))
        backward_as_split(model, lambda rows, i=idx, t=tgt: loss_on(model, i[rows], t[rows]), split)
        if host_adamw:
            for m, p in zip(masters, params):
                m.grad = p.grad.cpu() if p.grad is not None else None
            model.zero_grad()
        if clip is not None:
            nn.utils.clip_grad_norm_(masters if host_adamw else params, clip, foreach=False)
        opt.step()
        opt.zero_grad()
        if host_adamw:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, steps: int, first: int, accum: int
) -> None:
    per = GLOBAL_BATCH // world
    dev = next(model.parameters()).device
    for step in range(first, first + steps):
        idx, tgt = (t.to(dev) for t in global_batch(step))
        idx, tgt = idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]  # this rank's rows
        m = per // accum
        for a in range(accum):
            (loss_on(model, idx[a * m : (a + 1) * m], tgt[a * m : (a + 1) * m]) / accum).backward()
            opt.step()
            opt.zero_grad()


def _shared_run(cfg: dict, rank: int, world: int, dcfg: object, outdir: pathlib.Path) -> dict:
    """LoRA-like training on the node's shared copy (ranks in ``meta_frozen_ranks`` hold meta placeholders):
    the copy's accounting, the frozen weights' devices; a refusal by wrap() as ``error``/``message``."""
    import torch.distributed as dist

    from tidal_stream import memory_report, unwrap, wrap
    from tidal_stream.distributed import DistributedError

    out: dict = {}
    if "hosts" in cfg:  # simulated machines: the host name is all tidal reads to group ranks by node
        import socket

        socket.gethostname = lambda: cfg["hosts"][rank]
    model = LoraLike()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    if rank in cfg.get("meta_frozen_ranks", ()):
        for mod in model.modules():  # placeholders: this rank never holds the frozen weights itself
            for name, p in list(mod._parameters.items()):
                if p is not None and not p.requires_grad:
                    mod._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LORA_LR)
    try:
        model, opt = wrap(model, opt, distributed=dcfg)
    except DistributedError as e:
        return {"error": type(e).__name__, "message": str(e)}
    per = GLOBAL_BATCH // world
    for step in range(LORA_STEPS):
        lora_loss(model, lora_batch(step)[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()  # every rank has read every frozen page before the accounting is read
    rep = memory_report(model)
    out["shared"] = rep["distributed"]["shared_host"]
    out["frozen_same"] = all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    out["frozen_bytes"] = sum(t.numel() * t.element_size() for t in frozen.values())
    out["frozen_devices"] = sorted({str(p.device) for p in model.parameters() if not p.requires_grad})
    out["events"] = [e["message"] for e in rep["events"]]
    torch.save(
        {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        outdir / f"params{rank}.pt",
    )
    dist.barrier()  # keep every mapping alive until all ranks have read their smaps
    unwrap(model)
    return out


def main() -> None:
    scenario, outdir, cfg = sys.argv[1], pathlib.Path(sys.argv[2]), json.loads(sys.argv[3])
    import torch.distributed as dist

    from tidal_stream import memory_report, unwrap, wrap
    from tidal_stream.distributed import DistributedConfig, DistributedError

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = cfg.get("backend", "gloo")  # "nccl": one GPU per rank (device "cuda" means cuda:LOCAL_RANK)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.get("pg_timeout", 60)))
    dcfg = DistributedConfig(
        bucket_bytes=cfg.get("bucket_bytes", 4096),
        timeout=cfg.get("timeout", 30.0),
        peer_pooling=cfg.get("peer_pooling", False),
        peer_pool_bytes=cfg.get("peer_pool_bytes"),
        share_frozen=cfg.get("share_frozen", True),
    )
    out: dict = {"rank": rank}
    if scenario == "parity":
        device = cfg.get("device", "cpu")
        if backend == "nccl":
            device = f"cuda:{os.environ['LOCAL_RANK']}"
        model = make_model().to(device)
        if rank != 0:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(1.0)  # rank 0's trainable weights must win (broadcast at wrap)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        accum = cfg.get("accum", 1)
        model, opt = wrap(
            model, opt, distributed=dcfg, max_grad_norm=cfg.get("clip"), accumulation_steps=accum
        )
        rep = memory_report(model)
        keys = ("shard_lo", "shard_hi", "shard_numel", "numel", "buckets", "optimizer_host_bytes", "backend")
        out.update({k: rep["distributed"][k] for k in keys})
        out["shared_host"] = rep["distributed"].get("shared_host")
        out["host_bytes"] = rep["host"]["host_bytes"]
        out["device_weights_bytes"] = rep["tiers"]["device"]["weights_bytes"]
        out["frozen_devices"] = sorted({str(p.device) for p in model.parameters() if not p.requires_grad})
        out["events"] = [e["message"] for e in rep["events"]]
        steps, at = cfg["steps"], cfg.get("ckpt_at", cfg["steps"])
        _train(model, opt, rank, world, at, 0, accum)
        if at < steps:
            full = opt.state_dict(rank0_only=True)
            if rank == 0:
                torch.save({"model": model.state_dict(), "optim": full}, outdir / "ckpt.pt")
            dist.barrier()
            unwrap(model)
            fresh = make_model().to(device)  # a new model and optimizer, as in a resumed job
            opt2 = torch.optim.AdamW(fresh.parameters(), lr=LR, weight_decay=WD)
            model, opt = wrap(
                fresh, opt2, distributed=dcfg, max_grad_norm=cfg.get("clip"), accumulation_steps=accum
            )
            ck = torch.load(outdir / "ckpt.pt", weights_only=True)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optim"])
            _train(model, opt, rank, world, steps - at, at, accum)
        out["early_updates"] = memory_report(model)["distributed"]["early_updates"]
        torch.save(
            {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            outdir / f"params{rank}.pt",
        )
        unwrap(model)
    elif scenario == "shared":
        out.update(_shared_run(cfg, rank, world, dcfg, outdir))
    elif scenario == "pool":
        out.update(_pool_run(cfg, rank, world, dcfg, outdir))
    elif scenario == "fail":
        model = make_model()
        model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), distributed=dcfg)
        t0 = time.monotonic()
        try:
            for step in range(4):
                if step == 2 and rank == 1:
                    if cfg["mode"] == "crash":
                        os._exit(3)  # a hard crash: no cleanup, sockets closed by the kernel
                    time.sleep(120)  # a stall: alive, silent
                t0 = time.monotonic()
                idx, tgt = global_batch(step)
                loss_on(model, idx, tgt).backward()
                opt.step()
                opt.zero_grad()
            out["error"] = None
        except DistributedError as e:
            out.update(error=type(e).__name__, message=str(e), elapsed=time.monotonic() - t0)
        (outdir / f"result{rank}.json").write_text(json.dumps(out))
        os._exit(0)  # the process group is broken: skip its teardown
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    (outdir / f"result{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
