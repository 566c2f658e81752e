"""What every engine process shares: the VRAM filler, model materialization, data, LoRA, timing.

[Note: fairness] Each engine runs in its own process and goes through the same steps here: the filler
that leaves exactly the budget free is allocated first, the model is built on the meta device and filled
with the same seeded values (``normal_(0, 0.02)`` per tensor, seeded by the tensor's name), the batch is
the same seeded token tensor, and step time is the median of the steps after warm-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import statistics
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from engines.scenarios import LORA_ALPHA, LORA_RANK, LORA_TARGETS, GiB, Scenario, hf_config

log = logging.getLogger(__name__)

MiB = 1 << 20
#: The caching allocator and the driver hand out device memory in 2 MiB pages.
FILLER_GRANULARITY = 2 * MiB

Where = Literal["device", "cpu", "pinned"]


class BudgetError(RuntimeError):
    """The requested budget cannot be simulated on this device."""


class NotApplicable(RuntimeError):
    """The engine has no way to run this scenario (shown as ``n/a`` in the table)."""


def filler_bytes(free_bytes: int, budget_bytes: int, granularity: int = FILLER_GRANULARITY) -> int:
    """Bytes of filler that leave ``budget_bytes`` (rounded up to the page size) free.

    Args:
        free_bytes: free device memory now (``torch.cuda.mem_get_info()[0]``).
        budget_bytes: the memory the engine may use.
        granularity: allocation page size; the filler is a whole number of pages.

    Returns:
        The filler size: a multiple of ``granularity``, so that between ``budget_bytes`` and
        ``budget_bytes + granularity`` stay free.

    Raises:
        BudgetError: when the device has less free memory than the budget.
    """
    if budget_bytes <= 0:
        raise BudgetError(f"--vram-gb: got {budget_bytes / GiB:.2f} GiB; accepted: a positive budget")
    if budget_bytes > free_bytes:
        raise BudgetError(
            f"--vram-gb: {budget_bytes / GiB:.2f} GiB asked but only {free_bytes / GiB:.2f} GiB is free on the "
            "device; lower the budget or run without one"
        )
    return (free_bytes - budget_bytes) // granularity * granularity


class Filler:
    """Device memory held outside torch's caching allocator, so engines see it as another tenant's.

    [Note: filler outside torch] Engines that plan from ``mem_get_info`` minus their own
    ``memory_reserved`` (TrainStream, tidal) would count a torch-allocated filler as their own and plan
    for the whole card; a raw ``cudaMalloc`` (through CuPy's runtime, when present) makes the filler look
    like a smaller card to every engine alike. Without CuPy it falls back to a torch tensor and says so.
    """

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.device = device
        self.ptr: int | None = None
        self.tensor: torch.Tensor | None = None
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(device)
        self.nbytes = filler_bytes(free, budget_bytes)
        self.how = "cudaMalloc (CuPy runtime)"
        try:
            import cupy

            with cupy.cuda.Device(device.index or 0):
                self.ptr = cupy.cuda.runtime.malloc(self.nbytes) if self.nbytes else None
        except ImportError:
            self.how = "torch tensor (no CuPy: counted in torch.cuda.memory_reserved)"
            log.warning(
                "CuPy is missing: the VRAM filler is a torch tensor, engines see it as their own memory"
            )
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.free_after = torch.cuda.mem_get_info(device)[0]
        self.total = total

    def release(self) -> None:
        """Give the filler's memory back (engine processes just exit; tests release it)."""
        if self.ptr is not None:
            import cupy

            cupy.cuda.runtime.free(self.ptr)
            self.ptr = None
        self.tensor = None

    def describe(self) -> dict[str, Any]:
        """The filler's size and the free memory it left, for the result record."""
        return {
            "filler_gib": self.nbytes / GiB,
            "free_after_filler_gib": self.free_after / GiB,
            "filler": self.how,
        }


class DevicePeak:
    """Polls ``mem_get_info`` in a thread: the device-level peak of this process, allocator or not.

    Torch's ``max_memory_allocated`` misses memory that engines take outside the caching allocator and the
    CUDA context; this sees everything the card lost since ``start`` (the filler excluded).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.min_free = torch.cuda.mem_get_info(device)[0]
        self.base_free = self.min_free
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-device-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.min_free = min(self.min_free, torch.cuda.mem_get_info(self.device)[0])
            time.sleep(self.interval_s)

    def stop(self) -> int:
        """Stop polling; the peak bytes used since construction."""
        self._stop.set()
        self._thread.join()
        self.min_free = min(self.min_free, torch.cuda.mem_get_info(self.device)[0])
        return self.base_free - self.min_free


def build_meta_model(scenario: Scenario, dtype: torch.dtype) -> nn.Module:
    """The scenario's transformers model on the meta device (no memory), in ``dtype``."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(scenario))
    return model.to(dtype)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The block stack of a (possibly PEFT-wrapped) transformers causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def canonical(name: str) -> str:
    """A tensor's name without PEFT's wrapping (``base_model.model.`` prefix, ``.base_layer``)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _seed_of(name: str, seed: int) -> int:
    """A per-tensor seed: the same tensor gets the same values in every engine process, wrapped or not."""
    return (zlib.crc32(canonical(name).encode()) ^ (seed * 0x9E3779B1)) & 0x7FFF_FFFF


@torch.no_grad()
def fill_(name: str, p: torch.Tensor, seed: int) -> None:
    """Fill one tensor: LoRA B zeros (the standard init), norm weights ones, anything else N(0, 0.02)."""
    if "lora_B" in name:
        p.zero_()
    elif p.dim() == 1 and name.endswith("norm.weight"):
        p.fill_(1.0)
    else:
        g = torch.Generator(device=p.device).manual_seed(_seed_of(name, seed))
        p.normal_(0.0, 0.02, generator=g)


def _units(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """(prefix, module, recurse) in materialization order: each block, then everything else.

    [Note: names, not modules] Only names are held across the iteration and each module is looked up
    when its turn comes: a ``block_hook`` replaces modules (a quantized linear for an ``nn.Linear``), and a
    module map taken up front would keep every replaced module, bf16 weight included, alive until the
    last unit — the whole bf16 model on the device by the end of the build.
    """
    layers = decoder_layers(model)
    layer_ids = {id(b) for b in layers}
    inside: set[int] = set()
    for b in layers:
        inside.update(id(m) for m in b.modules())
    block_names: list[str] = []
    rest_names: list[str] = []
    for name, mod in model.named_modules():
        if id(mod) in layer_ids:
            block_names.append(name)
        elif id(mod) not in inside and mod is not layers:
            rest_names.append(name)
    del inside, layer_ids, layers
    for name in block_names:
        yield name, model.get_submodule(name), True
    # the rest (embeddings, final norm, head): modules outside the block stack, non-recursively
    for name in rest_names:
        yield name, model.get_submodule(name), False


def materialize(
    model: nn.Module,
    where: Where,
    *,
    device: torch.device,
    seed: int = 0,
    block_hook: Callable[[nn.Module], None] | None = None,
    rest_where: Where | None = None,
    frozen_meta: bool = False,
) -> nn.Module:
    """Fill a meta-device model in bounded chunks (one block at a time) and leave it where asked.

    Each block is allocated on ``device``, filled there (fast: a 14B model built on the CPU takes
    minutes), handed to ``block_hook`` (e.g. to quantize its linears while they are on the device), then
    moved to ``where``. The device never holds more than one block plus what already stays there, so a
    model larger than the budget can be built for an engine that streams or offloads it.

    Args:
        model: a model whose parameters are on the meta device (PEFT-wrapped or not).
        where: ``"device"`` (stay on ``device``), ``"cpu"`` (pageable host) or ``"pinned"`` (page-locked host).
        device: where values are generated.
        seed: base seed; every tensor's values depend only on its name and this seed.
        block_hook: called on each decoder block after it is filled, before it moves.
        rest_where: placement of the modules outside the block stack (default: ``where``).
        frozen_meta: leave frozen parameters on the meta device: placeholders that a data-parallel rank's
            shared host copy fills (``tidal_stream``'s local rank 0 holds the real ones).

    Returns:
        ``model``, materialized.
    """
    rest_where = rest_where or where
    # meta parameter id -> (that parameter, its replacement): tied weights stay tied. The meta original
    # is held so its id can't be reused; a block's map is dropped after the block, so what its hook
    # replaced (e.g. bf16 weights it quantized) is freed.
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for prefix, unit, recurse in _units(model):
        is_block = recurse
        target = where if is_block else rest_where
        done = {} if is_block else shared
        for pname, p in list(unit.named_parameters(recurse=recurse, remove_duplicate=False)):
            full = f"{prefix}.{pname}" if prefix else pname
            if id(p) in done:
                _set_param(unit, pname, done[id(p)][1])
                continue
            if p.device.type != "meta" or (frozen_meta and not p.requires_grad):
                continue
            # [out, in] or [n]: one tensor at a time keeps the device peak at one block
            new = torch.empty(p.shape, dtype=p.dtype, device=device)
            fill_(full, new, seed)
            done[id(p)] = (p, nn.Parameter(new, requires_grad=p.requires_grad))
            _set_param(unit, pname, done[id(p)][1])
        new = p = None  # no stray reference keeps the last tensor alive
        created = [weakref.ref(q) for _, q in done.values()] if is_block else []
        if is_block and block_hook is not None:
            block_hook(unit)
        if is_block:
            done.clear()
        _place(unit, target, recurse)
        if created:
            _release_orphans(prefix, unit, created)
        unit = None
    _rebuild_rotary(model, device if rest_where == "device" else torch.device("cpu"))
    return model


def _set_param(module: nn.Module, dotted: str, value: nn.Parameter) -> None:
    owner = module
    *path, leaf = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, value)


def _place(unit: nn.Module, where: Where, recurse: bool) -> None:
    tensors = list(unit.parameters(recurse=recurse)) + list(unit.buffers(recurse=recurse))
    for t in tensors:
        if t.device.type == "meta":
            continue
        if where == "device":
            continue
        host = t.data.to("cpu")
        t.data = host.pin_memory() if where == "pinned" else host


def _holder_chain(obj: object, ignore: tuple[object, ...], depth: int = 4) -> str:
    """``dict < Linear < list``: the types that keep ``obj`` alive, nearest first (frames skipped)."""
    chain: list[str] = []
    skip = {id(o) for o in ignore}
    for _ in range(depth):
        holders = [
            r
            for r in gc.get_referrers(obj)
            if id(r) not in skip and type(r).__name__ not in ("frame", "cell")
        ]
        if not holders:
            break
        skip.add(id(holders))
        obj = holders[0]
        chain.append(type(obj).__name__)
    return " < ".join(chain) or "nothing found"


#: One line per block whose replaced tensors were still referenced after its hook (freed by force).
BUILD_NOTES: list[str] = []


def _release_orphans(prefix: str, unit: nn.Module, created: list[weakref.ref]) -> None:
    """Free tensors this block was filled with that the block no longer holds but something still does.

    After the hook (e.g. quantization) and placement, a filled bf16 weight that is not the block's own
    any more must be gone; if a stray reference keeps it (a cache, a cycle, a module map), its storage is
    released here so the build stays bounded, and the holder's type is recorded in :data:`BUILD_NOTES`.
    """
    own = [*unit.parameters(), *unit.buffers()]
    kept = {id(t) for t in own}
    # a tensor the block keeps may share an orphan's storage (``nn.Parameter(old.bias.data)``): never freed
    kept_storage = {t.untyped_storage().data_ptr() for t in own if not t.is_meta}
    orphans = [t for t in (r() for r in created) if t is not None and id(t) not in kept]
    orphans = [
        t
        for t in orphans
        if t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() not in kept_storage
    ]
    if not orphans:
        return
    nbytes = sum(t.untyped_storage().nbytes() for t in orphans)
    note = (
        f"{prefix}: {len(orphans)} replaced tensors ({nbytes / MiB:.1f} MiB) still referenced after the hook"
    )
    if not BUILD_NOTES:  # the holder chain once: gc.get_referrers scans every object
        note += f" (held by {_holder_chain(orphans[0], ignore=(orphans,))})"
        log.warning("materialize: %s; their storage is freed", note)
    BUILD_NOTES.append(note)
    for t in orphans:
        t.untyped_storage().resize_(0)


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Rotary ``inv_freq`` is a non-persistent buffer computed at init: recompute it off the meta device.

    transformers 4.57 takes ``(config, device=None)``, newer 5.x only ``(config)``: building it under a
    ``torch.device`` context puts ``inv_freq`` on ``device`` with either signature.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rot = getattr(base.model, "rotary_emb", None)
    if rot is not None:
        with torch.device(device):
            base.model.rotary_emb = type(rot)(config=getattr(rot, "config", base.config)).to(device)


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The forward keyword for a KV cache: ``cache`` after transformers 5.x renamed it, else ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    return {name: cache}


def lora_config() -> Any:
    """The PEFT LoRA config every engine uses: r=16, alpha=32, no dropout, all projections."""
    import peft

    return peft.LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_lora(model: nn.Module, seed: int = 0, config_hook: Callable[[Any], Any] | None = None) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA (base frozen; fp32 adapters, PEFT's default), adapters seeded by name.

    The adapters get the same values in every engine (A ~ N(0, 0.02), B = 0) whatever PEFT's own init
    and wherever the base lives. ``config_hook`` may extend the shared config (e.g. teach PEFT an
    engine's own quantized linear) and returns it.
    """
    import peft

    config = lora_config() if config_hook is None else config_hook(lora_config())
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():
        if "lora_" in name and p.device.type != "meta":
            fill_(name, p.data, seed)
    return model


def make_batch(scenario: Scenario, vocab: int, device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """The seeded token batch shared by every engine: ``[batch, seq]`` int64, uniform over the vocabulary."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (scenario.batch, scenario.seq), generator=g)  # [B, T]
    return ids.to(device)


def adamw(model: nn.Module, lr: float, fused: bool | None = None) -> torch.optim.AdamW:
    """torch AdamW (no weight decay) over the trainable parameters of ``model``, as every engine builds it."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Callable[[], float]:
    """The step every training engine times: HF causal-LM loss on ``ids``, backward, optimizer step.

    Args:
        model: a causal LM taking ``input_ids`` and ``labels`` and returning ``.loss``.
        opt: the optimizer over its trainable parameters.
        ids: the token batch, ``[B, T]``; it is also the label tensor.
        forward_context: a fresh context manager per step around the forward (e.g. autocast).

    Returns:
        ``step() -> loss`` (a Python float).
    """

    def step() -> float:
        with forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory failure of any engine (torch, CUDA, or an engine's own refusal to fit)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "cuda_error_out_of_memory" in text


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the table's error text)."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}".strip()


@dataclasses.dataclass
class Timing:
    """Per-step times and losses of one run."""

    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    peak_reserved: list[int] = dataclasses.field(default_factory=list)
    """CUDA: the allocator's peak of reserved bytes so far, read at the end of each step (never reset: an
    engine may read the peaks itself), so the step that raised the run's peak shows."""
    gc_s: list[float] = dataclasses.field(default_factory=list)
    """Seconds each step spent in Python's cyclic garbage collector (on any thread)."""
    gc_full: list[int] = dataclasses.field(default_factory=list)
    """Full (generation 2) collections during each step: the ones that walk every tracked object."""

    def median(self, warmup: int) -> float | None:
        """Median step time after ``warmup`` steps (None before any timed step)."""
        timed = self.times[warmup:]
        return statistics.median(timed) if timed else None


class GcClock:
    """Time spent in Python's garbage collector, read through ``gc.callbacks`` (a step that is slow once in
    a while may be one that ran a full collection over the process's objects)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started: dict[int, float] = {}  # thread id -> start of its running collection

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now, me = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[me] = now
            self.full += info["generation"] == 2
        elif me in self._started:
            self.seconds += now - self._started.pop(me)

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def sync(device: torch.device) -> None:
    """Wait for the device before reading a clock (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(
    step: Callable[[], float],
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    progress: Callable[[dict[str, Any]], None],
    timing: Timing,
) -> Timing:
    """Run ``warmup + steps`` steps, each timed between device synchronizations.

    Raises:
        FloatingPointError: when a loss is not finite (a broken engine must not look fast).
    """
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        with GcClock() as collected:
            loss = float(step())
            sync(device)
        dt = time.perf_counter() - t0
        timing.gc_s.append(collected.seconds)
        timing.gc_full.append(collected.full)
        if loss != loss or loss in (float("inf"), float("-inf")):
            raise FloatingPointError(f"step {i}: loss is {loss}")
        timing.times.append(dt)
        timing.losses.append(loss)
        if device.type == "cuda":
            timing.peak_reserved.append(torch.cuda.max_memory_reserved(device))
        progress({"event": "step", "step": i, "warmup": i < warmup, "step_s": dt, "loss": loss})
    return timing
