"""Data parallel scaling of ``tidal_stream.wrap``: tokens/s per GPU of a LoRA-like and a full fine-tune of a
small GPT (Qwen2 architecture, random weights) at world 1 against world 2, and host RAM per rank.

Run on the GPU machine with two GPUs (nothing downloaded)::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 benchmarks/distributed/scaling.py \\
        --worlds 1,2 --json benchmarks/results/dp-scaling.json

Without ``RANK`` in the environment the script is the driver: for each mode and world it starts
``python -m torch.distributed.run --standalone --nproc_per_node=W`` on itself, collects every rank's
result, prints the table and writes the JSON. Under ``torchrun`` (``RANK`` set) it is one rank; it can be
launched so directly too (``torchrun --nproc_per_node=2 scaling.py --mode lora --rank-dir DIR``).

What one rank does: NCCL (gloo with ``--smoke``), model built on the meta device in bf16 and filled from a
seed (identical on every rank: frozen weights are not broadcast), ``wrap(model, AdamW,
distributed=True, param_offload=..., activation_offload=...)`` — world 1 runs the same data parallel path
(``ShardedHostAdamW`` on one rank), so the ratio measures scaling, not a change of optimizer. Weak scaling:
``--batch`` sequences per rank, so the global batch grows with the world. After ``--warmup`` steps,
``--steps`` steps are timed (every step ends with the weight all-gather, so the ranks' step times agree).

Streaming: LoRA streams ``--param-offload`` of the blocks' frozen weights from host RAM; a full fine-tune
under data parallel keeps trained weights resident (the sharded optimizer does not update streamed host
copies; the decision log says so, and the JSON keeps that line).

Peer pooling (LoRA): ``--peer-pooling on|off|auto`` (default off) sets ``DistributedConfig.peer_pooling``
(on = True: the rate rule skipped) and ``--peer-pool-gib`` its ``peer_pool_bytes`` (VRAM per GPU taken
from the budget for pooled blocks; default: the room the plan leaves). Run once with ``off`` and once with
``on``/``auto`` (two ``--json`` files) to compare; each row shows whether pooling was on and the bytes per
step that crossed the host link (``h2d GiB``) and came from a GPU (``pool GiB``); the decision line with
the measured rates is printed under the table.

Host RAM per rank: ``Rss`` and ``Pss`` of the whole process from ``/proc/self/smaps_rollup`` after the
timed steps (Pss splits shared pages — the shared host copy, CUDA's own mappings — between the ranks).

Prints per mode and world: median step s, tokens/s per GPU, efficiency against world 1 (goal >= 0.85),
host AdamW s of the rank's shard, Rss / Pss per rank in GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import QWEN2_ARGS, add_qwen2_args, random_qwen2

GiB = 2**30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable rank-``r`` update (``up`` starts at zero, as in LoRA)."""

    def __init__(self, base: nn.Linear, rank: int, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.down = nn.Parameter(torch.empty(rank, w.shape[1], device=w.device, dtype=w.dtype))
        self.up = nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device, dtype=w.dtype))
        with torch.no_grad():
            self.down.normal_(0.0, 0.02, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.down.t()) @ self.up.t()  # [..., out]


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """Qwen2ForCausalLM of the requested shape, bf16, seeded normal(0, 0.02) weights; LoRA on every
    projection when ``args.mode == "lora"`` (the base frozen)."""
    gen = torch.Generator(device=device).manual_seed(0)  # the same weights on every rank
    model = random_qwen2(args, device, gen)
    if args.mode == "lora":
        model.requires_grad_(False)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name in LORA_TARGETS:
                    if isinstance(getattr(parent, name, None), nn.Linear):
                        setattr(parent, name, LoraLinear(getattr(parent, name), args.lora_rank, gen))
    return model.train()


def host_ram() -> dict[str, int]:
    """``Rss`` and ``Pss`` of this process, bytes (``/proc/self/smaps_rollup``)."""
    out = {"rss": 0, "pss": 0}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            head = line.split()
            if head and head[0] in ("Rss:", "Pss:"):
                out[head[0][:-1].lower()] = int(head[1]) * 1024
    return out


