"""Configuration of the paged KV cache and the placement of layers (resident in VRAM or on the host)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tidal_kv.errors import KVCacheError, KVConfigError
from tidal_kv.policy import GATHER_STREAMS, GatherStream
from tidal_kv.storage import NF4_BLOCK

Storage = Literal["native", "fp8", "nf4"]
ResidentSpec = Literal["auto"] | int | Sequence[int]

_STORAGES = ("native", "fp8", "nf4")


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        accepted = "a positive int or None" if allow_none else "a positive int"
        raise KVConfigError(f"{name}={value!r} is not accepted: expected {accepted}; pass e.g. {name}=8.")


@dataclass(frozen=True)
class KVConfig:
    """Options of :class:`~tidal_kv.PagedKVCache`. Shapes left as ``None`` are taken from the first ``update``."""

    num_layers: int
    """Number of attention layers (no default)."""
    max_tokens: int
    """Tokens per sequence to preallocate for (no default); longer sequences still work, with a logged
    reallocation of the device buffers."""
    num_kv_heads: int | None = None
    """K/V heads per layer; default None = from the first update."""
    head_dim: int | None = None
    """Head dimension; default None = from the first update."""
    batch_size: int | None = None
    """Sequences per batch; default None = from the first update (a new batch size after ``reset`` reallocates)."""
    resident_layers: ResidentSpec = "auto"
    """Layers whose K/V stay in VRAM: "auto" (as many as the budget allows, the offloaded ones spread through
    the stack), an int count (spread), or an explicit list of layer indices; default "auto"."""
    page_tokens: int = 256
    """Tokens per host page (one device-to-host copy each time a page fills); default 256."""
    vram_budget: int | None = None
    """Bytes of VRAM the cache may use ("auto" placement); default None = ``vram_fraction`` of free VRAM."""
    vram_fraction: float = 0.5
    """Fraction of free VRAM the cache may use when ``vram_budget`` is None; default 0.5."""
    dtype: torch.dtype | None = None
    """Dtype of K/V (updates must match); default None = the first update's dtype."""
    storage: Storage = "native"
    """Host-page format: "native" (the K/V dtype), "fp8" (e4m3 with one fp32 scale per token and head,
    0.52x the host RAM and PCIe bytes of bf16 at head_dim 128, lossy) or "nf4" (NF4 with one absmax per 32
    elements, kept in the K/V dtype: 0.28x for bf16, lossier; head_dim a multiple of 32); default "native".
    Resident layers and each offloaded layer's partial page are always native."""
    device: torch.device | str | None = None
    """Device of the returned K/V; default None = the first update's device."""
    prefetch_slots: int = 2
    """Preallocated device slots that offloaded layers are gathered into (2 or 3; with 3 the copy runs two
    offloaded layers ahead); default 2."""
    gather_stream: GatherStream = "auto"
    """Where page gathers are issued: "side" (an H2D stream, overlapping compute), "compute" (the compute
    stream, no events: cheaper for a host-bound step whose copies fit in the device's idle time), or "auto"
    (the compute stream at batch 1 while the link time is a small share of the step; see
    :mod:`tidal_kv.policy`)."""

    def __post_init__(self) -> None:
        _positive_int("num_layers", self.num_layers)
        _positive_int("max_tokens", self.max_tokens)
        _positive_int("num_kv_heads", self.num_kv_heads, allow_none=True)
        _positive_int("head_dim", self.head_dim, allow_none=True)
        _positive_int("batch_size", self.batch_size, allow_none=True)
        _positive_int("page_tokens", self.page_tokens)
        if self.vram_budget is not None:
            _positive_int("vram_budget", self.vram_budget)
        if isinstance(self.vram_fraction, bool) or not isinstance(self.vram_fraction, (int, float)):
            raise KVConfigError(
                f"vram_fraction={self.vram_fraction!r} is not accepted: expected a float in (0, 1]; "
                "pass e.g. vram_fraction=0.5."
            )
        if not 0.0 < float(self.vram_fraction) <= 1.0:
            raise KVConfigError(
                f"vram_fraction={self.vram_fraction!r} is not accepted: expected a float in (0, 1]; "
                "pass e.g. vram_fraction=0.5."
            )
        if self.storage not in _STORAGES:
            raise KVConfigError(
                f"storage={self.storage!r} is not accepted: expected one of {_STORAGES}; "
                'pass storage="native" (exact), "fp8" (about half the host bytes) or "nf4" (about a quarter).'
            )
        if self.head_dim is not None:
            check_head_dim(self.storage, self.head_dim)
        if self.dtype is not None and (
            not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point
        ):
            raise KVConfigError(
                f"dtype={self.dtype!r} is not accepted: expected a floating torch.dtype or None; "
                "pass e.g. dtype=torch.bfloat16."
            )
        if self.dtype is not None and self.dtype.itemsize == 1:
            raise KVConfigError(
                f"dtype={self.dtype} is not accepted: K/V are computed in a 16- or 32-bit dtype; "
                'for 8-bit host pages pass storage="fp8" instead.'
            )
        if self.prefetch_slots not in (2, 3) or isinstance(self.prefetch_slots, bool):
            raise KVConfigError(
                f"prefetch_slots={self.prefetch_slots!r} is not accepted: expected 2 or 3; pass prefetch_slots=2."
            )
        if self.gather_stream not in GATHER_STREAMS:
            raise KVConfigError(
                f"gather_stream={self.gather_stream!r} is not accepted: expected one of "
                f'{", ".join(repr(g) for g in GATHER_STREAMS)}; pass gather_stream="auto".'
            )
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise KVConfigError(
                    f"device={self.device!r} is not accepted: expected a torch device such as 'cuda' or 'cpu'."
                ) from e
        self._check_resident_spec()

    @staticmethod
    def check_no_grad(k: object, v: object) -> None:
        """Refuse K/V that require grad while grad mode is on: the cache keeps K/V without their autograd
        history (host pages cannot carry it), so gradients through cached tokens would be silently lost."""
        if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (k, v)):
            raise KVConfigError(
                "k/v require grad and grad mode is on: the cache keeps K/V without their autograd history "
                "(host pages cannot carry it), so gradients through cached tokens would be lost. Run "
                "generation under torch.no_grad() or torch.inference_mode() (generate() does), or pass "
                "k.detach(), v.detach()."
            )

    def check_update(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise :class:`KVConfigError` when ``k``/``v`` are not ``[B, H, T_new, D]`` matching the fixed options."""
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise KVConfigError(
                f"k={got} is not accepted: expected a tensor [batch, kv_heads, new_tokens, head_dim]."
            )
        if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
            raise KVConfigError(
                f"v {tuple(v.shape)} {v.dtype} on {v.device} does not match k {tuple(k.shape)} {k.dtype} on "
                f"{k.device}: pass keys and values of one shape, dtype and device."
            )
        if k.shape[2] == 0:
            raise KVConfigError("k has 0 new tokens: pass at least one token per update.")
        c = self
        want = {
            "batch_size": (c.batch_size, k.shape[0]),
            "num_kv_heads": (c.num_kv_heads, k.shape[1]),
            "head_dim": (c.head_dim, k.shape[3]),
        }
        for name, (fixed, got) in want.items():
            if fixed is not None and fixed != got:
                raise KVConfigError(f"k has {name}={got} but the cache was built with {name}={fixed}.")
        if c.dtype is not None and k.dtype != c.dtype:
            raise KVConfigError(f"k has dtype {k.dtype} but the cache was built with dtype={c.dtype}.")
        want_dev = torch.device(c.device) if c.device is not None else None
        if want_dev is not None and (
            k.device.type != want_dev.type or want_dev.index not in (None, k.device.index)
        ):
            raise KVConfigError(f"k is on {k.device} but the cache was built with device={c.device!r}.")

    def _check_resident_spec(self) -> None:
        spec = self.resident_layers
        if spec == "auto":
            return
        if isinstance(spec, (bool, str)):
            raise KVConfigError(
                f"resident_layers={spec!r} is not accepted: expected 'auto', an int in [0, {self.num_layers}] "
                "or a list of layer indices; pass e.g. resident_layers='auto'."
            )
        if isinstance(spec, int):
            if not 0 <= spec <= self.num_layers:
                raise KVConfigError(
                    f"resident_layers={spec} is not accepted: expected a count in [0, num_layers={self.num_layers}]."
                )
            return
        if not isinstance(spec, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in spec
        ):
            raise KVConfigError(
                f"resident_layers={spec!r} is not accepted: expected 'auto', an int or a list of int layer "
                "indices; pass e.g. resident_layers=[0, 2, 4]."
            )
        bad = [i for i in spec if not 0 <= i < self.num_layers]
        if bad or len(set(spec)) != len(spec):
            raise KVConfigError(
                f"resident_layers={list(spec)} is not accepted: indices must be distinct and in "
                f"[0, {self.num_layers}) (got out-of-range or repeated {bad or sorted(spec)})."
            )


def check_head_dim(storage: str, head_dim: int) -> None:
    """Refuse a head dim the page format cannot store ("nf4" scales whole blocks of a head's row).

    Raises:
        KVConfigError: naming the storage, the head dim and what would work.
    """
    if storage == "nf4" and head_dim % NF4_BLOCK:
        raise KVConfigError(
            f'storage="nf4" is not accepted with head_dim={head_dim}: NF4 pages need a head_dim that is a '
            f'multiple of {NF4_BLOCK} (one scale per {NF4_BLOCK} elements); pass storage="fp8" or "native".'
        )


def same_layout(
    k: object, v: object, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``k``/``v`` are plain ``[B, H, T>0, D]`` tensors of ``shape`` (B, H, D), ``dtype`` and ``device``.

    The decode loop's cheap test: a True here needs no further checks; anything else goes through
    :meth:`KVConfig.check_update` and the cache's own checks, which explain what is wrong.
    """
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
        return False
    ks = k.shape
    return (
        (ks[0], ks[1], ks[3]) == shape and ks[2] > 0 and v.shape == ks
        and k.dtype == dtype and v.dtype == dtype and k.device == device and v.device == device
    )  # fmt: skip


def spread_offloaded(num_layers: int, num_offloaded: int) -> list[int]:
    """Indices of ``num_offloaded`` layers spread evenly through a stack of ``num_layers``.

    Spreading leaves resident layers between offloaded ones, so each offloaded layer's host-to-device copy
    overlaps the compute of the layers before it.

    Args:
        num_layers: Layers in the stack.
        num_offloaded: How many of them to offload (0..num_layers).

    Returns:
        Sorted distinct layer indices.
    """
    assert 0 <= num_offloaded <= num_layers
    if num_offloaded == 0:
        return []
    # centre of each of num_offloaded equal strides: 8 layers, 4 offloaded -> 1, 3, 5, 7
    return sorted({math.floor((i + 0.5) * num_layers / num_offloaded) for i in range(num_offloaded)})


@dataclass(frozen=True)
class LayerBytes:
    """Device bytes that placement weighs (at the current capacity)."""

    layer: int
    """K+V of one resident layer (also one gather slot)."""
    tail: int
    """K+V of one offloaded layer's partial page."""
    staging: int
    """The flush staging chunk, present when any layer is offloaded."""
    slot_stage: int = 0
    """Quantized storage: one gather slot's staging buffer (a layer's pages in their stored format, at the
    capacity); 0 for native pages, which land in the slot directly."""

    def total(self, num_layers: int, resident: int, slots: int) -> int:
        """Device bytes with ``resident`` layers in VRAM and ``slots`` gather slots for the rest."""
        off = num_layers - resident
        if not off:
            return resident * self.layer
        slot = self.layer + self.slot_stage
        return resident * self.layer + min(slots, off) * slot + off * self.tail + self.staging


def place_layers(config: KVConfig, budget: int | None, sizes: LayerBytes) -> tuple[list[int], str]:
    """The offloaded layers for ``config.resident_layers``, and a one-line note of the decision.

    Args:
        config: The cache options.
        budget: Device bytes for "auto" (None: keep every layer resident, the CPU default).
        sizes: Device bytes of the parts.

    Returns:
        ``(offloaded layer indices, note)``.

    Raises:
        KVCacheError: "auto" and not even the slots fit the budget.
    """
    n, spec = config.num_layers, config.resident_layers
    if spec == "auto":
        if budget is None:
            return (
                [],
                "resident_layers='auto' on a CPU device without vram_budget: every layer stays resident",
            )
        fits = [r for r in range(n, -1, -1) if sizes.total(n, r, config.prefetch_slots) <= budget]
        if not fits:
            need = sizes.total(n, 0, config.prefetch_slots)
            raise KVCacheError(
                f"vram_budget={budget} bytes cannot hold even the gather slots: with every layer offloaded the "
                f"cache needs {need} bytes ({config.prefetch_slots} slots of {sizes.layer}, partial pages and "
                "staging). Fix: raise vram_budget/vram_fraction, lower max_tokens, or use a smaller batch."
            )
        offloaded = spread_offloaded(n, n - fits[0])
    elif isinstance(spec, int):
        offloaded = spread_offloaded(n, n - spec)
    else:
        offloaded = sorted(set(range(n)) - set(spec))
    return offloaded, f"KV placement: {n - len(offloaded)} of {n} layers resident, offloaded {offloaded}"
