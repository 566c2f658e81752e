"""Fine-tune a Hugging Face causal LM with TidalTrainer: the Trainer loop, unchanged, one class name away.

    python examples/hf_finetune.py                                   # tiny byte-level model, stdlib text
    python examples/hf_finetune.py --model /path/to/model --lora --quantize nf4 --vram-budget 24GiB

The text is the Python standard library's own source (present everywhere, nothing downloaded). Without
``--model`` a small byte-level Llama-shaped model (vocabulary 256) is trained from scratch; with it the
model's tokenizer is used. Held-out perplexity is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch

import tidal_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_hf_common.py, also when loaded by path
from _hf_common import LORA_TARGETS, LabeledIds, quantize_option, tidal_options, training_args


def stdlib_text(max_bytes: int, held_out: float = 0.1) -> tuple[str, str]:
    """Train and held-out text from the standard library's ``.py`` files (split by file, sorted names)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text, total = [], 0
    for f in files:
        s = f.read_text(errors="ignore")
        text.append(s)
        total += len(s)
        if total >= max_bytes:
            break
    cut = max(1, int(len(text) * (1 - held_out)))
    return "\n".join(text[:cut]), "\n".join(text[cut:])


class Chunks(LabeledIds):
    """Fixed-length windows of a token stream (labels = inputs)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        n = len(ids) // seq_len
        super().__init__(ids[: n * seq_len].view(n, seq_len))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder with config.json, tokenizer and *.safetensors")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    p.add_argument(
        "--quantize", default="none", help="frozen base storage with --lora: nf4 | int8 | fp8 | none"
    )
    p.add_argument("--vram-budget", default=None)
    p.add_argument("--max-bytes", type=int, default=400_000, help="bytes of stdlib text to use")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--output-dir", default="/tmp/tidal-hf-finetune")
    return p.parse_args(argv)


@torch.no_grad()
def perplexity(model: torch.nn.Module, data: Chunks, batch: int) -> float:
    model.eval()
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for i in range(0, len(data), batch):
        ids = data.ids[i : i + batch].to(device)
        total += tidal_hf.causal_lm_loss(model, ids, ids).item() * len(ids)
        n += len(ids)
    model.train()
    return math.exp(total / max(n, 1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; returns (and prints as JSON) held-out perplexity before and after."""
    a = parse(argv)
    quantize = quantize_option(a.quantize)
    train_text, test_text = stdlib_text(a.max_bytes)
    cuda = torch.cuda.is_available()
    if a.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
        encode = lambda s: torch.tensor(tok(s)["input_ids"])  # noqa: E731
        model = tidal_hf.load_model(a.model, quantize=quantize if a.lora else None)
    else:
        encode = lambda s: torch.tensor(list(s.encode("utf-8")))  # noqa: E731
        config = tidal_hf.tiny_config(
            "llama",
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=256,
            max_position_embeddings=max(128, a.seq_len),
        )
        model = tidal_hf.load_model(
            config,
            random_weights=True,
            quantize=quantize if a.lora else None,
            dtype=torch.bfloat16 if cuda else torch.float32,
        )
    if a.lora:
        from peft import get_peft_model

        model = get_peft_model(model, tidal_hf.lora_config(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    train, test = Chunks(encode(train_text), a.seq_len), Chunks(encode(test_text), a.seq_len)
    before = perplexity(model, test, a.batch_size)
    args = training_args(
        a.output_dir,
        a.batch_size,
        a.steps,
        a.lr,
        logging_steps=10,
        gradient_accumulation_steps=a.grad_accum,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, a.steps // 10),
        max_grad_norm=1.0,
    )
    trainer = tidal_hf.TidalTrainer(
        model=model, args=args, train_dataset=train, tidal=tidal_options(a.vram_budget)
    )
    trainer.train()
    trainer.tidal_optimizer.synchronize()
    after = perplexity(model, test, a.batch_size)
    out = {"perplexity_before": before, "perplexity_after": after, "train_windows": len(train)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
