"""The engines compared by ``benchmarks/compare.py``: one module per engine family, one row per variant.

Every engine module exposes ``setup(ctx, **variant) -> step`` (``step()`` runs one training or decode
step and returns the loss as a float) and ``version() -> str``. ``setup`` raises ``NotApplicable`` when
the engine has no way to run the scenario; an import failure of the engine's package becomes a
``not installed`` row, any other failure an ``error`` / ``OOM`` row.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.scenarios import Scenario

# The GPU machine runs from a checkout with nothing installed: tidal's packages come from their src
# folders (appended, so installed copies win); engine processes inherit them through PYTHONPATH.
_SRC = [str(p) for p in sorted((Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]
sys.path.extend(p for p in _SRC if p not in sys.path)
_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join([*_PATH, *(p for p in _SRC if p not in _PATH)])


@dataclasses.dataclass(frozen=True)
class Engine:
    """One row of the comparison."""

    name: str
    """Command-line name (``--engines``)."""
    module: str
    """Module under ``engines`` that implements it."""
    package: str | None
    """Top-level package whose absence makes the row ``not installed`` (None: always there)."""
    modes: tuple[str, ...]
    """Scenario modes it applies to (others give an ``n/a`` row)."""
    label: str
    """Text of the table's engine column."""
    variant: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments for the module's ``setup``."""
    build: str | None = None
    """Python code that compiles the engine's native parts at first use (run ahead, in parallel)."""

    def installed(self) -> bool:
        """Whether the engine's package can be imported here (no import is done)."""
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def applies(self, scenario: Scenario) -> bool:
        """Whether the engine can run the scenario's mode at all."""
        return scenario.mode in self.modes


TRAIN = ("lora", "full")
# TrainStream's build keys its cache by the GPU architecture list; given it (from nvidia-smi) the build
# needs no GPU, so it holds no device memory while other engines run
_TS_BUILD = (
    "import os, subprocess; "
    "cap = subprocess.run(['nvidia-smi', '--query-gpu=compute_cap', '--format=csv,noheader'], "
    "capture_output=True, text=True).stdout.split()[0]; "
    "os.environ.setdefault('TORCH_CUDA_ARCH_LIST', cap); os.environ['CUDA_VISIBLE_DEVICES'] = ''; "
    "import trainstream"
)
_DS_BUILD = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in [
        Engine("stock", "stock", None, ("lora", "full", "decode"), "PyTorch + PEFT (stock)"),
        Engine(
            "bnb-nf4", "bnb", "bitsandbytes", ("lora",), "bitsandbytes NF4 QLoRA", {"checkpointing": False}
        ),
        Engine(
            "bnb-nf4-ckpt",
            "bnb",
            "bitsandbytes",
            ("lora",),
            "bitsandbytes NF4 QLoRA + ckpt",
            {"checkpointing": True},
        ),
        Engine(
            "trainstream",
            "trainstream",
            "trainstream",
            TRAIN,
            "TrainStream 0.4.1 (bf16)",
            {"quantize": "none"},
            _TS_BUILD,
        ),
        Engine(
            "trainstream-nf4",
            "trainstream",
            "trainstream",
            ("lora",),
            "TrainStream 0.4.1 NF4",
            {"quantize": "nf4"},
            _TS_BUILD,
        ),
        Engine(
            "ds-zero2",
            "deepspeed_zero",
            "deepspeed",
            TRAIN,
            "DeepSpeed ZeRO-2 + CPU optim",
            {"stage": 2},
            _DS_BUILD,
        ),
        Engine(
            "ds-zero3",
            "deepspeed_zero",
            "deepspeed",
            TRAIN,
            "DeepSpeed ZeRO-3 + CPU offload",
            {"stage": 3},
            _DS_BUILD,
        ),
        Engine("blockstreamer", "blockstreamer", "block_streamer", TRAIN, "BlockStreamer 0.2"),
        Engine("tidal", "tidal_engine", "tidal_hf", ("lora", "full"), "tidal (auto)", {"fmt": "auto"}),
        Engine("tidal-bf16", "tidal_engine", "tidal_stream", TRAIN, "tidal exact bf16", {"fmt": None}),
        Engine("tidal-nf4", "tidal_engine", "tidal_quant", ("lora",), "tidal NF4", {"fmt": "nf4"}),
        Engine("tidal-fp8", "tidal_engine", "tidal_quant", ("lora",), "tidal FP8", {"fmt": "fp8"}),
        Engine("tidal-nvfp4", "tidal_engine", "tidal_quant", ("lora",), "tidal NVFP4", {"fmt": "nvfp4"}),
    ]
}


def get_engine(name: str) -> Engine:
    """The engine called ``name``; a ValueError lists the accepted names."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"--engines: got {name!r}; accepted: {', '.join(ENGINES)} (or 'all')") from None


def select(spec: str) -> list[Engine]:
    """Engines named in a comma-separated ``spec`` (``"all"``: every engine), in table order."""
    if spec.strip() == "all":
        return list(ENGINES.values())
    return [get_engine(n.strip()) for n in spec.split(",") if n.strip()]


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What an engine's ``setup`` gets: the scenario, the device, the budget, the seed, a progress hook."""

    scenario: Scenario
    """The workload."""
    device: torch.device
    """``cuda`` on the GPU machine, ``cpu`` for ``--smoke``."""
    budget_bytes: int | None
    """VRAM the engine may use (the filler leaves exactly this free); None: the whole device."""
    seed: int = 0
    """Seed of weights and data."""
    progress: Callable[[dict[str, Any]], None] = lambda event: None
    """Called with JSON-able progress events."""

    @property
    def lr(self) -> float:
        """The scenario's learning rate."""
        return self.scenario.lr

    @property
    def vocab(self) -> int:
        """Vocabulary size of the scenario's architecture."""
        return int(self.scenario.shape["vocab_size"])

    def batch(self) -> torch.Tensor:
        """The shared token batch on the run's device: ``[batch, seq]``."""
        from engines.common import make_batch

        return make_batch(self.scenario, self.vocab, self.device, self.seed)
