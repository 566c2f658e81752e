"""DeepSpeed ZeRO-Offload in one process: ZeRO-2 (optimizer on the CPU) and ZeRO-3 (parameters too).

No launcher: the single-rank environment (``MASTER_ADDR/PORT``, ``RANK=0``, ``WORLD_SIZE=1``,
``LOCAL_RANK=0``) is set here and ``deepspeed.initialize`` gets a config dict. bf16 on, the optimizer is
DeepSpeed's CPU AdamW (its C++ op compiles at first use, about a minute). ZeRO-2 keeps the bf16 weights
on the device (the model is built there, as ``initialize`` would move it); ZeRO-3 builds the model
inside ``deepspeed.zero.Init`` so every weight is partitioned to pinned host memory as it is created,
then fills each one with the shared seeded values through ``GatheredParameters``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from engines import RunContext
from engines.common import NotApplicable, add_lora, build_meta_model, fill_, materialize
from engines.scenarios import hf_config


def version() -> str:
    """DeepSpeed's version."""
    import deepspeed

    return f"deepspeed {deepspeed.__version__}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """The environment a launcher would set for rank 0 of 1."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def ds_config(stage: int, batch: int, lr: float) -> dict[str, Any]:
    """The DeepSpeed config dict: bf16, CPU AdamW (no weight decay), ZeRO ``stage`` with CPU offload."""
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
        },
        "zero_optimization": zero,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _build_zero3(ctx: RunContext, cfg: dict[str, Any]) -> torch.nn.Module:
    """The model built inside ``zero.Init`` (weights partitioned to host as created), then seeded."""
    import deepspeed
    import transformers

    with deepspeed.zero.Init(
        config_dict_or_path=cfg, remote_device="cpu", pin_memory=True, dtype=torch.bfloat16
    ):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(ctx.scenario), dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        # one weight at a time is gathered to the device, filled, and partitioned back
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            fill_(name, p.data, ctx.seed)
    return model


def setup(ctx: RunContext, stage: int) -> Callable[[], float]:
    """``deepspeed.initialize`` with the stage's config; the step is ``engine.backward`` + ``engine.step``."""
    import deepspeed

    sc = ctx.scenario
    if ctx.device.type != "cuda":
        raise NotApplicable("DeepSpeed ZeRO-Offload runs on CUDA")
    single_rank_env()
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    cfg = ds_config(stage, sc.batch, ctx.lr)
    if stage == 3:
        model = _build_zero3(ctx, cfg)
    else:  # ZeRO-2 keeps every bf16 weight on the device: build it there (what initialize() would do)
        model = build_meta_model(sc, torch.bfloat16)
        materialize(model, "device", device=ctx.device, seed=ctx.seed)
    model.config.use_cache = False
    if sc.mode == "lora":
        model = add_lora(model, ctx.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    ids = ctx.batch()  # [B, T]

    def step() -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step
