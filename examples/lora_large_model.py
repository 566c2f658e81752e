"""LoRA on a large model through TidalTrainer: a Qwen2.5 shape with random weights, or your own folder.

    python examples/lora_large_model.py --size 14b --quantize nf4 --vram-budget 24GiB --steps 12
    python examples/lora_large_model.py --model /path/to/Qwen2.5-7B --quantize auto

With ``--size`` the exact architecture is built with random weights (nothing downloaded; the training
data are random tokens, so the loss only shows that gradients flow). Prints the median step time after
warm-up and the device peak.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

import tidal_hf
from tidal_hf.callbacks import StepTimeCallback
from tidal_hf.shapes import QWEN25_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/_hf_common.py, also when loaded by path
from _hf_common import LORA_TARGETS, LabeledIds, quantize_option, tidal_options, training_args


class RandomTokens(LabeledIds):
    """``n`` sequences of random token ids (labels = inputs)."""

    def __init__(self, vocab: int, n: int, seq_len: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        super().__init__(torch.randint(0, vocab, (n, seq_len), generator=g))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--size", choices=sorted(QWEN25_SIZES), help="Qwen2.5 shape with random weights")
    src.add_argument("--model", help="folder with config.json and *.safetensors")
    p.add_argument("--quantize", default="auto", help="nf4 | int8 | fp8 | nvfp4 | none | auto (default auto)")
    p.add_argument("--vram-budget", default=None, help="device bytes tidal may use, e.g. 24GiB")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick tries)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--output-dir", default="/tmp/tidal-lora-large")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the measured numbers (also printed as one JSON line)."""
    from peft import get_peft_model

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    a = parse(argv)
    quantize = quantize_option(a.quantize)
    overrides = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.size:
        config = tidal_hf.qwen25_config(a.size, **overrides)
        model = tidal_hf.load_model(config, quantize=quantize, random_weights=True)
    else:
        model = tidal_hf.load_model(a.model, quantize=quantize, **overrides)
    model.config.use_cache = False
    cfg = tidal_hf.lora_config(
        r=a.rank, lora_alpha=2 * a.rank, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, cfg)
    model.print_trainable_parameters()
    args = training_args(a.output_dir, a.batch_size, a.steps, a.lr, logging_steps=1)
    timer = StepTimeCallback()
    data = RandomTokens(model.config.vocab_size, a.steps * a.batch_size, a.seq_len)
    trainer = tidal_hf.TidalTrainer(
        model=model, args=args, train_dataset=data, tidal=tidal_options(a.vram_budget), callbacks=[timer]
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {
        "model": a.size or a.model,
        "quantize": quantize,
        "vram_budget": a.vram_budget,
        "seq_len": a.seq_len,
        "batch_size": a.batch_size,
        "median_step_s": timer.median(warmup=min(3, max(0, a.steps - 1))),
        "peak_vram_gib": timer.peak_bytes / 2**30,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
