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
from typing import Any

import torch

import tidal_hf
from tidal_hf.callbacks import StepTimeCallback
from tidal_hf.shapes import QWEN25_SIZES


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of random token ids (labels = inputs)."""

    def __init__(self, vocab: int, n: int, seq_len: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


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
    from transformers import TrainingArguments

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    a = parse(argv)
    quantize = None if a.quantize.lower() == "none" else a.quantize.lower()
    overrides = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.size:
        config = tidal_hf.qwen25_config(a.size, **overrides)
        model = tidal_hf.load_model(config, quantize=quantize, random_weights=True)
    else:
        model = tidal_hf.load_model(a.model, quantize=quantize, **overrides)
    model.config.use_cache = False
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = tidal_hf.lora_config(r=a.rank, lora_alpha=2 * a.rank, target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    model.print_trainable_parameters()
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.batch_size,
        max_steps=a.steps,
        learning_rate=a.lr,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim="adamw_torch",
        disable_tqdm=True,
    )
    timer = StepTimeCallback()
    data = RandomTokens(model.config.vocab_size, a.steps * a.batch_size, a.seq_len)
    tidal = {"vram_budget": a.vram_budget} if a.vram_budget else {}
    trainer = tidal_hf.TidalTrainer(
        model=model, args=args, train_dataset=data, tidal=tidal, callbacks=[timer]
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
