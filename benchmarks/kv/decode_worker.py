"""One engine of the decode8b benchmark, in its own process: build the model once, run every (context, batch) case.

Run by ``decode.py`` (``--worker ENGINE``); prints one ``RESULT {json}`` line per case as soon as it is known,
so a process killed at its deadline still leaves the rows it finished. Per case:

1. fit check: the engine's estimated device bytes (:func:`estimate`) against free VRAM; a case that cannot
   fit gives a ``skipped`` row with the numbers instead of an OOM;
2. fill: ``context - warmup - steps`` tokens of random K/V are written into the cache layer by layer through
   ``cache.update`` (the same call a prefill makes; the prefill's compute is not what is measured), so the
   last timed step attends over exactly ``context`` tokens;
3. ``warmup`` untimed decode steps, then up to ``steps`` timed ones, each ended by a device-wide
   synchronize (``generate()`` waits each step for the compute stream only, so a gather queued for the
   next step is charged here and not there; ``generate_rounds.py`` times ``generate()`` itself);
   tokens/s = batch / median step time.

A per-case time limit (SIGALRM, checked by Python between operations) turns an overlong case into a
``timeout`` row with the phase it reached; timing also stops early, keeping the steps done, when the
next step would pass the limit.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
PREFIX = "RESULT "
#: pinned host -> device copy rate of the GPU machine (GB/s), the floor for a step's page gathers
PCIE_H2D_GBPS = 55.4
#: the two staging chunks of PagedKVCache (64 MiB each)
_STAGING = 2 * (64 << 20)


# ---------------------------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class Shape:
    """The K/V geometry of a decoder (what the cache sizes depend on)."""

    layers: int
    """Attention layers."""
    kv_heads: int
    """K/V heads per layer."""
    head_dim: int
    """Head dimension."""
    heads: int
    """Query heads (for the GQA expansion some attention paths materialize)."""
    elt: int = 2
    """Bytes per K/V element (bf16: 2)."""

    def layer_bytes(self, batch: int, tokens: int) -> int:
        """K + V bytes of one layer."""
        return 2 * batch * self.kv_heads * tokens * self.head_dim * self.elt


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def estimate(shape: Shape, batch: int, ctx: int, resident: int, slots: int, page: int) -> dict[str, float]:
    """Bytes each engine needs for one case (GiB), computed without a GPU.

    Args:
        shape: The model's K/V geometry.
        batch: Sequences.
        ctx: Tokens per sequence.
        resident: TidalCache layers kept in VRAM.
        slots: TidalCache gather slots.
        page: TidalCache page tokens.

    Returns:
        ``kv`` (all layers), ``dynamic_vram`` (all K/V + one layer's ``torch.cat`` copy + a GQA expansion of one
        layer), ``tidal_vram`` (resident layers + slots + partial pages + staging), ``tidal_host`` (offloaded
        layers' pages), ``offloaded_vram`` (two layers in flight + one cat copy), ``offloaded_host`` (every
        layer pinned, each K and V rounded up to a power of two by torch's pinned-memory cache) and
        ``pcie_floor_ms`` (the time to copy the offloaded layers' pages to the device once, at PCIE_H2D_GBPS).
    """
    lay = shape.layer_bytes(batch, ctx)
    cap = -(-ctx // page) * page
    lay_cap = shape.layer_bytes(batch, cap)
    off = shape.layers - resident
    gqa = lay * (shape.heads // shape.kv_heads) if shape.heads != shape.kv_heads else 0
    b = {
        "kv": shape.layers * lay,
        "dynamic_vram": shape.layers * lay + lay + gqa,
        "tidal_vram": resident * lay_cap + min(slots, off) * lay_cap + off * shape.layer_bytes(batch, page)
        + (_STAGING if off else 0) + gqa,
        "tidal_host": off * lay_cap,
        "offloaded_vram": 3 * lay + gqa,
        "offloaded_host": shape.layers * 2 * _pow2(lay // 2),
    }  # fmt: skip
    out = {k: v / GiB for k, v in b.items()}
    gathered = off * shape.layer_bytes(batch, (ctx // page) * page)  # full pages copied in each step
    out["pcie_floor_ms"] = 1e3 * gathered / (PCIE_H2D_GBPS * 1e9)
    return out


ENGINE_VRAM = {
    "dynamic": "dynamic_vram",
    "tidal": "tidal_vram",
    "tidal-fp8": "tidal_vram",
    "tidal-nf4": "tidal_vram",
    "tidal-resident": "dynamic_vram",
    "offloaded": "offloaded_vram",
}


STORAGE = {"tidal-fp8": "fp8", "tidal-nf4": "nf4"}  # TidalCache engines with quantized host pages
# their host pages' bytes per bf16 byte at head_dim 128: e4m3 + a fp32 scale per row; NF4 + 4 bf16 absmax
PAGE_BYTES = {"tidal": 1.0, "tidal-fp8": 132 / 256, "tidal-nf4": 72 / 256}


def report(rows: list[dict[str, Any]], markdown: str, json_path: Any = None) -> list[dict[str, Any]]:
    """Print ``markdown`` (the rows' table) and, with ``json_path``, write the rows there as JSON lines."""
    print(markdown)
    if json_path is not None:
        json_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def cases(contexts: list[int], batches: list[int]) -> list[tuple[int, int]]:
    """Every (context, batch) pair, smallest K/V first (an overlong last case loses only itself)."""
    return sorted(((c, b) for c in contexts for b in batches), key=lambda cb: (cb[0] * cb[1], cb[0]))


# ---------------------------------------------------------------------------------------------- model


def build_model(config: Any, device: str, dtype: Any) -> Any:
    """``LlamaForCausalLM(config)`` with random weights made on ``device`` directly (meta init, ``normal_``)."""
    import torch
    import transformers

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
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
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return model.eval()


def cache_kw(model: Any) -> str:
    """Newer transformers 5.x call the forward argument ``cache``; 4.57 and early 5.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_cache(engine: str, model: Any, max_tokens: int, page_tokens: int, slots: int) -> Any:
    """The engine's cache: DynamicCache, DynamicCache(offloading=True) / OffloadedCache, or TidalCache."""
    import transformers

    if engine == "dynamic":
        return transformers.DynamicCache()
    if engine == "offloaded":
        tried = []
        for make in (
            lambda: transformers.DynamicCache(offloading=True),  # 4.56+
            lambda: transformers.DynamicCache(config=model.config, offloading=True),
            lambda: transformers.OffloadedCache(),  # older releases
        ):
            try:
                return make()
            except (TypeError, AttributeError, ValueError) as e:
                tried.append(f"{type(e).__name__}: {e}")
        raise RuntimeError(f"no offloaded cache in transformers {transformers.__version__}: {tried}")
    from tidal_hf.cache import TidalCache

    n = model.config.num_hidden_layers
    return TidalCache(
        model,
        max_tokens,
        resident_layers=n if engine == "tidal-resident" else n // 2,
        page_tokens=page_tokens,
        storage=STORAGE.get(engine, "native"),
        prefetch_slots=slots,
    )


def fill(cache: Any, model: Any, batch: int, tokens: int, seed: int, check: Any = None) -> None:
    """Append ``tokens`` random K/V tokens to every layer through ``cache.update``, as a prefill would."""
    import torch

    cfg, p = model.config, next(model.parameters())
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=p.device).manual_seed(seed)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(
            batch, heads, tokens, dim, device=p.device, dtype=p.dtype, generator=g
        )  # [B, H, T, D]
        v = torch.randn(batch, heads, tokens, dim, device=p.device, dtype=p.dtype, generator=g)
        cache.update(k, v, layer)
        del k, v
        if check is not None:
            check()


def step(model: Any, cache: Any, tok: Any) -> Any:
    """One decode step: the next greedy token ``[B, 1]``."""
    out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{cache_kw(model): cache})
    return out.logits[:, -1].argmax(-1, keepdim=True)


def parity(model: Any, page_tokens: int) -> float:
    """Max |Δ logits| over three decode steps, TidalCache vs DynamicCache on the same K/V (0 when exact)."""
    import torch

    device = next(model.parameters()).device
    ctx = 3 * page_tokens + 5  # crosses page boundaries, leaves a partial page
    tok = torch.randint(1, model.config.vocab_size, (2, 1), device=device)
    caches = [make_cache(e, model, ctx + 8, page_tokens, 2) for e in ("dynamic", "tidal")]
    for c in caches:
        fill(c, model, 2, ctx, seed=7)
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):
            ref, got = (
                model(input_ids=tok, use_cache=True, logits_to_keep=1, **{cache_kw(model): c}).logits[:, -1]
                for c in caches
            )
            worst = max(worst, (ref.float() - got.float()).abs().max().item())
            tok = ref.argmax(-1, keepdim=True)
    return worst


