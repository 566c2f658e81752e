"""``HardwareProfile``: what this machine can hold and move, measured once and cached on disk."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tidal_plan import measure
from tidal_plan.errors import PlanConfigError
from tidal_plan.units import GiB, MiB, format_bytes, parse_bytes

__all__ = ["UNLIMITED", "HardwareProfile", "profile_hardware"]

logger = logging.getLogger(__name__)

UNLIMITED = 2**63 - 1
"""``pagelock_limit_bytes`` when ``ulimit -l`` is unlimited."""

_CACHE_VERSION = 3
# Fields measured by timing (cached); the rest (free memory, budget, host RAM) is read fresh every call.
_MEASURED = (
    "h2d_gbps",
    "d2h_gbps",
    "bidir_gbps",
    "matmul_tflops",
    "host_adamw_params_per_s",
    "hbm_gbps",
)
# Measured where the device allows (None otherwise: a CPU stand-in has no sustained matmul figure).
_MEASURED_OPTIONAL = ("matmul_sustained_tflops", "host_update_params_per_s")
DEFAULT_HBM_GBPS = 4200.0
"""``hbm_gbps`` of a profile that does not give it: an H200-class device copy (read + write counted)."""


@dataclass(frozen=True)
class HardwareProfile:
    """What one device and its host can hold and move. All sizes in bytes, rates in 1e9 B/s or 1e12 FLOP/s."""

    device_name: str
    """Device name, e.g. ``"NVIDIA H200"`` or the CPU model."""
    device_kind: Literal["cuda", "cpu"]
    """``"cuda"``, or ``"cpu"`` when the CPU stands in for the GPU (CI)."""
    compute_capability: tuple[int, int] | None
    """CUDA compute capability, ``None`` on the CPU."""
    device_total_bytes: int
    """Total device memory (host RAM for a CPU profile)."""
    device_free_bytes: int
    """Free device memory the driver reported when profiled (``torch.cuda.mem_get_info``; available
    host RAM for a CPU profile). Memory torch's caching allocator already holds is not in it."""
    device_allocatable_bytes: int
    """Bytes this process could still allocate when profiled: ``device_free_bytes`` plus what torch's
    caching allocator holds but has not handed out (it reuses those blocks, or frees them and retries),
    capped by ``torch.cuda.set_per_process_memory_fraction`` (fraction x total, less what is allocated).
    It can exceed ``device_free_bytes`` when torch has cached memory; equal to it on the CPU."""
    vram_budget_bytes: int
    """Bytes tidal may use on the device. Derived: ``device_allocatable_bytes`` minus the headroom, so
    it never exceeds what can be allocated. Explicit (``vram_budget=``): taken as given, after a check
    that it fits in what this process can hold at once (what it has allocated plus what it can still
    allocate) and in the device total; it may exceed ``device_allocatable_bytes`` when the process
    already holds tensors the plan counts (weights loaded before planning, a filler simulating a smaller
    card)."""
    host_ram_bytes: int
    """Host RAM available to this process (explicit override, else MemAvailable)."""
    pagelock_limit_bytes: int
    """Page-lock limit (``ulimit -l``); ``UNLIMITED`` when unlimited."""
    h2d_gbps: float
    """Pinned host-to-device copy rate, GB/s (1e9 bytes/s)."""
    d2h_gbps: float
    """Pinned device-to-host copy rate, GB/s."""
    bidir_gbps: float
    """Total rate with both directions copying at once, GB/s."""
    matmul_tflops: float
    """bf16 matmul rate, TFLOP/s."""
    host_adamw_params_per_s: float
    """torch fused CPU AdamW throughput on fp32 tensors in pageable memory (28 bytes a parameter),
    parameters per second, at ``host_threads`` threads; far past the last-level cache (50 M parameters
    quick). The host figure the machine README states; the cost model prefers
    ``host_update_params_per_s``, the whole update as tidal-stream runs it."""
    host_threads: int
    """Threads the host AdamW rate was measured with."""
    has_fp8_tensor_cores: bool
    """FP8 tensor cores (sm_89+)."""
    has_fp4_tensor_cores: bool
    """FP4 tensor cores (sm_100+)."""
    notes: tuple[str, ...] = field(default=())
    """Degradations found while profiling (e.g. a rate that could not be measured), the peak and
    sustained matmul rates, the host update's split between widening, AdamW and narrowing, and the
    seconds each profiling stage took; one line each."""
    hbm_gbps: float = DEFAULT_HBM_GBPS
    """Device memory bandwidth, GB/s, bytes read plus bytes written (a device-to-device copy of N bytes
    moves 2N); default 4200 (an H200-class device); measured by :func:`profile_hardware`."""
    matmul_sustained_tflops: float | None = None
    """bf16 matmul rate under sustained load, TFLOP/s: the power limit lowers the clocks after a
    fraction of a second of full load (about 12 % below ``matmul_tflops`` on the H200). Default None:
    not measured, and the cost model takes ``matmul_tflops``."""
    host_update_params_per_s: float | None = None
    """Parameters per second of tidal-stream's whole host update of bf16 weights (widen the bf16
    gradient, fused AdamW on fp32 master and moments, narrow the new weight: 40 bytes a parameter) on
    page-locked buffers from a worker thread, at ``host_threads`` threads. Default None: not measured,
    and the cost model scales ``host_adamw_params_per_s`` by the bytes moved (28 against 40)."""

    def __post_init__(self) -> None:
        if self.device_kind not in ("cuda", "cpu"):
            raise PlanConfigError("device_kind", self.device_kind, "'cuda' or 'cpu'")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_bytes") and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise PlanConfigError(f.name, v, "a non-negative int of bytes", "use parse_bytes('24GiB')")
            optional = f.name in _MEASURED_OPTIONAL and v is None
            if (
                f.name.endswith(("_gbps", "_tflops", "_per_s"))
                and not optional
                and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)
            ):
                raise PlanConfigError(f.name, v, "a positive rate")
        if self.host_threads < 1:
            raise PlanConfigError("host_threads", self.host_threads, "an int >= 1")

    @classmethod
    def synthetic(cls, **overrides: Any) -> HardwareProfile:
        """A profile for tests and what-if planning; defaults resemble the H200 box (139.8 GiB, PCIe Gen5).

        Args:
            **overrides: Any field; ``*_bytes`` fields also accept strings like ``"24GiB"``.
                ``device_allocatable_bytes`` defaults to ``device_free_bytes`` (nothing cached) and
                ``vram_budget_bytes`` to the allocatable memory minus 1 GiB.
        """
        total = int(139.8 * GiB)
        base: dict[str, Any] = dict(
            device_name="NVIDIA H200 (synthetic)",
            device_kind="cuda",
            compute_capability=(9, 0),
            device_total_bytes=total,
            device_free_bytes=total,
            device_allocatable_bytes=None,
            vram_budget_bytes=None,
            host_ram_bytes=128 * 10**9,
            pagelock_limit_bytes=UNLIMITED,
            h2d_gbps=55.4,
            d2h_gbps=55.2,
            bidir_gbps=94.0,
            matmul_tflops=780.0,
            host_adamw_params_per_s=4.0e9,
            hbm_gbps=DEFAULT_HBM_GBPS,
            matmul_sustained_tflops=None,
            host_update_params_per_s=None,
            host_threads=16,
            has_fp8_tensor_cores=True,
            has_fp4_tensor_cores=False,
        )
        unknown = set(overrides) - set(base) - {"notes"}
        if unknown:
            raise PlanConfigError(
                "HardwareProfile.synthetic", sorted(unknown), f"fields {sorted(base)}", "check the spelling"
            )
        base.update(overrides)
        for k, v in list(base.items()):
            if k.endswith("_bytes") and isinstance(v, str):
                base[k] = parse_bytes(v, option=k)
        if base["device_allocatable_bytes"] is None:
            base["device_allocatable_bytes"] = base["device_free_bytes"]
        if base["vram_budget_bytes"] is None:
            base["vram_budget_bytes"] = max(0, base["device_allocatable_bytes"] - GiB)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise PlanConfigError("HardwareProfile.from_dict", sorted(unknown), f"keys {sorted(names)}")
        d = dict(d)
        cc = d.get("compute_capability")
        d["compute_capability"] = tuple(cc) if cc is not None else None
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)

    def summary(self) -> str:
        """A few readable lines: device, memory, links, rates."""
        cc = (
            f" sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""
        )
        lock = (
            "unlimited" if self.pagelock_limit_bytes >= UNLIMITED else format_bytes(self.pagelock_limit_bytes)
        )
        cores = [
            n for n, ok in (("fp8", self.has_fp8_tensor_cores), ("fp4", self.has_fp4_tensor_cores)) if ok
        ]
        kinds = ", ".join(cores) or ("none (CPU stand-in)" if self.device_kind == "cpu" else "bf16 only")
        sustained = f" ({self.matmul_sustained_tflops:.4g} sustained)" if self.matmul_sustained_tflops else ""
        update = (
            f", whole bf16 update {self.host_update_params_per_s / 1e9:.2f} G params/s"
            if self.host_update_params_per_s
            else ""
        )
        lines = [
            f"device      {self.device_name} ({self.device_kind}{cc}); low-precision tensor cores: {kinds}",
            f"memory      total {format_bytes(self.device_total_bytes)}, free {format_bytes(self.device_free_bytes)}, "
            f"allocatable {format_bytes(self.device_allocatable_bytes)}, budget {format_bytes(self.vram_budget_bytes)}",
            f"host        RAM {format_bytes(self.host_ram_bytes)}, page-lock limit {lock}, {self.host_threads} threads",
            f"link        H2D {self.h2d_gbps:.1f} GB/s, D2H {self.d2h_gbps:.1f} GB/s, both {self.bidir_gbps:.1f} GB/s",
            f"compute     bf16 matmul {self.matmul_tflops:.4g} TFLOP/s{sustained}; device memory "
            f"{self.hbm_gbps:.0f} GB/s",
            f"host update fused AdamW {self.host_adamw_params_per_s / 1e9:.2f} G params/s (fp32){update}",
        ]
        lines += [f"note        {n}" for n in self.notes]
        return "\n".join(lines)


