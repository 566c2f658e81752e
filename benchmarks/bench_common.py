"""What the stand-alone benchmark scripts (``stream/``, ``distributed/``) share: device-synchronized timing,
the Markdown table of their result rows, random weights (a stack of blocks, or a Qwen2-shaped model and the
command-line options of its shape).

A script reaches it by putting ``benchmarks/`` on ``sys.path`` (it is the parent of the script's folder)::

    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from bench_common import sync, time_calls  # noqa: E402

(The comparison harness, ``compare.py`` and ``engines/``, has its own per-engine steps in
``engines/common.py``.)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn


def sync(device: torch.device) -> None:
    """Wait for the device's queued work before reading a clock (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, repeat: int, warmup: int = 0) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn``, each between device synchronizations, after ``warmup`` calls.

    Args:
        fn: the work to time (no arguments).
        device: the device it queues work on (synchronized before and after every timed call).
        repeat: how many calls are timed.
        warmup: calls made first, untimed.

    Returns:
        The timed calls' wall seconds, in order.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def markdown_table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """A Markdown table of ``rows``, one column per key in ``cols`` (an empty cell where a row lacks it)."""
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


@torch.no_grad()
def fill_random_(module: nn.Module, gen: torch.Generator | None = None) -> None:
    """Norm weights 1 and norm biases 0; every other parameter ``normal_(0, 0.02)``, in parameter order.

    Args:
        module: its parameters are overwritten in place.
        gen: the generator the values are drawn from (one on the parameters' device); None: torch's global one.
    """
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def random_blocks(
    make_block: Callable[[], nn.Module], n: int, device: torch.device, dtype: torch.dtype
) -> nn.ModuleList:
    """``n`` blocks from ``make_block``, built on the meta device, filled on ``device`` by :func:`fill_random_`
    (torch's global generator), then cast to ``dtype``."""
    with torch.device("meta"):
        blocks = nn.ModuleList(make_block() for _ in range(n))
    blocks.to_empty(device=device)
    fill_random_(blocks)
    return blocks.to(dtype)


#: The ``argparse`` destinations :func:`random_qwen2` reads (the options :func:`add_qwen2_args` adds).
QWEN2_ARGS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "seq")


def add_qwen2_args(ap: argparse.ArgumentParser, defaults: Mapping[str, int]) -> None:
    """Add ``--hidden --intermediate --layers --heads --kv-heads --vocab --seq`` (the model's shape and the
    sequence length) to ``ap``: whole numbers, with ``defaults`` (one per name in :data:`QWEN2_ARGS`).

    Raises:
        ValueError: when ``defaults`` does not name exactly the :data:`QWEN2_ARGS`.
    """
    if sorted(defaults) != sorted(QWEN2_ARGS):
        raise ValueError(
            f"add_qwen2_args(defaults=): got {sorted(defaults)}; accepted: exactly {list(QWEN2_ARGS)}"
        )
    for dest in QWEN2_ARGS:
        ap.add_argument(f"--{dest.replace('_', '-')}", type=int, default=defaults[dest])


def random_qwen2(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> nn.Module:
    """``Qwen2ForCausalLM`` of the shape in ``args``, bf16, built on the meta device and filled on ``device``.

    Weights from :func:`fill_random_` drawn from ``gen`` (a generator on ``device``), so a seed gives the
    same model on every rank and run.

    Args:
        args: the :data:`QWEN2_ARGS` (:func:`add_qwen2_args`); positions: at least 4096, at least ``seq``.
        device: where the weights live.
        gen: the generator the weights are drawn from (the caller may keep drawing from it).

    Returns:
        The model in training mode, no KV cache, SDPA attention, untied head.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
        use_cache=False,  # training: no KV cache (it would also grow during recomputation)
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device=device)
    fill_random_(model, gen)
    # non-persistent buffers (rotary inv_freq) were left uninitialised by to_empty: rebuild them (under a
    # device context: transformers 5.x dropped the rotary embedding's ``device`` argument)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model.train()
