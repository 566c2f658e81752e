"""Saved-activation bytes of a block, calibrated by one traced forward under ``saved_tensors_hooks``.

The block runs once per shape on the meta device (no memory, no arithmetic: milliseconds), with its
parameters swapped for meta stand-ins through ``torch.func.functional_call`` when the model holds real
weights. Every tensor autograd saves is sorted into:

- weights (parameters and views of them): not activations, they stream with the weights;
- shared inputs (rotary tables, an attention mask): made once per forward and passed to every block;
- activations: the rest.

and counted three ways, each as a :class:`ByteRate` (bytes per token, per token per position of the
sequence for T x T scores or a materialized mask, and per position once for the batch for rotary tables):

- ``keep``: distinct storages of the activations: what the block holds on the device until backward;
- ``offload``: distinct saved views (storage, offset, shape, strides, dtype) of activations and shared
  inputs: what tidal-stream's offload hook copies to the host and back (it shares one copy between
  saves of the same view, never between two views of one storage, and does not tell shared inputs apart);
- ``saved``: every saved reference, repeats included: what a plain hook census adds up.

Results are cached per (block class, parameter shapes and dtypes, attention implementation, input
shapes, torch/transformers version), so a repeated ``census`` costs one dictionary lookup per block kind.
A block that cannot run on the meta device is traced on its own device, and when that fails too the
per-linear formula is used; either fallback is logged and recorded in the census notes.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tidal_plan.activations import (
    _capture_block_inputs,
    _first_tensor,
    _heuristic,
    _KernelCount,
    _meta_tracing,
    _model_device,
    _tensors,
)

__all__ = ["ByteRate", "SavedBytes", "block_saved_bytes", "clear_cache", "estimate_saved_bytes"]

logger = logging.getLogger(__name__)

Source = Literal["meta-trace", "measured", "heuristic", "override"]


@dataclass(frozen=True)
class ByteRate:
    """Bytes of a batch as ``tokens * (per_token + per_position * seq_len) + per_sequence_position *
    seq_len``: linear in tokens, plus what grows with the square of the sequence (T x T scores, a
    [B, 1, T, T] mask), plus tables of one row per position shared by the whole batch (rotary cos/sin)."""

    per_token: int
    """Bytes per token."""
    per_position: int
    """Bytes per token per position of its sequence."""
    per_sequence_position: int
    """Bytes per position of the sequence, once for the whole batch."""

    def at(self, tokens: int, seq_len: int) -> int:
        """Bytes for ``tokens`` tokens in sequences of ``seq_len``."""
        return tokens * (self.per_token + self.per_position * seq_len) + self.per_sequence_position * seq_len


@dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd saves in one forward of a block (see the module docstring)."""

    keep: ByteRate
    """Distinct storages of the block's activations: what ``keep`` holds on the device."""
    offload: ByteRate
    """Distinct saved views of activations and shared inputs: what ``offload`` copies each way."""
    saved: ByteRate
    """Every saved reference, repeats and shared inputs included (a plain hook census's sum)."""
    shared: ByteRate
    """Distinct storages of shared inputs the block saves (rotary tables, a float mask): held once per
    forward, not once per block."""
    input: int
    """Bytes per token of the block's main input (hidden states): what ``recompute`` keeps."""
    kernels: int
    """Device operations one forward of the block runs (views excluded); 0: unknown."""
    source: Source
    """``"meta-trace"`` (traced on the meta device), ``"measured"`` (traced on the model's device),
    ``"heuristic"`` (per-linear formula) or ``"override"``."""


@dataclass
class _Count:
    """Raw byte sums of one traced forward."""

    keep: int = 0
    offload: int = 0
    saved: int = 0
    shared: int = 0
    kernels: int = 0


_CACHE: dict[tuple[Any, ...], SavedBytes] = {}


def clear_cache() -> None:
    """Forget every calibrated block (tests; a process that patches modeling code at run time)."""
    _CACHE.clear()


