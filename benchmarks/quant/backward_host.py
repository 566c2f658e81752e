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

Steps are timed in windows of a few (``--per``), the device drained between windows. A long run of
back-to-back steps whose device time exceeds their host time fills the launch queue, and from then on
every launch waits for the device: the "host time" it reads is the device's (the first version of this
script, timing up to 205 steps in one row, read 200-400 µs NF4 forwards that way).
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


def _time(layer, x, g, reps: int, sync, per: int = 4) -> tuple[float, float]:
    """Median host µs per forward and per backward call, over ``reps`` windows of ``per`` steps each issued
    back-to-back (all forwards, then all backwards), the device drained before each window."""
    fwd, bwd = [], []
    for i in range(reps + 2):
        x.grad = None
        sync()  # why: an empty launch queue, so no launch in the window waits for the device
        t0 = time.perf_counter()
        ys = [layer(x) for _ in range(per)]
        t1 = time.perf_counter()
        for y in ys:
            y.backward(g if y.shape == g.shape else torch.ones_like(y))
        t2 = time.perf_counter()
        if i >= 2:  # the first windows warm the caches (and compile kernels)
            fwd.append((t1 - t0) / per)
            bwd.append((t2 - t1) / per)
    sync()
    return 1e6 * statistics.median(fwd), 1e6 * statistics.median(bwd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dim", type=int, nargs=2, default=[5120, 13824], metavar=("IN", "OUT"))
    ap.add_argument("--reps", type=int, default=50, help="windows timed")
    ap.add_argument("--per", type=int, default=4, help="steps per window")
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
    print(
        f"{a.tokens} tokens, {a.dim[0]}→{a.dim[1]}: host µs per call (median of {a.reps} windows of {a.per} steps)"
    )
    print("| layer | threads | forward µs | backward µs |\n|---|---|---:|---:|")
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, layer in layers.items():
            f, b = _time(layer, x, g, a.reps, sync, a.per)
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
