"""Device gather slots of :class:`~tidal_kv.PagedKVCache` and the cached views of their page gathers.

A decode step gathers every offloaded layer's full pages ``[0, pages)`` again, with the same tensors as the
step before until a page fills. Building the views of such a gather (host chunk range, slot range, staging
range for fp8) costs more host time than issuing its copy, so each slot keeps the views of its last gather
per layer (:class:`GatherRun`) and rebuilds them only when the page range changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tidal_arena import RowCopy
from tidal_kv.storage import ChunkLayout, PageChunk


class GatherRun(NamedTuple):
    """One contiguous run of ``m`` pages of a gather (inside one host chunk): its views and copies."""

    m: int
    """Pages in the run."""
    dst: torch.Tensor
    """``[2, B, H, m·P, D]`` the slot's token range of these pages."""
    stage: PageChunk | None
    """fp8 storage: ``[2, B, H, m·P, D]`` contiguous staging the host pages land in before they are
    dequantized into ``dst``; None for native storage, whose pages land in ``dst`` directly."""
    copies: tuple[RowCopy, ...]
    """The host-to-device copies of the run, checked once: the pages (into ``dst`` or ``stage``), then for
    fp8 storage their scales."""


@dataclass(eq=False)
class Slot:
    """A device buffer an offloaded layer is gathered into; ``owner``'s first ``pages`` pages are valid.

    Slots compare by identity (``eq=False``): the cache tests membership of slots in small lists.
    """

    kv: torch.Tensor  # [2, B, H, cap, D]: K and V in one buffer, so one copy moves both
    owner: int | None = None
    pages: int = 0
    ready: Any = None  # event: the H2D copy into this slot finished
    free_after: Any = None  # event: the compute stream finished reading the previous owner's K/V
    prefetched_pages: int = 0
    # long-lived events re-recorded each step (see `streams.record`): the decode loop creates none
    ready_ev: Any = None
    free_ev: Any = None
    # views made once (indexing kv per update costs host time on every decode step)
    k: torch.Tensor = field(init=False)  # [B, H, cap, D], kv[0]
    v: torch.Tensor = field(init=False)  # [B, H, cap, D], kv[1]
    # layer -> ((first, pages), runs) of the last gather of that layer into this slot
    plans: dict[int, tuple[tuple[int, int], list[GatherRun]]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.k, self.v = self.kv.unbind(0)

    def gather_runs(
        self,
        layer: int,
        first: int,
        pages: int,
        chunks: list[PageChunk],
        layout: ChunkLayout,
        stage: PageChunk | None,
    ) -> list[GatherRun]:
        """The runs that gather ``layer``'s pages ``[first, pages)`` from ``chunks`` into this slot.

        Args:
            layer: The offloaded layer (the cache key, with the page range).
            first: First page to gather.
            pages: One past the last page.
            chunks: The layer's host chunks, ``[2, B, H, C·P, D]`` each (only ever appended to).
            layout: Their layout (pages per chunk, tokens per page).
            stage: fp8 storage: the device staging chunk the pages land in before dequantization; else None.

        Returns:
            The runs in page order; cached, so the same range returns the same views without rebuilding them.
        """
        key = (first, pages)
        hit = self.plans.get(layer)
        if hit is not None and hit[0] == key:
            return hit[1]
        p, cp = layout.page_tokens, layout.chunk_pages
        runs = []
        page = first
        while page < pages:
            chunk, i0 = divmod(page, cp)
            m = min(cp - i0, pages - page)
            src = chunks[chunk].tokens(i0 * p, (i0 + m) * p)
            dst = self.kv[:, :, :, page * p : (page + m) * p]
            if stage is None:  # native pages: the host rows land straight in the slot's token range
                runs.append(GatherRun(m, dst, None, (RowCopy(dst, src.data, 3),)))
            else:
                staged = stage.packed(m * p)
                copies = (RowCopy(staged.data, src.data, 3), RowCopy(staged.scale, src.scale, 3))
                runs.append(GatherRun(m, dst, staged, copies))
            page += m
        self.plans[layer] = (key, runs)
        return runs
