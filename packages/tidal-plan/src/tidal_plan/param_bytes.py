"""Bytes per trainable element of the optimizer: its state, the host buffers, one update's memory traffic."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal_plan.cost import Context

__all__ = ["adamw_bytes", "host_slot_bytes", "state_bytes_per_param"]


def state_bytes_per_param(ctx: Context, moment: str) -> int:
    """Optimizer state per trainable element: two moments plus the fp32 master copy if kept."""
    return (8 if moment == "fp32" else 4) + (4 if ctx.master else 0)


def host_slot_bytes(ctx: Context, moment: str) -> tuple[int, int]:
    """``(pinned, pageable)`` host bytes per element of a parameter updated on the host, as the host
    optimizer reserves them without gradient accumulation or delayed updates: pinned what a device copy
    reads or writes (for 16-bit weights one landing buffer, which the new weight goes back from too; for
    fp32 weights the master, which is the outgoing weight, and the fp32 gradient the copy lands in),
    pageable what only the CPU touches (the moments, and for 16-bit weights the fp32 master)."""
    p, m = ctx.census.param_dtype_bytes, (4 if moment == "fp32" else 2)
    if p >= 4:
        return 4 + 4, 2 * m
    return p, (4 if ctx.master else 0) + 2 * m


def adamw_bytes(ctx: Context, moment: str) -> int:
    """HBM (or host memory) bytes one AdamW update moves per parameter.

    With fp32 masters of 16-bit weights: widen the gradient (p read, 4 written), the fused update on fp32
    master, gradient and moments (12 + 4m), narrow the new weight (4 read, p written). Without: the fused
    update on the weight itself (3p + 4m). ``p`` is the weight's element size, ``m`` the moments'.
    """
    p, m = ctx.census.param_dtype_bytes, (4 if moment == "fp32" else 2)
    return 2 * p + 20 + 4 * m if ctx.master else 3 * p + 4 * m
