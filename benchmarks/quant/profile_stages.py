"""Per-stage CUDA timing of tidal-quant's hot paths (run on the GPU machine; well under a minute).

(Not named ``profile.py``: with this folder on ``sys.path``, as ``table.py`` and the pytest benchmarks put
it, that name would shadow the standard library module that ``cProfile`` and ``torch._dynamo`` import.)

    python3 benchmarks/quant/profile_stages.py            # with packages/*/src on PYTHONPATH

For 5120→13824 at 512 and 2048 tokens it prints, per stage, the device time of the stage run alone
(``gpu µs``: CUDA events around 20 back-to-back calls, so launch gaps are hidden when the host keeps up)
and the host time to issue one call (``host µs``: wall clock per call without synchronizing; when it is
larger than the device time, the stage is host-bound). Stages: activation quantization, ``_scaled_mm``,
dequantize, dense matmul, the backward pieces, and the whole forward + input-gradient step, the step both
back-to-back and one isolated step at a time (synchronized, as ``table.py`` times it).
Also NF4 dequantize at Qwen2.5-14B shapes against the HBM copy bandwidth, back-to-back and isolated.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

import tidal_quant as tq
from tidal_quant import _triton, _triton_fp8, fp8_ops, ops


def back_to_back(fn: Callable[[], object], reps: int = 20) -> tuple[float, float]:
    """(device µs per call over ``reps`` back-to-back calls, host µs to issue one call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()  # why: warm-up must not leak into the timed window
    start = torch.cuda.Event(enable_timing=True)  # why: device time of the whole window
    end = torch.cuda.Event(enable_timing=True)  # why: pairs with start
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / reps * 1e6
    end.synchronize()  # why: read the elapsed time once the window ran
    return start.elapsed_time(end) / reps * 1e3, host


def row(name: str, fn: Callable[[], object]) -> None:
    gpu, host = back_to_back(fn)
    flag = "  <- host-bound" if host > gpu else ""
    print(f"  {name:<42} gpu {gpu:8.1f} µs   host {host:7.1f} µs{flag}")


def step_rows(name: str, layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    step = qbench.fwd_bwd(layer, x, g)
    row(f"{name}: fwd + input grad (back-to-back)", step)
    print(f"  {name + ': fwd + input grad (isolated)':<34} gpu {qbench.cuda_ms(step) * 1e3:8.1f} µs")


def linear_profile(in_f: int, out_f: int, tokens: int) -> None:
    print(f"\n{in_f}→{out_f}, {tokens} tokens")
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    xd = x.detach()
    bf16 = qbench.make_layer("bf16", in_f, out_f, w)
    row("bf16: x @ Wᵀ", lambda: xd @ w.t())
    row("bf16: grad @ W", lambda: g @ w)
    step_rows("bf16", bf16, x, g)

    nf4 = qbench.make_layer("nf4", in_f, out_f, w)
    qn = nf4.qweight
    row(
        "nf4: dequantize → bf16",
        lambda: _triton.dequantize(1, qn.data, qn.scales, None, qn.shape, 64, w.dtype),
    )
    row("nf4: tq.dequantize (API)", lambda: tq.dequantize(qn, torch.bfloat16))
    with torch.no_grad():
        row("nf4: forward (no grad)", lambda: nf4(xd))
    step_rows("nf4", nf4, x, g)

    fp8 = qbench.make_layer("fp8", in_f, out_f, w)
    qf = fp8.qweight
    data, scales = qf.data, qf.scales
    q, sa = _triton_fp8.quantize_rows_fp8(xd)
    row("fp8: activation quant (Triton)", lambda: _triton_fp8.quantize_rows_fp8(xd))
    for fast in (False, True):  # ops.FP8_FAST_ACCUM_FORWARD picks the forward's setting
        row(
            f"fp8: _scaled_mm rowwise, fast_accum={fast}",
            lambda fast=fast: torch._scaled_mm(
                q,
                data.t(),
                scale_a=sa,
                scale_b=scales.view(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            ),
        )
    one = torch.ones((), device="cuda")
    row(  # the same product with one scale per tensor: tells whether the rowwise kernel is the slow part
        "fp8: _scaled_mm tensorwise (compare)",
        lambda: torch._scaled_mm(q, data.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    )
    row("fp8: forward op (quant + mm)", lambda: fp8_ops.fp8_linear_cuda(xd, ops.as_bytes(data), scales, 0))
    row(
        "fp8: dequantize → bf16 (bwd)",
        lambda: _triton.dequantize(3, data, scales, None, qf.shape, 0, w.dtype),
    )
    row("fp8: grad quant (bwd8)", lambda: _triton_fp8.quantize_rows_fp8(g, col_scale=scales))
    row("fp8: weight transpose (bwd8)", lambda: _triton_fp8.transpose_bytes(data))
    row("fp8: grad op (bwd8, quant+T+mm)", lambda: fp8_ops.fp8_grad_cuda(g, ops.as_bytes(data), scales))
    with torch.no_grad():
        row("fp8: forward (no grad)", lambda: fp8(xd))
    step_rows("fp8", fp8, x, g)
    step_rows("fp8-bwd8", qbench.make_layer("fp8-bwd8", in_f, out_f, w), x, g)
    tq.reset_path_counts()
    with torch.no_grad():
        fp8(xd)
    print(f"  fp8 forward path: {tq.path_counts()}")


def dequant_profile() -> None:
    bw = qbench.copy_gbps()
    print(f"NF4 dequantize → bf16 (HBM copy {bw:.0f} GB/s)")
    for name, in_f, out_f in qbench.QWEN14B_LAYERS:
        qw = qbench.nf4_weight(in_f, out_f)
        nbytes = qbench.dequant_bytes(qw)
        gpu, host = back_to_back(lambda qw=qw: tq.dequantize(qw, torch.bfloat16), reps=50)
        iso = qbench.cuda_ms(lambda qw=qw: tq.dequantize(qw, torch.bfloat16)) * 1e3
        print(
            f"  {name:<13} {out_f}x{in_f}: back-to-back {gpu:6.1f} µs ({nbytes / gpu / 1e3 / bw:4.0%} of copy), "
            f"isolated {iso:6.1f} µs ({nbytes / iso / 1e3 / bw:4.0%}), host {host:5.1f} µs/call"
        )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_stages.py needs CUDA (run it on the GPU machine)")
    t0 = time.perf_counter()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    dequant_profile()
    for tokens in (512, 2048):
        linear_profile(5120, 13824, tokens)
        torch.cuda.empty_cache()
    print(f"\nprofiled in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
