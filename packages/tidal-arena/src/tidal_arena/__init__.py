"""tidal-arena: page-locked host memory on CuPy.

Exact-size slabs carved into aligned blocks (:class:`PinnedArena`), in-place pinning of existing tensors
(:func:`pin_`), a staging ring for pageable data (:class:`StagingRing`), per-tag accounting,
event-guarded reuse, strided copies in one call (:class:`RowCopy`) and stream work replayed as one CUDA
graph (:class:`StreamGraph`). Without CUDA or CuPy everything runs on pageable memory (logged once).
"""

from tidal_arena.__about__ import __version__
from tidal_arena._backend import CompletedEvent
from tidal_arena.arena import ArenaStats, Block, EventLike, PinnedArena, arena_stats
from tidal_arena.config import ArenaConfig, memlock_limit_bytes, physical_ram_bytes
from tidal_arena.errors import ArenaError, ArenaExhausted, PageLockLimitError
from tidal_arena.graphs import StreamGraph
from tidal_arena.pin import is_registered, pin_, unpin_
from tidal_arena.rows import RowCopy, Rows, copy_rows, cuda_runtime, rows_of
from tidal_arena.staging import StagingRing

__all__ = [
    "ArenaConfig",
    "ArenaError",
    "ArenaExhausted",
    "ArenaStats",
    "Block",
    "CompletedEvent",
    "EventLike",
    "PageLockLimitError",
    "PinnedArena",
    "RowCopy",
    "Rows",
    "StagingRing",
    "StreamGraph",
    "__version__",
    "arena_stats",
    "copy_rows",
    "cuda_runtime",
    "is_registered",
    "memlock_limit_bytes",
    "physical_ram_bytes",
    "pin_",
    "rows_of",
    "unpin_",
]
