"""Which stream the page gathers of :class:`~tidal_kv.PagedKVCache` go on: the side (H2D) stream or the
compute stream (``gather_stream``).

[Note: gathers on the compute stream] On a side stream a gather overlaps the layers computing before it, at
the price of host work on every offloaded layer and step: a wait of the side stream on the slot's release, an
event recorded after the copy and queried before attention, and issue calls that alternate between two
streams. A batch-1 decode step is bound by the host, and the device idles for most of it: issued on the
compute stream instead, with no event at all, the same copies ran in time the device had spare: an 8B
decode step at 4k x 1 went from 0.894 to 0.912x DynamicCache with native pages and from 0.897 to 0.910x
with NF4 pages, against the side stream in the same rounds (``kv-gather-stream-*``). Where the link decides
(long contexts, batch 16) the copies must overlap compute: NF4 pages at 32k x 1 issued on the compute
stream (there call by call, uncaptured) read 0.754 against 0.880x on the side stream.

``gather_stream="auto"`` therefore measures two things, and keeps gathers on the compute stream only while
their link time is a small share of the step:

- the link: the time of one host chunk's copy to the device, once, when the cache first allocates;
- the step: the host's time from a decode token of the first layer to the same step's token of the last
  layer, the median over a window of steps (a batch-1 step's time is what the host needs to issue it). The
  span leaves out the embedding, the head and sampling (a few per cent), which errs towards the side stream,
  and it leaves out whatever the host does between steps: with several caches stepped in turn (benchmarks
  that interleave engines) the time between two first-layer tokens held every other cache's step too, and
  made a 32k x 1 NF4 step look short enough for the compute stream (auto then read 0.839x, the side stream
  0.861x in the same rounds).

Gathers move to the compute stream at batch 1 when a step's pages take under :data:`INLINE_BELOW` of the
step on the link, and back to the side stream above :data:`SIDE_ABOVE` (or at another batch size). Between
the two thresholds the current choice stays, so a step whose share hovers at one threshold does not switch
back and forth.
"""

from __future__ import annotations

import statistics
import time
from typing import Literal

GatherStream = Literal["auto", "side", "compute"]
GATHER_STREAMS = ("auto", "side", "compute")

INLINE_BELOW = 0.35
"""Link share of a step under which ``"auto"`` issues gathers on the compute stream. The cases measured on
the GPU machine (8B, batch 1): native pages at 4k, about 27 % of the step (268 MB at 55 GB/s in an 18-20 ms
step), gained on the compute stream; NF4 pages at 32k, about 61 % (fp32 absmax then, 55 % with 16-bit
ones), lost there (uncaptured in that run)."""
SIDE_ABOVE = 0.5
"""Link share of a step over which ``"auto"`` issues gathers on the side stream again."""
WINDOW = 8
"""Decode steps per decision (their median step time is compared)."""


class GatherStreamPolicy:
    """Decides, once per :data:`WINDOW` decode steps, whether gathers go on the compute stream.

    Args:
        mode: ``"side"`` and ``"compute"`` fix the answer; ``"auto"`` decides from measurements (see module
            note).
    """

    __slots__ = ("_began", "_link_bps", "_steps", "inline", "mode")

    def __init__(self, mode: GatherStream) -> None:
        self.mode = mode
        self.inline = mode == "compute"
        self._link_bps: float | None = None  # host-to-device bytes per second, once measured
        self._began: float | None = None  # perf_counter of this step's decode token of the first layer
        self._steps: list[float] = []

    @property
    def measuring(self) -> bool:
        """Whether the policy needs :meth:`set_link` and :meth:`step` (``"auto"`` only)."""
        return self.mode == "auto"

    def set_link(self, nbytes: int, seconds: float) -> None:
        """Record one measured host-to-device copy of ``nbytes`` that took ``seconds``."""
        if seconds > 0:
            self._link_bps = nbytes / seconds

    def restart(self) -> None:
        """Forget the step times (a new sequence, or a prefill, is not a decode step)."""
        self._began = None
        self._steps.clear()

    def begin_step(self) -> None:
        """Note a decode token of the first layer: a step's span starts."""
        self._began = time.perf_counter()

    def end_step(self, step_bytes: int, batch: int) -> bool:
        """Note the same step's decode token of the last layer; returns True when the choice changed.

        A step whose first layer was not noted (it took another path, or a prefill came between) is not
        counted.

        Args:
            step_bytes: Bytes a decode step now gathers over the link (every offloaded layer's full pages).
            batch: Sequences per batch.
        """
        began, self._began = self._began, None
        if began is None:
            return False
        self._steps.append(time.perf_counter() - began)
        if len(self._steps) < WINDOW:
            return False
        step_s = statistics.median(self._steps)
        self._steps.clear()
        was = self.inline
        self.inline = self.wants_inline(step_bytes, batch, step_s, was)
        return self.inline != was

    def wants_inline(self, step_bytes: int, batch: int, step_s: float, inline_now: bool) -> bool:
        """The decision for a step of ``step_s`` seconds that gathers ``step_bytes`` (see module note)."""
        if self._link_bps is None or batch != 1 or step_s <= 0:
            return False
        share = step_bytes / self._link_bps / step_s
        return share < (SIDE_ABOVE if inline_now else INLINE_BELOW)
