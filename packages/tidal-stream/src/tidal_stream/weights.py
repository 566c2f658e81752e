"""Installers of weight streaming and activation policies — what ``wrap()`` calls for its part-2 options.

Contract with ``wrap()`` (``tidal_stream.wrap._part2``):

- :func:`install` ``(session, model, options) -> WeightsExtension | None`` reads the part-2 options of
  ``WrapOptions`` (``param_offload``, ``activation_offload``, ``recompute``, ``prefetch_depth``,
  ``max_inflight_bytes``, ``blocks``, ``attention``), finds the block stack, chooses the streamed blocks
  and per-block activation policies, installs them on ``session.streams`` and records each decision
  with ``session.record(kind, message, **data)``. It returns None when nothing is to be installed.
  It must run after the optimizer has read the weights (streamed parameters' device storage is emptied).
- The returned :class:`WeightsExtension` has ``report() -> dict`` (merged into ``memory_report()``),
  ``remove()`` (undo; every block resident again), ``host_tensor(param) -> Tensor | None`` and
  ``set_before_fetch(fn)`` and ``timeline_recorder()`` (a per-block PNG timeline of a step).

[Note: host optimizer and streamed weights] A streamed parameter's device storage is empty between
uses, so a host optimizer must not copy its new value into ``param.data``. Trained weights stream only
when ``session.optimizer.host_weight_updates`` is True, declaring that the optimizer writes the host copy
``ext.host_tensor(param)`` (None for parameters that are not streamed), and registers
``ext.set_before_fetch(fn)`` with ``fn(block_index, tensors)`` blocking until its pending updates of
``tensors`` have been written there; the next refill then carries the new weights to the device.
Gradients of streamed parameters are ordinary device ``.grad`` tensors.

Lower-level entry points, usable without a session:

- :func:`install_weight_streaming` ``(model, blocks, streamed_indices, device, *, prefetch_depth,
  max_inflight_bytes, arena, streams=None, adaptive=False) -> WeightStreamingHandle`` — a
  :class:`~tidal_stream.streamed_blocks.StreamedBlocks` over the streamed blocks (over all blocks, the
  others kept resident, when ``adaptive``, so :meth:`WeightStreamingHandle.set_streamed` can move
  blocks between VRAM and the host between steps).
- :func:`install_activation_policy` (from :mod:`tidal_stream.activations`).
- :func:`rebalance` — the adaptation rule: from a measured step peak and the budget, which blocks to
  stream next; :func:`keep_latest_activations` — room left under the budget keeps the latest blocks'
  activations in VRAM (apply with ``ActivationHandle.set_policy``).

"auto" follows ``session.plan`` when ``wrap()`` made or was given one for this block stack: its streamed
blocks and per-block activation modes (the plan split the optimizer assuming them, so ignoring them
overruns the budget). Without a plan: ``param_offload="auto"`` streams the fewest leading blocks that
bring the weights under 60 % of the budget (none on the CPU); ``activation_offload="auto"`` and
``recompute="auto"`` keep activations. ``prefetch_depth=None`` is 1;
``attention="auto"`` routes the blocks' SDPA calls to the fastest backend per shape on CUDA
(:mod:`tidal_stream.attention`), a backend name routes them to that backend, None leaves them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tidal_stream.activations import ActivationHandle, install_activation_policy
from tidal_stream.attention import AttentionHandle, install_attention
from tidal_stream.block_stack import check_indices as _check_indices
from tidal_stream.block_stack import find_blocks, select_blocks
from tidal_stream.block_stack import resolve_blocks as _resolve_blocks
from tidal_stream.errors import option_error
from tidal_stream.options import mostly_trained
from tidal_stream.streamed_blocks import StreamedBlocks, StreamingError
from tidal_stream.timeline import TimelineRecorder

__all__ = [
    "WeightStreamingHandle",
    "WeightsExtension",
    "find_blocks",
    "install",
    "install_activation_policy",
    "install_weight_streaming",
    "keep_latest_activations",
    "rebalance",
    "select_blocks",
]

logger = logging.getLogger(__name__)

_AUTO_WEIGHT_SHARE = 0.6  # of the budget that resident weights may take under param_offload="auto"


class WeightStreamingHandle:
    """Weight streaming installed over (some of) a block stack; indices are of the full stack."""

    def __init__(
        self, blocks: list[nn.Module], streamed: list[int], sb: StreamedBlocks, adaptive: bool
    ) -> None:
        self.blocks = blocks
        self.adaptive = adaptive
        self.sb = sb
        # position in the StreamedBlocks list of each stack index it covers
        self._pos = {i: k for k, i in enumerate(range(len(blocks)) if adaptive else streamed)}
        self._streamed = sorted(streamed)
        self._ever = set(self._streamed)  # every block that streamed at some time
        self._changes: list[dict[str, Any]] = []  # {"stopped", "started", "h2d_bytes_before"} per change

    @property
    def streamed(self) -> list[int]:
        """Indices (in the block stack) of the blocks streamed now."""
        return list(self._streamed)

    def set_streamed(self, indices: Sequence[int]) -> None:
        """Stream exactly ``indices`` from now on (adaptive handles only; call between steps)."""
        if not self.adaptive:
            raise StreamingError(
                "WeightStreamingHandle.set_streamed: this handle was installed with adaptive=False; accepted: "
                "an adaptive handle. Fix: install_weight_streaming(..., adaptive=True)."
            )
        new = sorted(_check_indices("streamed_indices", indices, len(self.blocks)))
        for i in range(len(self.blocks)):
            self.sb.set_resident(self._pos[i], i not in new)
        old = set(self._streamed)
        self._note_change(stopped=sorted(old - set(new)), started=sorted(set(new) - old))
        self._streamed = new
        self._ever.update(new)

    def block_of(self, tensor: torch.Tensor) -> int | None:
        """Stack index of the streamed block that owns ``tensor``, or None when it is not streamed."""
        pos = self.sb.block_of(tensor)
        if pos is None:
            return None
        i = next(i for i, k in self._pos.items() if k == pos)
        return i if i in self._streamed else None

    def block_nbytes(self, i: int) -> int:
        """Device bytes of block ``i``'s (streamed) parameters and buffers."""
        return self.sb.block_bytes()[self._pos[i]]

    def keep_resident(self, indices: Sequence[int]) -> None:
        """Stop streaming the blocks ``indices`` (stack indices of streamed blocks): each is filled from
        its host copy and stays on the device from now on. Works on any handle; call between steps."""
        for i in _check_indices("indices", indices, len(self.blocks)):
            if i not in self._streamed:
                raise StreamingError(
                    f"WeightStreamingHandle.keep_resident: block {i} is not streamed; accepted: one of "
                    f"{self._streamed}. Fix: pass streamed block indices only."
                )
        stopped = _check_indices("indices", indices, len(self.blocks))
        for i in stopped:
            self.sb.set_resident(self._pos[i], True)
            self._streamed.remove(i)
        self._note_change(stopped=sorted(stopped), started=[])

    def _note_change(self, stopped: list[int], started: list[int]) -> None:
        if stopped or started:
            before = self.sb.h2d_bytes
            self._changes.append({"stopped": stopped, "started": started, "h2d_bytes_before": before})

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The host copy of a streamed block's parameter/buffer, or None when it is not streamed."""
        try:
            return self.sb.host_tensor(tensor)
        except StreamingError:
            return None

    def stats(self) -> dict[str, Any]:
        """``StreamedBlocks.stats()`` plus ``streamed`` (stack indices streamed now), ``streamed_ever``
        (every block that streamed at some time) and ``changes`` (each change of the streamed set between
        steps: ``stopped`` / ``started`` block indices and the bytes streamed before it)."""
        return {
            **self.sb.stats(),
            "streamed": self.streamed,
            "streamed_ever": sorted(self._ever),
            "changes": [dict(c) for c in self._changes],
        }

    def remove(self) -> None:
        """Every block resident again, hooks removed."""
        self.sb.remove()


