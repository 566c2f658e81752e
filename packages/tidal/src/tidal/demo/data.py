"""Training text every machine has: the Python standard library's source, as bytes (one token per byte)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_bytes(max_bytes: int = 4 << 20) -> tuple[bytes, int]:
    """Concatenate the standard library's ``*.py`` files (sorted, so every run reads the same text).

    Returns:
        The text as bytes (at most ``max_bytes``) and the number of files read.

    Raises:
        FileNotFoundError: no ``.py`` source found (a stripped Python install); the message says so.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    buf = bytearray()
    n = 0
    for f in files:
        if len(buf) >= max_bytes:
            break
        buf += f.read_bytes()
        n += 1
    if not buf:
        raise FileNotFoundError(
            f"no Python standard library source (*.py) under {root}; the demo trains on it. "
            "Install a Python with its source files (the default everywhere but some slim images)"
        )
    return bytes(buf[:max_bytes]), n


class ByteBatches:
    """Random windows of the text, held as a uint8 tensor; a fixed seed makes runs repeatable."""

    def __init__(self, data: bytes, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(f"seq_len: {seq_len} is not shorter than the text ({len(data)} bytes)")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # [N]
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, both ``[B, T]`` int64 on ``device``."""
        starts = torch.randint(
            0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen
        )
        rows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()  # [B, T+1]
        return rows[:, :-1].to(device), rows[:, 1:].to(device)
