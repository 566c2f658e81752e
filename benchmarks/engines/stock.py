"""Stock PyTorch: the model on the device, PEFT LoRA or full fine-tune with fused AdamW, HF loss.

Full fine-tune keeps fp32 master weights and computes in bf16 under autocast (the usual mixed-precision
recipe); LoRA keeps the bf16 base frozen with PEFT's fp32 adapters. Decode runs a prefill of the prompt
and then times one generated token per step with transformers' own KV cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from engines import RunContext
from engines.common import adamw, add_lora, build_meta_model, cache_kwargs, materialize, train_step


def version() -> str:
    """torch and transformers versions."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def setup(ctx: RunContext) -> Callable[[], float]:
    """Build the model on the device and return the step function."""
    sc = ctx.scenario
    full = sc.mode == "full"
    model = build_meta_model(sc, torch.float32 if full else torch.bfloat16)
    materialize(model, "device", device=ctx.device, seed=ctx.seed)
    if sc.mode == "lora":
        model = add_lora(model, ctx.seed)
    ids = ctx.batch()  # [B, T]
    if sc.mode == "decode":
        return _decode(model, ids)
    model.train()
    opt = adamw(model, ctx.lr, fused=ctx.device.type == "cuda")
    return train_step(model, opt, ids, lambda: autocast(ctx.device, full))


def _decode(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    """Prefill ``ids`` once, then each step decodes one token greedily; returns its negative log-prob."""
    from transformers import DynamicCache

    model.eval()
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}  # [B, 1]

    # positions follow from the cache's length (newer transformers 5.x dropped ``cache_position``)
    @torch.inference_mode()
    def step() -> float:
        out = model(input_ids=state["next"], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        logp = out.logits[:, -1].float().log_softmax(-1)  # [B, V]
        state["next"] = logp.argmax(-1, keepdim=True)
        return -logp.max(-1).values.mean().item()

    return step
