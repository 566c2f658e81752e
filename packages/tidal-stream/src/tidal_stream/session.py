"""``Session``: the per-model state of ``wrap()`` — streams, host memory, plan and decision log."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tidal_stream.hostmem import HostMemory
from tidal_stream.options import WrapOptions
from tidal_stream.streams import DeviceStreams, device_streams

__all__ = ["Decision", "Session"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """One entry of the decision log."""

    kind: str
    """Short category (``"plan"``, ``"placement"``, ``"offload"``, ``"host-memory"``, ...)."""
    message: str
    """Human-readable sentence."""
    data: dict[str, Any] = field(default_factory=dict)
    """Numbers behind the decision."""
    time: float = 0.0
    """``time.time()`` when it was made."""

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (as in ``memory_report()["events"]``)."""
        return {"kind": self.kind, "message": self.message, "data": dict(self.data), "time": self.time}


class Session:
    """Everything ``wrap()`` attached to one model.

    Owns the H2D and D2H streams of the device, the host memory, the plan, the decision log and the
    counters that ``memory_report()`` returns.

    Args:
        model: the wrapped module (None for an optimizer used without wrap()).
        options: validated options.
        device: the training device.
    """

    def __init__(self, model: nn.Module | None, options: WrapOptions, device: torch.device) -> None:
        self.model = model
        self.options = options
        self.device = device
        self.verbose = options.verbose
        self.events: list[Decision] = []
        # one H2D and one D2H stream per device, shared by every mechanism of this session
        self.streams: DeviceStreams = device_streams(device)
        self.host = HostMemory(device, self.record)
        self.plan: object | None = None
        # the tidal_plan census the plan was made from (per-block bytes per token), when there is one
        self.census: object | None = None
        # the machine and the options wrap()'s plan was made with: the measured refinement asks the same
        # cost model (tidal_plan.predict) about the real batch; None when a plan was given
        self.profile: object | None = None
        self.plan_config: object | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.handles: list[Any] = []
        self.extensions: list[Any] = []
        # the node's shared host copy of frozen weights under data parallel (streamed blocks read it in place)
        self.shared_host: Any | None = None

    def record(self, kind: str, message: str, **data: Any) -> None:
        """Append a decision to the log, log it, and print it when ``verbose``."""
        d = Decision(kind, message, data, time.time())
        self.events.append(d)
        log.info("[%s] %s", kind, message)
        if self.verbose:
            print(f"tidal [{kind}] {message}", flush=True)

    def report(self) -> dict[str, Any]:
        """The dict of ``memory_report()``: tiers, pinned bytes, copy volumes, decisions."""
        out: dict[str, Any] = {
            "device": str(self.device),
            "host": self.host.stats(),
            "pinned_bytes": self.host.pinned_bytes,
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
        }
        opt = self.optimizer
        if opt is not None and hasattr(opt, "memory_tiers"):
            out["tiers"] = opt.memory_tiers()
        if opt is not None and hasattr(opt, "host_work"):
            out["host_optimizer"] = opt.host_work()
        if self.model is not None:
            on_device = [
                t
                for t in (*self.model.parameters(), *self.model.buffers())
                if t.device == self.device and t.untyped_storage().nbytes() > 0
            ]
            out.setdefault("tiers", {}).setdefault("device", {})["weights_bytes"] = sum(
                t.numel() * t.element_size() for t in on_device
            )
        if self.device.type == "cuda":
            out["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.plan is not None and hasattr(self.plan, "explain"):
            out["plan"] = self.plan.explain()
        for ext in self.extensions:
            if hasattr(ext, "report"):
                out.update(ext.report())
        out["events"] = [d.as_dict() for d in self.events]
        return out

    def close(self) -> None:
        """Remove every hook and release host memory."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.host.close()
