"""decode8b: decode tokens/s of a Llama-3-8B-shaped model with its KV cache partly on the host.

    python benchmarks/kv/decode.py                  # the GPU machine: all engines, 4k/32k x batch 1/16
    python benchmarks/kv/decode.py --smoke          # tiny model on the CPU (checks the script, not speed)
    python benchmarks/kv/decode.py --engines tidal --contexts 4096 --batches 1

Engines, each in its own process: ``dynamic`` (transformers' DynamicCache, all K/V in VRAM), ``tidal``
(TidalCache with half the layers' K/V in pinned host pages), ``offloaded`` (transformers'
DynamicCache(offloading=True), every layer's K/V on the host and one layer prefetched). Random weights on
exact shapes (meta init, ``normal_`` on the GPU). The cache is filled with random K/V of the context length
(a prefill's compute is not what is measured), then ``--steps`` greedy decode steps are timed after a
warm-up. The tidal worker first checks one decode step against DynamicCache on the same K/V. Prints
JSON lines (``RESULT {...}``) and a Markdown table: tokens/s, ratio to dynamic, KV VRAM and host bytes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30
ENGINES = ("dynamic", "tidal", "offloaded", "tidal-fp8")
DEFAULT_ENGINES = ("dynamic", "tidal", "offloaded")
PREFIX = "RESULT "


def _model(smoke: bool, device: str) -> Any:
    import torch
    import transformers

    if smoke:
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096,
        )  # fmt: skip
    else:  # Llama-3-8B
        cfg = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        )  # fmt: skip
    dtype = torch.float32 if smoke else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.normal_(0, 0.02, generator=g)
    # buffers are not parameters: rebuild the rotary embedding's inv_freq on the device
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg).to(device)
    return model.eval()


def _cache_kw(model: Any) -> str:
    """Newer transformers 5.x call the forward argument ``cache``; 4.57 and early 5.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _make_cache(engine: str, model: Any, max_tokens: int, page_tokens: int, slots: int = 2) -> Any:
    import transformers

    if engine == "dynamic":
        return transformers.DynamicCache()
    if engine == "offloaded":
        return transformers.DynamicCache(offloading=True)
    from tidal_hf.cache import TidalCache

    n = model.config.num_hidden_layers
    storage = "fp8" if engine == "tidal-fp8" else "native"
    return TidalCache(
        model,
        max_tokens,
        resident_layers=n // 2,
        page_tokens=page_tokens,
        storage=storage,
        prefetch_slots=slots,
    )


def _fill(cache: Any, model: Any, batch: int, ctx: int, seed: int) -> None:
    """Append ``ctx`` random K/V tokens to every layer, as a prefill would."""
    import torch

    cfg, p = model.config, next(model.parameters())
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=p.device).manual_seed(seed)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, heads, ctx, dim, device=p.device, dtype=p.dtype, generator=g)  # [B, H, T, D]
        v = torch.randn(batch, heads, ctx, dim, device=p.device, dtype=p.dtype, generator=g)
        cache.update(k, v, layer)
        del k, v


def _step(model: Any, cache: Any, tok: Any) -> Any:
    out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{_cache_kw(model): cache})
    return out.logits[:, -1]  # [B, V]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _parity(model: Any, device: str, page_tokens: int) -> float:
    """Max |Δ logits| of three decode steps: TidalCache vs DynamicCache on the same K/V (must be 0)."""
    import torch

    ctx = 3 * page_tokens + 5
    worst = 0.0
    tok = torch.randint(1, model.config.vocab_size, (2, 1), device=device)
    caches = [_make_cache(e, model, ctx + 8, page_tokens) for e in ("dynamic", "tidal")]
    for c in caches:
        _fill(c, model, 2, ctx, seed=7)
    with torch.no_grad():
        t = tok
        for _ in range(3):
            ref, got = (_step(model, c, t) for c in caches)
            worst = max(worst, (ref.float() - got.float()).abs().max().item())
            t = ref.argmax(-1, keepdim=True)
    return worst


