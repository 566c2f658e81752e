"""tidal: train and fine-tune models larger than the GPU's memory, on one GPU.

``import tidal`` is cheap: it imports no sibling package, no torch, no Triton and no CuPy. Each name of
the curated API below is resolved from its package on first use (PEP 562 module ``__getattr__``)::

    import tidal

    model, optimizer = tidal.wrap(model, optimizer, vram_budget="24GiB")

A name whose package is not installed (``tidal-hf`` is an extra: ``pip install "tidal[hf]"``), or not
yet present in it, raises :class:`~tidal.errors.MissingComponentError` naming the package, the name
and the install command.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from tidal.__about__ import __version__
from tidal.errors import MissingComponentError

# name -> (module it comes from, distribution that ships that module); order = the docs' order
_EXPORTS: dict[str, tuple[str, str]] = {
    # tidal-stream: wrap a model + optimizer; explicit streaming; chunked losses
    **{
        n: ("tidal_stream", "tidal-stream")
        for n in (
            "wrap",
            "unwrap",
            "memory_report",
            "OffloadAdamW",
            "StreamedBlocks",
            "chunked_cross_entropy",
            "sequence_logprobs",
            "dpo_loss",
        )
    },
    # tidal-quant: frozen weights in fewer bytes
    **{
        n: ("tidal_quant", "tidal-quant")
        for n in (
            "quantize",
            "dequantize",
            "QuantLinear",
            "quantize_model_",
            "bytes_per_weight",
            "QuantFormat",
        )
    },
    # tidal-plan: measure, census, plan (or refuse with numbers)
    **{
        n: ("tidal_plan", "tidal-plan")
        for n in (
            "profile_hardware",
            "census",
            "plan",
            "predict",
            "PlanConfig",
            "Plan",
            "InfeasiblePlan",
            "parse_bytes",
            "HardwareProfile",
        )
    },
    # tidal-arena: page-locked host memory
    **{n: ("tidal_arena", "tidal-arena") for n in ("PinnedArena", "pin_", "StagingRing", "arena_stats")},
    # tidal-kv: paged KV cache
    **{n: ("tidal_kv", "tidal-kv") for n in ("PagedKVCache", "KVConfig")},
    # tidal-hf (the [hf] extra): Hugging Face integration
    **{
        n: ("tidal_hf", "tidal-hf")
        for n in ("load_model", "TidalTrainer", "TidalQuantizationConfig", "TidalCache", "wrap_hf")
    },
}


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (finds it without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The curated API (a literal list, so tools can read it without importing); names of tidal-hf, an extra,
# are dropped below when it is not installed, so ``from tidal import *`` works either way.
__all__ = [
    "HardwareProfile",
    "InfeasiblePlan",
    "KVConfig",
    "MissingComponentError",
    "OffloadAdamW",
    "PagedKVCache",
    "PinnedArena",
    "Plan",
    "PlanConfig",
    "QuantFormat",
    "QuantLinear",
    "StagingRing",
    "StreamedBlocks",
    "TidalCache",
    "TidalQuantizationConfig",
    "TidalTrainer",
    "__version__",
    "arena_stats",
    "bytes_per_weight",
    "census",
    "chunked_cross_entropy",
    "dequantize",
    "dpo_loss",
    "load_model",
    "memory_report",
    "parse_bytes",
    "pin_",
    "plan",
    "predict",
    "profile_hardware",
    "quantize",
    "quantize_model_",
    "sequence_logprobs",
    "unwrap",
    "wrap",
    "wrap_hf",
]


def _drop_uninstalled() -> None:
    for name, (module, _) in _EXPORTS.items():
        if not _installed(module):
            __all__.remove(name)


_drop_uninstalled()


def _install_hint(dist: str) -> str:
    return 'pip install "tidal[hf]"' if dist == "tidal-hf" else f"pip install {dist}"


def __getattr__(name: str) -> Any:
    """Resolve a curated name from its package on first access, then cache it on this module."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    module_name, dist = _EXPORTS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a dependency of that package is missing: show the real cause
        raise MissingComponentError(
            f"tidal.{name} comes from the package {dist} (module {module_name}), which is not installed; "
            f"install it with `{_install_hint(dist)}`",
            name=module_name,
        ) from exc
    public = getattr(module, "__all__", ())
    if name not in public:
        raise MissingComponentError(
            f"tidal.{name}: {dist} {getattr(module, '__version__', '?')} is installed but does not export "
            f"{name!r} (its __all__ has: {', '.join(sorted(public)) or 'nothing'}); "
            f"install a {dist} version matching tidal {__version__}",
            name=module_name,
        )
    value = getattr(module, name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
