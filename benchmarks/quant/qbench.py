"""Timing functions and cases shared by ``test_bench_quant.py`` (pytest-benchmark) and ``table.py``.

All timings are CUDA-event medians after warm-up, bracketed by device synchronizations; inputs are
random (never zeros); every quantized layer is checked against its bf16 reference before it is timed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import tidal_quant as tq
from tidal_quant import ops

# Qwen2.5-14B linear layers, as (name, in_features, out_features).
QWEN14B_LAYERS = [
    ("q/o_proj", 5120, 5120),
    ("k/v_proj", 5120, 1024),
    ("gate/up_proj", 5120, 13824),
    ("down_proj", 13824, 5120),
]
LINEAR_SHAPES = [(5120, 13824), (13824, 5120), (5120, 5120)]
TOKENS = [512, 2048]
FORMATS = ["nf4", "nf4-fp8", "fp8", "fp8-bwd8", "int8", "nvfp4", "nvfp4-fp8"]
#: Layer kinds that are a tidal format with options: fp8-bwd8 computes the input gradient on FP8 tensor
#: cores too; nf4-fp8 / nvfp4-fp8 recast the 4-bit weight to e4m3 and run both products there.
VARIANTS = {
    "fp8-bwd8": ("fp8", {"fp8_backward": True}),
    "nf4-fp8": ("nf4", {"fp8_compute": True}),
    "nvfp4-fp8": ("nvfp4", {"fp8_compute": True}),
}
# quality floor of each format's layer output against bf16 (SQNR dB; measured ~21/32/44/21 on CPU; the
# e4m3 recast costs the 4-bit formats about 0.3-0.6 dB of weight SQNR, tests/test_fp8_compute.py)
MIN_SQNR = {"nf4": 18.0, "fp8": 28.0, "fp8-bwd8": 28.0, "int8": 38.0, "nvfp4": 18.0, "bnb-nf4": 18.0}
MIN_SQNR.update({"nf4-fp8": 18.0, "nvfp4-fp8": 18.0})


def cuda_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (each rep timed by its own events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()  # why: warm-up work must not leak into the first timed rep
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # why: device-side start of this rep
        end = torch.cuda.Event(enable_timing=True)  # why: device-side end of this rep
        start.record()
        fn()
        end.record()
        end.synchronize()  # why: read the elapsed time only once the rep finished
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_ms_pipelined(fn: Callable[[], object], warmup: int = 3, reps: int = 50) -> float:
    """Mean milliseconds per call of ``fn()`` over ``reps`` back-to-back calls (throughput: the host
    queues the next call while the device runs, as in a model's forward; isolated latency is
    :func:`cuda_ms`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()  # why: warm-up work must not leak into the timed window
    start = torch.cuda.Event(enable_timing=True)  # why: device-side start of the window
    end = torch.cuda.Event(enable_timing=True)  # why: device-side end of the window
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()  # why: read the elapsed time once the window ran
    return start.elapsed_time(end) / reps


def graph_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Device milliseconds per call of ``fn()``: ``reps`` calls captured in one CUDA graph and replayed,
    so no host launch cost is counted (the kernel's own throughput; eager cost is :func:`cuda_ms_pipelined`).
    """
    side = torch.cuda.Stream()  # why: capture must start from a non-default stream after warm-up
    side.wait_stream(torch.cuda.current_stream())  # why: inputs made on the default stream are ready
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the graph: Triton compiles, caches fill
            fn()
    torch.cuda.current_stream().wait_stream(side)  # why: warm-up done before capture begins
    torch.cuda.synchronize()  # why: a clean device before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()  # first replay uploads the graph
    return cuda_ms(graph.replay, warmup=1, reps=5) / reps


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """HBM device-to-device copy bandwidth in GB/s (read + write bytes per second)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def config_sweep(
    label: str,
    configs: list[tuple[int, ...]],
    default: tuple[int, ...],
    run: Callable[[tuple[int, ...]], tuple[torch.Tensor, ...]],
    nbytes: int,
    copy: float,
) -> list[str]:
    """Markdown rows ``| label | a | b [| c ...] | device µs | GB/s | of copy bw |`` of a kernel's launch
    configs (one column per config element).

    ``run(config)`` returns the kernel's outputs; each config must give the default's bytes (checked before
    it is timed) and is timed from a CUDA graph (:func:`graph_ms`) against the ``nbytes`` it must move.
    """
    want = [t.view(torch.uint8) for t in run(default)]
    rows = []
    for cfg in configs:
        got = [t.view(torch.uint8) for t in run(cfg)]
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"{label}: config {cfg} changes the output bytes; not timing it")
        ms = graph_ms(lambda c=cfg: run(c))
        gbps = nbytes / ms / 1e6
        mark = " (default)" if cfg == default else ""
        cells = " | ".join(str(c) for c in cfg)
        rows.append(f"| {label} | {cells}{mark} | {1e3 * ms:.1f} | {gbps:.0f} | {100 * gbps / copy:.0f}% |")
    return rows


def nf4_weight(in_f: int, out_f: int, fmt: str = "nf4") -> tq.QuantizedWeight:
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    return tq.quantize(w, fmt)


def dequant_bytes(qw: tq.QuantizedWeight) -> int:
    """Bytes a dequantize to bf16 must move: packed codes + scales read, bf16 written."""
    return qw.nbytes() + 2 * qw.numel


def nf4_dequant_case(in_f: int, out_f: int, fmt: str = "nf4") -> dict:
    """Dequantize → bf16 of one layer (``fmt`` nf4 by default): device ms (CUDA graph, → GB/s),
    back-to-back eager ms of the public ``tq.dequantize`` call, and one isolated call's ms."""
    qw = nf4_weight(in_f, out_f, fmt)
    args = (ops.as_bytes(qw.data), ops.as_bytes(qw.scales), qw.global_scale, fmt, qw.shape)
    want = ops.dequant_ref(*args, qw.block_size or 0, torch.float32)  # the pure-torch reference
    got = tq.dequantize(qw, torch.bfloat16).float()
    if not bool(((got - want).abs() <= want.abs() * 2.0**-8).all()):
        raise AssertionError(f"{fmt} dequantize {out_f}x{in_f} differs from the reference; not timing it")
    fn = lambda: tq.dequantize(qw, torch.bfloat16)  # noqa: E731
    dev = graph_ms(fn)
    eager = cuda_ms_pipelined(fn)
    nbytes = dequant_bytes(qw)
    return {
        "shape": f"{out_f}x{in_f}",
        "device_ms": dev,
        "gbps": nbytes / dev / 1e6,
        "ms": eager,
        "eager_gbps": nbytes / eager / 1e6,
        "isolated_ms": cuda_ms(fn),
    }


def make_layer(kind: str, in_f: int, out_f: int, weight: torch.Tensor) -> torch.nn.Module:
    """A frozen layer of ``kind`` ("bf16", "bnb-nf4", a tidal format or one of :data:`VARIANTS`) holding
    ``weight``."""
    if kind == "bf16":
        lin = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(weight)
        return lin.requires_grad_(False)
    if kind == "bnb-nf4":
        import bitsandbytes as bnb

        lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        lin.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4", blocksize=64)
        return lin.cuda()
    lin = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
    fmt, cfg = VARIANTS.get(kind, (kind, {}))
    return tq.QuantLinear.from_linear(lin, fmt, **cfg)


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward + input-gradient step of ``layer`` (weights frozen)."""

    def step() -> None:
        x.grad = None
        layer(x).backward(g)

    return step


def input_grad(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], object]:
    """The same step without touching ``x.grad`` (``torch.autograd.grad``): what a CUDA graph can capture
    (nothing accumulates across replays)."""
    return lambda: torch.autograd.grad(layer(x), x, g)


def step_graph_ms(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> float:
    """Device ms of one forward + input-gradient step replayed from a CUDA graph (:func:`graph_ms`), as
    tidal runs resident blocks in training; NaN when the layer cannot be captured."""
    try:
        return graph_ms(input_grad(layer, x, g))
    except RuntimeError as e:  # a peer's kernels may not be capturable: reported, not fatal
        print(f"(graph capture of {type(layer).__name__} failed: {str(e).splitlines()[0]})")
        torch.cuda.synchronize()
        return float("nan")


def check_layer(kind: str, layer: torch.nn.Module, ref: torch.nn.Module, x: torch.Tensor) -> float:
    """SQNR (dB) of ``layer``'s output against the bf16 reference; raises if under the format's floor."""
    with torch.no_grad():
        want, got = ref(x).float(), layer(x).float()
    db = 10 * torch.log10(want.square().sum() / (want - got).square().sum()).item()
    if db < MIN_SQNR[kind]:
        raise AssertionError(
            f"{kind}: output SQNR {db:.1f} dB < {MIN_SQNR[kind]} dB; not timing a wrong layer"
        )
    return db


PATH_ABBREV = {
    "fp8_scaled_mm": "fp8 TC",
    "fp8_recast": "recast",
    "fused_dequant_matmul": "fused",
    "dequant_matmul": "dq+mm",
}


def forward_path(layer: torch.nn.Module, x: torch.Tensor) -> str:
    """Which tidal compute path ``layer``'s forward takes on ``x`` ("" for non-tidal layers)."""
    if not isinstance(layer, tq.QuantLinear):
        return ""
    tq.reset_path_counts()
    with torch.no_grad():
        layer(x)
    return ",".join(PATH_ABBREV[p] for p in tq.path_counts())


def linear_case(in_f: int, out_f: int, tokens: int, kinds: list[str]) -> dict[str, float | str]:
    """Forward + input-gradient milliseconds per layer kind at one shape (bf16 reference included):
    ``"<kind>"`` one synchronized step at a time, ``"<kind>:b2b"`` per step over back-to-back steps,
    ``"<kind>:graph"`` device time per step replayed from a CUDA graph (no host cost).

    Also ``"<kind>:path"``: the forward compute path tidal chose for that kind.
    """
    torch.manual_seed(0)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    ref = make_layer("bf16", in_f, out_f, weight)
    step = fwd_bwd(ref, x, g)
    out: dict[str, float | str] = {"bf16": cuda_ms(step), "bf16:b2b": cuda_ms_pipelined(step, reps=20)}
    out["bf16:graph"] = step_graph_ms(ref, x, g)
    for kind in kinds:
        layer = make_layer(kind, in_f, out_f, weight)
        check_layer(kind, layer, ref, x.detach())
        step = fwd_bwd(layer, x, g)
        out[kind] = cuda_ms(step)
        out[f"{kind}:b2b"] = cuda_ms_pipelined(step, reps=20)
        out[f"{kind}:graph"] = step_graph_ms(layer, x, g)
        out[f"{kind}:path"] = forward_path(layer, x.detach())
        del layer
    return out
