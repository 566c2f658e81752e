"""``load_model``: a causal LM built on the meta device and filled tensor by tensor.

1. The config is read (local folder, or a Hub id already in the local cache: no network) and the model
   is built with its parameters on the meta device (buffers such as rotary tables are real: small).
2. Each checkpoint tensor is read on its own (:mod:`tidal_hf.safetensors_io`), cast to ``dtype``, moved
   to ``device`` and put in place; a frozen block linear's weight is quantized at once and its
   ``nn.Linear`` replaced by a ``QuantLinear``. Peak host memory: what was kept so far plus one tensor.
3. ``random_weights=True`` fills the same shapes module by module with the model's own initialiser.
4. On CUDA, blocks that the plan for ``vram_budget`` streams are filled on the device like the others,
   then moved to host memory module by module, so the device never holds more than what stays
   there plus one module (a 14B bf16 base at a 24 GiB budget is never built on the device).

Tied parameters (e.g. GPT-2's head and embeddings) are one Parameter registered under several names:
the first tensor read for any of them fills all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidal_hf.errors import CheckpointError, bad_option
from tidal_hf.safetensors_io import iter_safetensors, read_header
from tidal_hf.structure import find_block_stack
from tidal_quant import QuantLinear, bytes_per_weight

__all__ = ["load_model"]

log = logging.getLogger(__name__)

_FORMATS = ("int8", "nf4", "fp8", "nvfp4")
_PICKLE = (".bin", ".pt", ".pth", ".ckpt")


# ---------------------------------------------------------------------------------------------- files
def _resolve_dir(name_or_path: str | os.PathLike) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise bad_option("load_model", "name_or_path", str(name_or_path), "a folder with config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), local_files_only=True))
    except Exception as e:  # the hub client raises several types for "not cached" / "bad id"
        raise CheckpointError(
            f"load_model: name_or_path={str(name_or_path)!r} is neither a local folder nor a Hub id in the local "
            f"cache ({type(e).__name__}); no download is attempted. Fix: pass a folder with config.json and "
            "*.safetensors, or fetch the model on a machine with network and copy the folder."
        ) from e


def _checkpoint_files(folder: Path, allow_pickle: bool) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [folder / f for f in files]
            break
    else:
        paths = sorted(folder.glob("*.safetensors")) or sorted(
            p for p in folder.iterdir() if p.suffix in _PICKLE
        )
    if not paths:
        raise CheckpointError(
            f"load_model: {str(folder)!r} holds no checkpoint (*.safetensors or an index). Fix: point at the "
            "folder save_pretrained() wrote, or pass random_weights=True for shapes only."
        )
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise CheckpointError(
            f"load_model: shards {missing} listed in the index are missing from {str(folder)!r}."
        )
    pickles = [p.name for p in paths if p.suffix in _PICKLE]
    if pickles and not allow_pickle:
        raise CheckpointError(
            f"load_model: {pickles[:3]} are pickle checkpoints, which can run code when loaded; refused. "
            "Fix: convert them to safetensors, or pass allow_pickle=True if you trust their source."
        )
    return paths


def _iter_checkpoint(paths: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in paths:
        if path.suffix == ".safetensors":
            for info, tensor in iter_safetensors(path):
                yield info.name, tensor
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name in list(state):
                yield name, state.pop(name)


def _checkpoint_bytes(paths: list[Path]) -> int:
    return sum(
        sum(t.nbytes for t in read_header(p)) if p.suffix == ".safetensors" else p.stat().st_size
        for p in paths
    )


# ---------------------------------------------------------------------------------------------- model
def _meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with parameters on the meta device, cast to ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # the parameter patch of init_empty_weights undoes the tying done in __init__
    return model.to(dtype)


@dataclasses.dataclass(frozen=True)
class _Placement:
    """What the plan decided before any weight is read."""

    fmt: str | None
    """Format of the block linears (None: exact)."""
    streamed: frozenset[int] = frozenset()
    """Indices of the blocks kept in host memory, for ``tidal_stream.wrap`` to stream."""


def _weight_bytes(model: nn.Module, fmt: str | None) -> int:
    """Bytes of the model's parameters once loaded: block linear weights in ``fmt``, the rest as they are."""
    stack = find_block_stack(model)
    linear_weights = (
        {id(m.weight) for m in stack.modules() if type(m) is nn.Linear}
        if fmt and stack is not None
        else set()
    )
    total = 0
    for p in model.parameters():
        per = bytes_per_weight(fmt) if id(p) in linear_weights else p.element_size()
        total += int(p.numel() * per)
    return total