def install_weight_streaming(
    model: nn.Module | None,
    blocks: Sequence[nn.Module],
    streamed_indices: Sequence[int],
    device: torch.device | str,
    *,
    prefetch_depth: int = 1,
    max_inflight_bytes: int | None = None,
    arena: Any | None = None,
    streams: Any | None = None,
    adaptive: bool = False,
    stream_trainable: bool = True,
    adopt_host: Any | None = None,
    hold_turns: bool = True,
) -> WeightStreamingHandle:
    """Stream the weights of ``blocks[i]`` for ``i in streamed_indices``; the other blocks are untouched
    (or, with ``adaptive``, kept resident by the same machinery so they can be streamed later).

    Args:
        model: The model (only used in log messages; may be None).
        blocks: The full block stack, in execution order.
        streamed_indices: Blocks whose weights live on the host between uses.
        device: The compute device.
        prefetch_depth: Streamed blocks fetched ahead of the running one.
        max_inflight_bytes: Cap on the bytes of streamed blocks fetched ahead of the running one (None: no cap).
        arena: Optional ``tidal_arena.PinnedArena`` for the host copies.
        streams: Optional ``DeviceStreams`` (default: the device's shared ones).
        adaptive: Cover every block so :meth:`WeightStreamingHandle.set_streamed` works (host copies of
            resident blocks are kept too).
        stream_trainable: Stream trainable parameters too (full fine-tuning; the optimizer must then
            update the host copies). False keeps them resident (LoRA adapters).
        adopt_host: ``StreamedBlocks``' ``adopt_host``: frozen host tensors used in place as host copies.
        hold_turns: Keep the window's blocks over the turns of a training step instead of refilling them
            (``StreamedBlocks``' [Note: turn holds]).

    Returns:
        A :class:`WeightStreamingHandle` (``.remove()``, ``.stats()``).
    """
    blocks = list(blocks)
    streamed = sorted(_check_indices("streamed_indices", streamed_indices, len(blocks)))
    if not streamed and not adaptive:
        raise option_error("streamed_indices", list(streamed_indices), "at least one block index")
    covered = blocks if adaptive else [blocks[i] for i in streamed]
    keep = [i for i in range(len(blocks)) if i not in streamed] if adaptive else []
    sb = StreamedBlocks(
        covered,
        device,
        prefetch_ahead=prefetch_depth,
        arena=arena,
        streams=streams,
        max_inflight_bytes=max_inflight_bytes,
        keep_resident=keep,
        stream_trainable=stream_trainable,
        adopt_host=adopt_host,
        hold_turns=hold_turns,
    )
    logger.info(
        "weight streaming on %s: %d of %d blocks streamed (%s), prefetch %d",
        type(model).__name__ if model is not None else "blocks",
        len(streamed),
        len(blocks),
        streamed,
        prefetch_depth,
    )
    return WeightStreamingHandle(blocks, streamed, sb, adaptive)


