"""Seeing a step: a per-block timeline (compute spans, H2D/D2H bytes, VRAM) as a PNG, and a Chrome trace.

- :class:`TimelineRecorder` ``(blocks, device, *, streamed=None, activations=None, sync=None)`` — hooks
  on each block record, at the start and end of its forward and backward, the time, device memory
  allocated, and the running H2D (weight refills, from a ``StreamedBlocks``) and D2H (offloaded
  activations, from an ``ActivationHandle``) byte counts. On CUDA it synchronizes at each mark by
  default (``sync=True``) so a block's span is its real device time — this removes the overlap of
  compute with the *next* block's launch, so use it to see, not to time. ``.save_png(path)`` draws three
  panels sharing the time axis; ``.events`` holds the raw marks.
- :func:`chrome_trace` ``(fn, path, steps=1)`` runs ``fn()`` under ``torch.profiler`` (CPU and, when
  present, CUDA activity) and writes a Chrome/Perfetto trace; tidal's ``record_function`` ranges
  (``tidal::stream.fetch[i]``, ``tidal::act.offload``, ...) show which copy overlaps which kernel.

matplotlib is imported only by ``save_png``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tidal_stream.streamed_blocks import StreamingError, _tensors_of

__all__ = ["TimelineEvent", "TimelineRecorder", "chrome_trace"]


@dataclass(frozen=True)
class TimelineEvent:
    """One mark of the timeline."""

    t: float
    """Seconds since the recorder started."""
    block: int
    """Block index."""
    phase: Literal["forward", "backward"]
    """Which pass."""
    edge: Literal["start", "end"]
    """Start or end of the block's span in that pass."""
    vram: int
    """Device bytes allocated (``torch.cuda.memory_allocated``; 0 on the CPU)."""
    h2d_bytes: int
    """Weight bytes copied host → device so far."""
    d2h_bytes: int
    """Activation bytes copied device → host so far."""


class TimelineRecorder:
    """Record per-block spans of a step; see the module docstring."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        *,
        streamed: Any | None = None,
        activations: Any | None = None,
        sync: bool | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.streamed = streamed
        self.activations = activations
        self.sync = (self.device.type == "cuda") if sync is None else bool(sync)
        self.events: list[TimelineEvent] = []
        self._t0 = time.perf_counter()
        self._bwd_open: set[int] = set()
        self._hooks = []
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(self._pre(i)))
            self._hooks.append(b.register_forward_hook(self._post(i)))

    def _mark(self, block: int, phase: Any, edge: Any) -> None:
        cuda = self.device.type == "cuda"
        if cuda and self.sync:
            torch.cuda.synchronize(self.device)
        h2d = self.streamed.h2d_bytes if self.streamed is not None else 0
        d2h = self.activations.stats()["offloaded_bytes"] if self.activations is not None else 0
        vram = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.events.append(TimelineEvent(time.perf_counter() - self._t0, block, phase, edge, vram, h2d, d2h))

    def _pre(self, i: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if torch._C._current_graph_task_id() == -1:
                self._mark(i, "forward", "start")

        return pre

    def _post(self, i: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return
            self._mark(i, "forward", "end")
            outs = _tensors_of(output) if torch.is_grad_enabled() else []
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, lambda _g: self._bwd_start(i), mode="any")

        return post

    def _bwd_start(self, i: int) -> None:
        # a block's backward starts when its output gradient exists and ends when the next one starts
        for j in sorted(self._bwd_open, reverse=True):
            self._mark(j, "backward", "end")
        if not self._bwd_open:
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_done)
        self._bwd_open = {i}
        self._mark(i, "backward", "start")

    def _bwd_done(self) -> None:
        for j in sorted(self._bwd_open):
            self._mark(j, "backward", "end")
        self._bwd_open = set()

    def spans(self) -> list[tuple[int, str, float, float]]:
        """``(block, phase, start_s, end_s)`` for every completed span."""
        open_: dict[tuple[int, str], float] = {}
        out = []
        for e in self.events:
            if e.edge == "start":
                open_[(e.block, e.phase)] = e.t
            elif (e.block, e.phase) in open_:
                out.append((e.block, e.phase, open_.pop((e.block, e.phase)), e.t))
        return out

    def save_png(self, path: str) -> str:
        """Draw compute spans per block, cumulative H2D/D2H GB and VRAM over time into ``path``."""
        if not self.events:
            raise StreamingError(
                "TimelineRecorder.save_png: nothing recorded; accepted: a recorder that saw a step. "
                "Fix: run a forward (and backward) after creating it."
            )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1, ax2) = plt.subplots(3, 1, sharex=True, figsize=(11, 7), height_ratios=[3, 1.2, 1.2])
        colors = {"forward": "tab:blue", "backward": "tab:orange"}
        for block, phase, s, e in self.spans():
            ax0.barh(block, (e - s) * 1e3, left=s * 1e3, color=colors[phase], height=0.8)
        ax0.set_ylabel("block")
        ax0.invert_yaxis()
        ax0.legend(
            handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=p) for p, c in colors.items()],
            loc="upper right",
        )
        ts = [e.t * 1e3 for e in self.events]
        ax1.step(ts, [e.h2d_bytes / 1e9 for e in self.events], where="post", label="H2D weights")
        ax1.step(ts, [e.d2h_bytes / 1e9 for e in self.events], where="post", label="D2H activations")
        ax1.set_ylabel("GB (cumulative)")
        ax1.legend(loc="upper left")
        ax2.plot(ts, [e.vram / 2**30 for e in self.events])
        ax2.set_ylabel("VRAM GiB")
        ax2.set_xlabel("ms")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def remove(self) -> None:
        """Remove the hooks (the events are kept)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def chrome_trace(fn: Callable[[], Any], path: str, steps: int = 1) -> str:
    """Run ``fn()`` ``steps`` times under ``torch.profiler`` and write a Chrome/Perfetto trace to ``path``."""
    if not isinstance(steps, int) or steps < 1:
        raise StreamingError(f"chrome_trace: steps={steps!r} is invalid; accepted: an int >= 1. Fix: pass 1.")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return path
