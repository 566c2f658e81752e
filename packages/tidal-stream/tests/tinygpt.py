"""A small GPT-like model and its data for the optimizer tests (loaded by path: tests are not a package)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class TinyGPT(nn.Module):
    """Embedding, pre-norm attention + MLP blocks, tied lm head (weights shared with the embedding).

    No biases in the blocks: the key bias gets a pure round-off gradient (softmax ignores it), which
    Adam amplifies to ±lr, so any two AdamW implementations disagree on it (torch's own fused vs
    single-tensor paths do).
    """

    def __init__(
        self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4, seq: int = 16
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True, bias=False
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied weights
        self.frozen = nn.Parameter(torch.randn(dim), requires_grad=False)  # frozen parameter
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)) + 0.01 * self.frozen  # [B, T, D]
        for b in self.blocks:
            x = b(x, src_mask=self.mask[:t, :t])
        return self.head(self.ln_f(x))  # [B, T, V]


def make_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT().to(device=device, dtype=dtype)


def batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 64, (4, 16), generator=g)
    return idx.to(device), torch.roll(idx, -1, 1).to(device)


def loss_fn(model: nn.Module, step: int, device: str = "cpu", autocast: bool = False) -> torch.Tensor:
    idx, tgt = batch(step, device)
    # the math SDPA backend: deterministic gradients on CUDA too, so runs compare bit for bit
    with (
        sdpa_kernel(SDPBackend.MATH),
        torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast),
    ):
        logits = model(idx)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
