"""The block stack of a model: finding it, and the block indices a part-2 option selects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from tidal_stream.errors import StreamingError, option_error

__all__ = ["check_indices", "find_blocks", "resolve_blocks", "select_blocks"]


def check_indices(name: str, indices: Any, n: int) -> list[int]:
    """``indices`` as distinct block indices in ``0..n-1`` (negative ones count from the end); a clear
    error naming option ``name`` otherwise."""
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
        raise option_error(name, indices, f"a list of block indices in 0..{n - 1}")
    out = []
    for i in indices:
        if not isinstance(i, int) or isinstance(i, bool) or not -n <= i < n:
            raise option_error(name, indices, f"a list of block indices in 0..{n - 1}", f"drop {i!r}.")
        out.append(i % n)
    if len(set(out)) != len(out):
        raise option_error(name, indices, "distinct block indices", "remove the duplicates.")
    return out


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The block stack: the ``nn.ModuleList`` holding the most parameters whose children share a type."""
    best, best_n = None, 0
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = mod, n
    if best is None:
        raise StreamingError(
            f"find_blocks: no nn.ModuleList of same-type blocks found in {type(model).__name__}; accepted: a "
            "model with a layer stack. Fix: pass blocks= (a ModuleList, a list of modules or an attribute path)."
        )
    return list(best)


def select_blocks(name: str, value: Any, n: int) -> list[int]:
    """Block indices selected by a part-2 option value: True (all), False (none), a fraction in [0, 1]
    (the leading ``round(f × n)`` blocks) or a list of indices. ``"auto"`` is resolved by the caller."""
    if value is True:
        return list(range(n))
    if value is False or value is None:
        return []
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise option_error(name, value, "True, False, 'auto', a fraction in [0, 1] or a list of indices")
        return list(range(round(value * n)))
    return sorted(check_indices(name, value, n))


def resolve_blocks(model: nn.Module, spec: Any) -> list[nn.Module]:
    """The blocks ``spec`` names (the ``blocks=`` option): None finds them, a string is an attribute path."""
    if spec is None:
        return find_blocks(model)
    if isinstance(spec, str):
        obj: Any = model
        for part in spec.split("."):
            if not hasattr(obj, part):
                raise option_error("blocks", spec, "an attribute path of the model, e.g. 'model.layers'")
            obj = getattr(obj, part)
        spec = obj
    return list(spec)