def _decide(
    model: nn.Module,
    quantize: Any,
    device: torch.device,
    profile: Any = None,
    vram_budget: int | str | None = None,
) -> _Placement:
    """The block-linear format and the blocks left on the host, by the tidal plan for LoRA on ``device``.

    On the CPU nothing is planned: weights stay exact for ``"auto"`` and every block stays in place. On
    CUDA without a ``vram_budget``, an explicit format (or None) whose weights take under half the free
    memory skips the plan (the hardware profile takes seconds the first time); otherwise the plan chooses ``"auto"``'s format and
    which blocks do not fit, and those are placed in host memory as they are filled.
    """
    if quantize is False:
        quantize = None
    if quantize is not None and quantize != "auto" and quantize not in _FORMATS:
        raise bad_option("load_model", "quantize", quantize, f"'auto', None, or one of {list(_FORMATS)}")
    if device.type != "cuda":
        if quantize == "auto":
            log.info("load_model: quantize='auto' keeps weights exact on %s (nothing to fit)", device)
            return _Placement(None)
        return _Placement(quantize)
    from tidal_plan import PlanConfig, census, plan, profile_hardware

    # a budget given is planned: weights at half of it can still leave too little for activations and loss
    unplanned = quantize != "auto" and profile is None and vram_budget is None
    if unplanned and 2 * _weight_bytes(model, quantize) <= torch.cuda.mem_get_info(device)[0]:
        return _Placement(quantize)
    stack = find_block_stack(model)
    # plan for LoRA: the base frozen while planning; the blocks' 1-D parameters (norms, biases) stand in for
    # the adapters, which are as small. Flags are restored after.
    flags = {id(t): t.requires_grad for t in model.parameters()}
    in_blocks = {id(t) for t in stack.parameters()} if stack is not None else set()
    try:
        for t in model.parameters():
            t.requires_grad_(t.dim() == 1 and id(t) in in_blocks)
        hw = profile if profile is not None else profile_hardware(device, vram_budget=vram_budget)
        p = plan(
            census(model, blocks=stack),
            hw,
            PlanConfig(quantize=quantize, training="lora", bytes_per_weight=bytes_per_weight),
        )
    finally:
        for t in model.parameters():
            t.requires_grad_(flags[id(t)])
    fmt = p.quantize if quantize == "auto" else quantize
    streamed = frozenset(p.streamed_blocks) if stack is not None else frozenset()
    log.info(
        "load_model: block linears %s, %d of %d blocks kept in host memory (the plan for LoRA on %s)",
        fmt or "exact",
        len(streamed),
        len(stack) if stack is not None else 0,
        device,
    )
    return _Placement(fmt, streamed)


def _choose_format(model: nn.Module, quantize: Any, device: torch.device, profile: Any = None) -> str | None:
    """The block-linear format: ``quantize`` itself, or for ``"auto"`` the tidal plan's choice on ``device``."""
    return _decide(model, quantize, device, profile).fmt


def _targets(model: nn.Module, fmt: str | None) -> set[str]:
    """Qualified names of the block linears to quantize."""
    if fmt is None:
        return set()
    stack = find_block_stack(model)
    if stack is None:
        raise CheckpointError(
            f"load_model: quantize={fmt!r} needs the decoder-layer stack, which {type(model).__name__} does not "
            "declare (_no_split_modules). Fix: quantize=None, or tidal_quant.quantize_model_ after loading."
        )
    stack_name = next(n for n, m in model.named_modules() if m is stack)
    names = {
        f"{stack_name}.{n}" for n, m in stack.named_modules() if type(m) is nn.Linear and n.count(".") >= 1
    }
    if not names:
        log.info("load_model: %s blocks hold no nn.Linear; nothing is quantized", type(model).__name__)
    return names


