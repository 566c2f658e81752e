"""Device AdamW step of ``OffloadAdamW`` over a full model's parameters: fp32 vs bf16 moments vs torch.

    python3 benchmarks/stream/device_adamw.py                 # the GPU machine: Qwen2.5-1.5B shapes, 1.777 B
    python3 benchmarks/stream/device_adamw.py --smoke         # tiny shapes (checks the script; CPU is fine)

The parameters have the shapes of Qwen2.5-1.5B with an untied head (1.777 B), random values, bf16 weights
and gradients unless noted; every optimizer state lives on the device. Modes, each timed as the median of
``--repeat`` ``optimizer.step()`` calls after ``--warmup`` (CUDA synchronized around each):

- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on fp32 weights and fp32 gradients (stock);
- ``fp32_moments``: ``OffloadAdamW`` device update, fp32 moments (torch's fused AdamW on fp32 masters,
  gradients widened a batch at a time, masters narrowed to the bf16 weights);
- ``bf16_torch``: bf16 moments through torch's path (widen, fused AdamW, stochastic rounding per tensor
  chunk) — what ran before the Triton kernel;
- ``bf16_triton``: bf16 moments through the Triton kernel (``tidal_stream.adam_triton``);
- ``fp32_triton``: the Triton kernel with fp32 moments, called directly (for its bandwidth).

Before timing, the kernel is checked: bf16 moments bit for bit against its torch reference, fp32 moments
against ``torch._fused_adamw_`` (the largest difference in ulps is printed; 0 expected). Reported per
mode: ms, G params/s, and the memory traffic the step implies (bytes per parameter read + written) in
GB/s, against the device's ~4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(p) for p in (Path(__file__).resolve().parents[2] / "packages").glob("*/src")]
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import time_calls  # noqa: E402

from tidal_stream import OffloadAdamW  # noqa: E402

LR = 1e-5
# bytes per parameter read + written by each mode's step
BYTES = {
    "torch_fused": 4 * 4 + 3 * 4,  # read p g m v fp32, write p m v
    "fp32_moments": 2 + 4 + 2 * 4 + 4 * 2 + 2 + 4 + 4 + 2,  # + widened grad written/read, weight narrowed
    "bf16_torch": 2 + 4 + 2 * 2 + 4 * 3 + 4 * 3 + 2 * 2 + 4 + 2,  # widen, fused on fp32 copies, round back
    "bf16_triton": 2 + 4 + 2 + 2 + 4 + 2 + 2 + 2,  # read g p m v, write p m v w
    "fp32_triton": 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2,
}


def shapes(hidden: int, inter: int, layers: int, vocab: int, kv: int) -> list[tuple[int, ...]]:
    """Trainable parameter shapes of a Qwen2 decoder with an untied head, in module order."""
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden), (hidden,), (kv, hidden), (kv,), (kv, hidden), (kv,), (hidden, hidden)]
        out += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    return [*out, (hidden,), (vocab, hidden)]


def make_params(
    shp: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[torch.nn.Parameter]:
    """Random weights with random gradients of the same dtype (never zeros)."""
    g = torch.Generator(device=device).manual_seed(0)
    ps = []
    for s in shp:
        p = torch.nn.Parameter(torch.empty(s, device=device, dtype=dtype).normal_(0, 0.02, generator=g))
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=g)
        ps.append(p)
    return ps


def run_mode(mode: str, shp: list[tuple[int, ...]], device: torch.device, args: argparse.Namespace) -> dict:
    """Build the mode's parameters and optimizer, time its steps, free everything."""
    from tidal_stream import optimizer_device

    fp32 = mode == "torch_fused"
    params = make_params(shp, torch.float32 if fp32 else torch.bfloat16, device)
    n = sum(p.numel() for p in params)
    refusal = optimizer_device._triton_refusal
    opt: Any
    if mode == "torch_fused":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=device.type == "cuda")
        step = opt.step
    elif mode == "fp32_triton":
        from tidal_stream.adam_triton import adamw_triton_

        masters = [p.detach().float() for p in params]
        ms = [torch.zeros_like(m) for m in masters]
        vs = [torch.zeros_like(m) for m in masters]
        steps = [torch.zeros((), device=device) for _ in params]
        ids = list(range(len(params)))
        grads = [p.grad for p in params]
        weights = [p.data for p in params]

        def step() -> None:
            adamw_triton_(masters, grads, ms, vs, steps, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, tensor_ids=ids, weights=weights)  # fmt: skip
    else:
        if mode == "bf16_torch":
            optimizer_device._triton_refusal = lambda dev, h: "forced by the benchmark"
        moments = "fp32" if mode == "fp32_moments" else "bf16"
        opt = OffloadAdamW(
            params, lr=LR, weight_decay=0.1, gpu_params=params, moment_dtype=moments,
            max_grad_norm=args.clip or None,
        )  # fmt: skip
        step = opt.step
    try:
        times = time_calls(step, device, args.repeat, args.warmup)
    finally:
        optimizer_device._triton_refusal = refusal
    paths = []
    if isinstance(opt if mode not in ("torch_fused", "fp32_triton") else None, OffloadAdamW):
        paths = [e.message for e in opt.session.events if e.kind == "device-update"]
        opt.close()
    med = statistics.median(times)
    del params, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "mode": mode,
        "params": n,
        "ms": med * 1e3,
        "gparams_per_s": n / med / 1e9,
        "gb_per_s": n * BYTES[mode] / med / 1e9,
        "path": paths,
    }


