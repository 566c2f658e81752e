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

Scenarios: ``--scenario NAME`` takes the mode, the model's shape, ``--seq``, ``--batch`` (per rank) and the
default ``--vram-gb`` from ``benchmarks/engines/scenarios.py`` (``lora14b``: Qwen2.5-14B shape, LoRA r=16,
1x512; ``full8b``: Llama-3-8B shape, full fine-tune, 4x2048; ...). Any of those flags given on the command
line wins over the scenario. The model is then built as the comparison harness builds it
(``engines.tidal_engine.build_model``: the exact transformers architecture, Llama included, filled block by
block on the rank's GPU and kept in host RAM; LoRA through PEFT), and ``wrap`` gets ``device=`` and
``blocks=``; without ``--scenario`` the model is the Qwen2 of the shape flags with the script's own LoRA
linears (rank ``--lora-rank``; a scenario's LoRA is the harness's r=16), built on the GPU. Under data
parallel a full fine-tune keeps its trained weights resident whatever the budget (see above), so
``full8b`` at 24 GiB can use more VRAM than the budget: the ``peak GiB`` column shows what it did use.
For example::

    ... scaling.py --scenario lora14b --vram-gb 24 --worlds 1,2 --json dp-lora14b.json

One host copy from the start: with ``--placeholders`` the local ranks other than 0 build the scenario's
frozen weights as meta placeholders, which ``wrap`` fills from the machine's shared host copy (local rank 0
builds the real ones), so host RAM holds one copy of the base during the build too — ``lora72b`` (145 GB
of bf16 weights) at world 2 on a 256 GiB machine::

    ... scaling.py --scenario lora72b --worlds 2 --placeholders --peer-pooling off --json dp-lora72b-off.json

Budget and moments: ``--vram-gb X`` passes ``vram_budget`` (X GiB per GPU) to ``wrap`` and lets the plan
choose what streams (``--param-offload`` defaults to ``auto`` then, and with ``--scenario``);
``--moment-dtype`` passes ``moment_dtype`` (default: not passed, wrap's fp32).

Soak: with ``--soak`` every rank samples, after every step past ``--warmup``, the process RSS
(``/proc/self/statm``), tidal's pinned host bytes (``memory_report(model)["pinned_bytes"]``) and
``torch.cuda.memory_allocated`` (0 on the CPU); a metric is flat when ``(max - min) / max`` over those
samples is within ``--tolerance`` (the rule of ``benchmarks/soak.py``, imported from it). The rank JSON holds
each metric's summary and samples, the table a ``soak`` column, and one line per rank follows it; the exit
status is 1 when a metric is not flat (not with ``--smoke``). A 200-step soak at world 2::

    ... scaling.py --worlds 2 --modes lora --soak --steps 200 --warmup 20 --json dp-soak.json

Prints per mode and world: median step s, tokens/s per GPU, efficiency against world 1 (goal >= 0.85),
host AdamW s of the rank's shard, Rss / Pss per rank in GiB, device peak GiB (rank 0), the soak verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import QWEN2_ARGS, add_qwen2_args, random_qwen2
from engines.scenarios import SCENARIOS, Scenario, get_scenario
from soak import flatness, rss_bytes

GiB = 2**30
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The shape flags without ``--scenario`` (the small default model).
DEFAULT_SHAPE = dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000, seq=1024)
#: The tiny shape of ``--smoke`` (it wins over a scenario's shape too).
SMOKE_SHAPE = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, seq=32)
#: Shape flag -> transformers config field of ``Scenario.shape``.
SHAPE_FIELDS = {
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
}
#: What ``--soak`` samples every step after warm-up.
SOAK_METRICS = ("rss_bytes", "pinned_bytes", "vram_allocated_bytes")


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


def scenario_of(args: argparse.Namespace) -> Scenario:
    """``args.scenario`` with the shape, batch and sequence length of ``args`` (flags and ``--smoke`` win)."""
    sc = get_scenario(args.scenario)
    shape = dict(sc.shape, **{field: getattr(args, flag) for flag, field in SHAPE_FIELDS.items()})
    return dataclasses.replace(sc, shape=shape, batch=args.batch, seq=args.seq)


def build_scenario_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, nn.ModuleList]:
    """The scenario's model as the comparison harness builds it (exact architecture, PEFT LoRA, filled on
    ``device`` block by block, left in host RAM on CUDA; seeded by tensor name: the same on every rank)
    and its block stack."""
    from engines.common import decoder_layers
    from engines.tidal_engine import build_model as build_engine_model

    # with --placeholders only local rank 0 fills the frozen weights: the others read the shared host copy
    placeholder = args.placeholders and int(os.environ.get("LOCAL_RANK", "0")) != 0
    model = build_engine_model(scenario_of(args), None, device, seed=0, frozen_meta=placeholder)
    model.config.use_cache = False  # training: no KV cache
    return model.train(), decoder_layers(model)