class _Filler:
    """Puts tensors into a meta-built model; quantizes target linears as their weights arrive."""

    def __init__(
        self,
        model: nn.Module,
        fmt: str | None,
        dtype: torch.dtype,
        device: torch.device,
        streamed: frozenset[int] = frozenset(),
    ) -> None:
        self.model, self.fmt, self.dtype, self.device = model, fmt, dtype, device
        self.targets = _targets(model, fmt)
        stack = find_block_stack(model) if streamed else None
        stack_name = next((n for n, m in model.named_modules() if m is stack), "")
        #: name prefixes of the blocks that live in host memory (filled on ``device``, then moved)
        self.host_prefixes = tuple(f"{stack_name}.{i}." for i in sorted(streamed))
        self.aliases: dict[str, list[str]] = {}  # name -> every name of the same (tied) tensor
        groups: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        for names in groups.values():
            for n in names:
                self.aliases[n] = names
        self.expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self.expected |= {n for n, _ in model.named_buffers() if self._persistent(n)}
        self.filled: set[str] = set()
        prefix = getattr(model, "base_model_prefix", "")
        self.prefix = f"{prefix}." if prefix else ""
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
        self.ignore = [re.compile(p) for p in ignore]

    def _persistent(self, name: str) -> bool:
        owner, _, leaf = name.rpartition(".")
        mod = self.model.get_submodule(owner)
        return leaf not in getattr(mod, "_non_persistent_buffers_set", set())

    def key(self, name: str) -> str | None:
        """The model's name for a checkpoint key (a missing backbone prefix is added), or None to skip."""
        if name in self.expected:
            return name
        if self.prefix + name in self.expected:
            return self.prefix + name
        if any(p.search(name) for p in self.ignore):
            return None
        raise CheckpointError(
            f"load_model: checkpoint tensor {name!r} has no place in {type(self.model).__name__}. Fix: check that "
            "config.json matches the weights (model_type, sizes), or load with transformers' from_pretrained."
        )

    def on_host(self, module_name: str) -> bool:
        """Whether the module ``module_name`` belongs to a block the plan keeps in host memory."""
        return bool(self.host_prefixes) and f"{module_name}.".startswith(self.host_prefixes)

    def settle(self, module_name: str) -> None:
        """Move the module's own tensors to host memory when its block lives there.

        Pageable, not page-locked: ``tidal_stream.wrap`` copies streamed blocks into its own pinned arena,
        and torch's pinned blocks (each rounded up to a power of two) would stay cached beside it.
        """
        if not self.on_host(module_name):
            return
        module = self.model.get_submodule(module_name)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.is_meta or t.device.type == "cpu":
                continue
            t.data = t.data.to("cpu")

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Place ``tensor`` as the model's ``name`` (cast, moved, quantized if targeted)."""
        owner, _, leaf = name.rpartition(".")
        self._put(name, owner, leaf, tensor)
        self.settle(owner)

    def _put(self, name: str, owner: str, leaf: str, tensor: torch.Tensor) -> None:
        module = self.model.get_submodule(owner)
        tensor = tensor.to(self.device)  # first: a cast on the GPU is far faster than on the host
        if tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        if leaf in module._buffers:
            self._check_shape(name, module._buffers[leaf], tensor)
            module._buffers[leaf] = tensor
            self.filled.add(name)
            return
        if owner in self.targets:
            self._put_quantized(owner, module, leaf, tensor)
            self.filled.add(name)
            return
        old = module._parameters[leaf]
        self._check_shape(name, old, tensor)
        new = nn.Parameter(tensor, requires_grad=old.requires_grad)
        for alias in self.aliases[name]:
            o, _, lf = alias.rpartition(".")
            self.model.get_submodule(o)._parameters[lf] = new
            self.filled.add(alias)

    def _put_quantized(self, owner: str, module: nn.Module, leaf: str, tensor: torch.Tensor) -> None:
        if isinstance(module, QuantLinear):  # its weight came first: this is the bias
            self._check_shape(f"{owner}.{leaf}", module.bias, tensor)
            module.bias = nn.Parameter(tensor, requires_grad=False)
            return
        self._check_shape(f"{owner}.{leaf}", module._parameters[leaf], tensor)
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        if leaf != "weight":
            return  # a bias before its weight: it stays on the Linear until the weight arrives
        # a bias still on the meta device stays there in the QuantLinear until it is read
        q = QuantLinear.from_linear(module, self.fmt)
        parent, _, attr = owner.rpartition(".")
        setattr(self.model.get_submodule(parent), attr, q)

    @staticmethod
    def _check_shape(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        if tuple(old.shape) != tuple(new.shape):
            raise CheckpointError(
                f"load_model: {name!r} is {tuple(new.shape)} in the checkpoint but {tuple(old.shape)} in the model "
                "built from config.json. Fix: use the config that belongs to these weights."
            )

    def finish(self, from_checkpoint: bool) -> None:
        missing = sorted(self.expected - self.filled) if from_checkpoint else []
        meta = [n for n, t in self.model.state_dict(keep_vars=True).items() if t.is_meta]
        if missing or meta:
            names = missing or meta
            raise CheckpointError(
                f"load_model: {len(names)} tensors of the model are not in the checkpoint, e.g. {names[:4]}. Fix: "
                "pass the complete checkpoint folder (every shard of the index)."
            )


# ---------------------------------------------------------------------------------------------- random
@torch.no_grad()
def _fill_random(filler: _Filler, seed: int) -> None:
    """Materialize every meta module on the device and initialise it with the model's own ``_init_weights``.

    Module by module: each is filled, initialised, quantized when targeted, then moved to host memory
    when its block lives there. Only names are held across the loop (a list of the modules would keep
    every replaced bf16 linear alive to the end: the whole exact model on the device).
    """
    model = filler.model
    torch.manual_seed(seed)
    init = getattr(model, "_init_weights", None)
    names = [n for n, m in model.named_modules() if any(p.is_meta for p in m.parameters(recurse=False))]
    for name in names:
        module = model.get_submodule(name)
        local = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if not local:
            continue  # tied: materialized under another name already
        for leaf, p in local:
            new = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=filler.device), requires_grad=p.requires_grad
            )
            for alias in filler.aliases[f"{name}.{leaf}" if name else leaf]:  # tied names get it at once
                o, _, lf = alias.rpartition(".")
                model.get_submodule(o)._parameters[lf] = new
        new = p = None
        if callable(init):
            init(module)
        else:
            for _, q in module.named_parameters(recurse=False):
                q.normal_(0.0, 0.02)
        if name in filler.targets:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, QuantLinear.from_linear(module, filler.fmt))
        module = None
        filler.settle(name)


