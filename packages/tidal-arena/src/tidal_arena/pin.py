"""`pin_` / `unpin_`: page-lock an existing CPU tensor's memory in place (``cudaHostRegister``), no copy:
its whole storage, or (``view=True``) exactly the bytes of a contiguous view."""

from __future__ import annotations

import logging
import threading
import time

import torch

from tidal_arena import _backend
from tidal_arena._backend import PORTABLE, log_once, profile_range
from tidal_arena.errors import ArenaError, PageLockLimitError

logger = logging.getLogger(__name__)

# start of a registered range (a storage's, or a view's with view=True) -> (the storage, the range's bytes).
# [Note: registered storage lifetime] The storage must not be freed while registered (unregistering
# freed memory is undefined), so the registry holds a reference until unpin_.
_REGISTERED: dict[int, tuple[torch.UntypedStorage, int]] = {}
_LOCK = threading.Lock()


def _check_cpu_tensor(where: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: tensor must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{where}: tensor must be on the CPU, got device {tensor.device}. Only host memory can be page-locked."
        )
    return tensor


def _span(where: str, tensor: torch.Tensor, view: bool) -> tuple[int, int]:
    """``(start, bytes)`` that :func:`pin_` registers: the whole storage, or the contiguous view's bytes."""
    if not view:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    if not tensor.is_contiguous():
        raise ValueError(
            f"{where}(view=True): tensor must be contiguous (one byte range), got strides {tensor.stride()} "
            f"for shape {tuple(tensor.shape)}. Fix: pass a contiguous slice, or view=False for the storage."
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def pin_(tensor: torch.Tensor, *, view: bool = False) -> torch.Tensor:
    """Page-lock ``tensor``'s whole storage in place (``cudaHostRegister``): same memory, no copy.

    Afterwards ``tensor.is_pinned()`` is True and copies from it run asynchronously at full PCIe speed. The
    storage is kept alive until :func:`unpin_`. Registering costs time (0.06 s for 1 GiB on the GPU
    machine): do it once, up front. The storage is registered in one call: a CUDA copy cannot span two
    separate registrations (it fails with cudaErrorInvalidValue), so splitting it across threads is not an option. Pinning an already registered tensor is a no-op. Without CUDA or CuPy this logs once and
    leaves the tensor pageable (counted in ``arena_stats()["pin_noops"]``).

    With ``view=True`` only the bytes of ``tensor`` itself are registered (it must be contiguous): several
    disjoint views of one large storage (e.g. the parts of a shared mapping still read by the GPU) can be
    page-locked without faulting in, or locking, the parts between them. Views must not share a page.
    torch's ``is_pinned()`` looks at the storage's first byte, not the view's, so for such views ask
    :func:`is_registered` (``view=True``) instead.

    Args:
        tensor: a CPU tensor (any dtype, shape; its storage, or with ``view=True`` its bytes, registered).
        view: register the view's byte range instead of the whole storage.

    Returns:
        ``tensor`` itself.

    Raises:
        PageLockLimitError: the driver refused to page-lock the memory.
    """
    _check_cpu_tensor("pin_", tensor)
    storage = tensor.untyped_storage()
    ptr, nbytes = _span("pin_", tensor, view)
    if nbytes == 0:
        return tensor
    runtime, why = _backend.cupy_runtime()
    if runtime is None:
        log_once("pin-noop", "tidal-arena: pin_ cannot page-lock (%s); tensors stay pageable", why)
        _backend.bump_pin("pin_noops")
        return tensor
    with _LOCK:
        if ptr in _REGISTERED:
            return tensor
        with profile_range("tidal::arena.pin_"):
            t0 = time.perf_counter()
            try:
                runtime.hostRegister(ptr, nbytes, PORTABLE)
            except Exception as exc:
                raise PageLockLimitError(
                    f"pin_: cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: {exc}. Fix: check ulimit -l "
                    "and free page-locked memory; a range overlapping another registration (e.g. a view of "
                    "an already pinned tensor) cannot be registered twice."
                ) from exc
            seconds = time.perf_counter() - t0
        _REGISTERED[ptr] = (storage, nbytes)
    _backend.bump_pin("pin_calls")
    _backend.bump_pin("pinned_in_place_bytes", nbytes)
    _backend.bump_pin("pin_seconds", seconds)
    logger.debug("tidal-arena: registered %d bytes in %.3f s", nbytes, seconds)
    return tensor


def unpin_(tensor: torch.Tensor, *, view: bool = False) -> torch.Tensor:
    """Undo :func:`pin_`: unregister ``tensor``'s storage (its data is untouched) and drop the reference.

    Args:
        tensor: a CPU tensor previously passed to :func:`pin_` (or a tensor over the same storage).
        view: the range was registered with ``pin_(tensor, view=True)``.

    Returns:
        ``tensor`` itself.

    Raises:
        ArenaError: CUDA is present and the storage was not pinned by :func:`pin_`.
    """
    _check_cpu_tensor("unpin_", tensor)
    ptr, nbytes = _span("unpin_", tensor, view)
    if nbytes == 0:
        return tensor
    runtime, _why = _backend.cupy_runtime()
    if runtime is None:
        return tensor  # pin_ was a recorded no-op: nothing to undo
    with _LOCK:
        entry = _REGISTERED.pop(ptr, None)
        if entry is None:
            raise ArenaError(
                f"unpin_: the storage at {ptr:#x} was not pinned by pin_ (or was already unpinned). "
                "Pass the tensor given to pin_."
            )
        runtime.hostUnregister(ptr)
    _backend.bump_pin("pinned_in_place_bytes", -entry[1])
    return tensor


def is_registered(tensor: torch.Tensor, *, view: bool = False) -> bool:
    """True when ``tensor``'s storage (with ``view=True``: its own byte range) is page-locked by :func:`pin_`."""
    ptr = tensor.data_ptr() if view else tensor.untyped_storage().data_ptr()
    with _LOCK:
        return ptr in _REGISTERED
