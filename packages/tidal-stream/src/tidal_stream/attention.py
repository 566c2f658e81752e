"""Pick PyTorch's fastest SDPA backend for the model's attention shapes, timed once per shape.

:func:`time_sdpa_backends` runs ``F.scaled_dot_product_attention`` (forward, and backward when asked)
under each candidate backend (``torch.nn.attention.sdpa_kernel``) on random inputs of the given shape
and returns an :class:`AttentionChoice` (the fastest backend, the times, and why the others were left
out). In deterministic mode (``torch.are_deterministic_algorithms_enabled()`` or ``deterministic=True``)
the backends whose backward PyTorch documents as non-deterministic — memory-efficient and cuDNN — are
left out; flash (torch switches its backward to the deterministic variant under deterministic
algorithms) and math remain.

:func:`install_attention` ``(modules, backend="auto", *, deterministic=None, record=None)`` puts a
context around each given module's forward (module pre/post hooks; pass the blocks, so a recompute in
backward runs under it too): a fixed backend name enters ``sdpa_kernel([backend])``; ``"auto"`` runs a
forward with new input shapes under a ``TorchFunctionMode`` that times each SDPA call's shapes once
(cached) and routes the call to the fastest backend, then runs later forwards with the same input
shapes under plain ``sdpa_kernel`` of the backend found (no per-op overhead). Every choice is logged
and passed to ``record(kind, message, **data)``.

Timing calls with an explicit ``attn_mask`` use the mask's shape and dtype; dropout is timed off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from tidal_stream.errors import option_error

__all__ = ["BACKENDS", "AttentionChoice", "AttentionHandle", "install_attention", "time_sdpa_backends"]

logger = logging.getLogger(__name__)

#: Backend names accepted by ``backend=`` / ``wrap(attention=...)``.
BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_NONDETERMINISTIC = ("efficient", "cudnn")


@dataclass(frozen=True)
class AttentionChoice:
    """The outcome of timing the SDPA backends on one shape."""

    backend: str
    """The fastest usable backend's name."""
    times_ms: dict[str, float]
    """Median milliseconds per call (forward + backward when timed with backward) of each usable backend."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Backends left out, with the reason (unsupported for the shape, or non-deterministic)."""
    key: tuple[Any, ...] = ()
    """The shape key: (q shape, k shape, v shape, dtype, device, causal, mask shape, backward)."""


_CACHE: dict[tuple[Any, ...], AttentionChoice] = {}
_LOCK = threading.Lock()


def _deterministic(flag: bool | None) -> bool:
    return torch.are_deterministic_algorithms_enabled() if flag is None else bool(flag)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sdpa_backends(
    q_shape: Sequence[int],
    k_shape: Sequence[int] | None = None,
    v_shape: Sequence[int] | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    is_causal: bool = True,
    mask_shape: Sequence[int] | None = None,
    mask_dtype: torch.dtype = torch.bool,
    backward: bool = True,
    deterministic: bool | None = None,
    candidates: Sequence[str] = ("flash", "cudnn", "efficient", "math"),
    repeats: int = 5,
) -> AttentionChoice:
    """Time each candidate SDPA backend on ``[B, H, T, Dh]`` inputs; cached per shape key.

    Args:
        q_shape: Query shape ``[B, Hq, Tq, Dh]``.
        k_shape: Key shape (default: ``q_shape``); ``Hk < Hq`` for GQA needs ``enable_gqa`` support.
        v_shape: Value shape (default: ``k_shape``).
        dtype: Element type.
        device: Where to time.
        is_causal: Causal masking.
        mask_shape: Shape of an explicit ``attn_mask`` (then ``is_causal`` is ignored).
        mask_dtype: Dtype of that mask.
        backward: Time forward + backward (training) rather than forward only.
        deterministic: Leave out non-deterministic backends; None follows torch's global setting.
        candidates: Backend names to try, from :data:`BACKENDS`.
        repeats: Timed calls per backend (after one warm-up); the median is kept.

    Returns:
        The :class:`AttentionChoice`.

    Raises:
        OptionError: an unknown backend name, or none of the candidates can run this shape.
    """
    for c in candidates:
        if c not in BACKENDS:
            raise option_error("attention", c, f"one of {list(BACKENDS)}")
    dev = torch.device(device)
    k_shape = tuple(k_shape or q_shape)
    v_shape = tuple(v_shape or k_shape)
    det = _deterministic(deterministic)
    key = (
        tuple(q_shape),
        k_shape,
        v_shape,
        dtype,
        str(dev),
        bool(is_causal),
        tuple(mask_shape) if mask_shape else None,
        bool(backward),
        det,
        tuple(candidates),
    )
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(s, generator=g).to(dev, dtype).requires_grad_(backward)
        for s in (q_shape, k_shape, v_shape)
    )
    mask = None
    if mask_shape:
        mask = torch.rand(mask_shape, generator=g).to(dev) > 0.3 if mask_dtype == torch.bool else None
        if mask is None:
            mask = torch.randn(mask_shape, generator=g).to(dev, mask_dtype)
    times: dict[str, float] = {}
    excluded: dict[str, str] = {}
    for name in candidates:
        if det and name in _NONDETERMINISTIC:
            excluded[name] = "non-deterministic backward (deterministic mode)"
            continue
        try:
            times[name] = _time_one(
                BACKENDS[name], q, k, v, mask, is_causal and mask is None, backward, repeats
            )
        except RuntimeError as e:
            excluded[name] = f"unsupported: {str(e).splitlines()[0][:120]}"
    if not times:
        raise option_error(
            "attention",
            list(candidates),
            "a backend that supports this shape",
            f"add 'math' to the candidates (left out: {excluded}).",
        )
    best = min(times, key=times.__getitem__)
    choice = AttentionChoice(best, times, excluded, key)
    with _LOCK:
        _CACHE[key] = choice
    logger.info(
        "SDPA backend for q%s k%s %s: %s (times ms %s; left out %s)",
        q_shape,
        k_shape,
        dtype,
        best,
        times,
        excluded,
    )
    return choice


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _time_one(
    backend: SDPBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    backward: bool,
    repeats: int,
) -> float:
    gqa = q.shape[1] != k.shape[1]
    samples = []
    # timing may run inside a block's forward whose saved-tensor hooks checkpoint or offload what autograd
    # saves: the timing graph is private, so its tensors are saved as they are (else its backward would
    # recompute the enclosing block, or copy the timing tensors to the host)
    with (
        torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is),
        warnings.catch_warnings(),
        sdpa_kernel([backend]),
    ):
        warnings.simplefilter("ignore")  # torch warns per backend it rejects; rejection is the answer
        for r in range(repeats + 1):
            _sync(q.device)
            t0 = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
            if backward:
                (gq,) = torch.autograd.grad(out.sum(), (q,))
                del gq
            _sync(q.device)
            if r:  # the first call is warm-up
                samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


