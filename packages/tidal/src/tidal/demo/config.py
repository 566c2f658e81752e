"""Settings of ``tidal demo``: one frozen dataclass, validated on construction, resolved per device."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from tidal.demo.model import SIZES
from tidal.errors import CLIError

QuantName = Literal["none", "int8", "nf4", "fp8", "nvfp4"]
QUANT_FORMATS = ("none", "int8", "nf4", "fp8", "nvfp4")
DEVICES = ("auto", "cpu", "cuda")

# per-device defaults when an option is left at None / "auto"
CPU_DEFAULTS = {"size": "small", "steps": 100, "seq_len": 128, "batch_size": 8}
GPU_DEFAULTS = {"size": "large", "steps": 100, "seq_len": 512, "batch_size": 8}


@dataclass(frozen=True)
class DemoConfig:
    """Everything ``tidal demo`` needs. ``None``/``"auto"`` fields take the per-device defaults above."""

    size: str = "auto"
    """Model size preset (``tiny``, ``small``, ``base``, ``large``, ``xl``) or ``"auto"``: small on CPU, large on GPU."""
    steps: int | None = None
    """Optimizer steps; None: 100 on CPU and on GPU."""
    vram_budget: int | str | None = None
    """Device memory budget (bytes or e.g. ``"512MiB"``); None: chosen from the plan so that blocks stream."""
    quantize: QuantName = "none"
    """``none`` (full fine-tune) or a frozen-base format (``int8``, ``nf4``, ``fp8``, ``nvfp4``) with LoRA."""
    seq_len: int | None = None
    """Tokens (bytes) per sequence; None: 128 on CPU, 512 on GPU."""
    batch_size: int | None = None
    """Sequences per step; None: 8."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu`` or ``cuda``."""
    out: Path = Path("demo-out")
    """Folder for metrics.json and the two PNGs; default ``./demo-out``."""
    lr: float | None = None
    """Learning rate; None: 3e-3 for full fine-tuning of the small sizes, 1e-3 for large/xl and LoRA."""
    lora_rank: int = 8
    """Rank of the adapters when ``quantize`` is not ``none``; default 8."""
    seed: int = 0
    """Seed of the weights and of the data order; default 0."""

    def __post_init__(self) -> None:
        if self.size != "auto" and self.size not in SIZES:
            raise CLIError(
                f"--size: got {self.size!r}; accepted: auto, {', '.join(SIZES)}; pick one of those"
            )
        for name in ("steps", "seq_len", "batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise CLIError(f"--{name.replace('_', '-')}: got {v!r}; accepted: a positive integer")
        if self.quantize not in QUANT_FORMATS:
            raise CLIError(
                f"--quantize: got {self.quantize!r}; accepted: {', '.join(QUANT_FORMATS)}; "
                "use none for a full fine-tune"
            )
        if self.device not in DEVICES:
            raise CLIError(f"--device: got {self.device!r}; accepted: {', '.join(DEVICES)}")
        if self.lr is not None and not self.lr > 0:
            raise CLIError(f"--lr: got {self.lr!r}; accepted: a positive float such as 1e-3")
        if self.lora_rank < 1:
            raise CLIError(f"--lora-rank: got {self.lora_rank!r}; accepted: a positive integer")

    def resolve(self, cuda_available: bool) -> DemoConfig:
        """A copy with the device and every per-device default filled in.

        Raises:
            CLIError: ``device="cuda"`` asked for without a visible GPU, or ``seq_len`` too long for the size.
        """
        if self.device == "cuda" and not cuda_available:
            raise CLIError(
                "--device: got 'cuda' but torch sees no GPU; use --device cpu (or auto) or install torch's CUDA "
                "build (`tidal env` says what is missing)"
            )
        device = self.device if self.device != "auto" else ("cuda" if cuda_available else "cpu")
        d = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
        size = d["size"] if self.size == "auto" else self.size
        seq_len = self.seq_len or d["seq_len"]
        if seq_len > SIZES[size].max_seq_len:
            raise CLIError(
                f"--seq-len: got {seq_len}; size {size!r} supports at most {SIZES[size].max_seq_len}; "
                "lower --seq-len or pick a larger --size"
            )
        lr = self.lr
        if lr is None:
            lr = 1e-3 if (size in ("large", "xl") or self.quantize != "none") else 3e-3
        return replace(
            self,
            device=device,
            size=size,
            steps=self.steps or d["steps"],
            seq_len=seq_len,
            batch_size=self.batch_size or d["batch_size"],
            lr=lr,
        )
