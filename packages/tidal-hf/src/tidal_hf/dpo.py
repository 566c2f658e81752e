"""DPO with one model: the policy is the model with its LoRA adapters, the reference the same model with
them disabled. ``dpo_loss`` is tidal-stream's (sigmoid DPO with label smoothing), re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tidal_hf.errors import bad_option
from tidal_hf.loss import causal_lm_logprobs
from tidal_stream import dpo_loss

__all__ = ["dpo_loss", "reference_logprobs"]

log = logging.getLogger(__name__)


def _adapters_off(model: nn.Module) -> contextlib.AbstractContextManager:
    disable = getattr(model, "disable_adapter", None)
    if callable(disable):
        return disable()
    log.info(
        "reference_logprobs: %s has no adapters; the reference is its current weights", type(model).__name__
    )
    return contextlib.nullcontext()


@torch.no_grad()
def reference_logprobs(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    chunk_size: int = 1024,
    average: bool = False,
) -> torch.Tensor:
    """Log-probabilities of each batch's labelled tokens under the reference (adapters disabled).

    The model runs in eval mode without gradients (its training mode is restored after); a PEFT model's
    adapters are disabled (``model.disable_adapter()``), so the frozen base is the reference and no second
    model is needed. A model without adapters is its own reference (its current weights).

    Args:
        model: the policy (a PEFT model, or a plain causal LM).
        batches: mappings with ``input_ids`` and ``labels`` ``[B, T]`` (labels as for the model's loss) and
            optionally ``attention_mask``.
        chunk_size: tokens per logits chunk.
        average: mean over counted tokens instead of the sum.

    Returns:
        ``[sum of B]`` float32 CPU tensor, the batches' sequences in order.
    """
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    try:
        with _adapters_off(model):
            for i, batch in enumerate(batches):
                if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
                    raise bad_option(
                        "reference_logprobs",
                        f"batches[{i}]",
                        type(batch).__name__,
                        "mappings with 'input_ids' and 'labels' (and optionally 'attention_mask')",
                    )
                extra: dict[str, Any] = {}
                if batch.get("attention_mask") is not None:
                    extra["attention_mask"] = batch["attention_mask"]
                lp = causal_lm_logprobs(
                    model,
                    batch["input_ids"],
                    batch["labels"],
                    chunk_size=chunk_size,
                    average=average,
                    **extra,
                )
                out.append(lp.float().cpu())
    finally:
        model.train(was_training)
    if not out:
        raise bad_option("reference_logprobs", "batches", "an empty iterable", "at least one batch")
    return torch.cat(out)
