"""Low-rank adapters over frozen (quantized) linears, for ``tidal demo --quantize``.

The demo's quantized mode is QLoRA-shaped: the block linears become frozen ``QuantLinear`` (tidal-quant)
and each gets a trainable rank-``r`` update ``B @ A`` added to its output.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRA(nn.Module):
    """``base(x) + (x @ A.T @ B.T) * alpha / r`` with ``base`` frozen; ``B`` starts at zero (identity update)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        r: int = 8,
        alpha: float = 16.0,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))  # [r, in]
        self.lora_b = nn.Parameter(torch.zeros(out_features, r, device=device, dtype=dtype))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        update = (x.to(self.lora_a.dtype) @ self.lora_a.t()) @ self.lora_b.t()
        return self.base(x) + (update * self.scale).to(x.dtype)


def add_lora_(blocks: nn.ModuleList, r: int = 8, *, dtype: torch.dtype | None = None) -> int:
    """Wrap every linear-like child of each block (anything with ``in_features``/``out_features``) in LoRA.

    Freezes every parameter of ``blocks`` first. Adapters are created on the device of the layer they
    wrap, in ``dtype`` (default: torch's default dtype). Returns the number of adapters added.
    """
    for p in blocks.parameters():
        p.requires_grad_(False)
    n = 0
    for blk in blocks:
        for name, child in list(blk.named_children()):
            if hasattr(child, "in_features") and hasattr(child, "out_features"):
                device = next(iter([*child.parameters(), *child.buffers()])).device
                lora = LoRA(child, child.in_features, child.out_features, r=r, device=device, dtype=dtype)
                setattr(blk, name, lora)
                n += 1
    return n
