"""What TidalCache's page traffic costs a host-bound decode step, without TidalCache: copies, and waits on them.

```bash
python3 benchmarks/kv/page_traffic.py            # the GPU machine, ~30 s (8B shape, 4k x 1)
python3 benchmarks/kv/page_traffic.py --smoke    # tiny Llama on the CPU (checks the script)
```

One model decodes with DynamicCache, stepped in turn (as ``interleaved.py`` does) with variants that add, at
every other layer, what an offloaded TidalCache layer adds: one 4k-token K/V copy host -> device on a side
stream (16 MiB at the decode8b shape), and the compute stream's wait for it. Variants:

- ``big``: the same bytes in one copy at the start of the step (the link busy, one launch);
- ``copies``: the per-layer copies alone, nothing waits for them;
- ``waits``: the compute stream waits for the copy issued two layers before (long finished when the host
  gets there: the step is bound by the host);
- ``query``: the same, but waits only when ``Event.query()`` says the copy is still running (what
  :func:`tidal_kv.streams.wait` does);
- ``link<N>`` (one per ``--link-mb N``): N MB in one copy at the start of the step, nothing waits for it.
  It asks whether the link's traffic alone slows the host that issues the step: what NF4 pages move per
  step is about 600 MB at 32k x 1 and 1,130 MB at 4k x 16 (``--link-mb 600 1130``).

``tidal-resident`` and ``tidal`` (TidalCache with no / half the layers offloaded) run in the same rounds.
Each line: the median step and the median of the round-by-round ratios to DynamicCache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MODES = ("big", "copies", "waits", "query")


class Traffic:
    """A forward pre-hook that issues the page traffic of one variant at every other attention layer."""

    def __init__(self, shape: tuple[int, ...], device: str, link_mb: tuple[int, ...] = ()) -> None:
        import torch

        from tidal_arena import RowCopy

        cuda = device == "cuda"
        host = torch.empty(shape, dtype=torch.bfloat16)
        host = host.pin_memory() if cuda else host
        slots = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(2)]
        self.copies = [RowCopy(s, host, 3) for s in slots]  # [2, B, H, T, D] host rows -> a device slot
        n_off = 16  # the offloaded layers of the decode8b stack (half of 32)
        big_host = torch.empty((n_off, *shape), dtype=torch.bfloat16)
        big_host = big_host.pin_memory() if cuda else big_host
        big = torch.empty((n_off, *shape), dtype=torch.bfloat16, device=device)
        self.big = RowCopy(big, big_host, 1)  # one step's pages in one copy
        self.link = {}  # "link<N>" -> a copy of N MB, rows of 1 MiB
        for mb in link_mb:
            rows = (mb * 10**6) >> 20
            src = torch.empty(rows, 1 << 20, dtype=torch.uint8)
            dst = torch.empty(rows, 1 << 20, dtype=torch.uint8, device=device)
            self.link[f"link{mb}"] = RowCopy(dst, src.pin_memory() if cuda else src, 1)
        self.side = torch.cuda.Stream() if cuda else None  # why: the gathers' own stream, as TidalCache's
        self.done = [torch.cuda.Event() for _ in range(2)] if cuda else None  # copy i finished
        self.mode: str | None = None
        self.issued = self.waits = 0

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.mode is None or self.side is None:
            return
        if self.mode == "big" or self.mode in self.link:
            if module.layer_idx == 0:
                self.link.get(self.mode, self.big)(self.side)  # why: on the side stream, as a gather's copies
            return
        if module.layer_idx % 2 == 0:
            return
        import torch

        i = self.issued = self.issued + 1
        self.copies[i % 2](self.side)
        if self.mode == "copies":
            return
        self.done[i % 2].record(self.side)
        before = self.done[(i - 1) % 2]  # the copy issued at the previous odd layer
        if self.mode == "waits" or not before.query():
            self.waits += 1
            # why: what the attention of that copy's layer would need before reading it
            torch.cuda.current_stream().wait_event(before)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=60, help="timed rounds")
    ap.add_argument(
        "--link-mb",
        type=int,
        nargs="*",
        default=[],
        help="also time steps under one copy of this many MB each",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 256-token context")
    args = ap.parse_args(argv)
    import engines  # noqa: F401 - puts packages/*/src on the path
    import torch
    from decode import model_config
    from decode_worker import build_model, fill, make_cache, sdpa_backends, step

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    ctx, page = (256, 16) if args.smoke else (args.context, 256)
    model = build_model(model_config(args.smoke), device, torch.float32 if args.smoke else torch.bfloat16)
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    traffic = Traffic((2, 1, heads, ctx, dim), device, tuple(args.link_mb))
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(traffic, with_kwargs=True)
    modes = (*MODES, *traffic.link)
    names = ["dynamic", *(f"dynamic+{m}" for m in modes), "tidal-resident", "tidal"]
    caches, toks = {}, {}
    for e in names:
        caches[e] = make_cache(e.split("+")[0], model, ctx + 1, page, 2)
        fill(caches[e], model, 1, ctx - args.steps - 5, seed=1)
        toks[e] = torch.randint(1, cfg.vocab_size, (1, 1), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {e: [] for e in names}
    with torch.no_grad(), sdpa_backends("no-cudnn"):
        for r in range(args.steps + 3):  # 3 untimed rounds; the order rotates round by round
            for e in names[r % len(names) :] + names[: r % len(names)]:
                traffic.mode = e.split("+")[1] if "+" in e else None
                sync()
                t = time.perf_counter()
                toks[e] = step(model, caches[e], toks[e])
                sync()
                traffic.mode = None
                if r >= 3:
                    times[e].append(time.perf_counter() - t)
    print(f"{ctx} tokens x 1, {device}; ratio = DynamicCache step / this step, median of rounds")
    for e in names:
        ratios = [a / b for a, b in zip(times["dynamic"], times[e], strict=True)]
        print(
            f"{e:16s} {1e3 * statistics.median(times[e]):7.2f} ms  x dynamic {statistics.median(ratios):.3f}"
        )
    print(f"waits inserted: {traffic.waits} (query and waits variants, {traffic.issued} copies in all)")


if __name__ == "__main__":
    main()
