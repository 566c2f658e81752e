"""DPO with one model: LoRA adapters are the policy, the same model with adapters off is the reference.

    python examples/dpo_lora.py                      # a tiny random Qwen2 and a synthetic preference
    python examples/dpo_lora.py --model /path/to/model --quantize nf4 --steps 200

The synthetic preference needs no data: the chosen answer repeats the prompt, the rejected one is random
tokens. The reference log-probabilities are computed once (adapters disabled, no grad); training then
raises the chosen-vs-rejected margin, which the printed reward accuracy and margin show.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import tidal_hf


def preference_pairs(
    vocab: int, n: int, prompt_len: int, answer_len: int, seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` (chosen, rejected) pairs as batches of one: chosen repeats the prompt, rejected is random."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        chosen = torch.cat([prompt, prompt[:answer_len]])
        rejected = torch.cat([prompt, torch.randint(0, vocab, (answer_len,), generator=g)])
        pair = {}
        for side, ids in (("chosen", chosen), ("rejected", rejected)):
            labels = ids.clone()
            labels[:prompt_len] = -100  # the prompt does not count
            pair[side] = {"input_ids": ids[None], "labels": labels[None]}
        pairs.append(pair)
    return pairs


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder with config.json and *.safetensors (default: tiny)")
    p.add_argument("--quantize", default="none", help="nf4 | int8 | fp8 | nvfp4 | none | auto")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--answer-len", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--rank", type=int, default=8)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; returns (and prints as JSON) the first and last loss, margin and reward accuracy."""
    from peft import get_peft_model

    a = parse(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quantize = None if a.quantize.lower() == "none" else a.quantize.lower()
    torch.manual_seed(0)
    if a.model:
        model = tidal_hf.load_model(a.model, quantize=quantize, device=device)
    else:
        config = tidal_hf.tiny_config("qwen2", hidden_size=128, intermediate_size=256, vocab_size=256)
        model = tidal_hf.load_model(
            config, quantize=quantize, random_weights=True, dtype=torch.float32, device=device
        )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        model, tidal_hf.lora_config(r=a.rank, lora_alpha=2 * a.rank, target_modules=targets)
    )
    pairs = preference_pairs(model.config.vocab_size, a.pairs, a.prompt_len, a.answer_len)
    for pair in pairs:
        for side in ("chosen", "rejected"):
            pair[side] = {k: v.to(device) for k, v in pair[side].items()}
    # the reference once, before training: the same model with its adapters off
    ref = tidal_hf.reference_logprobs(model, [p[s] for p in pairs for s in ("chosen", "rejected")])
    ref_chosen, ref_rejected = ref[0::2].to(device), ref[1::2].to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, opt = tidal_hf.wrap_hf(
        model, torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.0), max_grad_norm=1.0
    )
    model.train()
    history = []
    for step in range(a.steps):
        i = step % len(pairs)
        pair = pairs[i]
        pc = tidal_hf.causal_lm_logprobs(model, **pair["chosen"])
        pr = tidal_hf.causal_lm_logprobs(model, **pair["rejected"])
        loss, rc, rr = tidal_hf.dpo_loss(
            pc,
            pr,
            ref_chosen[i : i + 1],
            ref_rejected[i : i + 1],
            beta=a.beta,
            label_smoothing=a.label_smoothing,
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), (rc - rr).mean().item(), float((rc > rr).float().mean())))
        if step % 10 == 0 or step == a.steps - 1:
            print(f"step {step:4d}  loss {history[-1][0]:.4f}  margin {history[-1][1]:+.4f}")
    opt.synchronize()
    n = max(1, min(len(pairs), len(history) // 2))
    out = {
        "first_loss": sum(h[0] for h in history[:n]) / n,
        "last_loss": sum(h[0] for h in history[-n:]) / n,
        "last_margin": sum(h[1] for h in history[-n:]) / n,
        "last_reward_accuracy": sum(h[2] for h in history[-n:]) / n,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