def host_ram() -> dict[str, int]:
    """``Rss`` and ``Pss`` of this process, bytes (``/proc/self/smaps_rollup``)."""
    out = {"rss": 0, "pss": 0}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            head = line.split()
            if head and head[0] in ("Rss:", "Pss:"):
                out[head[0][:-1].lower()] = int(head[1]) * 1024
    return out


def soak_sample(model: nn.Module, device: torch.device) -> dict[str, int]:
    """This rank's RSS, tidal's pinned host bytes and allocated device bytes (0 on the CPU), now."""
    import tidal_stream

    return {
        "rss_bytes": rss_bytes(),
        "pinned_bytes": int(tidal_stream.memory_report(model)["pinned_bytes"]),
        "vram_allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
    }


def soak_summary(samples: list[dict[str, int]], tolerance: float) -> dict[str, Any]:
    """Per metric: ``soak.flatness`` (min, max, first, last, spread, flat) and the samples; ``flat``: all."""
    metrics = {}
    for k in SOAK_METRICS:
        values = [s[k] for s in samples]
        metrics[k] = {**flatness(values, tolerance), "samples": values}
    return {
        "samples": len(samples),
        "tolerance": tolerance,
        "metrics": metrics,
        "flat": all(m["flat"] for m in metrics.values()),
    }


def wrap_options(args: argparse.Namespace, device: torch.device, blocks: Any) -> dict[str, Any]:
    """The keyword arguments of ``tidal_stream.wrap`` for this rank."""
    from tidal_stream.distributed import DistributedConfig

    pool: dict = {}
    if args.mode == "lora":
        pool["peer_pooling"] = {"on": True, "off": False, "auto": "auto"}[args.peer_pooling]
        if args.peer_pool_gib is not None:
            pool["peer_pool_bytes"] = int(args.peer_pool_gib * GiB)
    options: dict = {"distributed": DistributedConfig(timeout=float(args.timeout), **pool)}
    if blocks is not None:  # a scenario's model is built in host RAM: wrap moves it to the rank's device
        options["device"], options["blocks"] = device, blocks
    if not args.smoke:
        options["param_offload"] = args.param_offload if args.mode == "lora" else "auto"
    if args.vram_gb is not None:
        options["vram_budget"] = int(args.vram_gb * GiB)
    if args.moment_dtype is not None:
        options["moment_dtype"] = args.moment_dtype
    return options


def progress(rank: int, what: str) -> None:
    """Rank 0's progress on stderr, as it happens: a run cut short by a time limit still shows how far
    it got (a large scenario spends minutes building its model and host copy)."""
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] rank 0: {what}", file=sys.stderr, flush=True)


