"""Which stream ``gather_stream="auto"`` puts page gathers on, case by case (see ``tidal_kv.policy``).

```bash
python3 benchmarks/kv/stream_choice.py            # the GPU machine: the decode8b shape, ~20 s
python3 benchmarks/kv/stream_choice.py --smoke    # tiny Llama on the CPU (no link to time: side stream)
```

For each (engine, context, batch) it fills a TidalCache like the decode benchmarks do, runs ``--steps``
decode steps, and prints the link bandwidth the cache measured, how often it switched streams, how many
gathers ran on the compute stream, and where the gathers are now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode, decode_worker) and benchmarks/ (engines)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CASES = (("tidal", 4096, 1), ("tidal-nf4", 4096, 1), ("tidal-nf4", 32768, 1), ("tidal-nf4", 4096, 16))


def choice(model: Any, engine: str, context: int, batch: int, steps: int, device: str) -> dict[str, Any]:
    """Run ``steps`` decode steps of one case and return the cache's stream choice and counters."""
    import torch
    from decode_worker import fill, make_cache, sdpa_backends, step

    cache = make_cache(engine, model, context + steps + 8, 256, 2)
    fill(cache, model, batch, context - steps, seed=1)
    tok = torch.randint(1, model.config.vocab_size, (batch, 1), device=device)
    with torch.no_grad(), sdpa_backends("no-cudnn"):
        for _ in range(steps):
            tok = step(model, cache, tok)
    link = cache.paged._policy._link_bps
    s = cache.stats
    return {
        "engine": engine, "context": context, "batch": batch, "link_gbps": round(link / 1e9, 1) if link else None,
        "switches": s.gather_stream_switches, "inline_gathers": s.inline_gathers,
        "stream": "compute" if cache.paged._inline else "side",
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 64-token context")
    args = ap.parse_args(argv)
    import torch
    from decode import model_config
    from decode_worker import build_model

    device = "cpu" if args.smoke else "cuda"
    model = build_model(model_config(args.smoke), device, torch.float32 if args.smoke else torch.bfloat16)
    cases = [(e, 64, b) for e, _, b in CASES[:2]] if args.smoke else CASES
    rows = []
    for engine, context, batch in cases:
        rows.append(choice(model, engine, context, batch, args.steps, device))
        print(rows[-1], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
