"""The plans ``tidal demo --device cuda --quantize nf4|fp8`` makes on the GPU machine, reproduced on the CPU.

The GPU run picks its budget from tidal-plan (``Planner.default_budget``) against the measured H200;
here a synthetic H200 profile stands in for the measurement, so the same plan path runs without a GPU.
That plan then drives ``tidal.wrap`` on the CPU stand-in for real steps: tidal-stream refuses a plan
whose streamed blocks keep their optimizer on the device, which is what failed on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import tidal
from tidal.demo.data import ByteBatches
from tidal.demo.lora import add_lora_
from tidal.demo.model import SIZES, TinyGPT
from tidal.demo.run import Planner, plan_options
from tidal_plan import HardwareProfile

GPU_BATCH_TOKENS = 8 * 512  # the GPU defaults: batch 8 x seq_len 512


def _quantized_lora(size: str, fmt: str, dtype: torch.dtype) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(SIZES[size]).to(dtype)
    tidal.quantize_model_(model.blocks, fmt)
    add_lora_(model.blocks, r=8, dtype=dtype)
    return model


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_gpu_demo_plan_streams_with_host_updates_and_trains(fmt):
    torch.set_num_threads(1)
    model = _quantized_lora("base", fmt, torch.bfloat16)  # the GPU demo's model, dtype and batch
    planner = Planner(model, torch.device("cuda"), GPU_BATCH_TOKENS, profile=HardwareProfile.synthetic())
    blk = planner.census.blocks[0]  # the census sees the stored base and the fused attention projection
    assert (blk.stored_format, blk.quantizable_params) == (fmt, 0) and blk.stored_params == 12 * 512 * 512
    assert blk.attention_width == 512
    budget, p = planner.default_budget()
    text = p.explain()
    assert p.streamed_blocks, text  # the budget makes blocks stream, as the GPU test requires
    for b in p.blocks:
        assert not (b.weights == "streamed" and b.optimizer == "gpu"), text
        assert b.storage == fmt, text
    assert set(p.optimizer.gpu_blocks).isdisjoint(p.streamed_blocks), text
    assert p.tiers["vram"] <= budget

    # the same plan carried out on the CPU stand-in (fp32 there: bf16 matmuls are slow on CPUs); a short
    # batch keeps the steps cheap, the placements are the plan's
    model = model.float()
    # snapshot before wrap(): a streamed block's device storage is empty between uses
    lora_before = {n: t.detach().clone() for n, t in model.named_parameters() if t.requires_grad}
    opt = torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=1e-3, weight_decay=0.0)
    model, opt = tidal.wrap(
        model,
        opt,
        vram_budget=budget,
        device=torch.device("cpu"),
        plan=p,
        batch_tokens=64,
        **plan_options(p, model.blocks),
    )
    batches = ByteBatches(bytes(range(256)) * 64, 32, 2, seed=0)
    for _ in range(2):
        x, y = batches.next(torch.device("cpu"))  # [2, 32] each
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(loss)
    opt.synchronize()
    report = tidal.memory_report(model)
    ws = report["weight_streaming"]
    assert sorted(ws["streamed"]) == sorted(ws["streamed_ever"]) == sorted(p.streamed_blocks)
    # the plan given to wrap() is followed as given (on the GPU the refinement keeps its streamed blocks)
    assert any("plan given (plan=): followed as given" in e["message"] for e in report["events"])
    model = tidal.unwrap(model)  # every weight back in place
    moved = [n for n, t in model.named_parameters() if t.requires_grad and not torch.equal(t, lora_before[n])]
    first = p.streamed_blocks[0]  # a streamed block's adapters train
    assert any(".lora_b" in n and f"blocks.{first}." in n for n in moved), moved
