"""LoRA on the Qwen2.5-14B shape (random weights, NF4 base) through TidalTrainer on a simulated 24 GiB card.

    python benchmarks/hf/trainer_lora14b.py [--budget-gib 24] [--steps 12] [--seq-len 1024] [--layers N]

A filler tensor first takes everything but ``--budget-gib`` of free device memory (the fair way to
simulate a smaller card); tidal is also told the budget (``vram_budget``). Prints the median step time
after warm-up and the peak device memory minus the filler, as one JSON line (GPU only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick try")
    p.add_argument("--quantize", default="nf4")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("trainer_lora14b: needs a CUDA device (run it on the GPU machine).")
    free, _ = torch.cuda.mem_get_info()
    budget = int(a.budget_gib * 2**30)
    filler_bytes = max(0, free - budget)
    filler = torch.empty(filler_bytes, dtype=torch.uint8, device="cuda")  # leaves exactly the budget free
    torch.cuda.reset_peak_memory_stats()
    sys.path.insert(0, str(ROOT / "examples"))
    import lora_large_model

    argv2 = [
        "--size",
        "14b",
        "--quantize",
        a.quantize,
        "--vram-budget",
        f"{budget}",
        "--steps",
        str(a.steps),
        "--seq-len",
        str(a.seq_len),
    ]
    if a.layers:
        argv2 += ["--layers", str(a.layers)]
    out = lora_large_model.main(argv2)
    out["budget_gib"] = a.budget_gib
    out["filler_gib"] = filler_bytes / 2**30
    out["peak_vram_minus_filler_gib"] = (torch.cuda.max_memory_allocated() - filler_bytes) / 2**30
    del filler
    print("RESULT " + json.dumps(out))
    return out


if __name__ == "__main__":
    main()
