"""``tidal env``: versions of every tidal package and of what they run on, the GPU, and what is missing.

Versions come from package metadata (``importlib.metadata``), so Triton and CuPy are reported without
being imported; only torch is imported, to ask about CUDA and the GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

TIDAL_DISTS = (
    "tidal",
    "tidal-arena",
    "tidal-quant",
    "tidal-plan",
    "tidal-stream",
    "tidal-kv",
    "tidal-hf",
    "tidal-testing",
)
# distribution -> (import name, why tidal wants it)
THIRD_PARTY = {
    "torch": ("torch", "required by every tidal package"),
    "triton": ("triton", "tidal-quant's CUDA kernels (ships with torch's CUDA wheels)"),
    "cupy": ("cupy", "tidal-arena's exact-size page-locked slabs (else torch's pinned allocator)"),
    "transformers": ("transformers", "tidal-hf (load_model, TidalTrainer, TidalCache)"),
    "peft": ("peft", "LoRA through tidal-hf"),
    "safetensors": ("safetensors", "tidal-hf's load_model"),
    "accelerate": ("accelerate", "transformers' Trainer under TidalTrainer"),
    "bitsandbytes": ("bitsandbytes", "optional: only the NF4 byte-compatibility tests"),
    "matplotlib": ("matplotlib", "the demo's PNG plots"),
    "tqdm": ("tqdm", "progress bars"),
}
_CUPY_DISTS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")


@dataclass
class EnvReport:
    """Everything ``tidal env`` prints; ``to_dict()`` is its ``--json`` form."""

    python: str
    platform: str
    tidal: dict[str, str | None]
    packages: dict[str, str | None]
    torch_cuda: str | None = None
    cuda_available: bool = False
    gpus: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _module_version(dist: str, module: str) -> str | None:
    """Metadata version, else the version of a module found on the path without metadata (PYTHONPATH)."""
    v = _version(dist)
    if v is not None:
        return v
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    if module.startswith("tidal"):
        about = importlib.import_module(f"{module}.__about__")  # tiny: one string, imports nothing
        return f"{about.__version__} (not installed; found on the path)"
    return "present (no metadata)"


def collect() -> EnvReport:
    """Gather versions, the GPU(s) and the list of what is missing with the command that fixes it."""
    tidal = {d: _module_version(d, d.replace("-", "_")) for d in TIDAL_DISTS}
    packages: dict[str, str | None] = {}
    for dist, (module, _) in THIRD_PARTY.items():
        if dist == "cupy":
            found = [(d, _version(d)) for d in _CUPY_DISTS]
            found = [(d, v) for d, v in found if v is not None]
            packages[dist] = f"{found[0][1]} ({found[0][0]})" if found else _module_version(dist, module)
        else:
            packages[dist] = _module_version(dist, module)
    report = EnvReport(
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.machine()}",
        tidal=tidal,
        packages=packages,
    )
    if packages["torch"] is not None:
        import torch

        report.torch_cuda = torch.version.cuda
        report.cuda_available = torch.cuda.is_available()
        for i in range(torch.cuda.device_count() if report.cuda_available else 0):
            p = torch.cuda.get_device_properties(i)
            report.gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "fp8_tensor_cores": (p.major, p.minor) >= (8, 9),
                    "fp4_tensor_cores": p.major >= 10,
                }
            )
    report.missing = _missing(report)
    return report


def _missing(r: EnvReport) -> list[str]:
    out = []
    for dist, v in r.tidal.items():
        if v is None and dist != "tidal-testing":
            hint = 'pip install "tidal[hf]"' if dist == "tidal-hf" else f"pip install {dist}"
            out.append(f"{dist}: not installed -> {hint}")
    if r.packages["torch"] is None:
        out.append("torch: not installed -> pip install torch (see pytorch.org for the CUDA build)")
        return out
    if r.packages["transformers"] is None:
        out.append('transformers: not installed -> pip install "tidal[hf]" (Hugging Face integration)')
    if not r.cuda_available:
        build = "CPU-only build of torch" if r.torch_cuda is None else f"torch built for CUDA {r.torch_cuda}"
        out.append(
            f"GPU: none visible ({build}); tidal runs its CPU stand-in. For a GPU, install torch's CUDA build "
            "(pytorch.org) and check `nvidia-smi`"
        )
        return out
    cuda_major = (r.torch_cuda or "12").split(".")[0]
    if r.packages["cupy"] is None:
        out.append(
            f'cupy: not installed -> pip install "tidal[cuda{cuda_major}]" (exact-size pinned slabs; '
            "without it tidal-arena uses torch's pinned allocator, which rounds up to powers of two)"
        )
    if r.packages["triton"] is None:
        out.append(
            "triton: not installed -> it ships with torch's CUDA wheels; reinstall torch from pytorch.org"
        )
    return out


def render(r: EnvReport) -> str:
    """The human-readable table printed by ``tidal env``."""
    lines = [f"python {r.python} on {r.platform}", "", "tidal packages:"]
    lines += [f"  {d:<16} {v or 'MISSING'}" for d, v in r.tidal.items()]
    lines += ["", "dependencies:"]
    for dist, v in r.packages.items():
        lines.append(f"  {dist:<16} {v or 'missing':<28} {THIRD_PARTY[dist][1]}")
    lines += ["", f"CUDA (torch build): {r.torch_cuda or 'none (CPU build)'}"]
    if r.gpus:
        for g in r.gpus:
            feats = ", ".join(
                f
                for f, on in (("FP8 tensor cores", g["fp8_tensor_cores"]), ("FP4", g["fp4_tensor_cores"]))
                if on
            )
            lines.append(
                f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
                f"{g['memory_gib']} GiB{', ' + feats if feats else ''}"
            )
    else:
        lines.append("GPU: none visible")
    lines += ["", "missing / to do:" if r.missing else "nothing missing"]
    lines += [f"  - {m}" for m in r.missing]
    return "\n".join(lines)