def rebalance(
    block_bytes: Sequence[int],
    streamed: Sequence[int],
    peak_bytes: int,
    budget_bytes: int,
    headroom: float = 0.1,
) -> list[int]:
    """The adaptation rule: the blocks to stream next step, given the measured peak of this one.

    Over budget (``peak > budget × (1 - headroom)``): stream more resident blocks, earliest first, until
    the freed bytes cover the excess. Under it: bring the latest streamed blocks back into VRAM while
    they fit in the room left (their backward comes first, so they save the most stall).

    Args:
        block_bytes: Weight bytes of each block of the stack.
        streamed: Blocks streamed in the measured step.
        peak_bytes: Measured device peak of that step.
        budget_bytes: The device budget.
        headroom: Fraction of the budget kept free.

    Returns:
        Sorted block indices to stream.
    """
    if not 0.0 <= headroom < 1.0:
        raise option_error("headroom", headroom, "a float in [0, 1)")
    limit = budget_bytes * (1.0 - headroom)
    out = set(streamed)
    if peak_bytes > limit:
        excess = peak_bytes - limit
        for i in range(len(block_bytes)):
            if excess <= 0:
                break
            if i not in out:
                out.add(i)
                excess -= block_bytes[i]
        return sorted(out)
    room = limit - peak_bytes
    for i in sorted(out, reverse=True):
        if block_bytes[i] <= room:
            out.discard(i)
            room -= block_bytes[i]
    return sorted(out)


def keep_latest_activations(
    policies: Sequence[str], activation_bytes: Sequence[int], room_bytes: int
) -> list[str]:
    """The second adaptation rule: with ``room_bytes`` of VRAM left under the budget, keep the
    activations of the latest blocks (their backward comes first, so their copies would have the least
    time to hide) instead of offloading or recomputing them, latest first, while they fit.

    Args:
        policies: Current per-block policies.
        activation_bytes: Saved-activation bytes of each block (e.g. ``block_offloaded_bytes`` of
            ``ActivationHandle.stats()``, or an estimate for recomputed blocks).
        room_bytes: Device bytes free under the budget at the measured peak.

    Returns:
        The new per-block policies.
    """
    if len(policies) != len(activation_bytes):
        raise option_error(
            "activation_bytes", len(activation_bytes), f"one entry per block ({len(policies)})"
        )
    out = list(policies)
    room = room_bytes
    for i in range(len(out) - 1, -1, -1):
        if out[i] != "keep":
            if activation_bytes[i] > room:
                break
            out[i] = "keep"
            room -= activation_bytes[i]
    return out