def rank_main(args: argparse.Namespace) -> None:
    """One rank: wrap, warm up, time ``args.steps`` steps, write ``rank{R}.json`` into ``args.rank_dir``."""
    import torch.distributed as dist

    import tidal_stream

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
    t_build = time.perf_counter()
    if args.scenario:
        model, blocks = build_scenario_model(args, device)
    else:
        model, blocks = build_model(args, device), None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the model inside
    model_class = type(base).__name__
    trainable = [p for p in model.parameters() if p.requires_grad]
    lr = 2e-4 if args.mode == "lora" else 2e-5
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    build_s = time.perf_counter() - t_build
    progress(rank, f"model built in {build_s:.1f} s")
    t_wrap = time.perf_counter()
    model, opt = tidal_stream.wrap(model, opt, **wrap_options(args, device, blocks))
    wrap_s = time.perf_counter() - t_wrap
    progress(rank, f"wrapped in {wrap_s:.1f} s")
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own rows of the global batch
    times, losses, samples = [], [], []
    ws0: dict = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            ws0 = dict(tidal_stream.memory_report(model).get("weight_streaming", {}))
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)  # [B, T]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # why: the step's time starts with an idle device
        t0 = time.perf_counter()
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # why: the step's kernels are done before the clock stops
        if step < 3 or (step + 1) % 25 == 0:  # the first steps, then every 25th (a soak runs hundreds)
            progress(rank, f"step {step + 1}/{args.warmup + args.steps}: {time.perf_counter() - t0:.3f} s")
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if args.soak:
                samples.append(soak_sample(model, device))
    rep = tidal_stream.memory_report(model)
    d = rep["distributed"]
    ws = rep.get("weight_streaming", {})
    step_s = statistics.median(times)
    per_step = {k: (ws.get(k, 0) - ws0.get(k, 0)) / max(1, args.steps) for k in ("h2d_bytes", "source_bytes")}
    result = {
        "rank": rank,
        "world": world,
        "mode": args.mode,
        "scenario": args.scenario,
        "model_class": model_class,
        "shape": {k: getattr(args, k) for k in QWEN2_ARGS},
        "batch": args.batch,
        "vram_budget_bytes": int(args.vram_gb * GiB) if args.vram_gb is not None else None,
        "moment_dtype": args.moment_dtype,
        "build_s": build_s,
        "wrap_s": wrap_s,
        "step_s": step_s,
        "step_times": times,
        "loss_first": losses[0],
        "loss_last": losses[-1],
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
        "soak": soak_summary(samples, args.tolerance) if args.soak else None,
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
    """The options a rank needs, as command-line arguments (every one resolved: nothing left to a default)."""
    out = []
    for k in (*QWEN2_ARGS, "batch", "steps", "warmup", "lora_rank", "param_offload", "threads", "timeout"):
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out += ["--peer-pooling", args.peer_pooling, "--tolerance", str(args.tolerance)]
    for k in ("scenario", "peer_pool_gib", "vram_gb", "moment_dtype"):
        if getattr(args, k) is not None:
            out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out += ["--soak"] if args.soak else []
    out += ["--placeholders"] if args.placeholders else []
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
            soaked = [r["soak"] for r in ranks if r["soak"] is not None]
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
                    "device_peak_gib_per_rank": [r["device_peak_bytes"] / GiB for r in ranks],
                    "peer_pooling_on": all(r["peer_pooling"].get("on") for r in ranks),
                    "h2d_gib_per_step": ranks[0]["h2d_bytes_per_step"] / GiB,
                    "pool_gib_per_step": ranks[0]["pool_bytes_per_step"] / GiB,
                    "soak_flat": all(s["flat"] for s in soaked) if soaked else None,
                    "trainable": ranks[0]["trainable"],
                    "params": ranks[0]["params"],
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'mode':<5} {'W':>2} {'step s':>8} {'tok/s/GPU':>10} {'eff':>5} {'AdamW s':>8} {'RSS GiB':>14} "
        f"{'Pss GiB':>14} {'peak GiB':>8} {'pool':>4} {'h2d GiB':>8} {'pool GiB':>8} {'soak':>8}"
    )
    print(head)
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        rss = "/".join(f"{x:.2f}" for x in r["rss_gib_per_rank"])
        pss = "/".join(f"{x:.2f}" for x in r["pss_gib_per_rank"])
        soak = {None: "-", True: "flat", False: "NOT flat"}[r["soak_flat"]]
        print(
            f"{r['mode']:<5} {r['world']:>2} {r['step_s']:>8.4f} {r['tokens_per_s_per_gpu']:>10.0f} {eff:>5} "
            f"{r['host_adamw_s']:>8.4f} {rss:>14} {pss:>14} {r['device_peak_gib_per_rank'][0]:>8.2f} "
            f"{'on' if r['peer_pooling_on'] else 'off':>4} {r['h2d_gib_per_step']:>8.3f} "
            f"{r['pool_gib_per_step']:>8.3f} {soak:>8}"
        )


def print_soak(runs: dict[str, dict[int, list[dict]]]) -> None:
    """One line per rank that soaked: each metric's min and max (MiB), spread and verdict."""
    for m, by_world in runs.items():
        for w, ranks in sorted(by_world.items()):
            for r in ranks:
                if r["soak"] is None:
                    continue
                s = r["soak"]
                parts = [
                    f"{k.removesuffix('_bytes')} {v['min'] / 2**20:.1f}-{v['max'] / 2**20:.1f} MiB "
                    f"{100 * v['spread']:.3f}% {'flat' if v['flat'] else 'NOT flat'}"
                    for k, v in s["metrics"].items()
                ]
                print(
                    f"  soak [{m} W={w} rank {r['rank']}] {s['samples']} samples, tolerance "
                    f"{100 * s['tolerance']:.2f}%: " + "; ".join(parts)
                )