_NO_SDPA = object()  # marker: a forward with these inputs made no SDPA call


def _signature(args: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Shapes and dtypes of a forward's tensor arguments: what decides its SDPA shapes."""
    items = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return tuple(
        (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else type(a) for a in items
    )


class _SDPAMode(TorchFunctionMode):
    def __init__(self, handle: AttentionHandle, key: tuple[Any, ...]) -> None:
        super().__init__()
        self.handle = handle
        self.key = key
        self.seen: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        name = self.handle._backend_for(args, kwargs)
        self.seen.add(name)
        with sdpa_kernel([BACKENDS[name]]):
            return func(*args, **kwargs)


class AttentionHandle:
    """SDPA routing installed on some modules; ``.choices`` holds the decisions, ``.remove()`` undoes."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        backend: str,
        deterministic: bool | None,
        record: Callable[..., None] | None,
    ) -> None:
        self.backend = backend
        self.deterministic = deterministic
        self.record = record
        self.choices: dict[tuple[Any, ...], AttentionChoice] = {}
        self._local = threading.local()
        self._by_input: dict[tuple[Any, ...], Any] = {}  # forward input signature -> backend name
        self._hooks = []
        for m in modules:
            self._hooks.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        if stack:  # nested inside a routed module: the outer context already applies
            stack.append(None)
            return
        if self.backend != "auto":
            ctx: Any = sdpa_kernel([BACKENDS[self.backend]])
        else:
            key = (id(module), *_signature(args, kwargs))  # per module: its SDPA shapes are its own
            known = self._by_input.get(key)
            # a forward whose inputs were seen runs under the backend found then (cheap: no per-op hook);
            # new input shapes run once under the mode, which times and records the SDPA calls
            ctx = sdpa_kernel([BACKENDS[known]]) if isinstance(known, str) else _SDPAMode(self, key)
            if known is _NO_SDPA:
                ctx = contextlib.nullcontext()
        ctx.__enter__()
        stack.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._local.__dict__.get("stack", [])
        if stack:
            ctx = stack.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
                if isinstance(ctx, _SDPAMode):
                    seen = ctx.seen
                    # one backend for every SDPA call of this forward: reuse it; several: keep the mode
                    self._by_input[ctx.key] = (
                        seen.pop() if len(seen) == 1 else (_NO_SDPA if not seen else None)
                    )

    def _backend_for(self, args: Any, kwargs: dict[str, Any]) -> str:
        if self.backend != "auto":
            return self.backend
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = bool(kwargs.get("is_causal", False))
        choice = time_sdpa_backends(
            tuple(q.shape),
            tuple(k.shape),
            tuple(v.shape),
            dtype=q.dtype,
            device=q.device,
            is_causal=causal,
            mask_shape=tuple(mask.shape) if mask is not None else None,
            mask_dtype=mask.dtype if mask is not None else torch.bool,
            backward=torch.is_grad_enabled() and q.requires_grad,
            deterministic=self.deterministic,
            candidates=("flash", "cudnn", "efficient", "math") if q.is_cuda else ("flash", "math"),
        )
        if choice.key not in self.choices:
            self.choices[choice.key] = choice
            if self.record is not None:
                self.record(
                    "attention",
                    f"SDPA {choice.backend} for q{tuple(q.shape)} {q.dtype}",
                    times_ms=choice.times_ms,
                    excluded=choice.excluded,
                )
        return choice.backend

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def install_attention(
    modules: Sequence[nn.Module] | nn.Module,
    backend: str = "auto",
    *,
    deterministic: bool | None = None,
    record: Callable[..., None] | None = None,
) -> AttentionHandle:
    """Route every SDPA call inside ``modules``' forwards to one backend (``"auto"``: the fastest per shape).

    Args:
        modules: A module or the blocks (recommended: the blocks, so recomputes are routed too).
        backend: ``"auto"`` or one of :data:`BACKENDS`.
        deterministic: Leave out non-deterministic backends under ``"auto"``; None follows torch.
        record: Optional decision-log callback ``record(kind, message, **data)``.

    Returns:
        An :class:`AttentionHandle`.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise option_error("attention", backend, f"'auto' or one of {list(BACKENDS)}")
    if _deterministic(deterministic) and backend in _NONDETERMINISTIC:
        raise option_error(
            "attention",
            backend,
            "a deterministic backend ('flash', 'math') in deterministic mode",
            "use 'auto'.",
        )
    # a ModuleList is never called itself: hook its members
    mods = (
        [modules]
        if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList)
        else list(modules)
    )
    return AttentionHandle(mods, backend, deterministic, record)
