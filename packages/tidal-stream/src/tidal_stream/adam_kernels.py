"""The Adam/AdamW update on one tensor: torch's fused kernels, plus bf16 moments with stochastic rounding.

``torch._fused_adamw_`` / ``torch._fused_adam_`` run on CPU tensors (vectorised, multi-threaded) and on
CUDA tensors; on fp32 state they are bit-identical to ``torch.optim.AdamW(fused=True)`` on the same
device (checked in tests). torch's other paths (single-tensor, foreach) round differently in the last
bits, and the CPU and CUDA kernels need not agree bit for bit. bf16 moments are widened to fp32 in
chunks, updated by the same kernel, and narrowed back with stochastic rounding so small updates are not
systematically lost.

:func:`adam_update` runs the whole per-tensor host path (undo copy, gradient widen / accumulate / clip
scale, update, narrow of the new weight) in one call, optionally in one pass of cache-sized blocks
(``block=``; see ``_BLOCK``), with the same bits either way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["AdamHyper", "UndoCopy", "adam_update", "adam_update_many", "default_block", "stochastic_round_"]

_CHUNK = 1 << 22  # elements per widened chunk of bf16 moments (16 MiB of fp32 per moment)
# elements per cache block of the host update with fp32 moments (0: whole-tensor passes, the default).
# Blocking keeps each block's gradient scratch, master, moments, landing and staging (20 B per element)
# in the CPU caches between the widen, the fused kernel and the narrow — ~28 B/param of memory traffic
# instead of ~40 — but every block costs ~10-20 us of Python plus a fork/join of the intra-op threads per
# op, and a fork/join waits for its slowest thread: one preempted by another busy thread (the training
# loop's) stalls it for a scheduler slice. Measured on a loaded 2-core host: blocks of 256K were 1.13x
# faster when the cores were free and 1.2-7x slower while other processes competed for them, so blocking
# is opt-in until measured on the GPU machine (benchmarks/stream/host_adamw.py --sweep/--hog).
_BLOCK = 0
# with an undo copy (rollback=True): the copy brings the block's master and moments into the caches and
# the update reads them from there (3 x 1 MiB of fp32)
_UNDO_BLOCK = 1 << 18
# block boundaries fall on multiples of this: the fused CPU kernel runs whole vectors except for each
# call's tail (at most 16 fp32 with AVX-512), whose scalar code may round differently
_ALIGN = 64
# elements per block when the caller keeps no fp32 gradient buffer (``grad=None``): the gradient is
# widened from the landing buffer into a per-thread scratch of at most this size (256 MiB), so tensors up
# to 64 M elements (every block weight of models to ~30B) still go in one whole-tensor pass, the fastest
# on the GPU machine's host (280 ms over 468 M parameters, against 299 ms in blocks of 4 M elements).
_LEAN_BLOCK = 1 << 26
_tls = threading.local()  # per-thread fp32 gradient scratch of one block
# [Note: host rounding noise] stochastic rounding on the host reads its noise from a fixed table at an
# offset drawn per chunk from the caller's generator, instead of drawing fresh numbers: a generator on
# the CPU draws ~90 M numbers a second, which made the bf16-moment host update 16x slower than the fp32
# one. The table is _NOISE_PERIOD // 65536 independent permutations of 0..65535 (every 16-bit value
# equally often), followed by its first _CHUNK entries again so any offset below _NOISE_PERIOD has a
# contiguous window. For a given element the offset is uniform and drawn anew at every call, so its
# noise is uniform over the 16 low bits and independent from call to call (rounding is unbiased); m and
# v draw separate offsets. The table's seed is part of the noise's definition: the bits depend on the
# caller's generator alone, in every process and at any thread count.
_NOISE_PERIOD = 1 << 23
_NOISE_SEED = 0x5EED
_NOISE_TABLE: torch.Tensor | None = None
_NOISE_LOCK = threading.Lock()


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


def _noise_table() -> torch.Tensor:
    """[_NOISE_PERIOD + _CHUNK] int32 noise table of [Note: host rounding noise], built once per process."""
    global _NOISE_TABLE
    with _NOISE_LOCK:
        if _NOISE_TABLE is None:
            g = torch.Generator().manual_seed(_NOISE_SEED)
            perms = [
                torch.randperm(1 << 16, generator=g, dtype=torch.int32) for _ in range(_NOISE_PERIOD >> 16)
            ]
            _NOISE_TABLE = torch.cat(perms + perms[: -(-_CHUNK >> 16)])[: _NOISE_PERIOD + _CHUNK]
        return _NOISE_TABLE


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``src`` into bf16 ``dst`` with stochastic rounding (unbiased in expectation).

    Adds uniform noise below bf16's last mantissa bit to the fp32 bit pattern, then truncates; infinities
    and NaNs are kept. On the CPU the noise is read from a fixed table (see [Note: host rounding noise]);
    elsewhere it is drawn from ``generator``. Both tensors are contiguous and of the same shape.
    """
    bits = src.view(-1).view(torch.int32)  # [N] fp32 bit patterns
    if src.device.type != "cpu":
        rounded = torch.randint(
            0, 1 << 16, bits.shape, dtype=torch.int32, device=src.device, generator=generator
        )
        rounded.add_(bits).bitwise_and_(-65536)  # clear the 16 low bits: exactly representable in bf16
        # non-finite values (inf/nan) must not be perturbed into other bit patterns
        torch.where(torch.isfinite(src.view(-1)), rounded, bits, out=rounded)
        dst.copy_(rounded.view(torch.float32).view(dst.shape))
        return
    out = dst.view(-1)  # [N] bf16
    table = _noise_table()
    pieces = bits.split(_CHUNK)
    offsets = torch.randint(0, _NOISE_PERIOD, (len(pieces),), generator=generator).tolist()
    for j, (piece, off) in enumerate(zip(pieces, offsets)):
        n = piece.numel()
        rounded = torch.add(piece, table[off : off + n], out=_scratch(n, "rounded", torch.int32))  # [n]
        rounded.bitwise_and_(-65536)  # clear the 16 low bits: exactly representable in bf16
        out[j * _CHUNK : j * _CHUNK + n].copy_(rounded.view(torch.float32))
    # an infinity keeps its bits (the noise sits below the kept 16), but a NaN's payload can carry into its
    # exponent or sign: one reduction finds whether any non-finite value is there, and only then they are
    # written again by plain rounding (which keeps NaN and inf)
    if not bool(torch.isfinite(src.sum())):
        bad = ~torch.isfinite(src.view(-1))
        out[bad] = src.view(-1)[bad].to(out.dtype)


