"""The Adam/AdamW update on one tensor: torch's fused kernels, plus bf16 moments with stochastic rounding.

``torch._fused_adamw_`` / ``torch._fused_adam_`` run on CPU tensors (vectorised, multi-threaded) and on
CUDA tensors; on fp32 state they are bit-identical to ``torch.optim.AdamW(fused=True)`` on the same
device (checked in tests). torch's other paths (single-tensor, foreach) round differently in the last
bits, and the CPU and CUDA kernels need not agree bit for bit. bf16 moments are widened to fp32 in
chunks, updated by the same kernel, and narrowed back with stochastic rounding so small updates are not
systematically lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AdamHyper", "UndoCopy", "adam_update", "adam_update_many", "stochastic_round_"]

_CHUNK = 1 << 22  # elements per widened chunk of bf16 moments (16 MiB of fp32 per moment)
# elements per cache-blocked step when an undo copy is taken: the copy reads the chunk's master and moments
# into the CPU caches and the update then reads them from there (3 x 1 MiB of fp32)
_UNDO_CHUNK = 1 << 18


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one update, read from the param group at update time."""

    lr: float
    """Learning rate."""
    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Denominator epsilon."""
    weight_decay: float
    """Weight decay (decoupled for AdamW, L2 for Adam)."""
    decoupled: bool
    """True: AdamW; False: Adam (L2 added to the gradient)."""
    maximize: bool
    """Ascend instead of descend."""

    @classmethod
    def from_group(cls, group: dict) -> AdamHyper:
        """Read a torch.optim param group (lr may be a tensor, as with some schedulers)."""
        b1, b2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(group.get("decoupled_weight_decay", True)),
            maximize=bool(group.get("maximize", False)),
        )


@dataclass
class UndoCopy:
    """Buffers receiving a tensor's pre-update master and moments (1-D, as long as the tensor), and how far
    the copy got: elements ``[0, copied)`` hold the old values, the rest was not touched by the update."""

    master: torch.Tensor
    """[N] fp32: the old master."""
    exp_avg: torch.Tensor
    """[N] moment dtype: the old first moment."""
    exp_avg_sq: torch.Tensor
    """[N] moment dtype: the old second moment."""
    copied: int = 0
    """Elements copied so far (the update has not touched any element at or past it)."""

    def save(self, live: tuple[torch.Tensor, torch.Tensor, torch.Tensor], s: int, e: int) -> None:
        """Copy elements ``[s, e)`` of the live (master, exp_avg, exp_avg_sq) before they are updated."""
        for dst, src in zip((self.master, self.exp_avg, self.exp_avg_sq), live):
            dst[s:e].copy_(src[s:e])
        self.copied = e

    def restore(self, live: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write the copied elements back into the live tensors and forget them."""
        n = self.copied
        for dst, src in zip(live, (self.master, self.exp_avg, self.exp_avg_sq)):
            dst.view(-1)[:n].copy_(src[:n])
        self.copied = 0


def _fused(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    steps: list[torch.Tensor],
    h: AdamHyper,
) -> None:
    fn = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    fn(
        params,
        grads,
        m,
        v,
        [],
        steps,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        amsgrad=False,
        maximize=h.maximize,
    )


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``src`` into bf16 ``dst`` with stochastic rounding (unbiased in expectation).

    Adds uniform noise below bf16's last mantissa bit to the fp32 bit pattern, then truncates.
    """
    bits = src.view(torch.int32)  # [N] fp32 bit patterns
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=src.device, generator=generator)
    rounded = (bits + noise) & -65536  # clear the 16 low bits: exactly representable in bf16
    # non-finite values (inf/nan) must not be perturbed into other bit patterns
    rounded = torch.where(torch.isfinite(src), rounded, bits)
    dst.copy_(rounded.view(torch.float32))


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    h: AdamHyper,
    generator: torch.Generator | None = None,
    undo: UndoCopy | None = None,
) -> None:
    """One Adam(W) step on fp32 ``param`` in place; ``step`` (a 0-d fp32 tensor) is incremented first.

    Moments may be fp32 (one fused call) or bf16 (chunked widen → fused → stochastic round).
    ``undo`` receives the old ``param`` and moments chunk by chunk, each just before the chunk is updated
    (cache-blocked: the update reads what the copy just brought into the CPU caches; AdamW is
    elementwise, so the result is the same bits); its ``copied`` says how far a failed update got.
    """
    step.add_(1)
    p1, g1, m1, v1 = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))  # [N] each
    if exp_avg.dtype == torch.float32:
        if undo is None:
            _fused([param], [grad], [exp_avg], [exp_avg_sq], [step], h)
            return
        for s in range(0, p1.numel(), _UNDO_CHUNK):
            e = min(s + _UNDO_CHUNK, p1.numel())
            undo.save((p1, m1, v1), s, e)
            _fused([p1[s:e]], [g1[s:e]], [m1[s:e]], [v1[s:e]], [step], h)
        return
    for s in range(0, p1.numel(), _CHUNK):
        e = min(s + _CHUNK, p1.numel())
        if undo is not None:
            undo.save((p1, m1, v1), s, e)
        mw, vw = m1[s:e].float(), v1[s:e].float()  # [n] widened moments
        _fused([p1[s:e]], [g1[s:e]], [mw], [vw], [step], h)
        stochastic_round_(m1[s:e], mw, generator)
        stochastic_round_(v1[s:e], vw, generator)


def adam_update_many(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    h: AdamHyper,
    generator: torch.Generator | None = None,
) -> None:
    """:func:`adam_update` over lists of fp32 tensors on one device: one multi-tensor launch for fp32 moments."""
    if not params:
        return
    if exp_avgs[0].dtype != torch.float32:
        for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            adam_update(p, g, m, v, st, h, generator)
        return
    torch._foreach_add_(steps, 1)
    _fused(params, grads, exp_avgs, exp_avg_sqs, steps, h)
