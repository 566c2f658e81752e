"""Print Markdown tables of tidal-quant's CUDA timings (run on the GPU machine).

    python3 benchmarks/quant/table.py [--stages] [--skip-decode]   # packages/*/src on PYTHONPATH

1. NF4 dequantize → bf16 at Qwen2.5-14B layer shapes (and int8 / NVFP4 at one): GB/s and fraction of
   the HBM copy bandwidth (goal ≥ 70 %), device time (CUDA graph) and eager back-to-back calls.
2. Forward + input gradient of one frozen layer at 5120→13824, 13824→5120, 5120→5120 with 512 and
   2048 tokens: bf16 ``nn.Linear``, tidal nf4 / nf4-fp8 (``fp8_compute``: recast to e4m3, FP8 tensor
   cores) / fp8 / fp8-bwd8 (input gradient on FP8 tensor cores too) / int8 / nvfp4 / nvfp4-fp8 and
   bitsandbytes ``Linear4bit`` (when importable), as milliseconds and ratios (goals: nf4 ≤ 0.8×
   bitsandbytes, fp8 ≤ 0.75× bf16 at 2048 tokens), timed three ways: one synchronized
   step, back-to-back steps and steps replayed from a CUDA graph; each goal's verdict after each table.
3. Small token counts (decode-like forward only, nf4 unless ``--decode-formats`` says otherwise) and
   which kernel tidal picked per shape.
With ``--stages``: the per-stage device / host time of 5120→5120 at 2048 tokens (profile_stages.py).
Table 3 starts only within 45 s of the first table and ``--stages`` within 75 s (cold Triton caches
compile every kernel first), so one run stays under a minute and a half.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

import tidal_quant as tq

DEQUANT_GOAL, NF4_BNB_GOAL, FP8_BF16_GOAL = 0.70, 0.80, 0.75  # the acceptance goals


def dequant_table() -> list[str]:
    bw = qbench.copy_gbps()
    rows = [
        f"Dequantize → bf16 (HBM copy bandwidth {bw:.0f} GB/s; bytes = packed codes + scales read, bf16 written)",
        "",
        "| format | layer | weight | device µs | GB/s | of copy bw | eager µs (back-to-back) | of copy bw "
        "| one isolated call (µs) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    nf4 = []
    cases = [("nf4", *layer) for layer in qbench.QWEN14B_LAYERS]
    cases += [(fmt, "gate/up_proj", 5120, 13824) for fmt in ("int8", "nvfp4")]
    for fmt, name, in_f, out_f in cases:
        r = qbench.nf4_dequant_case(in_f, out_f, fmt)
        nf4 += [r["gbps"] / bw] if fmt == "nf4" else []
        rows.append(
            f"| {fmt} | {name} | {r['shape']} | {r['device_ms'] * 1e3:.1f} | {r['gbps']:.0f} "
            f"| {r['gbps'] / bw:.0%} | {r['ms'] * 1e3:.1f} | {r['eager_gbps'] / bw:.0%} "
            f"| {r['isolated_ms'] * 1e3:.1f} |"
        )
        torch.cuda.empty_cache()
    rows += [
        "",
        "device µs: the kernel alone (10 calls in one CUDA graph); eager: the public tq.dequantize call "
        "issued back-to-back from Python (host cost included when it exceeds the kernel's).",
        f"NF4 goal ≥ {DEQUANT_GOAL:.0%} of copy bandwidth (device): "
        f"{'met' if min(nf4) >= DEQUANT_GOAL else 'missed'} (lowest {min(nf4):.0%}, highest {max(nf4):.0%})",
    ]
    return rows


def _verdict(ratios: list[float], goal: float) -> str:
    met = sum(x <= goal for x in ratios)
    return f"met in {met} of {len(ratios)} ({', '.join(f'{x:.2f}' for x in ratios)})"


def linear_tables(kinds: list[str]) -> list[str]:
    """Three tables from one set of layers: each step timed alone (synchronized before and after, so the
    host's issue time counts in full), steps back-to-back (the host queues the next step while the
    device runs, as across a model's layers) and steps replayed from a CUDA graph (the device's time
    alone, as in tidal's graphed blocks), then each goal's verdict in each."""
    has_bnb = "bnb-nf4" in kinds
    vs_bnb = [k for k in ("nf4", "nf4-fp8") if k in kinds] if has_bnb else []  # NF4 goal: ≤ 0.8× bnb
    vs_bf16 = [k for k in ("fp8", "fp8-bwd8", "nf4-fp8") if k in kinds]  # FP8 goal: ≤ 0.75× bf16
    results = []
    for in_f, out_f in qbench.LINEAR_SHAPES:
        for tokens in qbench.TOKENS:
            results.append((in_f, out_f, tokens, qbench.linear_case(in_f, out_f, tokens, kinds)))
            torch.cuda.empty_cache()
    rows: list[str] = []
    modes = (
        ("one step at a time (synchronized)", ""),
        ("back-to-back steps", ":b2b"),
        ("device time, 10 steps replayed from one CUDA graph (as tidal runs resident blocks)", ":graph"),
    )
    for mode, suffix in modes:
        head = "| shape | tokens | bf16 ms | " + " | ".join(f"{k} ms (×bf16)" for k in kinds)
        head += "".join(f" | {k} / bnb" for k in vs_bnb) + " |"
        title = f"Forward + input gradient, frozen weight, {mode} (ms; ratio to bf16, tidal's forward path)"
        rows += [title, "", head, "|" + "---|" * (head.count("|") - 1)]
        bnb_ratios: dict[str, list[float]] = {k: [] for k in vs_bnb}
        bf16_ratios: dict[str, list[float]] = {k: [] for k in vs_bf16}
        for in_f, out_f, tokens, r in results:
            bf16 = r["bf16" + suffix]
            cells = [f"{in_f}→{out_f}", str(tokens), f"{bf16:.3f}"]
            for k in kinds:
                path = f", {r[k + ':path']}" if r[k + ":path"] else ""
                cells.append(f"{r[k + suffix]:.3f} ({r[k + suffix] / bf16:.2f}{path})")
            for k in vs_bnb:
                bnb_ratios[k].append(r[k + suffix] / r["bnb-nf4" + suffix])
                cells.append(f"{bnb_ratios[k][-1]:.2f}")
            if tokens == 2048:
                for k in vs_bf16:
                    bf16_ratios[k].append(r[k + suffix] / bf16)
            rows.append("| " + " | ".join(cells) + " |")
        rows.append("")
        if not has_bnb:
            rows.append("NF4 / bitsandbytes: bitsandbytes not importable, no comparison")
        for k in vs_bnb:
            rows.append(f"{k} / bitsandbytes goal ≤ {NF4_BNB_GOAL}: {_verdict(bnb_ratios[k], NF4_BNB_GOAL)}")
        for k in vs_bf16:
            rows.append(
                f"{k} / bf16 at 2048 tokens goal ≤ {FP8_BF16_GOAL}: {_verdict(bf16_ratios[k], FP8_BF16_GOAL)}"
            )
        rows.append("")
    return rows


def decode_table(formats: list[str]) -> list[str]:
    """Forward only at 1 and 16 tokens: µs of one synchronized call / per call back-to-back."""
    rows = ["Forward only, few tokens (kernel chosen per shape by measurement)", "", "| shape | tokens |"]
    rows[-1] += " bf16 µs (one / back-to-back) | " + " | ".join(f"{f} µs (one / b2b, path)" for f in formats)
    rows[-1] += " |"
    rows.append("|---|---|---:|" + "---:|" * len(formats))
    for in_f, out_f in qbench.LINEAR_SHAPES:
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = qbench.make_layer("bf16", in_f, out_f, weight)
        layers = {fmt: qbench.make_layer(fmt, in_f, out_f, weight) for fmt in formats}
        for tokens in (1, 16):
            x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                fn = lambda ref=ref, x=x: ref(x)  # noqa: E731
                one, b2b = qbench.cuda_ms(fn), qbench.cuda_ms_pipelined(fn)
                cells = [f"{in_f}→{out_f}", str(tokens), f"{one * 1e3:.1f} / {b2b * 1e3:.1f}"]
                for fmt, layer in layers.items():
                    qbench.check_layer(fmt, layer, ref, x)
                    tq.reset_path_counts()
                    layer(x)
                    path = qbench.PATH_ABBREV[next(iter(tq.path_counts()))]
                    fn = lambda layer=layer, x=x: layer(x)  # noqa: E731
                    one, b2b = qbench.cuda_ms(fn), qbench.cuda_ms_pipelined(fn)
                    cells.append(f"{one * 1e3:.1f} / {b2b * 1e3:.1f} ({path})")
            rows.append("| " + " | ".join(cells) + " |")
        del layers
        torch.cuda.empty_cache()
    return rows


def _left(t0: float, start_by_s: float, what: str) -> bool:
    """Whether ``what`` may still start (``start_by_s`` seconds into the run); says so when skipped."""
    elapsed = time.perf_counter() - t0
    if elapsed <= start_by_s:
        return True
    print(f"({what} skipped: {elapsed:.0f} s elapsed, it starts only before {start_by_s:.0f} s)\n")
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-decode", action="store_true", help="leave out table 3")
    p.add_argument(
        "--decode-formats",
        default="nf4",
        help="comma-separated formats of table 3 (default nf4; each adds Triton compiles of the fused tiles)",
    )
    p.add_argument(
        "--stages",
        action="store_true",
        help="also print the per-stage device / host time of 5120→5120 at 2048 tokens (profile_stages.py)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("table.py needs CUDA (run it on the GPU machine)")
    kinds = list(qbench.FORMATS) + (["bnb-nf4"] if qbench.bnb_available() else [])
    t0 = time.perf_counter()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for table in (dequant_table(), linear_tables(kinds)):
        print("\n".join(table) + "\n", flush=True)
    # the optional parts start only while the whole run can stay under a minute and a half
    if not args.skip_decode and _left(t0, 45.0, "table 3 (decode)"):
        print("\n".join(decode_table(args.decode_formats.split(","))) + "\n", flush=True)
    if args.stages and _left(t0, 75.0, "--stages"):
        import profile_stages

        print("Stages (device µs of back-to-back calls; host µs to issue one call)")
        profile_stages.linear_profile(5120, 5120, 2048)
    print(f"\ntables in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
