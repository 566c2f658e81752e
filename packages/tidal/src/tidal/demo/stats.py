"""What the demo measures per step: device memory, and bytes tidal moved over PCIe (from its memory report).

On a GPU, memory is torch's allocator's (``memory_allocated`` / ``max_memory_allocated``). With the CPU
standing in for the GPU there is no allocator to ask, so the demo counts what tidal keeps on the stand-in
device: the storage of the model's parameters, buffers and gradients (a streamed block's storage is empty
between uses) plus the optimizer state placed on the device; the peak adds the largest set of streamed
blocks resident at once (weight streaming's own count). Activations are not in that count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def transfer_totals(report: dict[str, Any]) -> tuple[int, int]:
    """Cumulative (host→device, device→host) bytes of a ``memory_report()``, every mechanism together.

    The top-level counters are the optimizer's copies (gradients out, updated weights back); weight streaming
    reports its refills (``weight_streaming.h2d_bytes``); activation offload the saved tensors it sent to
    the host, each of which comes back once for backward (``activations.offloaded_bytes``).
    """
    h2d = int(report.get("h2d_bytes", 0))
    d2h = int(report.get("d2h_bytes", 0))
    h2d += int(report.get("weight_streaming", {}).get("h2d_bytes", 0))
    acts = int(report.get("activations", {}).get("offloaded_bytes", 0))
    return h2d + acts, d2h + acts


def resident_bytes(model: nn.Module, report: dict[str, Any], device: torch.device) -> int:
    """Bytes tidal holds on ``device`` for the model: parameter, buffer and gradient storage + device optimizer state."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for t in tensors:
        if t.device.type != device.type:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    tiers = report.get("tiers", {})
    return total + int(tiers.get("device", {}).get("bytes", 0))


class DeviceMemory:
    """Per-step memory readings for the demo (the CUDA allocator, or the stand-in count on the CPU).

    On a GPU, readings are above ``baseline``: what the process had allocated on the device when this
    object was made (before the demo built anything; e.g. tensors another part of the process keeps).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.baseline = 0
        if self.cuda:
            self.baseline = torch.cuda.memory_allocated(device)  # the allocator's count: no sync needed

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # why: host clocks must not stop before queued GPU work ends

    def read(self, model: nn.Module, report: dict[str, Any]) -> tuple[int, int]:
        """(peak bytes since the last reset, bytes allocated now)."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)  # since reset_peak(), the baseline included
            return peak - self.baseline, torch.cuda.memory_allocated(self.device) - self.baseline
        now = resident_bytes(model, report, self.device)
        # streamed blocks are empty after the step; during it, at most the streaming window's peak was filled
        window = int(report.get("weight_streaming", {}).get("resident_peak_bytes", 0))
        return now + window, now
