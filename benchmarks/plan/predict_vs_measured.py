"""Predicted vs measured step time: tidal-plan's cost model against real training steps.

Three configurations of one ~0.4 B Qwen2 shape (hidden 2048, MLP 5632, 6 layers, 16 heads / 4 KV heads,
vocabulary 32000, bf16), full fine-tune, batch 4 x 512:

- ``gpu``: plain fused ``torch.optim.AdamW`` on the device (no tidal-stream);
- ``split``: ``tidal_stream.wrap`` under a VRAM budget that holds only half of the optimizer state, so
  the plan splits AdamW between the GPU and the host;
- ``stream``: ``tidal_stream.wrap`` with every block's weights streamed from the host and AdamW on the host.

For each: the model is built on the meta device and filled on the device (``normal_(0, 0.02)``), the plan
is made with ``tidal_plan.plan(census(model), profile_hardware(device), PlanConfig(...))`` for the same
setting (the wrapped runs follow that very plan), 3 warm-up and 5 measured steps are timed between device
synchronizations, and the median is set beside the prediction with ``tidal_plan.compare_prediction``.

On the GPU machine (about a minute)::

    python benchmarks/plan/predict_vs_measured.py
    python benchmarks/plan/predict_vs_measured.py --json benchmarks/results/predict-vs-measured-h200.json

On any machine (seconds; a tiny model, the CPU standing in for the GPU)::

    python benchmarks/plan/predict_vs_measured.py --smoke

The exit status is 1 when a prediction misses the measured step by more than 25 % (not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

QWEN_04B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
CONFIGS = ("gpu", "split", "stream")


def build_model(shape: dict[str, int], device: torch.device, seed: int) -> nn.Module:
    """A Qwen2 causal LM of ``shape`` in bf16: built on the meta device, then filled on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    # to_empty leaves buffers uninitialised: rebuild the rotary embeddings (their inverse frequencies);
    # built under a device context because newer transformers 5.x dropped their ``device`` argument
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "inv_freq"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            with torch.device(device):
                setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=model.config))
    return model


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    model: nn.Module, opt: Any, ids: torch.Tensor, warmup: int, steps: int
) -> tuple[list[float], float]:
    """Seconds of each measured training step (each between device synchronizations) and the last loss."""
    times = []
    loss = torch.zeros(())
    for i in range(warmup + steps):
        synchronize(ids.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(ids.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss.detach())


def plan_config(kind: str, tokens: int, seq: int, budget: int | None) -> Any:
    """The ``PlanConfig`` of configuration ``kind`` (activations kept everywhere, as the runs do)."""
    from tidal_plan import PlanConfig

    common = dict(batch_tokens=tokens, seq_len=seq, recompute=False, activation_offload=False)
    if kind == "gpu":
        # torch.optim.AdamW on bf16 weights: no fp32 master, moments in the weights' dtype
        return PlanConfig(
            **common, offload=False, param_offload=False, master_weights=False, moment_dtype="bf16"
        )
    if kind == "split":
        return PlanConfig(**common, vram_budget=budget, param_offload=False, moment_dtype="fp32")
    return PlanConfig(**common, offload=True, param_offload=True, moment_dtype="fp32", prefetch_depth=2)


def split_budget(census: Any, profile: Any, tokens: int, seq: int) -> int:
    """A budget that holds everything the all-GPU (tidal AdamW) plan needs but half its optimizer state."""
    from tidal_plan import plan

    cfg = dataclasses.replace(plan_config("split", tokens, seq, None), offload=False)
    full = plan(census, profile, cfg)
    need = full.tiers["vram"] - full.vram_breakdown["headroom"] - full.optimizer.gpu_state_bytes // 2
    # the planner keeps max(256 MiB, 5 % of the budget) free on top of what it places
    return int(max(need + 256 * 2**20, math.ceil(need / 0.95)))


def host_params(opt: Any) -> int:
    """Parameters the wrapped optimizer updates on the host right now."""
    return sum(s.param.numel() for s in opt.host_slots())


def run_config(kind: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build, plan, train and time one configuration; returns its row."""
    from tidal_plan import census, compare_prediction, plan, profile_hardware

    model = build_model(args.shape, device, args.seed)
    tokens = args.batch * args.seq
    ids = torch.randint(
        0,
        args.shape["vocab_size"],
        (args.batch, args.seq),
        generator=torch.Generator().manual_seed(args.seed),
    ).to(device)
    c = census(model)
    profile = profile_hardware(device)
    budget = split_budget(c, profile, tokens, args.seq) if kind == "split" else None
    p = plan(c, profile, plan_config(kind, tokens, args.seq, budget))
    planned_host = sum(b.trainable_params for b in c.blocks if b.index not in p.optimizer.gpu_blocks)
    planned_host += 0 if p.optimizer.outside_on_gpu else c.outside_trainable_params
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True if device.type == "cuda" else None)
    wrapped = kind != "gpu"
    if wrapped:
        from tidal_stream import unwrap, wrap

        stream = kind == "stream"
        model, opt = wrap(
            model,
            opt,
            plan=p if kind == "split" else None,
            offload="auto" if kind == "split" else True,
            vram_budget=budget,
            param_offload=stream,
            recompute=False,
            activation_offload=False,
            prefetch_depth=p.prefetch_depth if stream else None,
            moment_dtype="fp32",
            batch_tokens=tokens,
            attention=None,
        )
    times, loss = time_steps(model, opt, ids, args.warmup, args.steps)
    actual_host = host_params(opt) if wrapped else 0
    if wrapped:
        opt.synchronize()
        unwrap(model)
    if not math.isfinite(loss):
        raise RuntimeError(f"{kind}: the loss is {loss} after {args.warmup + args.steps} steps")
    measured = statistics.median(times)
    cmp = compare_prediction(p, measured)
    print(f"\n=== {kind} ===\n{p.explain()}\n{cmp['summary']}")
    print(f"steps (ms): {', '.join(f'{t * 1e3:.1f}' for t in times)}; loss {loss:.4f}")
    if wrapped and actual_host != planned_host:
        print(
            f"note: the plan updates {planned_host / 1e6:.1f} M parameters on the host, the run "
            f"{actual_host / 1e6:.1f} M (tidal-stream refined the split after the first step)"
        )
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": kind,
        "placement": p.optimizer.placement,
        "streamed_blocks": len(p.streamed_blocks),
        "vram_budget": p.vram_budget_bytes,
        "planned_host_params": planned_host,
        "actual_host_params": actual_host,
        "steps_s": times,
        "loss": loss,
        "parts": dict(p.prediction.parts),
        **{k: v for k, v in cmp.items() if k != "summary"},
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """One Markdown table of every configuration."""
    lines = [
        "| config | optimizer | streamed blocks | bound | predicted ms | measured ms | measured/predicted "
        "| error | within ±25 % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['placement']} | {r['streamed_blocks']} | {r['bound']} "
            f"| {r['predicted_step_s'] * 1e3:.1f} | {r['measured_step_s'] * 1e3:.1f} | {r['ratio']:.2f} "
            f"| {r['error']:+.0%} | {'yes' if r['within_25pct'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (seconds)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.configs.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CONFIGS]
    if bad or not kinds:
        ap.error(f"--configs: {bad or kinds} given; accepted: a comma-separated subset of {CONFIGS}")
    if args.batch < 1 or args.seq < 1 or args.warmup < 0 or args.steps < 1:
        ap.error("--batch, --seq and --steps must be >= 1, --warmup >= 0")
    args.shape = QWEN_04B
    if args.smoke:
        args.device = args.device or "cpu"
        args.shape, args.batch, args.seq, args.warmup, args.steps = TINY, 2, 16, 1, 2
        torch.set_num_threads(1)
    elif args.device is None:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on the GPU machine, or pass --smoke")
        args.device = "cuda"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    rows = [run_config(k, args, device) for k in kinds]
    table = markdown(rows)
    print(f"\n{table}\n\n({time.perf_counter() - t0:.1f} s in all)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "rows": rows, "table": table}, indent=1))
        print(f"rows written to {args.json}")
    return 0 if args.smoke or all(r["within_25pct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
