"""Small models and training loops shared by the reliability scenarios (imported by path: tests are not a package)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

VOCAB, DIM, LAYERS, SEQ, BATCH = 64, 32, 3, 16, 2


class Block(nn.Module):
    """Pre-norm residual MLP block (hidden width ``mlp_ratio * dim``)."""

    def __init__(self, dim: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, mlp_ratio * dim)
        self.down = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))  # [B, T, D]


class TinyLM(nn.Module):
    """Embedding, a stack of residual MLP blocks, a final norm and an untied head.

    Also the soak benchmark's model (``benchmarks/soak.py``, with ``mlp_ratio=4``).
    """

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # [B, T, D]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))  # [B, T, V]


class NoStack(nn.Module):
    """A model without a block stack: two different layers, no ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def make_model(seed: int = 0, device: str = "cpu", **kw: int) -> TinyLM:
    """A seeded ``TinyLM`` on ``device``."""
    torch.manual_seed(seed)
    return TinyLM(**kw).to(device)


def batches(n: int, seed: int = 1, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, target) token batches, random but reproducible."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tok[:, :-1].to(device), tok[:, 1:].to(device)))
    return out


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    x, y = batch
    logits = model(x)  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, data: list, sync: Callable | None = None
) -> list[float]:
    """One optimizer step per batch; returns the losses."""
    losses = []
    for b in data:
        loss = loss_of(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if sync is not None:
        sync()
    return losses


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(model: nn.Module) -> nn.Module:
    """A deep copy (same weights)."""
    return copy.deepcopy(model)
