"""Eager against compiled quantized layers: does ``torch.compile`` with CUDA graphs take the host cost away?

```bash
python3 benchmarks/quant/compiled.py              # the GPU machine, ~2 min (packages/*/src on PYTHONPATH)
python3 benchmarks/quant/compiled.py --device cpu --tokens 8 --dim 64 128 --layers 2 --modes eager,compile
```

An eager step of a quantized layer issues its kernels for longer than they run at a few hundred tokens
(``backward_host.py``); ``torch.compile(mode="reduce-overhead")`` traces tidal-quant's custom ops and
replays the whole forward and backward from CUDA graphs. This times a stack of ``--layers`` frozen MLPs
(up ``IN→OUT``, SiLU, down ``OUT→IN``, as a transformer block's) for a forward + input-gradient step,
per layer kind (``--kinds``: bf16 ``nn.Linear``, tidal NF4 and bitsandbytes ``Linear4bit`` eager when
importable by default; any tidal format or variant such as nf4-fp8)
and mode: ``eager``, ``compile`` (inductor, no graphs) and ``graphs`` (``mode="reduce-overhead"``).
Each step is timed by the wall clock in windows of a few steps, the device drained between windows: what
a training loop sees, host and device together. Every compiled stack's output and input gradient are
checked against its eager run before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

import tidal_quant as tq

MODES = ("eager", "compile", "graphs")
MIN_SQNR_DB = 40.0  # compiled against eager, same layers: only fusion-order rounding may differ


class _MLPs(torch.nn.Module):
    """``layers`` × (up, SiLU, down) with frozen weights of the given kind."""

    def __init__(self, ups: list[torch.nn.Module], downs: list[torch.nn.Module]) -> None:
        super().__init__()
        self.ups, self.downs = torch.nn.ModuleList(ups), torch.nn.ModuleList(downs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs):
            x = down(torch.nn.functional.silu(up(x)))
        return x


def _stack(kind: str, weights: list[tuple[torch.Tensor, torch.Tensor]], device: str) -> _MLPs:
    def layer(w: torch.Tensor) -> torch.nn.Module:
        out_f, in_f = w.shape
        if device == "cuda":
            return qbench.make_layer(kind, in_f, out_f, w)
        lin = torch.nn.Linear(in_f, out_f, bias=False, dtype=w.dtype).requires_grad_(False)
        with torch.no_grad():
            lin.weight.copy_(w)
        fmt, cfg = qbench.VARIANTS.get(kind, (kind, {}))
        return lin if kind == "bf16" else tq.QuantLinear.from_linear(lin, fmt, **cfg)

    return _MLPs([layer(u) for u, _ in weights], [layer(d) for _, d in weights])


def _step(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, graphs: bool):
    def step() -> tuple[torch.Tensor, torch.Tensor]:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # why: each step's graph outputs are new
        x.grad = None
        y = model(x)
        y.backward(g)
        return y.detach(), x.grad

    return step


def _ms(step, sync, windows: int, per: int = 4) -> float:
    """Median wall-clock ms per step over ``windows`` windows of ``per`` steps (device drained between)."""
    for _ in range(3):
        step()
    out = []
    for _ in range(windows):
        sync()  # why: each window starts from an idle device and an empty launch queue
        t0 = time.perf_counter()
        for _ in range(per):
            step()
        sync()  # why: the window ends when its last step's kernels have run
        out.append((time.perf_counter() - t0) / per * 1e3)
    return statistics.median(out)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-30)))


def run(kinds: list[str], modes: list[str], dims, tokens: int, layers: int, device: str, windows: int):
    """Yields ``(kind, mode, ms per step)`` as each is timed; raises if a compiled stack disagrees with its
    eager run."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    in_f, out_f = dims
    weights = [
        tuple(
            (torch.randn(o, i, generator=gen) * 0.02).to(device, torch.bfloat16)
            for o, i in ((out_f, in_f), (in_f, out_f))
        )
        for _ in range(layers)
    ]
    x = torch.randn(tokens, in_f, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    g = torch.randn(tokens, in_f, generator=gen).to(device, torch.bfloat16)
    for kind in kinds:
        model = _stack(kind, weights, device)
        eager = _step(model, x, g, graphs=False)
        want_y, want_gx = (t.clone() for t in eager())
        for mode in modes:
            if mode == "eager":
                step = eager
            elif kind == "bnb-nf4":
                continue  # bitsandbytes is timed eager only, as its users run it
            else:
                compiled = torch.compile(model, mode="reduce-overhead" if mode == "graphs" else None)
                step = _step(compiled, x, g, graphs=mode == "graphs")
                y, gx = step()
                for what, a, b in (("output", want_y, y), ("input gradient", want_gx, gx)):
                    db = _sqnr_db(a, b)
                    if db < MIN_SQNR_DB:
                        raise AssertionError(f"{kind} {mode}: {what} {db:.1f} dB from eager; not timing it")
            yield kind, mode, _ms(step, sync, windows)
            torch.compiler.reset()  # why: each stack compiles afresh, nothing reused across kinds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dim", type=int, nargs=2, default=[5120, 13824], metavar=("IN", "OUT"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument(
        "--kinds",
        default="bf16,nf4,bnb-nf4",
        help="comma-separated layer kinds, bf16 first (tidal formats, qbench.VARIANTS such as nf4-fp8, bnb-nf4)",
    )
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: {bad} unknown; accepted: {', '.join(MODES)}")
    kinds = a.kinds.split(",")
    if kinds[0] != "bf16":
        raise SystemExit(f"--kinds: {a.kinds!r} must start with bf16 (the ratios' reference)")
    if "bnb-nf4" in kinds and not (a.device == "cuda" and qbench.bnb_available()):
        kinds.remove("bnb-nf4")  # bitsandbytes' CUDA layers only
    print(
        f"torch {torch.__version__}; {a.layers} × ({a.dim[0]}→{a.dim[1]}, SiLU, {a.dim[1]}→{a.dim[0]}), {a.tokens} tokens"
    )
    print("| layers | mode | ms per forward + input gradient | × bf16 eager |\n|---|---|---:|---:|")
    bf16_eager = None  # the first row when eager is timed: bf16 comes first
    for kind, mode, ms in run(kinds, modes, a.dim, a.tokens, a.layers, a.device, a.windows):
        bf16_eager = bf16_eager or (ms if (kind, mode) == ("bf16", "eager") else None)
        ratio = f"{ms / bf16_eager:.2f}" if bf16_eager else "-"
        print(f"| {kind} | {mode} | {ms:.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
