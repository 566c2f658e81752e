"""Host-side overhead of TidalCache against DynamicCache on the CPU (Python, dispatch, bookkeeping).

```bash
python3 benchmarks/kv/overhead.py                 # tiny 32-layer Llama on the CPU, ~10 s on one thread
python3 benchmarks/kv/overhead.py --profile 15    # + cProfile of the cache-only loop (top 15 by tottime)
# the GPU machine: the cache-only loop at the decode8b K/V shape, + a torch.profiler table of its host calls
python3 benchmarks/kv/overhead.py --device cuda --dtype bfloat16 --hidden 4096 --heads 32 --kv-heads 8 \
    --context 4096 --page-tokens 256 --cache-only --trace 25
```

On the CPU every copy of tiny tensors is a memcpy, so the difference between the two caches is the
per-layer host cost that a GPU decode step also pays while it is host-bound. Two measurements, each the
median of ``--repeats`` runs (each run the median step of ``--steps`` timed steps):

- ``model``: one ``model(token, cache)`` decode step of a tiny Llama (hidden 256, 4 heads, 2 K/V heads,
  32 layers, vocab 512) after a ``--context``-token prefill; TidalCache keeps half the layers on the host.
- ``cache``: the caches' ``update`` alone, called for every layer in stack order with one new token (what
  the model's attention layers call), so the per-layer figure has no model compute in it.

On the CPU, CUDA-only costs (event record/wait, stream switches, non-blocking copies) are no-ops: the probe
then measures the Python and dispatch part only. With ``--device cuda --cache-only`` it times the same loop
with real streams, events and page copies (each step synchronized; ``cache_*_issue_us_per_layer`` is the
host time to issue a step's updates, before the copies finish), and ``--trace N`` prints the N host
calls with the most self CPU time under ``torch.profiler`` (e.g. whether ``cudaMemcpyAsync`` blocks).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any


def llama_config(args: Any) -> Any:
    """The Llama config (sdpa) of ``args``: 32 layers, hidden 256, 4 heads, 2 K/V heads by default."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=65536,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny_llama(args: Any) -> Any:
    """A seeded random Llama of :func:`llama_config` on ``args.device``."""
    import torch
    import transformers

    torch.manual_seed(0)
    return (
        transformers.LlamaForCausalLM(llama_config(args)).to(args.device, getattr(torch, args.dtype)).eval()
    )


