"""Causal-LM losses of Hugging Face models without the full ``[tokens, vocab]`` logits.

The model runs up to its last hidden states (its backbone, e.g. ``model.model`` of Llama or
``model.transformer`` of GPT-2); the head is then applied chunk by chunk by tidal-stream's chunked
losses. Labels are given as the model's own loss takes them: the input ids with ``-100`` where a token
does not count; position ``t`` predicts label ``t + 1`` (the shift happens here).

[Note: head] this works for heads that are a plain ``nn.Linear`` (tied or not); a LoRA-adapted or
quantized head, or a model that transforms its logits (soft-capping, a logit scale), is refused with
:class:`~tidal_hf.errors.UnsupportedModelError` rather than silently computing a different loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidal_hf.errors import UnsupportedModelError, bad_option
from tidal_hf.structure import hf_model_of
from tidal_stream import chunked_cross_entropy, sequence_logprobs

__all__ = ["causal_lm_logprobs", "causal_lm_loss", "last_hidden_states", "lm_head_of"]

IGNORE_INDEX = -100
# config attributes of models whose logits are not plain ``hidden @ W.T + b``
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


def lm_head_of(model: nn.Module) -> nn.Linear:
    """The output projection of a causal LM, checked to be a plain ``nn.Linear``.

    Raises:
        UnsupportedModelError: if the head is missing, wrapped (LoRA, quantized) or its logits transformed.
    """
    hf = hf_model_of(model)
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:
        raise UnsupportedModelError(
            f"the chunked loss needs the model's output embeddings to be a plain torch.nn.Linear; "
            f"{type(hf).__name__} has {type(head).__name__}. Fix: leave lm_head out of LoRA target_modules "
            "and of quantization, or disable the chunked loss (loss_chunk_size=None)."
        )
    config = getattr(hf, "config", None)
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value not in (None, 0, 1, 1.0, False):
            raise UnsupportedModelError(
                f"{type(hf).__name__} transforms its logits (config.{attr}={value!r}); the chunked loss computes "
                "plain hidden @ W.T + b. Fix: disable the chunked loss (loss_chunk_size=None) for this model."
            )
    return head


def _backbone(model: nn.Module) -> nn.Module:
    hf = hf_model_of(model)
    prefix = getattr(hf, "base_model_prefix", "")
    backbone = getattr(hf, prefix, None) if prefix else None
    if not isinstance(backbone, nn.Module):
        raise UnsupportedModelError(
            f"{type(hf).__name__} has no backbone attribute (base_model_prefix={prefix!r}); accepted: a "
            "transformers *ForCausalLM model. Fix: pass an AutoModelForCausalLM model."
        )
    return backbone


def last_hidden_states(model: nn.Module, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """Final hidden states ``[B, T, D]`` of a causal LM (its backbone's output; no logits computed).

    Args:
        model: a transformers causal LM, possibly inside a PEFT wrapper (adapters apply as usual).
        input_ids: ``[B, T]``.
        **inputs: other backbone inputs (``attention_mask``, ``position_ids``, ...); ``labels`` is refused.
    """
    if "labels" in inputs:
        raise bad_option("last_hidden_states", "labels", "…", "no labels (the backbone takes none)")
    inputs.setdefault("use_cache", False)
    out = _backbone(model)(input_ids=input_ids, **inputs)
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _check_labels(fn: str, input_ids: torch.Tensor, labels: torch.Tensor, chunk_size: object) -> None:
    if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise bad_option(
            fn,
            "labels",
            shape,
            f"an int tensor shaped like input_ids {tuple(input_ids.shape)}",
            "pass labels as for the model's own loss: the input ids, -100 where a token does not count",
        )
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise bad_option(fn, "chunk_size", chunk_size, "an int > 0", "e.g. 1024")


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int = 1024,
    **inputs: Any,
) -> torch.Tensor:
    """The model's causal-LM loss (as ``model(input_ids, labels=labels).loss``) without full logits.

    Args:
        model: a transformers causal LM (or a PEFT model over one).
        input_ids: ``[B, T]``.
        labels: ``[B, T]`` unshifted; ``-100`` positions do not count.
        num_items_in_batch: as transformers' loss: when given, the sum over tokens divided by it (the
            Trainer passes the token count of the whole accumulation window); else the mean.
        chunk_size: tokens per logits chunk.
        **inputs: other model inputs (``attention_mask``, ...).

    Returns:
        The fp32 scalar loss.
    """
    _check_labels("causal_lm_loss", input_ids, labels, chunk_size)
    head = lm_head_of(model)
    hidden = last_hidden_states(model, input_ids, **inputs)  # [B, T, D]
    shift_labels = labels[:, 1:].to(hidden.device)  # [B, T-1]
    with torch.profiler.record_function("tidal::hf.causal_lm_loss"):
        if num_items_in_batch is None:
            return chunked_cross_entropy(
                hidden[:, :-1], head.weight, shift_labels, bias=head.bias, chunk_size=chunk_size
            )
        total = chunked_cross_entropy(
            hidden[:, :-1], head.weight, shift_labels, bias=head.bias, chunk_size=chunk_size, reduction="sum"
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    average: bool = False,
    **inputs: Any,
) -> torch.Tensor:
    """Per-sequence log-probability of the labelled tokens, differentiable, without full logits.

    Args:
        model: a transformers causal LM (or a PEFT model over one).
        input_ids: ``[B, T]``.
        labels: ``[B, T]`` as the model's own loss takes them (``-100`` where a token does not count, e.g.
            the prompt and padding); position ``t`` predicts label ``t + 1``.
        chunk_size: tokens per logits chunk.
        average: the mean over counted tokens instead of the sum.
        **inputs: other model inputs (``attention_mask``, ...).

    Returns:
        ``[B]`` fp32 log-probabilities (sums, or means with ``average=True``).
    """
    _check_labels("causal_lm_logprobs", input_ids, labels, chunk_size)
    if not isinstance(average, bool):
        raise bad_option("causal_lm_logprobs", "average", average, "True or False")
    head = lm_head_of(model)
    hidden = last_hidden_states(model, input_ids, **inputs)  # [B, T, D]
    shift_labels = labels[:, 1:].to(hidden.device)  # [B, T-1]
    with torch.profiler.record_function("tidal::hf.causal_lm_logprobs"):
        return sequence_logprobs(
            hidden[:, :-1],
            head.weight,
            shift_labels,
            chunk_size,
            average,
            bias=head.bias,
            ignore_index=IGNORE_INDEX,
        )
