"""decode8b's engines through transformers' own ``model.generate()``, paired round by round: the decode step a user
of each cache sees.

```bash
python3 benchmarks/kv/generate_rounds.py --context 4096 32768 --engines dynamic,tidal,tidal-nf4   # GPU machine
python3 benchmarks/kv/generate_rounds.py --smoke                                   # tiny Llama on the CPU
```

``decode.py`` and ``interleaved.py`` time single forward calls and end each with a device-wide synchronize.
``generate()`` waits for less: each step ends when its stopping check reads the new tokens on the host, which
waits for the compute stream only, so a TidalCache gather already queued for the next step (on its side
stream) carries on into that step, as it does for a user. Here each round prefills a random prompt of
``context`` tokens and generates ``--new-tokens`` greedy tokens with every engine in turn (the order rotated
round by round); a logits processor stamps the host clock at each step, and the time between stamps is the
step as ``generate()`` runs it, sampling and stopping checks included. Per engine and round: the median step
after ``--skip`` steps; the ratio to DynamicCache's in the same round, with a 95 % bootstrap interval over
rounds (``interleaved.paired_ratio``).

One JSON line per engine and context on stdout (``RESULT {...}``) and a table.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from decode_worker import SDPA_BACKENDS, cache_kw, report  # noqa: E402
from interleaved import ratio_cells, run_contexts, step_stats  # noqa: E402


def step_times(model: Any, cache: Any, prompt: Any, new_tokens: int) -> list[float]:
    """Seconds between consecutive decode steps of one greedy ``model.generate()`` over ``cache``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())  # after each forward is issued, before its token is read
            return scores

    model.generate(
        prompt,
        **{cache_kw(model): cache},
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # the same step count for every engine
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([Stamp()]),
    )
    return [b - a for a, b in itertools.pairwise(stamps)]


def run_context(model: Any, engines: list[str], ctx: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.rounds`` rounds of one ``generate()`` per engine at ``ctx`` prompt tokens; one row per engine."""
    import torch
    from decode_worker import make_cache, release

    cuda = model.device.type == "cuda"
    max_tokens = ctx + args.new_tokens + 1
    # TidalCache engines keep their cache (and its pinned pages) across rounds and reset it; the others are new
    kept = {
        e: make_cache(e, model, max_tokens, args.page_tokens, args.slots) for e in engines if "tidal" in e
    }
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, ctx), device=model.device)
    steps: dict[str, list[float]] = {e: [] for e in engines}
    per_round: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(args.rounds + 1):  # round 0 warms every engine up and is not kept
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            if e in kept:  # not `kept.get(e) or ...`: an empty cache may be falsy (len 0)
                cache = kept[e]
                cache.reset()
            else:
                cache = make_cache(e, model, max_tokens, args.page_tokens, args.slots)
            if cuda:
                torch.cuda.synchronize()  # why: each generate() starts on an idle device, whatever ran before
            times = step_times(model, cache, prompt, args.new_tokens)[args.skip :]
            if r:
                steps[e] += times
                per_round[e].append(statistics.median(times))
            del cache
    rounds = SimpleNamespace(wall=per_round)  # one median step per engine and round, for paired_ratio
    rows = [
        {
            "engine": e,
            "context": ctx,
            "batch": args.batch,
            "rounds": args.rounds,
            **step_stats(steps, rounds, e, args.batch),
        }
        for e in engines
    ]
    kept.clear()
    release(cuda)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| engine | context | batch | ms/step (median) | min-max ms | tokens/s | x dynamic, all steps "
        "| x dynamic, round by round [95 % CI] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x, paired = ratio_cells(r, digits=3)
        lines.append(
            f"| {r['engine']} | {r['context']} | {r['batch']} | {r['ms_per_step']:.1f} | "
            f"{r['ms_min']:.1f}-{r['ms_max']:.1f} | {r['tokens_per_s']:.1f} | {x} | {paired} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="dynamic,tidal,tidal-nf4", help="comma-separated (decode.py's)")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (one generate() per engine each)")
    ap.add_argument("--new-tokens", type=int, default=40, help="tokens each generate() makes")
    ap.add_argument("--skip", type=int, default=4, help="first steps of each generate() left out")
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--sdpa", choices=list(SDPA_BACKENDS), default="no-cudnn", help="as interleaved.py's")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 64-token prompt")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if "dynamic" not in args.engines.split(","):
        ap.error(f"--engines={args.engines!r} must include dynamic: every ratio is to it")
    if args.smoke:
        args.context, args.page_tokens, args.new_tokens, args.skip, args.rounds = [64], 16, 12, 2, 2
    rows = run_contexts(args, run_context)
    return report(rows, table(rows), args.json)


if __name__ == "__main__":
    main()
