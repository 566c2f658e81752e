"""Print Markdown tables of tidal-quant's CUDA timings (run on the GPU machine).

    python3 benchmarks/quant/table.py            # with packages/*/src on PYTHONPATH

1. NF4 dequantize → bf16 at Qwen2.5-14B layer shapes: GB/s and fraction of the HBM copy bandwidth
   (goal ≥ 70 %).
2. Forward + input gradient of one frozen layer at 5120→13824, 13824→5120, 5120→5120 with 512 and
   2048 tokens: bf16 ``nn.Linear``, tidal nf4 / fp8 / fp8-bwd8 (input gradient on FP8 tensor cores
   too) / int8 / nvfp4 and bitsandbytes ``Linear4bit`` (when importable), as milliseconds and ratios
   (goals: nf4 ≤ 0.8× bitsandbytes, fp8 ≤ 0.75× bf16 at 2048 tokens).
3. Small token counts (decode-like forward only) and which kernel tidal picked per shape.
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


def dequant_table() -> list[str]:
    bw = qbench.copy_gbps()
    rows = [
        f"NF4 dequantize → bf16 (HBM copy bandwidth {bw:.0f} GB/s)",
        "",
        "| layer | weight | time (µs, back-to-back) | GB/s | of copy bandwidth | one isolated call (µs) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, in_f, out_f in qbench.QWEN14B_LAYERS:
        r = qbench.nf4_dequant_case(in_f, out_f)
        rows.append(
            f"| {name} | {r['shape']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | {r['gbps'] / bw:.0%} "
            f"| {r['isolated_ms'] * 1e3:.1f} |"
        )
    return rows


def linear_table(kinds: list[str]) -> list[str]:
    head = "| shape | tokens | bf16 ms | " + " | ".join(f"{k} ms (×bf16)" for k in kinds)
    has_bnb = "bnb-nf4" in kinds
    head += " | nf4 / bnb |" if has_bnb else " |"
    title = "Forward + input gradient, frozen weight (ms; ratio to bf16, tidal's forward path)"
    rows = [title, "", head, "|" + "---|" * (head.count("|") - 1)]
    for in_f, out_f in qbench.LINEAR_SHAPES:
        for tokens in qbench.TOKENS:
            r = qbench.linear_case(in_f, out_f, tokens, kinds)
            cells = [f"{in_f}→{out_f}", str(tokens), f"{r['bf16']:.3f}"]
            for k in kinds:
                path = f", {r[k + ':path']}" if r[k + ":path"] else ""
                cells.append(f"{r[k]:.3f} ({r[k] / r['bf16']:.2f}{path})")
            if has_bnb:
                cells.append(f"{r['nf4'] / r['bnb-nf4']:.2f}")
            rows.append("| " + " | ".join(cells) + " |")
            torch.cuda.empty_cache()
    return rows


def decode_table() -> list[str]:
    rows = ["Forward only, few tokens (kernel chosen per shape by measurement)", "", "| shape | tokens |"]
    rows[-1] += " bf16 µs | " + " | ".join(f"{f} µs (path)" for f in ("nf4", "int8", "nvfp4")) + " |"
    rows.append("|---|---|---:|---:|---:|---:|")
    for in_f, out_f in qbench.LINEAR_SHAPES:
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = qbench.make_layer("bf16", in_f, out_f, weight)
        for tokens in (1, 16):
            x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                cells = [
                    f"{in_f}→{out_f}",
                    str(tokens),
                    f"{qbench.cuda_ms(lambda ref=ref, x=x: ref(x)) * 1e3:.1f}",
                ]
                for fmt in ("nf4", "int8", "nvfp4"):
                    layer = qbench.make_layer(fmt, in_f, out_f, weight)
                    qbench.check_layer(fmt, layer, ref, x)
                    tq.reset_path_counts()
                    layer(x)
                    path = next(iter(tq.path_counts()))
                    cells.append(f"{qbench.cuda_ms(lambda layer=layer, x=x: layer(x)) * 1e3:.1f} ({path})")
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-decode", action="store_true", help="leave out table 3")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("table.py needs CUDA (run it on the GPU machine)")
    kinds = list(qbench.FORMATS) + (["bnb-nf4"] if qbench.bnb_available() else [])
    t0 = time.perf_counter()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    for table in (dequant_table(), linear_table(kinds), [] if args.skip_decode else decode_table()):
        print("\n".join(table) + "\n")
    print(f"tables in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
