"""Host cost of the CUDA calls a decode step of the paged KV cache issues, one primitive at a time.

```bash
python3 benchmarks/kv/host_costs.py            # on the GPU machine; ~20 s
```

A batch-1 decode step is bound by the host: what it costs is the time Python needs to *issue* its calls, not
the device time they take. This times each primitive the cache's update path is built from (and a few
candidates to replace them, a gather's dequantization of fp8 and NF4 pages, and a whole gather of each page
format issued call by call and as one CUDA graph) as the median over ``--repeats`` loops of ``--calls`` back-to-back issues, at the
decode8b K/V shape (8 K/V heads, head_dim 128, bf16). Each line prints µs per call (issue only: the device
is drained between loops, never inside one).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(call: Callable[[], None], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median µs per ``call`` over ``repeats`` loops of ``calls`` issues (the device drained between loops)."""
    per = []
    for _ in range(repeats + 1):  # the first loop warms up and is dropped
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per.append((time.perf_counter() - t) / calls * 1e6)
        sync()
    return statistics.median(per[1:])


def primitives(heads: int, head_dim: int, context: int, page: int) -> dict[str, Callable[[], None]]:
    """The calls to time, by name, on one CUDA device."""
    import torch

    from tidal_arena import RowCopy
    from tidal_kv.slots import Slot
    from tidal_kv.views import KVRange

    dev, bf = torch.device("cuda"), torch.bfloat16
    k = torch.randn(1, heads, 1, head_dim, device=dev, dtype=bf)  # [B, H, 1, D]
    v = torch.randn_like(k)
    tail = torch.zeros(2, 1, heads, page, head_dim, device=dev, dtype=bf)  # [2, B, H, P, D]
    slot = torch.zeros(2, 1, heads, context + page, head_dim, device=dev, dtype=bf)
    t_old = page // 2
    tk = tail[0, :, :, t_old : t_old + 1]
    tv = tail[1, :, :, t_old : t_old + 1]
    part = tail[:, :, :, : t_old + 1]
    dst = slot[:, :, :, context : context + t_old + 1]
    keys = torch.randn(1, heads, context, head_dim, device=dev, dtype=bf)
    h2d, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    ev = torch.cuda.Event()
    ev.record(compute)
    host = torch.empty(2, 1, heads, 16, head_dim, dtype=bf).pin_memory()  # 64 KiB: issue cost, not bandwidth
    small = slot[:, :, :, :16]
    row_copy = RowCopy(small, host, 3)
    base = torch._C._CudaEventBase

    def three_copies() -> None:
        tk.copy_(k)
        tv.copy_(v)
        dst.copy_(part)

    out = {
        "copy_ k -> tail view": lambda: tk.copy_(k),
        "copy_ tail -> slot view": lambda: dst.copy_(part),
        "3 copy_ (offloaded decode)": three_copies,
        "_foreach_copy_ k,v -> tail": lambda: torch._foreach_copy_([tk, tv], [k, v]),
        "KVRange.write_token k,v -> tail": functools.partial(
            KVRange(tail[0], tail[1]).write_token, t_old, k, v
        ),
        "Slot.copy_page tail -> slot": functools.partial(Slot(slot).copy_page, context // page, page, tail),
        "torch.cat K,k (DynamicCache)": lambda: torch.cat([keys, k], dim=-2),
        "Event.record(stream)": lambda: ev.record(compute),
        "_CudaEventBase.record": lambda: base.record(ev, compute),
        "Stream.wait_event": lambda: h2d.wait_event(ev),
        "_CudaEventBase.wait": lambda: base.wait(ev, h2d),
        "RowCopy H2D 64 KiB": lambda: row_copy(h2d),
        "copy_ H2D non_blocking 64 KiB": lambda: small.copy_(host, non_blocking=True),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # why: what replaying the three copies as one graph costs to issue
        three_copies()
    out["CUDAGraph.replay (3 copies)"] = graph.replay
    out.update(triton_launch(k))
    out.update(page_decoders(slot[:, :, :, :context]))
    return out


def page_gathers(heads: int, head_dim: int, context: int, page: int) -> dict[str, Callable[[], None]]:
    """One offloaded layer's gather of ``context`` tokens of pages: its copies (H2D stream) issued one call each
    and as the replay of their CUDA graph ([Note: gather graphs] in ``tidal_kv.slots``), and for quantized pages
    the dequantization its layer's update replays (see [Note: dequantization off the link] there)."""
    import torch

    from tidal_kv import PagedKVCache

    out = {}
    kv = torch.randn(1, heads, context, head_dim, device="cuda", dtype=torch.bfloat16)
    for storage in ("native", "fp8", "nf4"):
        cache = PagedKVCache(2, context + page, resident_layers=[0], page_tokens=page, storage=storage)
        for layer in (0, 1):
            cache.update(layer, kv, kv)
        slot, h2d = cache._slots[0], cache._h2d
        plan = slot.gather_plan(
            1, 0, context // page, cache._host[1], cache._chunk_layout, cache._tails[1].buf
        )
        plan.issue(h2d)
        plan.issue(h2d)  # the second use captures the plan (more than one operation)
        out[f"{storage} copies, one call each"] = functools.partial(plan.copies._queue, h2d)
        if plan.graph is not None:
            out[f"{storage} copies, graph launch"] = functools.partial(plan.graph.launch, h2d)
        if plan.finish is not None:
            out[f"{storage} dequantization, one call each"] = plan.decode_now
    return out


def page_decoders(dst: Any) -> dict[str, Callable[[], None]]:
    """A gather's dequantization of ``dst``'s tokens (a slot's token range) from fp8 and from NF4 staging."""
    import torch

    from tidal_kv.storage import ChunkLayout, device_chunk

    _, b, h, t, d = dst.shape
    out = {}
    for storage in ("fp8", "nf4"):
        layout = ChunkLayout(1, b, h, t, d, dst.dtype, storage)
        staged = device_chunk(layout, dst.device)
        staged.data.view(torch.uint8).zero_()
        staged.scale.fill_(1.0)
        out[f"{storage} page decode ({t} tokens)"] = staged.decoder(dst)
    return out


def triton_launch(k: Any) -> dict[str, Callable[[], None]]:
    """A minimal Triton copy kernel's launch, when Triton is installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return {}

    @triton.jit
    def _copy(src, dst, n: tl.constexpr):
        i = tl.arange(0, n)
        tl.store(dst + i, tl.load(src + i))

    flat = k.reshape(-1)
    out = flat.clone()
    _copy[(1,)](flat, out, flat.numel())
    return {"triton kernel[grid](...)": lambda: _copy[(1,)](flat, out, flat.numel())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("host_costs.py times CUDA calls: it needs a GPU")
    calls = primitives(args.heads, args.head_dim, args.context, args.page_tokens)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call (issue), median of {args.repeats}"
    )
    for name, call in calls.items():
        print(f"{name:34s} {timed(call, args.calls, args.repeats, torch.cuda.synchronize):8.2f}")
    # a gather keeps the link busy for 0.1-2 ms: few enough that the host never waits for room in the queue
    calls = min(args.calls, 32)
    print(f"whole gathers of {args.context} tokens, {calls} back to back:")
    for name, call in page_gathers(args.heads, args.head_dim, args.context, args.page_tokens).items():
        print(f"{name:34s} {timed(call, calls, args.repeats, torch.cuda.synchronize):8.2f}")


if __name__ == "__main__":
    main()
