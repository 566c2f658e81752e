"""bitsandbytes NF4 QLoRA + PEFT: block linears stored as NF4 on the device, bf16 compute, LoRA on top.

Each block is filled on the device in bf16 and its linears are replaced by ``bnb.nn.Linear4bit``
(NF4, double-quantized absmax, as QLoRA does) before the next block is filled, so the bf16 model never
exists on the device at once. Embeddings, norms and the head stay bf16, as in a QLoRA load. With
``checkpointing`` the blocks recompute in backward (non-reentrant), the usual QLoRA memory setting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engines import RunContext
from engines.common import NotApplicable, adamw, add_lora, build_meta_model, materialize, train_step
from engines.scenarios import Scenario


def version() -> str:
    """bitsandbytes and peft versions."""
    import bitsandbytes
    import peft

    return f"bitsandbytes {bitsandbytes.__version__}, peft {peft.__version__}"


def quantize_block_(block: nn.Module, device: torch.device) -> int:
    """Replace every ``nn.Linear`` inside ``block`` by an NF4 ``Linear4bit`` (quantized on ``device``)."""
    import bitsandbytes as bnb

    count = 0
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            q.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", module=q
            ).to(device)
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)
            count += 1
    return count


def build_model(
    scenario: Scenario, device: torch.device, seed: int, on_block: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """The QLoRA base: each block filled in bf16 on ``device``, its linears made NF4 there, the rest bf16.

    Runs on any device bitsandbytes has a backend for (the CPU included, for tests); ``on_block`` sees
    each block right after it is quantized.
    """
    model = build_meta_model(scenario, torch.bfloat16)

    def hook(block: nn.Module) -> None:
        quantize_block_(block, device)
        if on_block is not None:
            on_block(block)

    materialize(model, "device", device=device, seed=seed, block_hook=hook)
    return model


def setup(ctx: RunContext, checkpointing: bool) -> Callable[[], float]:
    """QLoRA: NF4 base on the device, PEFT LoRA r=16 on all projections, torch AdamW on the adapters."""
    import bitsandbytes  # noqa: F401  (a missing package is a "not installed" row)

    sc = ctx.scenario
    if sc.mode != "lora":
        raise NotApplicable("QLoRA trains adapters over a frozen 4-bit base only")
    if ctx.device.type != "cuda":
        raise NotApplicable("bitsandbytes NF4 training needs CUDA")
    built: list[int] = []  # allocated bytes after each quantized block, for an out-of-memory message

    def count(_: nn.Module) -> None:
        built.append(torch.cuda.memory_allocated(ctx.device))

    try:
        model = build_model(sc, ctx.device, ctx.seed, on_block=count)
    except torch.OutOfMemoryError as exc:
        gib = [round(b / 2**30, 2) for b in built[-3:]]
        where = f"building: {len(built)} blocks quantized, GiB allocated after the last ones {gib}"
        raise torch.OutOfMemoryError(f"{exc} [{where}]") from exc
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = add_lora(model, ctx.seed)
    model.train()
    ids = ctx.batch()  # [B, T]
    opt = adamw(model, ctx.lr, fused=True)
    return train_step(model, opt, ids)
