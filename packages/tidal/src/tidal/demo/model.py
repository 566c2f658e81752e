"""A small byte-level GPT built in-process (no download): pre-norm blocks in one ``nn.ModuleList``.

The block stack is ``model.blocks`` — the repeated stack tidal's census finds and streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

SizeName = Literal["tiny", "small", "base", "large", "xl"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the demo model."""

    vocab_size: int = 256
    """Byte-level tokens: every byte value is a token. Default 256."""
    d_model: int = 128
    """Hidden size. Default 128."""
    n_layers: int = 4
    """Number of transformer blocks (the streamed stack). Default 4."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``. Default 4."""
    max_seq_len: int = 256
    """Longest sequence (learned positions). Default 256."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name}: got {v!r}; accepted: a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads: {self.n_heads} does not divide d_model={self.d_model}; "
                "pick n_heads that divides d_model"
            )

    def n_params(self) -> int:
        """Parameter count (untied head)."""
        d = self.d_model
        block = 12 * d * d + 13 * d  # qkv+proj (4d²+4d), mlp (8d²+5d), two LayerNorms (4d)
        return self.n_layers * block + 2 * self.vocab_size * d + self.max_seq_len * d + 2 * d


# name -> shape; "tiny" is for tests, "small" the CPU default, "large" the GPU default
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=64, n_layers=4, n_heads=4, max_seq_len=256),
    "small": GPTConfig(d_model=192, n_layers=6, n_heads=6, max_seq_len=256),
    "base": GPTConfig(d_model=512, n_layers=8, n_heads=8, max_seq_len=512),
    "large": GPTConfig(d_model=1536, n_layers=16, n_heads=16, max_seq_len=1024),
    "xl": GPTConfig(d_model=2560, n_layers=24, n_heads=20, max_seq_len=1024),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a GELU MLP, both residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # [B, T, D]
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)  # 3 × [B, T, D]
        q, k, v = (
            z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v)
        )  # [B, H, T, Dh]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))  # [B, T, D]
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # [B, T, D]


class TinyGPT(nn.Module):
    """Byte-level GPT: embeddings, ``blocks`` (an ``nn.ModuleList``), final norm, untied head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` or, with ``targets`` ``[B, T]`` (the next bytes), the mean cross-entropy."""
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)  # [T]
        x = self.tok(input_ids) + self.pos(pos)  # [B, T, D]
        for blk in self.blocks:
            x = blk(x)  # [B, T, D]
        logits = self.head(self.ln_f(x))  # [B, T, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
