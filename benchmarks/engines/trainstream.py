"""TrainStream 0.4.1: ``trainstream.wrap(model, optimizer, device=..., quantize=...)`` on a host-resident model.

The model is filled block by block on the device and left in host RAM; ``wrap`` is given the CUDA
device, so (per its documentation) block weights stay in host RAM and its memory planner decides how
many to bring into VRAM from the free memory it sees (the filler leaves exactly the budget). The
frozen base is exact bf16 (``quantize="none"``) or NF4 (``quantize="nf4"``). TrainStream compiles its
C++/CUDA extension at first import (about 3 minutes, cached under ~/.cache/trainstream).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines import RunContext
from engines.common import (
    NotApplicable,
    adamw,
    add_lora,
    build_meta_model,
    decoder_layers,
    materialize,
    train_step,
)


def version() -> str:
    """TrainStream's version."""
    import trainstream

    return f"trainstream {trainstream.__version__}"


def setup(ctx: RunContext, quantize: str) -> Callable[[], float]:
    """Host-resident model, PEFT LoRA (or full), ``trainstream.wrap`` with a torch AdamW it converts."""
    import trainstream

    sc = ctx.scenario
    if ctx.device.type != "cuda":
        raise NotApplicable("TrainStream trains on CUDA devices only")
    model = build_meta_model(sc, torch.bfloat16)
    materialize(model, "cpu", device=ctx.device, seed=ctx.seed)
    if sc.mode == "lora":
        model = add_lora(model, ctx.seed)
    model.config.use_cache = False
    model.train()
    opt = adamw(model, ctx.lr)
    model, opt = trainstream.wrap(
        model,
        opt,
        device=ctx.device,
        blocks=list(decoder_layers(model)),
        quantize=quantize,
    )
    ids = ctx.batch()  # [B, T]
    return train_step(model, opt, ids)