def worker(engine: str, args: argparse.Namespace) -> None:
    import torch

    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(0)
    model = _model(args.smoke, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if engine == "tidal":
        diff = _parity(model, device, args.page_tokens)
        print(PREFIX + json.dumps({"engine": engine, "parity_max_abs_logit_diff": diff}), flush=True)
        if diff != 0.0:
            print(f"warning: TidalCache logits differ from DynamicCache by {diff}", file=sys.stderr)
    for ctx in args.contexts:
        for batch in args.batches:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device == "cuda" else 0
            cache = _make_cache(
                engine, model, ctx + args.steps + args.warmup + 1, args.page_tokens, args.slots
            )
            t0 = time.perf_counter()
            _fill(cache, model, batch, ctx, seed=1)
            _sync(device)
            fill_s = time.perf_counter() - t0
            if device == "cuda":
                fill_peak = torch.cuda.max_memory_allocated() - base
                torch.cuda.reset_peak_memory_stats()  # the decode-phase peak, without the fill's temporaries
            tok = torch.randint(1, model.config.vocab_size, (batch, 1), device=device)
            with torch.no_grad():
                for _ in range(args.warmup):
                    tok = _step(model, cache, tok).argmax(-1, keepdim=True)
                _sync(device)
                h2d0 = cache.stats.h2d_bytes if engine.startswith("tidal") else 0
                t0, steps = time.perf_counter(), 0
                # at least 2 timed steps; stop early past the time box (the offloaded cache is slow at 32k)
                while steps < args.steps and (steps < 2 or time.perf_counter() - t0 < args.time_box):
                    tok = _step(model, cache, tok).argmax(-1, keepdim=True)
                    steps += 1
                _sync(device)
                dt = time.perf_counter() - t0
            row: dict[str, Any] = {
                "engine": engine, "context": ctx, "batch": batch, "steps": steps,
                "tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps, "fill_s": fill_s,
            }  # fmt: skip
            if device == "cuda":
                row["kv_vram_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
                row["fill_vram_peak_gib"] = fill_peak / GiB
                row["weights_gib"] = weights / GiB
            if engine.startswith("tidal"):
                mem, st = cache.memory(), cache.stats
                row.update(
                    kv_device_gib=mem["device_bytes"] / GiB, kv_host_gib=mem["host_bytes"] / GiB,
                    all_resident_gib=mem["all_resident_device_bytes"] / GiB,
                    offloaded_layers=len(mem["offloaded_layers"]), prefetched=st.prefetched,
                    gathered_on_demand=st.gathered_on_demand, h2d_gib=st.h2d_bytes / GiB,
                    h2d_gb_per_s=(st.h2d_bytes - h2d0) / dt / 1e9, inspections=st.inspections,
                )  # fmt: skip
            print(PREFIX + json.dumps(row), flush=True)
            del cache


def _table(rows: list[dict[str, Any]]) -> str:
    base = {(r["context"], r["batch"]): r["tokens_per_s"] for r in rows if r["engine"] == "dynamic"}
    lines = [
        "| engine | context | batch | tokens/s | × dynamic | ms/step | decode VRAM peak GiB (KV + temps) | KV host GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        ref = base.get((r["context"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "–"
        vram = f"{r['kv_vram_peak_gib']:.2f}" if "kv_vram_peak_gib" in r else "–"
        host = f"{r['kv_host_gib']:.2f}" if "kv_host_gib" in r else "–"
        lines.append(
            f"| {r['engine']} | {r['context']} | {r['batch']} | {r['tokens_per_s']:.1f} | {ratio} | "
            f"{r['ms_per_step']:.1f} | {vram} | {host} |"
        )
    return "\n".join(lines)


def _saved(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    dyn = {(r["context"], r["batch"]): r for r in rows if r["engine"] == "dynamic" and "tokens_per_s" in r}
    for r in rows:
        if not r["engine"].startswith("tidal") or "tokens_per_s" not in r:
            continue
        line = (
            f"context {r['context']} batch {r['batch']}: {r['engine']} keeps {r['kv_device_gib']:.2f} GiB of K/V in VRAM "
            f"instead of {r['all_resident_gib']:.2f} GiB (saved {r['all_resident_gib'] - r['kv_device_gib']:.2f} GiB, "
            f"{r['offloaded_layers']} layers on the host); prefetched {r['prefetched']}, on demand "
            f"{r['gathered_on_demand']}; H2D {r['h2d_gb_per_s']:.1f} GB/s while decoding"
        )
        d = dyn.get((r["context"], r["batch"]))
        if d and "kv_vram_peak_gib" in d and "kv_vram_peak_gib" in r:
            line += f"; peak KV VRAM {r['kv_vram_peak_gib']:.2f} vs dynamic {d['kv_vram_peak_gib']:.2f} GiB"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES)
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="context lengths (default 4096 32768)"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 16)")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps (fewer past --time-box)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed decode steps first")
    ap.add_argument(
        "--time-box", type=float, default=8.0, help="seconds after which timing stops (min 2 steps)"
    )
    ap.add_argument("--page-tokens", type=int, default=256, help="TidalCache page size")
    ap.add_argument("--slots", type=int, default=2, choices=(2, 3), help="TidalCache prefetch slots")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = ap.parse_args(argv)
    if args.contexts is None:
        args.contexts = [96, 200] if args.smoke else [4096, 32768]
    if args.batches is None:
        args.batches = [1, 3] if args.smoke else [1, 16]
    if args.smoke:
        args.page_tokens = min(args.page_tokens, 16)
    if args.worker:
        worker(args.worker, args)
        return 0
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"--engines: unknown {bad}; accepted {list(ENGINES)}")
    if args.smoke and "offloaded" in engines:
        engines.remove("offloaded")  # transformers' offloaded cache needs CUDA streams
        print("[offloaded] skipped: transformers' offloaded cache needs CUDA", file=sys.stderr)
    fwd = ["--contexts", *map(str, args.contexts), "--batches", *map(str, args.batches)]
    fwd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--time-box", str(args.time_box)]
    fwd += ["--page-tokens", str(args.page_tokens), "--slots", str(args.slots)]
    fwd += ["--smoke"] if args.smoke else []
    rows: list[dict[str, Any]] = []
    status = 0
    for engine in engines:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, *fwd]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(f"[{engine}] exit {proc.returncode} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for line in proc.stdout.splitlines():
            if line.startswith(PREFIX):
                rows.append(json.loads(line[len(PREFIX) :]))
                print(line, flush=True)
        if proc.returncode:
            status = 1
            print(proc.stderr[-4000:], file=sys.stderr)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(_table(rows))
    print()
    for line in _saved(rows):
        print("- " + line)
    for r in rows:
        if "parity_max_abs_logit_diff" in r:
            print(f"- parity: TidalCache vs DynamicCache max |Δ logits| = {r['parity_max_abs_logit_diff']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
