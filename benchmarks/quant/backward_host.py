"""Host time of a backward through a Python autograd.Function on CUDA: where does an eager step's time go?

```bash
python3 benchmarks/quant/backward_host.py            # the GPU machine, ~20 s (packages/*/src on PYTHONPATH)
python3 benchmarks/quant/backward_host.py --device cpu --tokens 16 --dim 64   # checks the script
```

profile_stages.py measured an NF4 forward + input-gradient step at 5120→13824 and 512 tokens issuing for
~650 µs of host time back-to-back, while its forward issues in ~80 µs and its backward pieces in ~50 µs.
This times, per step, the host cost of the forward (``layer(x)``) and of ``.backward(g)`` separately, for
bf16 ``nn.Linear`` (C++ backward), an identity ``autograd.Function`` (a Python backward doing nothing), and
NF4 / FP8 ``QuantLinear``; each with autograd's device threads (the default: CUDA backward runs on a
worker thread that takes the GIL for Python nodes) and with ``torch.autograd.set_multithreading_enabled
(False)`` (the backward runs in the calling thread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _layers(dim_in: int, dim_out: int, device: str) -> dict[str, torch.nn.Module]:
    import tidal_quant as tq

    lin = torch.nn.Linear(dim_in, dim_out, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(
        False
    )

    class Ident(torch.nn.Module):
        def forward(self, x):
            return _Identity.apply(x)

    return {
        "bf16 nn.Linear": lin,
        "identity Function": Ident(),
        "nf4 QuantLinear": tq.QuantLinear.from_linear(lin, "nf4"),
        "fp8 QuantLinear": tq.QuantLinear.from_linear(lin, "fp8"),
        "fp8-bwd8 QuantLinear": tq.QuantLinear.from_linear(lin, "fp8", fp8_backward=True),
    }


def _time(layer, x, g, reps: int, sync) -> tuple[float, float]:
    """Median host µs of the forward and of the backward call, steps issued back-to-back."""
    fwd, bwd = [], []
    for i in range(reps + 5):
        x.grad = None
        t0 = time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        y.backward(g if y.shape == g.shape else torch.ones_like(y))
        t2 = time.perf_counter()
        if i >= 5:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    sync()
    return 1e6 * statistics.median(fwd), 1e6 * statistics.median(bwd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dim", type=int, nargs=2, default=[5120, 13824], metavar=("IN", "OUT"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--trace",
        type=int,
        default=0,
        help="also list the CUDA runtime calls torch.profiler records over this many steps (on the GPU machine "
        "it recorded the main thread's only: look there for a synchronizing call in the forward path)",
    )
    a = ap.parse_args(argv)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    print(
        f"torch {torch.__version__}, python {sys.version.split()[0]}, switch interval {sys.getswitchinterval()}"
    )
    layers = _layers(a.dim[0], a.dim[1], a.device)
    x = torch.randn(a.tokens, a.dim[0], device=a.device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(a.tokens, a.dim[1], device=a.device, dtype=torch.bfloat16)
    print(f"{a.tokens} tokens, {a.dim[0]}→{a.dim[1]}: host µs per call (median of {a.reps}, back-to-back)")
    print("| layer | threads | forward µs | backward µs |\n|---|---|---:|---:|")
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, layer in layers.items():
            f, b = _time(layer, x, g, a.reps, sync)
            print(
                f"| {name} | {'device threads' if threads else 'calling thread'} | {f:.1f} | {b:.1f} |",
                flush=True,
            )
    torch.autograd.set_multithreading_enabled(True)
    if a.trace:
        for name in ("bf16 nn.Linear", "nf4 QuantLinear", "fp8 QuantLinear"):
            print(f"\n{name}: CUDA runtime calls over {a.trace} back-to-back steps (host µs, calls)")
            print(_runtime_calls(layers[name], x, g, a.trace, sync))


def _runtime_calls(layer, x, g, steps: int, sync) -> str:
    """CUDA runtime calls (``cuda*`` host events) of ``steps`` forward + backward steps, by total host time:
    a synchronizing call (stream / event / device synchronize, a blocking memcpy, cudaFree) shows here."""
    from torch.profiler import ProfilerActivity, profile

    _time(layer, x, g, 2, sync)  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            x.grad = None
            layer(x).backward(g)
        sync()
    rows = [e for e in prof.key_averages() if e.key.startswith("cuda")]
    rows.sort(key=lambda e: e.cpu_time_total, reverse=True)
    return "\n".join(f"  {e.key:<36} {e.cpu_time_total:9.0f} µs  {e.count:5d} calls" for e in rows[:12])


if __name__ == "__main__":
    main()