@contextlib.contextmanager
def _meta_sdpa_with_mask() -> Any:
    """On top of :func:`_meta_tracing`: a fused attention that also saves an explicit ``attn_mask``
    (the memory-efficient CUDA kernel and the CPU flash kernel both keep it for backward)."""
    fused = torch.nn.functional.scaled_dot_product_attention

    class _MaskSaved(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            ctx.save_for_backward(mask)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # pragma: no cover
            return grad, None

    def sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, *a: Any, **kw: Any
    ) -> Any:
        out = fused(q, k, v)  # [B, H, T, Dv]
        if isinstance(attn_mask, torch.Tensor):
            if attn_mask.dtype == torch.bool:
                # torch turns a boolean mask into a new additive one of q's dtype in every call (its
                # storage is the block's own, not shared) and the kernel saves that
                attn_mask = torch.empty(
                    attn_mask.shape, dtype=q.dtype, device=attn_mask.device
                )  # [B, 1, T, S]
            out = _MaskSaved.apply(out, attn_mask)
        return out

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = fused


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _trace(block: nn.Module, args: tuple, kwargs: dict[str, Any], on_meta: bool) -> tuple[_Count, int]:
    """Run ``block`` once under ``saved_tensors_hooks``; byte sums of what it saves, and its tokens."""
    x, positional, where = _first_tensor(args, kwargs)
    params = dict(block.named_parameters(remove_duplicate=False))
    buffers = dict(block.named_buffers(remove_duplicate=False))
    if on_meta and x.device.type != "meta":
        # stand-ins with the weights' shapes, dtypes and requires_grad: nothing is computed or allocated
        swap = {
            n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in params.items()
        }
        swap.update({n: torch.empty_like(b, device="meta") for n, b in buffers.items()})
        args, kwargs = _to_meta(args), _to_meta(kwargs)
        x, _, _ = _first_tensor(args, kwargs)
    else:
        swap = {}
    x = x.detach().requires_grad_(True)
    if positional:
        args = (*args[:where], x, *args[where + 1 :])
    else:
        kwargs = {**kwargs, where: x}
    weights = {_storage_key(t) for t in (swap or {**params, **buffers}).values()}
    shared = {_storage_key(t) for t in _tensors((args, kwargs)) if t is not x}
    keep: dict[int, int] = {}
    shared_seen: dict[int, int] = {}
    views: set[tuple[Any, ...]] = set()
    c = _Count()
    hold: list[torch.Tensor] = []  # keeps every saved tensor alive so storage ids stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if isinstance(t, nn.Parameter) or key in weights:
            return t
        hold.append(t)
        nbytes = t.numel() * t.element_size()
        c.saved += nbytes
        view = (key, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view not in views:
            views.add(view)
            c.offload += nbytes
        (shared_seen if key in shared else keep)[key] = t.untyped_storage().nbytes()
        return t

    counter = _KernelCount()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        if swap:
            torch.func.functional_call(block, swap, args, kwargs, strict=False)
        else:
            block(*args, **kwargs)
    c.keep, c.shared, c.kernels = sum(keep.values()), sum(shared_seen.values()), counter.kernels
    tokens = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
    return c, tokens


def _to_meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to("meta")
    if isinstance(obj, tuple):
        return tuple(_to_meta(o) for o in obj)
    if isinstance(obj, list):
        return [_to_meta(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_meta(v) for k, v in obj.items()}
    return obj


def _seq_len(args: tuple, kwargs: dict[str, Any]) -> int:
    x, _, _ = _first_tensor(args, kwargs)
    return int(x.shape[-2]) if x.dim() >= 2 else 1


def _fit(
    calls: list[tuple[tuple, dict[str, Any]]], block: nn.Module, on_meta: bool, source: Source
) -> SavedBytes:
    """Trace at each captured (batch, sequence length) and fit :class:`ByteRate` to the byte sums.

    [Note: with traces at (1, T), (1, 2T) and (2, T) the three terms of a ByteRate are determined
    exactly: bytes = B*S*a + B*S*S*b + S*c. Fewer traces (explicit example inputs) fit fewer terms: one
    gives ``a`` alone, two of one batch give ``a`` and ``b``. Least squares on exact sums is exact.]
    """
    runs = []
    for args, kwargs in calls:
        c, _ = _trace(block, args, kwargs, on_meta)
        x, _, _ = _first_tensor(args, kwargs)
        batch = x.numel() // (x.shape[-1] * x.shape[-2]) if x.dim() >= 2 else 1
        runs.append((c, batch, _seq_len(args, kwargs)))
    batches = {r[1] for r in runs}
    seqs = {r[2] for r in runs}
    # columns: per token, per token per position, per sequence position
    cols = [0] + ([1] if len(seqs) > 1 else []) + ([2] if len(batches) > 1 else [])
    rows = torch.tensor([[[b * s, b * s * s, s][k] for k in cols] for _, b, s in runs], dtype=torch.float64)

    def fit(field: str) -> ByteRate:
        y = torch.tensor([[float(getattr(c, field))] for c, _, _ in runs], dtype=torch.float64)
        sol = torch.linalg.lstsq(rows, y).solution.flatten().tolist()
        terms = [0, 0, 0]
        for k, v in zip(cols, sol):
            terms[k] = max(0, round(v))
        return ByteRate(*terms)

    x, _, _ = _first_tensor(*calls[0])
    return SavedBytes(
        keep=fit("keep"),
        offload=fit("offload"),
        saved=fit("saved"),
        shared=fit("shared"),
        input=x.shape[-1] * x.element_size(),
        kernels=runs[0][0].kernels,
        source=source,
    )


def _versions() -> tuple[str, str]:
    import sys

    tf = sys.modules.get("transformers")
    return torch.__version__, str(getattr(tf, "__version__", ""))


def _model_key(model: nn.Module, seq_len: int) -> tuple[Any, ...]:
    """The model's part of a block's cache key: its class, the attention implementation and the config's
    other scalars (head counts, head dim, window, activation: equal weight shapes can hide them) and the
    trace length."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    scalars = tuple(
        sorted((k, v) for k, v in vars(config).items() if isinstance(v, (int, float, str, bool, type(None))))
        if config is not None
        else ()
    )
    return type(model).__qualname__, attn, scalars, seq_len


def _block_key(block: nn.Module) -> tuple[Any, ...]:
    """The block's part: its class, weights' shapes/dtypes/grad flags, and train/eval."""
    shapes = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad)
        for n, p in block.named_parameters(remove_duplicate=False)
    )
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers(remove_duplicate=False))
    cls = type(block)
    return cls.__module__, cls.__qualname__, shapes, bufs, block.training


def block_saved_bytes(
    model: nn.Module,
    block: nn.Module,
    calls: list[tuple[tuple, dict[str, Any]]],
    *,
    key: tuple[Any, ...] | None = None,
    trace: Literal["meta", "device"] = "meta",
) -> SavedBytes:
    """Calibrate one block: a meta-device trace, else a trace on the model's device (logged).

    Args:
        model: The model the block belongs to (its config names the attention implementation).
        block: The block.
        calls: The block's ``(args, kwargs)`` at one or two sequence lengths (T and 2T).
        key: Cache key (None: no caching).
        trace: ``"meta"``: trace meta stand-ins (no memory, no arithmetic), falling back to the model's
            device; ``"device"``: run the block on the model's device (what its kernels really save).

    Returns:
        The block's saved bytes. Raises what the trace on the model's device raised if both traces fail.
    """
    if key is not None and key in _CACHE:
        return _CACHE[key]
    on_model_meta = _first_tensor(*calls[0])[0].device.type == "meta"
    if trace == "device" and not on_model_meta:
        result = _fit(calls, block, on_meta=False, source="measured")
        if key is not None:
            _CACHE[key] = result
        return result
    try:
        with _meta_tracing(True), _meta_sdpa_with_mask():
            result = _fit(calls, block, on_meta=True, source="meta-trace")
    except Exception as e:
        if on_model_meta:
            raise
        logger.warning(
            "meta-device trace of %s failed (%s: %s); tracing on %s",
            type(block).__name__,
            type(e).__name__,
            e,
            _first_tensor(*calls[0])[0].device,
        )
        result = _fit(calls, block, on_meta=False, source="measured")
    if key is not None:
        _CACHE[key] = result
    return result


def estimate_saved_bytes(
    model: nn.Module,
    stack: nn.Module,
    *,
    seq_len: int,
    example_inputs: dict[str, Any] | None,
    override: int | None,
    trace: Literal["meta", "device"] = "meta",
) -> tuple[list[SavedBytes], list[str]]:
    """Per block of ``stack``: its :class:`SavedBytes`; plus notes on anything estimated.

    Blocks of one class with the same weight shapes are traced once (and once per process, see the
    module docstring). ``override`` replaces ``keep`` and ``offload`` of every block.
    """
    notes: list[str] = []
    device = _model_device(model)
    versions = _versions()
    model_key = (*_model_key(model, seq_len), trace)
    local_keys = [(*_block_key(blk), *model_key) for blk in stack]
    # explicit inputs may change the path through the block: no process-wide cache for them
    keys = {k: (None if example_inputs is not None else (*k, *versions)) for k in local_keys}
    local: dict[tuple[Any, ...], SavedBytes] = {k: _CACHE[g] for k, g in keys.items() if g in _CACHE}
    calls: list[tuple[tuple, dict[str, Any]]] | None = None
    if len(local) < len(keys):
        try:
            with _meta_tracing(device.type == "meta"):
                calls = [_capture_block_inputs(model, stack[0], seq_len, example_inputs)]
                if example_inputs is None:
                    calls.append(_capture_block_inputs(model, stack[0], 2 * seq_len, None))
                    ids = torch.zeros(2, seq_len, dtype=torch.long, device=device)  # [2, T]
                    calls.append(_capture_block_inputs(model, stack[0], seq_len, {"input_ids": ids}))
        except Exception as e:
            logger.warning("could not capture the first block's inputs (%s: %s)", type(e).__name__, e)
            notes.append(f"block inputs not captured ({type(e).__name__}: {e}); per-linear formula used")
    out: list[SavedBytes] = []
    for blk, k in zip(stack, local_keys):
        if k not in local:
            local[k] = _one(model, blk, calls, keys[k], notes, trace)
        out.append(local[k])
    if override is not None:
        out = [_overridden(s, override) for s in out]
    return out, notes


def _one(
    model: nn.Module,
    blk: nn.Module,
    calls: list[tuple[tuple, dict[str, Any]]] | None,
    key: tuple[Any, ...] | None,
    notes: list[str],
    trace: Literal["meta", "device"],
) -> SavedBytes:
    if calls is not None:
        try:
            return block_saved_bytes(model, blk, calls, key=key, trace=trace)
        except Exception as e:
            logger.warning(
                "activation trace of %s failed (%s: %s); per-linear formula used",
                type(blk).__name__,
                type(e).__name__,
                e,
            )
            notes.append(
                f"activation trace of {type(blk).__name__} failed ({type(e).__name__}: {e}); per-linear formula used"
            )
    return _analytic(blk)


def _analytic(block: nn.Module) -> SavedBytes:
    """The per-linear formula: each linear saves its input and its output (ReLU/SiLU/products similar)."""
    per_token = _heuristic(block)
    first = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
    inp = first.in_features * first.weight.element_size() if first is not None else 0
    logger.info("%s: per-linear formula gives %d activation bytes per token", type(block).__name__, per_token)
    rate = ByteRate(per_token, 0, 0)
    return SavedBytes(rate, rate, rate, ByteRate(0, 0, 0), inp, 0, "heuristic")


def _overridden(s: SavedBytes, value: int) -> SavedBytes:
    rate = ByteRate(value, 0, 0)
    return SavedBytes(rate, rate, rate, ByteRate(0, 0, 0), s.input, s.kernels, "override")
