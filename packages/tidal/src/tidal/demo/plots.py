"""The demo's two PNGs: the loss curve, and the memory / transfer timeline. matplotlib loads lazily."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _unit(n: float) -> tuple[str, float]:
    """The binary unit that shows ``n`` as a number of reasonable size."""
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if n >= size:
            return unit, size
    return "bytes", 1.0


def plot_loss(steps: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Per-step training loss with a running mean; returns ``path``."""
    plt = _pyplot()
    xs = [s["step"] for s in steps]
    ys = [s["loss"] for s in steps]
    k = max(1, len(ys) // 10)
    smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(xs, ys, lw=0.8, alpha=0.45, label="loss")
    ax.plot(xs, smooth, lw=2.0, label=f"running mean ({k} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_timeline(
    steps: Sequence[dict[str, Any]], path: Path, budget_bytes: int | None, device_label: str
) -> Path:
    """Device memory per step (peak and after the step, against the budget) over bytes moved per step."""
    plt = _pyplot()
    xs = [s["step"] for s in steps]
    top = max([budget_bytes or 0] + [s["peak_bytes"] for s in steps])
    unit, scale = _unit(top)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), dpi=110, sharex=True)
    ax1.plot(xs, [s["peak_bytes"] / scale for s in steps], marker=".", label="peak in step")
    ax1.plot(xs, [s["allocated_bytes"] / scale for s in steps], marker=".", label="allocated after step")
    if budget_bytes:
        ax1.axhline(budget_bytes / scale, color="red", ls="--", label="budget")
    ax1.set_ylim(0, top / scale * 1.1)
    ax1.set_ylabel(f"{device_label} memory ({unit})")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    width = 0.4
    unit2, scale2 = _unit(max([1] + [max(s["h2d_bytes"], s["d2h_bytes"]) for s in steps]))
    ax2.bar(
        [x - width / 2 for x in xs], [s["h2d_bytes"] / scale2 for s in steps], width, label="host → device"
    )
    ax2.bar(
        [x + width / 2 for x in xs], [s["d2h_bytes"] / scale2 for s in steps], width, label="device → host"
    )
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"moved per step ({unit2})")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle("memory and transfers per step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