def _cache_dir() -> Path:
    env = os.environ.get("TIDAL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tidal"


def _pagelock_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return UNLIMITED if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def profile_hardware(
    device: str | torch.device | None = None,
    *,
    quick: bool = True,
    force: bool = False,
    vram_budget: int | str | None = None,
    host_ram: int | str | None = None,
    headroom: int | str = 512 * MiB,
    host_threads: int | None = None,
) -> HardwareProfile:
    """Measure (or load from the cache) this machine's profile.

    Args:
        device: ``"cuda"``, ``"cuda:N"``, ``"cpu"``, or ``None`` for CUDA when available, else the CPU.
        quick: Short measurements (under 3 s in all) instead of longer, steadier ones.
        force: Re-measure even when a cached profile exists.
        vram_budget: Explicit device budget (bytes or ``"24GiB"``), at most what this process can hold
            at once; else the allocatable memory (free plus torch's unused cache, under
            ``torch.cuda.set_per_process_memory_fraction``) minus ``headroom``.
        host_ram: Explicit host RAM (on some VMs MemTotal grows as memory is touched, so the kernel's
            figure can be wrong); else MemAvailable.
        headroom: Bytes kept free on the device when the budget is derived (CUDA workspaces, fragmentation).
        host_threads: Threads the host AdamW runs with (default: torch's current setting); the rate is
            measured at that count.

    Returns:
        The profile. Rates come from the cache at ``~/.cache/tidal/profile-<key>.json`` (``TIDAL_CACHE_DIR``
        overrides the folder), keyed by device name, driver, torch version, threads and ``quick``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise PlanConfigError("device", device, "'cuda', 'cuda:N', 'cpu' or None") from None
    if dev.type not in ("cuda", "cpu"):
        raise PlanConfigError("device", device, "'cuda', 'cuda:N', 'cpu' or None")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PlanConfigError("device", device, "a CUDA device torch can see", "pass device='cpu'")
    headroom_b = parse_bytes(headroom, option="headroom")
    budget_b = parse_bytes(vram_budget, option="vram_budget") if vram_budget is not None else None
    if budget_b is not None and budget_b <= 0:  # same rule as PlanConfig.vram_budget
        raise PlanConfigError("vram_budget", vram_budget, "a positive size or None", "e.g. '24GiB'")
    host_b = (
        parse_bytes(host_ram, option="host_ram") if host_ram is not None else measure.host_ram_available()
    )
    if host_threads is not None and (
        isinstance(host_threads, bool) or not isinstance(host_threads, int) or host_threads < 1
    ):
        raise PlanConfigError("host_threads", host_threads, "an int >= 1 or None")
    threads = host_threads if host_threads is not None else torch.get_num_threads()
    notes: list[str] = []

    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        dev = torch.device("cuda", idx)
        props = torch.cuda.get_device_properties(idx)
        name, cc = props.name, (props.major, props.minor)
        free, total = torch.cuda.mem_get_info(idx)
        usable = measure.cuda_usable_bytes(idx, free, total, notes)
        held = torch.cuda.memory_allocated(idx)
        if budget_b is not None and budget_b > min(total, held + usable):
            raise PlanConfigError(
                "vram_budget",
                vram_budget,
                f"at most {format_bytes(min(total, held + usable))}: this process holds {format_bytes(held)} "
                f"and can allocate {format_bytes(usable)} more (device total {format_bytes(total)})",
                "lower the budget, free device memory, or raise the per-process memory fraction",
            )
        budget = budget_b if budget_b is not None else max(0, usable - headroom_b)
        fp8, fp4 = cc >= (8, 9), cc >= (10, 0)
        key_parts = [name, measure.driver_version(), torch.__version__, str(torch.version.cuda)]
    else:
        name, cc = measure.cpu_name(), None
        total, free = measure.host_ram_total(), host_b
        usable = free
        budget = budget_b if budget_b is not None else max(0, host_b - headroom_b)
        fp8 = fp4 = False
        key_parts = [name, "cpu", torch.__version__]
    key_parts += [f"threads={threads}", f"quick={quick}", f"v{_CACHE_VERSION}"]
    key = hashlib.sha1("|".join(key_parts).encode()).hexdigest()[:16]
    path = _cache_dir() / f"profile-{dev.type}-{key}.json"

    rates: dict[str, float | None] | None = None
    if not force and path.is_file():
        try:
            cached = json.loads(path.read_text())
            rates = {k: float(cached[k]) for k in _MEASURED}
            rates.update({k: cached.get(k) for k in _MEASURED_OPTIONAL})
            notes += list(cached.get("notes", []))
        except (OSError, ValueError, KeyError) as e:
            logger.warning("ignoring unreadable profile cache %s: %s", path, e)
            rates = None
    if rates is None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rates, measured_notes = measure.measure_rates(dev, quick=quick)
        finally:
            torch.set_num_threads(previous)
        notes += measured_notes
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**rates, "notes": measured_notes, "key": key_parts}, indent=1))
        except OSError as e:
            logger.warning("could not write the profile cache %s: %s", path, e)
    return HardwareProfile(
        device_name=name,
        device_kind=dev.type,  # type: ignore[arg-type]
        compute_capability=cc,
        device_total_bytes=int(total),
        device_free_bytes=int(free),
        device_allocatable_bytes=int(usable),
        vram_budget_bytes=int(budget),
        host_ram_bytes=int(host_b),
        pagelock_limit_bytes=_pagelock_limit(),
        host_threads=threads,
        has_fp8_tensor_cores=fp8,
        has_fp4_tensor_cores=fp4,
        notes=tuple(notes),
        **rates,
    )
