"""The cost model on the three lora14b placements measured with CUDA graphs (no GPU needed).

On 2026-11-30 the benchmark harness ran LoRA on the Qwen2.5-14B shape at 512 tokens under a 24 GiB budget
with CUDA graphs on (``benchmarks/results/compare-lora14b-tidal-graphs-h200-2026-11-30.jsonl``; exact bf16
again with turn holds, ``compare-lora14b-turn-holds-h200x2-2026-11-30.jsonl``). After the first step each
run ended with this placement (from its ``"placement"`` decision line):

- NF4: every block resident and keeping its activations; optimizer on the GPU;
- FP8: every block resident; blocks 0-2, 19-26 and 40-47 keep their activations, the others recompute;
- exact bf16: blocks 27-47 stream their weights (optimizer on the host for them), block 47 keeps its
  activations, the others recompute.

This script builds the same model on the meta device (PEFT LoRA, the frozen linears as ``QuantLinear``
buffers for NF4 and FP8, as the harness holds them), takes its census, and asks ``tidal_plan.predict``
for a step of each placement at 512 tokens, with and without ``cuda_graphs``, on a profile with the
rates the GPU machine measured in those runs (``profiled cuda:0`` lines of the harness' logs)::

    python benchmarks/plan/lora14b_placements.py

It prints predicted against measured (the measured medians are from the results file above).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.common import add_lora, build_meta_model
from engines.scenarios import GiB, get_scenario

# what the GPU machine measured (profile_hardware, quick mode) in the 2026-11-30 runs
PROFILE = dict(
    h2d_gbps=52.06,
    d2h_gbps=53.65,
    bidir_gbps=86.95,
    hbm_gbps=4075.6,
    matmul_tflops=787.5,
    matmul_sustained_tflops=673.1,
    host_adamw_params_per_s=2.468e9,
    host_update_params_per_s=1.105e9,
    vram_budget_bytes=int(23.66 * GiB),
    has_fp8_tensor_cores=True,
)
FP8_KEEP = {0, 1, 2, *range(19, 27), *range(40, 48)}
# (label, stored format, streamed blocks, activation policy of block i, measured s/step with graphs)
PLACEMENTS = [
    ("tidal NF4", "nf4", set(), lambda i: "keep", 0.154),
    ("tidal FP8", "fp8", set(), lambda i: "keep" if i in FP8_KEEP else "recompute", 0.174),
    ("tidal exact bf16", None, set(range(27, 48)), lambda i: "keep" if i == 47 else "recompute", 0.492),
]


def _census(fmt: str | None):
    """The census of the harness' lora14b model with its frozen linears held in ``fmt`` (meta device)."""
    from tidal_plan import census
    from tidal_quant import QuantLinear

    model = add_lora(build_meta_model(get_scenario("lora14b"), torch.bfloat16), 0)
    if fmt:
        for m in list(model.modules()):
            base = getattr(m, "base_layer", None)
            if isinstance(base, nn.Linear):
                m.base_layer = QuantLinear(
                    base.in_features, base.out_features, fmt, bias=base.bias is not None, device="meta"
                )
    return census(model, blocks=model.base_model.model.model.layers)


def main() -> list[dict]:
    from tidal_plan import HardwareProfile, PlanConfig, plan, predict

    prof = HardwareProfile.synthetic(**PROFILE)
    rows = []
    for label, fmt, streamed, act, measured in PLACEMENTS:
        c = _census(fmt)
        base = plan(c, prof, PlanConfig())
        blocks = tuple(
            dataclasses.replace(
                b,
                weights="streamed" if i in streamed else "resident",
                activations=act(i),
                optimizer="host" if i in streamed else "gpu",
            )
            for i, b in enumerate(base.blocks)
        )
        placement = dataclasses.replace(
            base, blocks=blocks, optimizer=dataclasses.replace(base.optimizer, outside_on_gpu=True)
        )
        row = {"engine": label, "measured_s": measured}
        for graphs in (False, True):
            pred = predict(c, prof, placement, PlanConfig(cuda_graphs=graphs), batch_tokens=512)
            row["graphs" if graphs else "eager"] = pred.step_s
        rows.append(row)
        print(
            f"{label:18s} measured {measured * 1e3:6.0f} ms | predicted with graphs {row['graphs'] * 1e3:6.0f} ms "
            f"(measured/predicted {measured / row['graphs']:.2f}) | predicted eager {row['eager'] * 1e3:6.0f} ms"
        )
    return rows


if __name__ == "__main__":
    main()
