"""What quantized host pages cost a decode: next-byte loss of a trained byte LM decoding through TidalCache.

```bash
python3 benchmarks/kv/page_quality.py --minutes 4      # the CPU (or a GPU): trains ~4 min, evaluates ~1 min
python3 benchmarks/kv/page_quality.py --smoke          # CPU, seconds: checks the script, not quality
```

No model can be downloaded, so a Llama-style byte LM is trained first on the standard library's source
(``benchmarks/quality.py``'s corpus, held-out split and training loop; head_dim 64, so NF4 pages hold whole
32-element blocks). Then for held-out windows each engine prefills ``--context`` bytes and decodes the next
``--decode`` bytes teacher-forced: the true byte goes in, the log-probability of the following true byte is
recorded. Engines: DynamicCache, and TidalCache with half the layers' K/V on the host in each page format
(native, fp8, nf4), with small pages (``--page-tokens``) so nearly all the context sits in host pages.

Per engine: bits per byte over the decoded bytes, the difference to DynamicCache, how often the greedy byte
equals DynamicCache's, and the largest logit difference. Native pages must match DynamicCache exactly on the
CPU; the quantized formats show what their rounding of the past K/V costs the next-token distribution.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (quality: corpus, training)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import quality  # noqa: E402 - benchmarks/quality.py: corpus, training loop, reference shape
import torch  # noqa: E402

ENGINES = ("dynamic", "tidal", "tidal-fp8", "tidal-nf4")
#: The byte LM: ``quality.py``'s, 4 layers of 256 with head_dim 64 (4 heads) and grouped K/V (2 heads), as in
#: the models users decode, and positions for a whole window.
MODEL = dict(
    quality.MODEL,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
SMOKE_MODEL = dict(
    MODEL, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1
)


def make_cache(engine: str, model: Any, max_tokens: int, page_tokens: int) -> Any:
    """DynamicCache, or TidalCache with half the layers offloaded in the engine's page format."""
    import transformers

    if engine == "dynamic":
        return transformers.DynamicCache()
    from decode_worker import STORAGE

    from tidal_hf.cache import TidalCache

    n = model.config.num_hidden_layers
    storage = STORAGE.get(engine, "native")
    return TidalCache(model, max_tokens, resident_layers=n // 2, page_tokens=page_tokens, storage=storage)


@torch.no_grad()
def decode_window(model: Any, cache: Any, window: torch.Tensor, context: int) -> torch.Tensor:
    """Prefill ``window[:context]``, then feed each next true byte: ``[len(window) - context, 256]`` logits
    (fp32), row ``i`` predicting ``window[context + i]``."""
    from decode_worker import cache_kw

    kw = {cache_kw(model): cache, "use_cache": True}
    x = window[None].to(next(model.parameters()).device)  # [1, T]
    out = [model(input_ids=x[:, :context], logits_to_keep=1, **kw).logits[0, -1].float()]
    for t in range(context, x.shape[1] - 1):
        out.append(model(input_ids=x[:, t : t + 1], **kw).logits[0, -1].float())
    return torch.stack(out)  # [decode, 256]


def evaluate(model: Any, held: torch.Tensor, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every engine over the same held-out windows; one row per engine."""
    seq = args.context + args.decode
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, held.numel() - seq, (args.windows,), generator=gen).tolist()
    logits: dict[str, list[torch.Tensor]] = {e: [] for e in ENGINES}
    for s in starts:
        window = held[s : s + seq]
        for e in ENGINES:
            cache = make_cache(e, model, seq, args.page_tokens)
            logits[e].append(decode_window(model, cache, window, args.context).cpu())
    targets = torch.cat([held[s + args.context : s + seq] for s in starts])  # the bytes each row predicts
    ref = torch.cat(logits["dynamic"])
    rows = []
    for e in ENGINES:
        got = torch.cat(logits[e])
        nll = torch.nn.functional.cross_entropy(got, targets, reduction="mean").item()
        rows.append(
            {
                "engine": e,
                "bits_per_byte": nll / math.log(2),
                "greedy_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                "max_abs_logit_diff": (got - ref).abs().max().item(),
                "decoded_bytes": targets.numel(),
            }
        )
    base = rows[0]["bits_per_byte"]
    for r in rows:
        r["delta_bits_per_byte"] = r["bits_per_byte"] - base
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown."""
    lines = [
        "| engine | bits / byte | Δ vs DynamicCache | greedy byte = DynamicCache's | max abs Δ logit |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['bits_per_byte']:.4f} | {r['delta_bits_per_byte']:+.4f} | "
            f"{r['greedy_agreement']:.4f} | {r['max_abs_logit_diff']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="training time")
    ap.add_argument("--context", type=int, default=384, help="prefilled bytes per window")
    ap.add_argument("--decode", type=int, default=128, help="teacher-forced decode steps per window")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few files, seconds of training")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    import engines  # noqa: F401 - puts packages/*/src on the path
    from decode_worker import report

    if args.smoke:
        args.minutes, args.context, args.decode, args.windows = 0.05, 40, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    train_data, held = quality.load_corpus(quality.stdlib_files(60 if args.smoke else None))
    model = quality.build(SMOKE_MODEL if args.smoke else MODEL, device)
    fit = quality.train(
        model, train_data, lr=2e-3, seconds=args.minutes * 60, max_steps=10**9, batch=16, seq=256,
        device=device, seed=args.seed,
    )  # fmt: skip
    print(json.dumps({"event": "trained", **fit}), flush=True)
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    model.config.use_cache = True
    rows = evaluate(model, held, args)
    for r in rows:
        print("RESULT " + json.dumps({**r, "device": device.type, "train_steps": fit["steps"]}), flush=True)
    return report(rows, table(rows), args.json)


if __name__ == "__main__":
    main()
