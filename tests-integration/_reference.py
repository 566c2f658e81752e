"""The unwrapped references the scenarios compare tidal against, run with the kernels tidal runs.

tidal's host optimizer updates fp32 host copies of the weights with torch's fused CPU AdamW kernel. On
the GPU, ``torch.optim.AdamW(fused=True)`` on the device runs the CUDA kernel instead, which rounds
differently (about 1 ulp per step); Adam turns the difference into updates of ~lr * noise / eps on
elements whose gradient is rounding noise, ~1e-6 after a few steps at lr 1e-2. So the reference steps
the same ``torch.optim.AdamW(fused=True)`` on host copies, and runs attention on the same SDPA backend
as the wrapped model: an exact comparison then has nothing left to differ but tidal itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["ATTENTION", "HostAdamW", "reference_attention"]

ATTENTION = "math"
"""SDPA backend both sides use (``wrap(attention=ATTENTION)``): deterministic and on every device."""


@contextmanager
def reference_attention() -> Iterator[None]:
    """Run the reference's SDPA calls on the backend ``wrap(attention=ATTENTION)`` routes tidal's to."""
    with sdpa_kernel([SDPBackend.MATH]):
        yield


class HostAdamW:
    """``torch.optim.AdamW(fused=True)`` over fp32 host copies of ``params``, copied back after each step.

    Args:
        params: the reference model's trainable parameters (on any device).
        **hyper: ``torch.optim.AdamW`` hyper-parameters (``lr=``, ...).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **hyper: float) -> None:
        self.params = list(params)
        self.masters = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, fused=True, **hyper)

    def step(self) -> None:
        """One AdamW step on the host copies, then the weights take their values."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)  # host -> device (a plain copy on the CPU)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (the reference always sets them to None)."""
        for p in self.params:
            p.grad = None