def check_kernel(device: torch.device) -> dict:
    """The kernel against its references on one 4M-element tensor and a small odd one."""
    from tidal_stream.adam_triton import adamw_reference_, adamw_triton_

    g = torch.Generator(device=device).manual_seed(1)
    out: dict[str, Any] = {}
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for mdt in (torch.bfloat16, torch.float32):
        sizes = [1 << 22, 1537]
        a = {
            "masters": [torch.randn(n, device=device, generator=g) for n in sizes],
            "grads": [torch.randn(n, device=device, generator=g).bfloat16() * 0.01 for n in sizes],
            "exp_avgs": [(torch.randn(n, device=device, generator=g) * 1e-3).to(mdt) for n in sizes],
            "exp_avg_sqs": [(torch.rand(n, device=device, generator=g) * 1e-5).to(mdt) for n in sizes],
            "steps": [torch.full((), 5.0, device=device) for _ in sizes],
        }
        b = {k: [t.clone() for t in v] for k, v in a.items()}
        adamw_triton_(**a, tensor_ids=[0, 1], **hyper)
        if mdt == torch.bfloat16:
            for i in range(2):
                adamw_reference_(*(b[k][i] for k in a), tensor_id=i, **hyper)
            same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for k in ("exp_avgs", "exp_avg_sqs")
                       for x, y in zip(a[k], b[k]))  # fmt: skip
            same = same and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
            out["bf16_vs_reference_bitwise"] = same
        else:
            torch._foreach_add_(b["steps"], 1)
            torch._fused_adamw_(b["masters"], [x.float() for x in b["grads"]], b["exp_avgs"], b["exp_avg_sqs"],
                                [], b["steps"], amsgrad=False, maximize=False, **hyper)  # fmt: skip
            ulp = max((x.view(torch.int32).long() - y.view(torch.int32).long()).abs().max().item()
                      for k in ("masters", "exp_avgs", "exp_avg_sqs") for x, y in zip(a[k], b[k]))  # fmt: skip
            out["fp32_vs_torch_fused_max_ulp"] = ulp
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument("--modes", default="torch_fused,fp32_moments,bf16_torch,bf16_triton,fp32_triton")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--clip", type=float, default=0.0, help="max_grad_norm for OffloadAdamW (0: none)")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        shp = shapes(hidden=64, inter=160, layers=2, vocab=512, kv=16)
        args.warmup, args.repeat = 1, 2
    else:
        shp = shapes(hidden=1536, inter=8960, layers=28, vocab=151936, kv=256)
    modes = args.modes.split(",")
    if device.type != "cuda":
        modes = [m for m in modes if m != "fp32_triton"]  # the kernel runs on CUDA (or the interpreter)
    res: dict[str, Any] = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu")}
    if device.type == "cuda":
        res["check"] = check_kernel(device)
        print("check:", res["check"], flush=True)
    res["modes"] = []
    print(f"{'mode':<14} {'ms':>9} {'Gparam/s':>9} {'GB/s':>8}  path")
    for m in modes:
        r = run_mode(m, shp, device, args)
        res["modes"].append(r)
        print(
            f"{m:<14} {r['ms']:9.2f} {r['gparams_per_s']:9.1f} {r['gb_per_s']:8.0f}  {' | '.join(r['path'])}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