# ---------------------------------------------------------------------------------------------- time limits


class CaseTimeout(Exception):
    """A case passed its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread after ``seconds`` (Python checks between operations)."""

    def _fire(signum: int, frame: Any) -> None:
        raise CaseTimeout

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def emit(row: dict[str, Any]) -> None:
    """Print one result line for the parent."""
    print(PREFIX + json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------- one case


def run_case(engine: str, model: Any, args: Any, ctx: int, batch: int, limit_s: float) -> dict[str, Any]:
    """Fill, warm up and time one (context, batch) case; the row (``status`` ok / timeout / oom / skipped)."""
    import torch

    cuda = next(model.parameters()).device.type == "cuda"
    warmup, steps = (
        (args.offloaded_warmup, args.offloaded_steps) if engine == "offloaded" else (args.warmup, args.steps)
    )
    row: dict[str, Any] = {
        "engine": engine,
        "context": ctx,
        "batch": batch,
        "status": "ok",
        "limit_s": limit_s,
    }
    shape = model_shape(model)
    est = estimate(shape, batch, ctx, shape.layers // 2, args.slots, args.page_tokens)
    row["est_gib"] = est[ENGINE_VRAM[engine]]
    if cuda:
        sync = torch.cuda.synchronize
        free, _ = torch.cuda.mem_get_info()
        row["free_gib"] = free / GiB
        if est[ENGINE_VRAM[engine]] * GiB > free - 2 * GiB:
            row.update(
                status="skipped", detail=f"needs ~{row['est_gib']:.1f} GiB of VRAM, {free / GiB:.1f} free"
            )
            return row
        torch.cuda.reset_peak_memory_stats()
    else:
        sync = lambda: None  # noqa: E731
    base = torch.cuda.memory_allocated() if cuda else 0
    t_start = time.perf_counter()
    deadline = t_start + limit_s
    phase, times, cache = "cache", [], None
    try:
        with time_limit(limit_s), torch.no_grad():
            cache = make_cache(engine, model, ctx + 1, args.page_tokens, args.slots)
            phase = "fill"
            fill(cache, model, batch, ctx - warmup - steps, seed=1)
            sync()
            row["fill_s"] = time.perf_counter() - t_start
            if cuda:
                row["fill_vram_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
                torch.cuda.reset_peak_memory_stats()  # the decode-phase peak, without the fill's temporaries
            tok = torch.randint(1, model.config.vocab_size, (batch, 1), device=model.device)
            phase = "warmup"
            for _ in range(warmup):
                tok = step(model, cache, tok)
            sync()
            h2d0 = cache.stats.h2d_bytes if engine.startswith("tidal") else 0
            phase = "steps"
            for _ in range(steps):
                # stop early, keeping what was timed, when the next step would likely pass the limit
                if times and time.perf_counter() + 1.5 * max(times) > deadline - 1.0:
                    row["detail"] = f"timed {len(times)} of {steps} steps (time limit)"
                    break
                t0 = time.perf_counter()
                tok = step(model, cache, tok)
                sync()
                times.append(time.perf_counter() - t0)
    except CaseTimeout:
        row.update(status="timeout", detail=f"passed the {limit_s:.0f} s case limit during {phase}")
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", detail=f"during {phase}: {str(e).splitlines()[0][:160]}")
    row["phase"] = phase
    if times and row["status"] == "ok":
        med = statistics.median(times)
        row.update(
            steps=len(times), ms_per_step=1e3 * med, ms_mean=1e3 * statistics.fmean(times),
            tokens_per_s=batch / med,
        )  # fmt: skip
    elif row["status"] == "ok":
        row.update(status="timeout", detail=f"no step timed within {limit_s:.0f} s")
    if cuda and row["status"] == "ok":
        row["decode_vram_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
    if cache is not None and engine.startswith("tidal") and row["status"] == "ok":
        mem, st = cache.memory(), cache.stats
        dt = sum(times)
        row.update(
            kv_device_gib=mem["device_bytes"] / GiB, kv_host_gib=mem["host_bytes"] / GiB,
            all_resident_gib=mem["all_resident_device_bytes"] / GiB, offloaded_layers=len(mem["offloaded_layers"]),
            prefetched=st.prefetched, gathered_on_demand=st.gathered_on_demand, inspections=st.inspections,
            h2d_gb_per_s=(st.h2d_bytes - h2d0) / dt / 1e9 if dt else 0.0,
            h2d_ms_floor=1e3 * (st.h2d_bytes - h2d0) / max(len(times), 1) / (PCIE_H2D_GBPS * 1e9),
        )  # fmt: skip
    if cache is not None:
        off = getattr(cache, "offloading", None)
        row["impl"] = type(cache).__name__ + ("" if off is None else f"(offloading={off})")
    row["case_s"] = time.perf_counter() - t_start
    del cache
    release(cuda)
    return row


def release(cuda: bool) -> None:
    """Free what a case left: Python garbage, the CUDA cache, torch's cached pinned host blocks."""
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # the offloaded cache's pinned K/V copies stay cached in torch otherwise (name by torch release)
        acc = getattr(torch, "accelerator", None)
        for empty_host in (
            getattr(acc, "empty_host_cache", None),
            getattr(torch._C, "_host_emptyCache", None),
        ):
            if empty_host is not None:
                empty_host()
                break


def model_shape(model: Any) -> Shape:
    """The K/V geometry of a transformers decoder."""
    cfg = model.config
    return Shape(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
        cfg.num_attention_heads,
        next(model.parameters()).element_size(),
    )


# ---------------------------------------------------------------------------------------------- worker


#: ``--sdpa`` choices: the scaled_dot_product_attention backends allowed (None: torch's default order)
SDPA_BACKENDS = {
    "default": None,
    "no-cudnn": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "flash": ("FLASH_ATTENTION",),
}


def sdpa_backends(choice: str) -> Any:
    """A context allowing only ``SDPA_BACKENDS[choice]`` (a no-op for "default")."""
    import contextlib

    names = SDPA_BACKENDS[choice]
    if names is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, n) for n in names])


def worker(engine: str, config: Any, args: Any) -> None:
    """Build the model once, then every case in :func:`cases` order, each within its share of the deadline."""
    import torch

    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(config, device, torch.float32 if args.smoke else torch.bfloat16)
    if device == "cuda":
        torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emit({"engine": engine, "setup": True, "weights_gib": weights / GiB, "build_s": time.perf_counter() - t0})
    if engine == "tidal":
        try:
            emit({"engine": engine, "parity_max_abs_logit_diff": parity(model, args.page_tokens)})
        except Exception as e:  # the timing cases still run; the report shows the parity failure
            emit({"engine": engine, "parity_error": f"{type(e).__name__}: {e}"[:300]})
        release(device == "cuda")
    todo = cases(args.contexts, args.batches)
    for i, (ctx, batch) in enumerate(todo):
        left = args.deadline - time.time()
        after = len(todo) - i - 1
        # later cases keep a floor of 10 s each, but never below an equal share of what is left: the small
        # cases come first and rarely need their limit, which only guards against a hang
        limit = min(args.case_timeout, max(left - 10.0 * after, left / (after + 1)) - 2.0)
        if limit < 3.0:
            emit({"engine": engine, "context": ctx, "batch": batch, "status": "timeout",
                  "detail": f"no time left before the engine's deadline ({left:.0f} s)"})  # fmt: skip
            continue
        try:
            with sdpa_backends(args.sdpa):
                row = run_case(engine, model, args, ctx, batch, limit)
            row["sdpa"] = args.sdpa
        except Exception as e:  # one broken case must not lose the others
            row = {"engine": engine, "context": ctx, "batch": batch, "status": "error",
                   "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}  # fmt: skip
            release(device == "cuda")
        emit(row)
    sys.stdout.flush()