def _check_device(device: Any) -> torch.device:
    """Validate ``load_model``'s ``device`` up front; None picks CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    accepted = 'None, "cpu", "cuda", "cuda:N" or a torch.device of type cpu/cuda'
    dev = None
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise bad_option("load_model", "device", device, accepted, 'pass device="cuda" or device="cpu"')
    return dev


def _check_budget(vram_budget: Any) -> None:
    """Validate ``load_model``'s ``vram_budget`` up front: None, a positive int, or a size string."""
    from tidal_plan import PlanConfigError, parse_bytes

    if vram_budget is None:
        return
    accepted = 'None, a positive number of bytes, or a size string such as "24GiB"'
    try:
        ok = parse_bytes(vram_budget, option="vram_budget") > 0
    except PlanConfigError:
        ok = False
    if not ok:
        raise bad_option("load_model", "vram_budget", vram_budget, accepted, 'e.g. vram_budget="24GiB"')


# ---------------------------------------------------------------------------------------------- API
def load_model(
    name_or_path: str | os.PathLike | Any,
    quantize: str | None = "auto",
    dtype: torch.dtype = torch.bfloat16,
    random_weights: bool = False,
    *,
    device: torch.device | str | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    seed: int = 0,
    vram_budget: int | str | None = None,
    **config_overrides: Any,
) -> nn.Module:
    """Load a causal LM with bounded host memory, quantizing frozen block linears while reading.

    Args:
        name_or_path: a folder with ``config.json`` and ``*.safetensors`` (single file or shards with
            ``model.safetensors.index.json``), a Hub id already in the local cache (nothing is downloaded),
            or — with ``random_weights=True`` — a ``transformers.PretrainedConfig``.
        quantize: storage of the decoder blocks' ``nn.Linear`` weights: ``"int8"``, ``"nf4"``, ``"fp8"``,
            ``"nvfp4"``, None (exact), or ``"auto"`` (the tidal plan for LoRA on ``device`` decides; exact
            on the CPU). Embeddings, norms and the head stay exact. Quantized layers are frozen.
        dtype: dtype of the floating-point tensors kept exact.
        random_weights: build the exact shapes with random weights (the model's own initialiser) and
            read no weight file.
        device: where every tensor is placed as it is read: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
            cpu/cuda ``torch.device``; None: CUDA when available, else the CPU.
        allow_pickle: accept ``.bin``/``.pt`` pickle checkpoints (they can run code when loaded).
        progress: show a tqdm bar in bytes.
        seed: seed of ``random_weights``.
        vram_budget: device bytes (or ``"24GiB"``) the model will train in on CUDA; None: the memory free
            now. The plan for that budget picks ``"auto"``'s format and the blocks that do not fit: those
            are filled on the device and kept in host memory for ``tidal_stream.wrap`` to stream.
        **config_overrides: config fields to change (e.g. ``num_hidden_layers=2``).

    Returns:
        The model in eval mode (as ``from_pretrained`` returns it).

    Raises:
        CheckpointError: no such folder / not cached, pickle refused, tensors missing or misplaced.
        OptionError: invalid arguments.
    """
    from transformers import AutoConfig, PretrainedConfig

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise bad_option(
            "load_model", "dtype", dtype, "a floating torch.dtype (torch.bfloat16, torch.float32, ...)"
        )
    for flag, value in (
        ("random_weights", random_weights),
        ("allow_pickle", allow_pickle),
        ("progress", progress),
    ):
        if not isinstance(value, bool):
            raise bad_option("load_model", flag, value, "True or False")
    dev = _check_device(device)
    _check_budget(vram_budget)
    if isinstance(name_or_path, PretrainedConfig):
        if not random_weights:
            raise bad_option(
                "load_model",
                "name_or_path",
                type(name_or_path).__name__,
                "a folder or Hub id (a config only with random_weights=True)",
                "pass random_weights=True, or the checkpoint folder",
            )
        config, folder = (
            name_or_path.__class__.from_dict({**name_or_path.to_dict(), **config_overrides}),
            None,
        )
    else:
        folder = _resolve_dir(name_or_path)
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **config_overrides)
    model = _meta_model(config, dtype)
    placed = _decide(model, quantize, dev, vram_budget=vram_budget)
    fmt = placed.fmt
    filler = _Filler(model, fmt, dtype, dev, placed.streamed)
    if random_weights:
        _fill_random(filler, seed)
    else:
        assert folder is not None
        paths = _checkpoint_files(folder, allow_pickle)
        from tqdm.auto import tqdm

        with (
            tqdm(
                total=_checkpoint_bytes(paths),
                unit="B",
                unit_scale=True,
                desc="load_model",
                disable=not progress,
            ) as bar,
            torch.profiler.record_function("tidal::hf.load_model"),
        ):
            for name, tensor in _iter_checkpoint(paths):
                nbytes = tensor.nbytes
                key = filler.key(name)
                if key is not None and key not in filler.filled:
                    filler.put(key, tensor)
                del tensor
                bar.update(nbytes)
    filler.finish(from_checkpoint=not random_weights)
    model.eval()
    log.info("load_model: %s on %s, %s, block linears %s", type(model).__name__, dev, dtype, fmt or "exact")
    return model
