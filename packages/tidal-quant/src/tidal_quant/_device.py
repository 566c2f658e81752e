"""The device a Triton kernel launches on: Triton uses the current CUDA device (and its current stream), torch
the tensors' own; these make the tensors' device current for a launch, only when it is not already."""

from __future__ import annotations

import contextlib

import torch

# the current CUDA device's index: a C call (torch.cuda.current_device() adds a lazy-init check)
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_SAME_DEVICE = contextlib.nullcontext()


def device_at(index: int | None) -> contextlib.AbstractContextManager:
    """For a kernel launch on CUDA device ``index``: that device made current when it is not (a model on a
    GPU other than the current one), else a shared no-op context (also for ``None``: a CPU tensor)."""
    return _SAME_DEVICE if index is None or index == current_device() else torch.cuda.device(index)


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """:func:`device_at` of ``t``'s device."""
    return device_at(t.device.index)