class WeightsExtension:
    """What :func:`install` returns to ``wrap()``: report, remove, and the host-optimizer hooks."""

    def __init__(
        self,
        weights: WeightStreamingHandle | None,
        acts: ActivationHandle | None,
        attention: AttentionHandle | None = None,
        blocks: Sequence[nn.Module] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.weights = weights
        self.activations = acts
        self.attention = attention
        self.blocks = list(blocks)
        self.device = torch.device(device)

    def timeline_recorder(self, sync: bool | None = None) -> TimelineRecorder:
        """A :class:`~tidal_stream.timeline.TimelineRecorder` on the block stack, reading this
        installation's H2D and D2H counters: run a step, then ``.save_png(path)`` (e.g. for
        ``memory_report(model, plot=...)``) and ``.remove()``."""
        return TimelineRecorder(
            self.blocks,
            self.device,
            streamed=self.weights.sb if self.weights is not None else None,
            activations=self.activations,
            sync=sync,
        )

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Host copy of a streamed parameter (write updates there), or None when not streamed."""
        return self.weights.host_tensor(tensor) if self.weights is not None else None

    def streamed_block_of(self, tensor: torch.Tensor) -> int | None:
        """Stack index of the streamed block owning ``tensor``, or None when it is not streamed."""
        return self.weights.block_of(tensor) if self.weights is not None else None

    def unstream(self, indices: Sequence[int]) -> int:
        """Keep the streamed blocks ``indices`` on the device from now on; returns their weight bytes.

        The caller makes sure their host copies are current (pending host updates written) first.
        """
        if self.weights is None or not indices:
            return 0
        nbytes = sum(self.weights.block_nbytes(i) for i in indices)
        self.weights.keep_resident(indices)
        return nbytes

    def set_before_fetch(self, fn: Any) -> None:
        """``fn(block_index, tensors)`` runs before a block's host copies are read for a refill."""
        if self.weights is not None:
            self.weights.sb.before_fetch = fn

    def report(self) -> dict[str, Any]:
        """``{"weight_streaming": {...}, "activations": {...}}`` for ``memory_report()``."""
        out: dict[str, Any] = {}
        if self.weights is not None:
            out["weight_streaming"] = self.weights.stats()
        if self.activations is not None:
            out["activations"] = self.activations.stats()
        if self.attention is not None:
            out["attention"] = {
                "backend": self.attention.backend,
                "choices": [
                    {"key": c.key, "backend": c.backend, "times_ms": c.times_ms}
                    for c in self.attention.choices.values()
                ],
            }
        return out

    def remove(self) -> None:
        """Remove every installation (weights become resident again)."""
        if self.attention is not None:
            self.attention.remove()
        if self.activations is not None:
            self.activations.remove()
        if self.weights is not None:
            self.weights.remove()


def _planned(session: Any) -> tuple[list[int], list[int], list[int]] | None:
    """``(streamed, recompute, offload)`` block indices of ``session.plan``, or None without a plan."""
    plan = getattr(session, "plan", None)
    if plan is None:
        return None
    blocks = plan.blocks
    return (
        [b.index for b in blocks if b.weights == "streamed"],
        [b.index for b in blocks if b.activations == "recompute"],
        [b.index for b in blocks if b.activations == "offload"],
    )


def install(session: Any, model: nn.Module, options: Any) -> WeightsExtension | None:
    """Install what the part-2 options of ``wrap()`` ask for (see the module docstring)."""
    planned = _planned(session)
    wanted = any(
        getattr(options, k) not in ("auto", False, None)
        for k in ("param_offload", "activation_offload", "recompute")
    ) or (planned is not None and any(planned))
    if options.blocks is None and not wanted:
        if session.device.type == "cpu":
            return None
        try:
            blocks = find_blocks(model)
        except StreamingError:
            session.record("weights", "no block stack found: weights and activations stay as they are")
            return None
    else:
        blocks = _resolve_blocks(model, options.blocks)
    n = len(blocks)
    device = session.device
    if planned is not None and len(session.plan.blocks) != n:
        session.record(
            "weights",
            f"the plan covers {len(session.plan.blocks)} blocks, the stack found here {n}: 'auto' options "
            "fall back to the installer's own rules",
        )
        planned = None
    p_streamed, p_recompute, p_offload = planned if planned is not None else (None, [], [])
    streamed: list[int]
    if options.param_offload == "auto":
        streamed = p_streamed if p_streamed is not None else _auto_streamed(session, model, blocks)
    else:
        streamed = select_blocks("param_offload", options.param_offload, n)
    recompute = (
        p_recompute if options.recompute == "auto" else select_blocks("recompute", options.recompute, n)
    )
    offload = (
        p_offload
        if options.activation_offload == "auto"
        else select_blocks("activation_offload", options.activation_offload, n)
    )
    if planned is not None:
        session.record(
            "plan",
            f"'auto' part-2 options follow the plan: {len(streamed)} blocks streamed, "
            f"{len(recompute)} recomputed, {len(offload)} offloaded",
            streamed=streamed,
            recompute=recompute,
            offload=offload,
        )
    policies = ["recompute" if i in recompute else "offload" if i in offload else "keep" for i in range(n)]
    depth = 1 if options.prefetch_depth is None else options.prefetch_depth
    inflight = options.max_inflight_bytes
    if isinstance(inflight, str):
        from tidal_stream.options import parse_bytes_option

        inflight = parse_bytes_option("max_inflight_bytes", inflight)
    weights = None
    if streamed:
        # LoRA-like: adapters stay resident, the frozen base streams; full fine-tuning: trained weights
        # stream too, updated in their host copies (see the module docstring)
        # buffers count: a quantized base is held in buffers (tidal_quant.QuantLinear)
        tensors = [t for i in streamed for t in (*blocks[i].parameters(), *blocks[i].buffers())]
        trainable = sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
        stream_trainable = mostly_trained(trainable, sum(t.numel() * t.element_size() for t in tensors))
        if stream_trainable and not getattr(
            getattr(session, "optimizer", None), "host_weight_updates", False
        ):
            # the optimizer would write updates into emptied device storage: refuse rather than corrupt
            if options.param_offload == "auto":
                session.record(
                    "weights",
                    "param_offload='auto' would stream trained weights, which this optimizer cannot update "
                    "through their host copies; weights stay resident",
                    streamed=streamed,
                )
                streamed = []
            else:
                raise option_error(
                    "param_offload",
                    options.param_offload,
                    "blocks whose trainable weights are a small share (LoRA) while the optimizer cannot "
                    "update streamed weights through their host copies",
                    "train adapters (LoRA) or leave param_offload at 'auto'/False for full fine-tuning.",
                )
    if streamed:
        weights = install_weight_streaming(
            model,
            blocks,
            streamed,
            device,
            prefetch_depth=depth,
            max_inflight_bytes=inflight,
            streams=session.streams,
            stream_trainable=stream_trainable,
            adopt_host=getattr(getattr(session, "shared_host", None), "owns", None),
        )
        session.record(
            "weights",
            f"{len(streamed)} of {n} blocks stream their weights (prefetch {depth}); trainable parameters "
            + ("stream too" if stream_trainable else "stay resident"),
            streamed=streamed,
            prefetch_depth=depth,
            stream_trainable=stream_trainable,
        )
    acts = None
    if any(p != "keep" for p in policies):
        acts = install_activation_policy(
            blocks, policies, device=device, prefetch_ahead=depth, streams=session.streams
        )
        session.record(
            "activations",
            f"activation policy: {policies.count('offload')} offload, {policies.count('recompute')} recompute, "
            f"{policies.count('keep')} keep",
            policies=policies,
        )
    attention = None
    # timing backends only pays on the GPU; on the CPU only an explicit backend name is honoured
    if options.attention is not None and (options.attention != "auto" or device.type == "cuda"):
        attention = install_attention(blocks, options.attention, record=session.record)
    if weights is None and acts is None and attention is None:
        return None
    return WeightsExtension(weights, acts, attention, blocks, device)


def _auto_streamed(session: Any, model: nn.Module, blocks: list[nn.Module]) -> list[int]:
    if session.device.type != "cuda":
        return []
    budget = session.options.vram_budget_bytes
    if budget is None:
        free, _total = torch.cuda.mem_get_info(session.device)
        budget = free + torch.cuda.memory_allocated(session.device)
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    excess = total - _AUTO_WEIGHT_SHARE * budget
    if excess <= 0:
        return []
    sizes = [sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in blocks]
    k = 0
    while k < len(blocks) and excess > 0:
        excess -= sizes[k]
        k += 1
    session.record(
        "weights",
        f"param_offload='auto': weights {total / 2**30:.2f} GiB exceed {_AUTO_WEIGHT_SHARE:.0%} of the "
        f"{budget / 2**30:.2f} GiB budget; streaming the first {k} blocks",
        budget=budget,
        weights=total,
    )
    return list(range(k)) if k else []
