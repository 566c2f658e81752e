"""Where things are inside a transformers model: the model under a PEFT wrapper, the decoder-layer stack."""

from __future__ import annotations

from torch import nn

__all__ = ["find_block_stack", "hf_model_of"]


def hf_model_of(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model`` (a PEFT wrapper's base model, or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def find_block_stack(model: nn.Module) -> nn.ModuleList | None:
    """The decoder-layer ``ModuleList`` of a transformers model (from ``_no_split_modules``), or None."""
    hf = hf_model_of(model)
    names = set(getattr(hf, "_no_split_modules", None) or ())
    for module in hf.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1 and type(module[0]).__name__ in names:
            return module
    return None
