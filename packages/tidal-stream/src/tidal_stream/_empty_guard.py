"""A clear error instead of a crash when a streamed weight is read while its device storage is empty.

[Note: reads between uses] a streamed block's parameters and buffers keep their shape while their
device storage is resized to 0 bytes between uses (see [Note: storage handling] in streamed_blocks.py).
Reading one then (``p.clone()``, ``p.sum()``, ``repr(p)``, ``copy.deepcopy``, ``torch.save(p)``,
``model.to(...)``) would read freed memory — a segmentation fault on the CPU. :func:`guard` swaps the
tensor's class for a subclass whose ``__torch_function__`` raises :class:`StreamingError` naming the
tensor and the fix when a data-reading call gets it with empty storage; everything else passes through
unchanged. Metadata (shape, dtype, ``.grad``, ``.data``, ``untyped_storage()``, ``detach()`` — what
``state_dict()`` and the streaming machinery itself use) is always allowed. Only exactly ``nn.Parameter``
and ``torch.Tensor`` are guarded; other tensor subclasses are left as they are. :func:`unguard` restores
the class for good.

The guarded class is worn only while the storage is empty: the refill that fills it swaps in the plain
class (:func:`lift`) and the release that empties it swaps the guarded one back (:func:`drop`), so the
block's own kernels, forward and backward, run on plain tensors — no Python ``__torch_function__`` call
(several microseconds each, on every op that reads a streamed weight) stands between them and the GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["drop", "guard", "lift", "unguard"]

# calls that read no element: allowed on an empty tensor (``__get__`` / ``__set__``: attributes)
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "__hash__",
        "detach",
        "untyped_storage",
        "numel",
        "size",
        "dim",
        "stride",
        "element_size",
        "is_contiguous",
        "storage_offset",
        "data_ptr",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "is_floating_point",
        "is_complex",
        "nelement",
        "get_device",
        "__len__",
    }
)
_NAME = "_tidal_stream_name"


def _check(func: Any, args: tuple) -> None:
    if getattr(func, "__name__", "") in _METADATA:
        return
    for a in args:
        if (
            isinstance(a, (_GuardedParameter, _GuardedTensor))
            and a.numel()
            and a.untyped_storage().nbytes() == 0
        ):
            from tidal_stream.streamed_blocks import StreamingError

            what = getattr(func, "__name__", repr(func))
            raise StreamingError(
                f"{a.__dict__.get(_NAME, 'a streamed tensor')}: its weights stream, and between uses its device "
                f"storage is empty and it cannot be read here (by {what}); accepted: reads inside the block's forward/"
                "backward. Fix: read weights with model.state_dict() (streamed ones come from their host "
                "copies), or unwrap(model) first (StreamedBlocks: .gathered() or .host_tensor(t))."
            )


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        _check(func, args)
        return func(*args, **(kwargs or {}))


class _GuardedParameter(nn.Parameter):
    """``nn.Parameter`` of a streamed block (see the module docstring)."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]

    def __reduce_ex__(self, proto: Any) -> Any:
        _check(self.__reduce_ex__, (self,))  # pickling reads the data through .data (not guarded)
        return super().__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> Any:
        _check(self.__deepcopy__, (self,))
        with torch._C.DisableTorchFunctionSubclass():
            out = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = out
        return out


class _GuardedTensor(torch.Tensor):
    """A buffer of a streamed block (see the module docstring)."""

    __torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict) -> Any:
        _check(self.__deepcopy__, (self,))
        with torch._C.DisableTorchFunctionSubclass():
            out = copy.deepcopy(self.as_subclass(torch.Tensor), memo)
        return out


def guard(t: torch.Tensor, name: str) -> None:
    """Make reads of ``t`` with empty storage raise (``name`` is shown in the error)."""
    if type(t) is nn.Parameter:
        t.__class__ = _GuardedParameter
    elif type(t) is torch.Tensor:
        t.__class__ = _GuardedTensor
    else:
        return
    t.__dict__[_NAME] = name


def lift(t: torch.Tensor) -> None:
    """``t``'s storage is filled: the plain class, its name kept for :func:`drop`."""
    if type(t) is _GuardedParameter:
        t.__class__ = nn.Parameter
    elif type(t) is _GuardedTensor:
        t.__class__ = torch.Tensor


def drop(t: torch.Tensor) -> None:
    """``t``'s storage is empty again: the guarded class, if :func:`guard` named it."""
    name = t.__dict__.get(_NAME)
    if name is not None:
        guard(t, name)


def unguard(t: torch.Tensor) -> None:
    """Undo :func:`guard` for good: the plain class, the name forgotten."""
    lift(t)
    t.__dict__.pop(_NAME, None)