def rank_main(args: argparse.Namespace) -> None:
    """One rank: wrap, warm up, time ``args.steps`` steps, write ``rank{R}.json`` into ``args.rank_dir``."""
    import torch.distributed as dist

    import tidal_stream
    from tidal_stream.distributed import DistributedConfig

    torch.set_num_threads(args.threads)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # before the process group: NCCL binds each rank to its GPU
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    lr = 2e-4 if args.mode == "lora" else 2e-5
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    pool: dict = {}
    if args.mode == "lora":
        pool["peer_pooling"] = {"on": True, "off": False, "auto": "auto"}[args.peer_pooling]
        if args.peer_pool_gib is not None:
            pool["peer_pool_bytes"] = int(args.peer_pool_gib * GiB)
    options: dict = {"distributed": DistributedConfig(timeout=float(args.timeout), **pool)}
    if not args.smoke:
        options["param_offload"] = args.param_offload if args.mode == "lora" else "auto"
    model, opt = tidal_stream.wrap(model, opt, **options)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own rows of the global batch
    times = []
    ws0: dict = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            ws0 = dict(tidal_stream.memory_report(model).get("weight_streaming", {}))
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)  # [B, T]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # why: the step's time starts with an idle device
        t0 = time.perf_counter()
        model(input_ids=idx, labels=idx).loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # why: the step's kernels are done before the clock stops
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    rep = tidal_stream.memory_report(model)
    d = rep["distributed"]
    ws = rep.get("weight_streaming", {})
    step_s = statistics.median(times)
    per_step = {k: (ws.get(k, 0) - ws0.get(k, 0)) / max(1, args.steps) for k in ("h2d_bytes", "source_bytes")}
    result = {
        "rank": rank,
        "world": world,
        "mode": args.mode,
        "step_s": step_s,
        "step_times": times,
        "tokens_per_s": args.batch * args.seq / step_s,
        "trainable": sum(p.numel() for p in trainable),
        "params": sum(p.numel() for p in model.parameters()),
        "shard_numel": d["shard_numel"],
        "host_adamw_s": d["host_adamw_last_s"],
        "optimizer_host_bytes": d["optimizer_host_bytes"],
        "tidal_host_bytes": rep["host"]["host_bytes"],
        "pinned_bytes": rep["pinned_bytes"],
        "shared_host_bytes": d["shared_host"]["counted_bytes"] if "shared_host" in d else 0,
        "device_peak_bytes": rep.get("device_peak_bytes", 0),
        "host_ram": host_ram(),
        "peer_pooling": d.get("peer_pooling", {"on": False}),
        "h2d_bytes_per_step": per_step["h2d_bytes"],
        "pool_bytes_per_step": per_step["source_bytes"],
        "decisions": [
            e["message"]
            for e in rep["events"]
            if e["kind"] in ("weights", "plan", "shared-host", "placement")
            or e["message"].startswith("peer pooling")
        ],
    }
    tidal_stream.unwrap(model)
    pathlib.Path(args.rank_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _forward(args: argparse.Namespace) -> list[str]:
    """The options a rank needs, as command-line arguments."""
    out = []
    for k in (*QWEN2_ARGS, "batch"):
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lora-rank", str(args.lora_rank)]
    out += ["--param-offload", str(args.param_offload), "--threads", str(args.threads)]
    out += ["--timeout", str(args.timeout), "--peer-pooling", args.peer_pooling]
    out += ["--peer-pool-gib", str(args.peer_pool_gib)] if args.peer_pool_gib is not None else []
    out += ["--smoke"] if args.smoke else []
    return out


def run_world(args: argparse.Namespace, mode: str, world: int) -> list[dict]:
    """Start ``world`` ranks with torchrun for ``mode``; every rank's result, in rank order."""
    with tempfile.TemporaryDirectory(prefix="tidal-dp-scaling-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
        cmd += [__file__, "--mode", mode, "--rank-dir", tmp, *_forward(args)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit_s)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} at world {world} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return [json.loads(pathlib.Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def summarize(runs: dict[str, dict[int, list[dict]]]) -> list[dict]:
    """One row per mode and world: rank 0's step (the ranks agree), per-GPU rate, efficiency, host RAM."""
    rows = []
    for mode, by_world in runs.items():
        base = None
        for world, ranks in sorted(by_world.items()):
            tps = statistics.mean(r["tokens_per_s"] for r in ranks)  # per GPU: each rank is one GPU
            base = tps if world == 1 else base
            rows.append(
                {
                    "mode": mode,
                    "world": world,
                    "step_s": ranks[0]["step_s"],
                    "tokens_per_s_per_gpu": tps,
                    "efficiency": tps / base if base else None,
                    "host_adamw_s": max(r["host_adamw_s"] for r in ranks),
                    "rss_gib_per_rank": [r["host_ram"]["rss"] / GiB for r in ranks],
                    "pss_gib_per_rank": [r["host_ram"]["pss"] / GiB for r in ranks],
                    "optimizer_host_gib_per_rank": [r["optimizer_host_bytes"] / GiB for r in ranks],
                    "peer_pooling_on": all(r["peer_pooling"].get("on") for r in ranks),
                    "h2d_gib_per_step": ranks[0]["h2d_bytes_per_step"] / GiB,
                    "pool_gib_per_step": ranks[0]["pool_bytes_per_step"] / GiB,
                    "trainable": ranks[0]["trainable"],
                    "params": ranks[0]["params"],
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'mode':<5} {'W':>2} {'step s':>8} {'tok/s/GPU':>10} {'eff':>5} {'AdamW s':>8} {'RSS GiB':>14} "
        f"{'Pss GiB':>14} {'pool':>4} {'h2d GiB':>8} {'pool GiB':>8}"
    )
    print(head)
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        rss = "/".join(f"{x:.2f}" for x in r["rss_gib_per_rank"])
        pss = "/".join(f"{x:.2f}" for x in r["pss_gib_per_rank"])
        print(
            f"{r['mode']:<5} {r['world']:>2} {r['step_s']:>8.4f} {r['tokens_per_s_per_gpu']:>10.0f} {eff:>5} "
            f"{r['host_adamw_s']:>8.4f} {rss:>14} {pss:>14} {'on' if r['peer_pooling_on'] else 'off':>4} "
            f"{r['h2d_gib_per_step']:>8.3f} {r['pool_gib_per_step']:>8.3f}"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2", help="driver: worlds to compare (the first should be 1)")
    ap.add_argument("--modes", default="lora,full", help="driver: lora, full or both")
    ap.add_argument("--mode", choices=("lora", "full"), default="lora", help="rank: what to train")
    ap.add_argument("--rank-dir", help="rank: where rank{R}.json goes (set by the driver)")
    ap.add_argument("--json", help="driver: write the rows and every rank's result here")
    add_qwen2_args(
        ap, dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000, seq=1024)
    )
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--param-offload", type=float, default=0.5, help="LoRA: fraction of blocks streamed")
    ap.add_argument("--threads", type=int, default=4, help="host threads per rank (AdamW)")
    ap.add_argument(
        "--peer-pooling",
        choices=("on", "off", "auto"),
        default="off",
        help="LoRA: DistributedConfig.peer_pooling (on = True, off = False)",
    )
    ap.add_argument(
        "--peer-pool-gib", type=float, default=None, help="LoRA: DistributedConfig.peer_pool_bytes, GiB"
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds a collective waits for the others")
    ap.add_argument("--limit-s", type=int, default=540, help="driver: seconds one torchrun may take")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with gloo: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab, args.seq, args.batch, args.steps, args.warmup, args.threads = 256, 32, 2, 2, 1, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if "RANK" in os.environ:
        if not args.rank_dir:
            raise SystemExit("--rank-dir is required under torchrun")
        rank_main(args)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    runs = {m: {w: run_world(args, m, w) for w in worlds} for m in args.modes.split(",")}
    rows = summarize(runs)
    print_table(rows)
    for m, by_world in runs.items():
        for w, ranks in by_world.items():
            for line in ranks[0]["decisions"]:
                print(f"  [{m} W={w}] {line}")
    if args.json:
        out = {"rows": rows, "ranks": {m: {str(w): r for w, r in bw.items()} for m, bw in runs.items()}}
        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name(0)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
