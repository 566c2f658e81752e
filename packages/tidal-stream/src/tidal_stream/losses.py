"""Losses over a language-model head that never build the full ``[tokens, vocab]`` logits.

The tokens are cut into chunks of ``chunk_size``; each chunk's logits (``hidden_chunk @ weight.T``, in
the hidden dtype, then upcast to fp32 exactly as Hugging Face models do before their loss) live only
while that chunk is processed. A custom autograd Function saves the hidden states and the head weight —
not the logits — and recomputes each chunk's logits in backward, so peak extra memory is one chunk of
logits (``chunk_size × vocab × 4`` bytes) instead of all of them.

- :func:`chunked_cross_entropy` — equals ``F.cross_entropy(logits.float(), labels)`` (loss and
  gradients) up to the order of the fp32 sums across chunks.
- :func:`sequence_logprobs` — per-sequence sum (or mean) of the label tokens' log-probabilities, the
  input of preference losses.
- :func:`dpo_loss` — the sigmoid DPO loss (with optional label smoothing, i.e. conservative DPO) on
  such log-probabilities.

Labels are aligned with the hidden positions: for next-token prediction pass ``hidden[:, :-1]`` and
``labels[:, 1:]``. Positions labelled ``ignore_index`` contribute nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from tidal_stream.errors import StreamError

__all__ = ["LossError", "chunked_cross_entropy", "dpo_loss", "sequence_logprobs"]


class LossError(StreamError, ValueError):
    """A chunked-loss argument is invalid."""


def _check_chunk(chunk_size: Any, fn: str) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise LossError(
            f"{fn}: chunk_size={chunk_size!r} is invalid; accepted: an int > 0. "
            "Fix: pass e.g. 1024 (logits of one chunk take chunk_size × vocab × 4 bytes)."
        )


def _check_shapes(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, fn: str) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise LossError(
            f"{fn}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match; accepted: "
            "hidden [..., D] and weight [V, D]. Fix: pass the lm head's weight (vocab rows)."
        )
    if labels.shape != hidden.shape[:-1]:
        raise LossError(
            f"{fn}: labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}; accepted: "
            "labels with hidden's leading shape. Fix: shift first (hidden[:, :-1], labels[:, 1:])."
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise LossError(f"{fn}: labels dtype {labels.dtype} is invalid; accepted: int64 or int32.")


class _TokenLogprobs(torch.autograd.Function):
    """``lp[n] = log_softmax(h[n] @ W.T + b)[labels[n]]`` (0 at ignored positions), chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # [N, D]
        weight: torch.Tensor,  # [V, D]
        bias: torch.Tensor | None,  # [V]
        labels: torch.Tensor,  # [N]
        chunk_size: int,
        ignore_index: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # [N]
        valid = labels != ignore_index  # [N]
        safe = torch.where(valid, labels, torch.zeros_like(labels)).long()  # [N]
        with torch.profiler.record_function("tidal::loss.chunked_forward"):
            for s in range(0, n, chunk_size):
                e = min(n, s + chunk_size)
                logits = F.linear(hidden[s:e], weight, bias).float()  # [C, V]
                lse = torch.logsumexp(logits, dim=-1)  # [C]
                tgt = logits.gather(1, safe[s:e, None]).squeeze(1)  # [C]
                out[s:e] = torch.where(valid[s:e], tgt - lse, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, safe, valid)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # grad_out: [N]
        hidden, weight, bias, safe, valid = ctx.saved_tensors
        n, cs = hidden.shape[0], ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, D]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        g_all = torch.where(valid, grad_out.float(), torch.zeros_like(grad_out, dtype=torch.float32))  # [N]
        with torch.profiler.record_function("tidal::loss.chunked_backward"):
            for s in range(0, n, cs):
                e = min(n, s + cs)
                logits = F.linear(hidden[s:e], weight, bias).float()  # [C, V] recomputed
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C, 1]
                # d lp / d logits = onehot(label) - softmax(logits); softmax built in place (one [C, V] fp32)
                g = logits.sub_(lse).exp_().mul_(-g_all[s:e, None])  # [C, V]
                g.scatter_add_(1, safe[s:e, None], g_all[s:e, None])
                g_lowp = g.to(hidden.dtype)  # the .float() upcast's backward
                if grad_h is not None:
                    grad_h[s:e] = g_lowp @ weight  # [C, D]
                if grad_w is not None:
                    # add_ widens the bf16 product element by element: no [V, D] fp32 temporary
                    grad_w.add_(g_lowp.t() @ hidden[s:e])  # [V, D]
                if grad_b is not None:
                    grad_b += g_lowp.float().sum(0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def _token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_size: int,
    ignore_index: int,
) -> torch.Tensor:
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    flat_l = labels.reshape(-1)  # [N]
    lp = _TokenLogprobs.apply(flat_h, weight, bias, flat_l, chunk_size, ignore_index)  # [N]
    return lp.view(labels.shape)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without the full logits.

    Args:
        hidden: Final hidden states ``[..., D]`` (any float dtype).
        weight: LM head weight ``[V, D]``.
        labels: Target ids ``[...]`` aligned with ``hidden`` (already shifted).
        bias: Optional head bias ``[V]``.
        chunk_size: Tokens per chunk.
        ignore_index: Label value that contributes nothing (and is not counted by ``"mean"``).
        reduction: ``"mean"`` over non-ignored tokens (as ``F.cross_entropy``), ``"sum"``, or ``"none"``
            (per-token losses, 0 at ignored positions).

    Returns:
        fp32 loss: a scalar, or ``labels``-shaped for ``"none"``. A mean over zero valid tokens is NaN,
        as in ``F.cross_entropy``.
    """
    fn = "chunked_cross_entropy"
    _check_chunk(chunk_size, fn)
    _check_shapes(hidden, weight, labels, fn)
    if reduction not in ("mean", "sum", "none"):
        raise LossError(
            f"{fn}: reduction={reduction!r} is invalid; accepted: 'mean', 'sum', 'none'. Fix: pick one."
        )
    nll = -_token_logprobs(hidden, weight, labels, bias, chunk_size, ignore_index)  # [...]
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()


def sequence_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    average: bool = False,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum (or mean) over each sequence of ``log p(label)`` under ``hidden @ lm_head_weight.T``.

    Args:
        hidden: ``[B, T, D]`` hidden states (positions already aligned with ``labels``).
        lm_head_weight: ``[V, D]``.
        labels: ``[B, T]``; ``ignore_index`` marks prompt/padding positions.
        chunk_size: Tokens per chunk.
        average: Mean over the valid tokens instead of the sum (0 valid tokens gives NaN).
        bias: Optional head bias ``[V]``.
        ignore_index: Label value to skip.

    Returns:
        ``[B]`` fp32 log-probabilities.
    """
    fn = "sequence_logprobs"
    _check_chunk(chunk_size, fn)
    _check_shapes(hidden, lm_head_weight, labels, fn)
    if hidden.dim() != 3:
        raise LossError(
            f"{fn}: hidden {tuple(hidden.shape)} is invalid; accepted: [B, T, D]. Fix: add the batch dim."
        )
    lp = _token_logprobs(hidden, lm_head_weight, labels, bias, chunk_size, ignore_index)  # [B, T]
    total = lp.sum(-1)  # [B]
    if average:
        return total / (labels != ignore_index).sum(-1)
    return total


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid DPO loss on sequence log-probabilities (e.g. from :func:`sequence_logprobs`).

    ``z = beta * ((pc - pr) - (rc - rr))``; per pair ``-(1 - ε) log σ(z) - ε log σ(-z)``, ε the label
    smoothing (conservative DPO).

    Args:
        policy_chosen: ``[B]`` log-probs of the chosen answers under the policy.
        policy_rejected: ``[B]`` the rejected answers under the policy.
        ref_chosen: ``[B]`` the chosen answers under the reference model (no grad needed).
        ref_rejected: ``[B]`` the rejected answers under the reference model.
        beta: Temperature, > 0.
        label_smoothing: ε in ``[0, 0.5)``.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: the mean loss, and ``beta * (policy - ref)``
        per pair for each side (detached).
    """
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta > 0:
        raise LossError(f"dpo_loss: beta={beta!r} is invalid; accepted: a float > 0. Fix: pass e.g. 0.1.")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 0.5:
        raise LossError(
            f"dpo_loss: label_smoothing={label_smoothing!r} is invalid; accepted: a float in [0, 0.5). "
            "Fix: pass 0.0 for standard DPO."
        )
    shapes = {t.shape for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1:
        raise LossError(
            f"dpo_loss: the four log-prob tensors have shapes {sorted(tuple(s) for s in shapes)}; accepted: "
            "one shape [B] for all. Fix: pass per-pair sums from sequence_logprobs."
        )
    z = beta * ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected))  # [B]
    losses = -F.logsigmoid(z) * (1.0 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    chosen_rewards = (beta * (policy_chosen - ref_chosen)).detach()
    rejected_rewards = (beta * (policy_rejected - ref_rejected)).detach()
    return losses.mean(), chosen_rewards, rejected_rewards