def _fraction(text: str) -> float | str:
    """``--param-offload``: ``auto`` or a fraction in [0, 1]."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: 'auto' or a number in [0, 1]")
    return value


def _resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill what was left at None: from ``--scenario``, then the defaults; ``--smoke`` then wins."""
    sc = None
    if args.scenario is not None:
        try:
            sc = get_scenario(args.scenario)
        except ValueError as e:
            ap.error(str(e))
        if sc.mode not in ("lora", "full"):
            trains = [n for n, s in SCENARIOS.items() if s.mode in ("lora", "full")]
            ap.error(
                f"--scenario: got {args.scenario!r}, a {sc.mode} scenario; accepted: a training scenario "
                f"({', '.join(trains)}). Pick one of those names."
            )
        if args.modes not in (None, sc.mode):
            ap.error(
                f"--modes: got {args.modes!r} with --scenario {sc.name} (a {sc.mode} scenario); accepted: "
                f"{sc.mode!r} or nothing. Drop --modes."
            )
        args.modes = args.mode = sc.mode
        fill = {flag: sc.shape[field] for flag, field in SHAPE_FIELDS.items()}
        fill.update(seq=sc.seq, batch=sc.batch)
        if args.vram_gb is None:
            args.vram_gb = sc.vram_gb
    else:
        args.modes = args.modes or "lora,full"
        fill = dict(DEFAULT_SHAPE, batch=4)
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.param_offload is None:
        args.param_offload = "auto" if sc is not None or args.vram_gb is not None else 0.5
    args.steps = args.steps if args.steps is not None else 2 if args.smoke else 10
    args.warmup = args.warmup if args.warmup is not None else 1 if args.smoke else 3
    if args.smoke:
        for k, v in SMOKE_SHAPE.items():
            setattr(args, k, v)
        args.batch, args.threads = 2, 1
    checks = [
        ("--steps", args.steps, args.steps >= 1, "an integer >= 1"),
        ("--warmup", args.warmup, args.warmup >= 0, "an integer >= 0"),
        ("--tolerance", args.tolerance, args.tolerance >= 0, "a number >= 0"),
        ("--vram-gb", args.vram_gb, args.vram_gb is None or args.vram_gb > 0, "a number of GiB > 0"),
    ]
    for flag, value, ok, accepted in checks:
        if not ok:
            ap.error(f"{flag}: got {value!r}; accepted: {accepted}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2", help="driver: worlds to compare (the first should be 1)")
    ap.add_argument("--modes", default=None, help="driver: lora, full or both (default both; a scenario's)")
    ap.add_argument("--mode", choices=("lora", "full"), default="lora", help="rank: what to train")
    ap.add_argument("--rank-dir", help="rank: where rank{R}.json goes (set by the driver)")
    ap.add_argument("--json", help="driver: write the rows and every rank's result here")
    ap.add_argument(
        "--scenario",
        default=None,
        help=f"take mode, shape, --seq, --batch and --vram-gb from a scenario: one of {', '.join(SCENARIOS)}",
    )
    add_qwen2_args(ap, dict.fromkeys(QWEN2_ARGS))  # None: from --scenario, else DEFAULT_SHAPE
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 4)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --smoke)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --smoke)"
    )
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument(
        "--param-offload",
        type=_fraction,
        default=None,
        help="LoRA: fraction of blocks streamed, or auto (default 0.5; auto with --vram-gb or --scenario)",
    )
    ap.add_argument("--vram-gb", type=float, default=None, help="wrap's vram_budget per GPU, GiB")
    ap.add_argument(
        "--moment-dtype", choices=("fp32", "bf16", "auto"), default=None, help="wrap's moment_dtype"
    )
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
    ap.add_argument("--soak", action="store_true", help="sample RSS, pinned and device bytes every step")
    ap.add_argument(
        "--placeholders",
        action="store_true",
        help="scenario: local ranks other than 0 build frozen weights as meta placeholders (one host copy "
        "per machine from the start: a 72B base on a 256 GiB machine)",
    )
    ap.add_argument(
        "--tolerance", type=float, default=0.01, help="soak: flat means (max-min)/max <= this (default 0.01)"
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds a collective waits for the others")
    ap.add_argument("--limit-s", type=int, default=540, help="driver: seconds one torchrun may take")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with gloo: checks the script")
    args = ap.parse_args(argv)
    _resolve(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:
        if not args.rank_dir:
            raise SystemExit("--rank-dir is required under torchrun")
        rank_main(args)
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    shape = ", ".join(f"{k} {getattr(args, k)}" for k in QWEN2_ARGS if k != "seq")
    budget = f"{args.vram_gb:g} GiB per GPU" if args.vram_gb is not None else "none"
    print(
        f"scenario {args.scenario or '-'}: {args.modes}; {shape}; {args.batch}x{args.seq} tokens per rank; "
        f"VRAM budget {budget}; {args.warmup} warm-up + {args.steps} timed steps"
        + ("; soak" if args.soak else "")
    )
    runs = {m: {w: run_world(args, m, w) for w in worlds} for m in args.modes.split(",")}
    rows = summarize(runs)
    print_table(rows)
    for m, by_world in runs.items():
        for w, ranks in by_world.items():
            for line in ranks[0]["decisions"]:
                print(f"  [{m} W={w}] {line}")
    print_soak(runs)
    if args.json:
        out: dict[str, Any] = {
            "scenario": args.scenario,
            "vram_gb": args.vram_gb,
            "soak": args.soak,
            "rows": rows,
            "ranks": {m: {str(w): r for w, r in bw.items()} for m, bw in runs.items()},
        }
        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name(0)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    not_flat = [r for r in rows if r["soak_flat"] is False]
    if not_flat and not args.smoke:
        print(f"soak: not flat in {len(not_flat)} run(s) (see the soak lines above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