def make_cache(kind: str, config: Any, max_tokens: int, page_tokens: int) -> Any:
    """``dynamic`` (DynamicCache) or ``tidal`` (TidalCache, half the layers offloaded, 2 slots)."""
    import transformers

    if kind == "dynamic":
        return transformers.DynamicCache()
    from tidal_hf.cache import TidalCache

    layers = config.num_hidden_layers
    return TidalCache(config, max_tokens, resident_layers=layers // 2, page_tokens=page_tokens)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_model(kind: str, model: Any, args: Any) -> float:
    """Median ms of one decode step after a prefill of ``args.context`` tokens."""
    import torch

    kw = (
        "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=g).to(args.device)
    cache = make_cache(kind, model.config, args.context + args.steps + 4, args.page_tokens)
    times = []
    with torch.inference_mode():
        out = model(ids, **{kw: cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(args.steps + 2):
            _sync(args.device)
            t0 = time.perf_counter()
            out = model(tok, **{kw: cache}, use_cache=True)
            _sync(args.device)
            dt = time.perf_counter() - t0
            tok = out.logits[:, -1:].argmax(-1)
            if i >= 2:  # two warm-up steps
                times.append(dt)
    return 1e3 * statistics.median(times)


def cache_loop(kind: str, config: Any, args: Any) -> tuple[Any, Any]:
    """A filled cache and a function running ``steps`` decode steps of ``update`` over every layer."""
    import torch

    c, dt = config, getattr(torch, args.dtype)
    layers, heads, dim = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(2)
    cache = make_cache(kind, config, args.context + 4 * args.steps + 4, args.page_tokens)
    for layer in range(layers):
        kv = torch.randn(2, 1, heads, args.context, dim, generator=g).to(args.device, dt)  # [2, B, H, T, D]
        cache.update(kv[0], kv[1], layer)
    new = torch.randn(2, 1, heads, 1, dim, generator=g).to(args.device, dt)  # [2, B, H, 1, D]: one token

    def run(steps: int, issue: list[float] | None = None) -> list[float]:
        times = []
        for _ in range(steps):
            _sync(args.device)
            t0 = time.perf_counter()
            for layer in range(layers):
                cache.update(new[0], new[1], layer)
            if issue is not None:  # host time to issue the step (on CUDA the copies may still run)
                issue.append(time.perf_counter() - t0)
            _sync(args.device)
            times.append(time.perf_counter() - t0)
        return times

    return cache, run


def time_cache(kind: str, config: Any, args: Any) -> tuple[float, float]:
    """Median ms of one step of ``update`` calls over every layer (no model compute), and of its issue time."""
    _, run = cache_loop(kind, config, args)
    run(2)
    issue: list[float] = []
    total = run(args.steps, issue)
    return 1e3 * statistics.median(total), 1e3 * statistics.median(issue)


def profile_cache(config: Any, args: Any) -> str:
    """cProfile of TidalCache's update loop (top ``args.profile`` functions by own time)."""
    _, run = cache_loop("tidal", config, args)
    run(2)
    prof = cProfile.Profile()
    prof.enable()
    run(args.steps)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile)
    return buf.getvalue()


def trace_cache(config: Any, args: Any) -> str:
    """torch.profiler table of TidalCache's update loop: the ``args.trace`` ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    _, run = cache_loop("tidal", config, args)
    run(2)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        run(args.steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.trace)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run both measurements, print and return the results."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (half of them offloaded)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden / heads)")
    ap.add_argument("--kv-heads", type=int, default=2, help="K/V heads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="torch dtype name of the weights and K/V")
    ap.add_argument("--cache-only", action="store_true", help="skip the model measurement (no weights built)")
    ap.add_argument("--context", type=int, default=40, help="prefill tokens before the timed steps")
    ap.add_argument("--page-tokens", type=int, default=16, help="TidalCache page tokens")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs per measurement (the median is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--profile", type=int, default=0, help="print a cProfile top-N of TidalCache.update")
    ap.add_argument("--trace", type=int, default=0, help="print a torch.profiler top-N of TidalCache.update")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = llama_config(args)
    res: dict[str, Any] = {k: getattr(args, k) for k in ("device", "layers", "context", "page_tokens")}
    todo = [("cache", time_cache, config)]
    if not args.cache_only:
        todo.insert(0, ("model", time_model, tiny_llama(args)))
    for what, fn, obj in todo:
        for kind in ("dynamic", "tidal"):
            runs = [fn(kind, obj, args) for _ in range(args.repeats)]
            if what == "cache":  # (step, issue) pairs
                res[f"cache_{kind}_issue_us_per_layer"] = (
                    1e3 * statistics.median(r[1] for r in runs) / args.layers
                )
                runs = [r[0] for r in runs]
            res[f"{what}_{kind}_ms"] = statistics.median(runs)
        extra = res[f"{what}_tidal_ms"] - res[f"{what}_dynamic_ms"]
        res[f"{what}_extra_us_per_layer"] = 1e3 * extra / args.layers
    res["cache_tidal_us_per_layer"] = 1e3 * res["cache_tidal_ms"] / args.layers
    res["cache_dynamic_us_per_layer"] = 1e3 * res["cache_dynamic_ms"] / args.layers
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    print(json.dumps(res))
    if args.profile:
        print(profile_cache(config, args))
    if args.trace:
        print(trace_cache(config, args))
    return res


if __name__ == "__main__":
    main()