def default_block(t: torch.Tensor, undo: bool = False) -> int:
    """Elements per cache block of :func:`adam_update` with fp32 moments on tensors like ``t`` (0: whole).

    Args:
        t: a tensor on the device the update runs on.
        undo: an undo copy is taken during the update.
    """
    if t.device.type != "cpu":
        return 0  # device kernels stream from HBM: nothing to block
    return _BLOCK or (_UNDO_BLOCK if undo else 0)


def _scratch(n: int, name: str = "grad", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n] scratch of the calling thread, reused across blocks and calls (stays in the CPU caches, and
    large ones are not handed back to the OS and page-faulted in again at every chunk)."""
    buf = getattr(_tls, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_tls, name, buf)
    return buf[:n]


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    h: AdamHyper,
    generator: torch.Generator | None = None,
    undo: UndoCopy | None = None,
    *,
    landing: torch.Tensor | None = None,
    accumulate: bool = False,
    grad_scale: torch.Tensor | float | None = None,
    narrow_to: torch.Tensor | None = None,
    block: int | None = None,
) -> None:
    """One Adam(W) step on fp32 ``param`` in place; ``step`` (a 0-d fp32 tensor) is incremented once first.

    The whole per-tensor host path in one call, in one pass of blocks (the whole tensor by default on
    CPU without an undo copy, see ``_BLOCK``): per block, the undo copy, the gradient (widened from
    ``landing`` / summed / scaled; into a small reused fp32 scratch when blocked, so it stays in the
    CPU caches), torch's fused kernel on the block's views, and the narrowing of the new master into
    ``narrow_to``. AdamW is elementwise and the kernel gets the same inputs per element, so every
    blocking gives the bits of whole-tensor passes (``block=0``).

    Args:
        param: [N...] fp32 master, updated in place.
        grad: [N...] fp32 gradient; with ``landing`` and ``accumulate=False`` it is not read. Left as it
            was when blocked and a ``landing`` / ``grad_scale`` is given (whole-tensor: holds the result).
            None: no fp32 gradient buffer (the caller saves its memory); needs ``landing`` without
            ``accumulate``, and the update goes in blocks (``_LEAN_BLOCK`` unless ``block`` says).
        exp_avg: [N...] first moment, fp32 or bf16 (bf16: widened per block, stochastically rounded back).
        exp_avg_sq: [N...] second moment, same dtype as ``exp_avg``.
        step: 0-d fp32 step count, incremented once.
        h: hyper-parameters.
        generator: stochastic-rounding generator (bf16 moments).
        undo: receives the old ``param`` and moments block by block, each just before the block is
            updated; its ``copied`` says how far a failed update got.
        landing: [N...] gradient as copied from the device (any float dtype): the gradient used is
            ``landing`` (``accumulate=False``) or ``grad + landing`` (``accumulate=True``).
        accumulate: add ``landing`` to ``grad`` instead of replacing it.
        grad_scale: multiply the gradient by this (0-d tensor or float) before the update (clipping).
        narrow_to: [N...] receives the new master in its dtype (the weight going back to the device).
        block: elements per block with fp32 moments, rounded down to a multiple of 64 (the kernel's
            vector tails must fall where the whole-tensor call has them); None: :func:`default_block`;
            0: whole tensor. bf16 moments always go in chunks of ``_CHUNK`` (see below).
    """
    if grad is None and (landing is None or accumulate):
        raise ValueError("adam_update: grad=None needs landing= and accumulate=False (nothing to read)")
    step.add_(1)
    p1, m1, v1 = (t.view(-1) for t in (param, exp_avg, exp_avg_sq))  # [N] each
    n = p1.numel()
    bf16 = exp_avg.dtype != torch.float32
    if bf16:
        # stochastic rounding draws the noise of m then v per chunk: the bits depend on the chunking, so
        # it stays fixed (the bf16 path is bound by the generator, not by memory traffic)
        block = _CHUNK
    elif block is None:
        block = default_block(param, undo is not None) or (_LEAN_BLOCK if grad is None else 0)
    if block > 0:
        block = max(_ALIGN, block - block % _ALIGN)
    if block <= 0 or block >= n:
        block = max(n, 1)
    # without a gradient buffer even a whole-tensor pass widens into the scratch
    blocked = block < n or grad is None
    # the blocks' views, made in one call per tensor (per-block Python overhead is what limits small blocks)
    ps, ms, vs = (t.split(block) for t in (p1, m1, v1))  # [b] each
    gs = ps if grad is None else grad.view(-1).split(block)  # [b] each (never read when grad is None)
    ls = None if landing is None else landing.view(-1).split(block)  # [b] each
    ns = None if narrow_to is None else narrow_to.view(-1).split(block)  # [b] each
    scratch = _scratch(block) if blocked and (ls is not None or grad_scale is not None) else None  # [block]
    for i, (p, g, m, v) in enumerate(zip(ps, gs, ms, vs)):
        if undo is not None:
            undo.save((p1, m1, v1), i * block, i * block + p.numel())
        if ls is not None or grad_scale is not None:
            dst = g if scratch is None else scratch[: p.numel()]  # [b] fp32
            if ls is None:
                torch.mul(g, grad_scale, out=dst)  # scale while reading (clipping)
            else:
                if accumulate:
                    torch.add(g, ls[i], out=dst)  # the last micro-step's gradient, summed in fp32
                else:
                    dst.copy_(ls[i])  # widen
                if grad_scale is not None:
                    dst.mul_(grad_scale)
            g = dst
        if not bf16:
            _fused([p], [g], [m], [v], [step], h)
        else:
            mw = _scratch(m.numel(), "exp_avg").copy_(m)  # [b] widened moments
            vw = _scratch(v.numel(), "exp_avg_sq").copy_(v)
            _fused([p], [g], [mw], [vw], [step], h)
            stochastic_round_(m, mw, generator)
            stochastic_round_(v, vw, generator)
        if ns is not None:
            ns[i].copy_(p)  # narrow the new master into the outgoing weight


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
