"""Reading checkpoint files one tensor at a time, straight into the tensor's own storage.

[Note: no mmap] ``safetensors.safe_open`` maps the whole file; every page read stays mapped, so a
process reading a 1 GB shard holds the mapping *and* the copies it made (2x the model in RSS). Here the
file's header (8-byte little-endian length + JSON, the safetensors layout) gives each tensor's byte range,
and ``readinto`` fills a freshly allocated tensor: peak memory is the tensors kept plus the one being read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

from tidal_hf.errors import CheckpointError

__all__ = ["TensorInfo", "iter_safetensors", "read_header", "read_tensor"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file."""

    name: str
    """Key in the file."""
    dtype: torch.dtype
    """Stored dtype."""
    shape: tuple[int, ...]
    """Stored shape."""
    begin: int
    """Absolute byte offset of the data in the file."""
    nbytes: int
    """Data bytes."""


def read_header(path: str | os.PathLike) -> list[TensorInfo]:
    """The tensors of a safetensors file, in file order (the order that reads the file sequentially)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{os.fspath(path)!r} is not a safetensors file (shorter than 8 bytes).")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{os.fspath(path)!r}: header of {n} bytes; not a safetensors file.")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{os.fspath(path)!r}: unreadable safetensors header ({e}).") from e
    start = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{os.fspath(path)!r}: tensor {name!r} has dtype {meta['dtype']!r}; accepted: {sorted(_DTYPES)}."
            )
        b, e = meta["data_offsets"]
        out.append(TensorInfo(name, _DTYPES[meta["dtype"]], tuple(meta["shape"]), start + b, e - b))
    out.sort(key=lambda t: t.begin)
    return out


def read_tensor(fh: BinaryIO, info: TensorInfo) -> torch.Tensor:
    """Read one tensor (CPU, stored dtype) from an open file; the only allocation is the tensor itself."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)  # [nbytes]
    fh.seek(info.begin)
    view = memoryview(buf.numpy())
    got = 0
    while got < info.nbytes:
        n = fh.readinto(view[got:])
        if not n:
            raise CheckpointError(f"tensor {info.name!r}: file ended after {got} of {info.nbytes} bytes.")
        got += n
    return buf.view(info.dtype).view(info.shape)


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """Yield ``(info, tensor)`` for every tensor of the file, one at a time, in file order."""
    infos = read_header(path)
    with open(path, "rb", buffering=0) as fh:
        for info in infos:
            yield info, read_tensor(fh, info)
