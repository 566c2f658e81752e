"""Two planner decisions checked against the cost model on the GPU machine's shapes.

1. Overlap order: backward lands the last blocks' gradients first, so the host share of the optimizer
   (and the streamed blocks inside it) goes on the last blocks, the GPU share on the first ones.
2. Activations per block: keep, recompute or offload by predicted exposed time, offloaded copies
   counted in the phase where they must cross the link (to the host in forward, back in backward).
"""

from __future__ import annotations

import pytest

from tidal_plan import HardwareProfile, InfeasiblePlan, Plan, PlanConfig, plan
from tidal_plan.cost import GpuTime, State, evaluate, exposed_host_update_s, gpu_time, host_update_rate
from tidal_plan.planner import _context
from tidal_plan.predict import plan_state
from tidal_plan.units import MiB

# benchmarks/stream/full_finetune.py on the GPU machine: batch 4 x 512, chunked loss of 1024 tokens
BATCH = dict(batch_tokens=2048, seq_len=512, loss_chunk_tokens=1024)


def h200(**more) -> HardwareProfile:
    """The GPU machine as measured: 55 GB/s each way, ~690 TFLOP/s sustained bf16, 4.15 TB/s HBM, and
    the host update rate the full fine-tune run implied (1.26 G params/s, the whole bf16 path)."""
    base = dict(
        vram_budget_bytes="24GiB",
        h2d_gbps=55.0,
        d2h_gbps=55.0,
        matmul_sustained_tflops=690.0,
        hbm_gbps=4150.0,
        host_update_params_per_s=1.26e9,
    )
    return HardwareProfile.synthetic(**{**base, **more})


def _mirror(p: Plan) -> State:
    """The plan's placement upside down: host share and streamed blocks on the first blocks."""
    s = plan_state(p)
    return State(s.fmt, s.moment, s.resident[::-1], s.act[::-1], s.opt_gpu[::-1], s.outside_opt_gpu)


# ---- 1. overlap order -------------------------------------------------------------------------------------


def test_full_finetune_puts_the_host_share_on_the_last_blocks(qwen1_5b_untied_census, overlap_order):
    """Qwen2.5-1.5B shape, full fine-tune, 24 GiB, fp32 moments: the split the GPU machine ran with the
    host share on blocks 0-9 measured 466 ms a step. The planner now leaves the host the last blocks and
    predicts the step that placement saves."""
    c = qwen1_5b_untied_census
    cfg = PlanConfig(vram_budget="24GiB", moment_dtype="fp32", **BATCH)
    p = plan(c, h200(), cfg)
    print(p.explain())
    assert p.optimizer.placement == "split" and p.prediction.bound == "host_adamw"
    overlap_order(p)
    host = [b.index for b in p.blocks if b.optimizer == "host"]
    assert 0 < len(host) < 28 and host[-1] == 27 and 0 not in host
    ctx = _context(c, h200(), cfg)
    mirrored = evaluate(ctx, _mirror(p))
    assert mirrored.vram_total == p.tiers["vram"]  # the same bytes in every tier, upside down
    # the mirrored placement is the kind measured (host blocks 0-9): the model agrees with that run
    assert mirrored.prediction.step_s == pytest.approx(0.466, rel=0.25)
    new, old = p.prediction, mirrored.prediction
    assert new.host_adamw_s == pytest.approx(old.host_adamw_s, rel=1e-12)
    # at the top of the stack the host work overlaps backward of the GPU-updated blocks and the next
    # forward up to the first host block, which the bottom placement cannot
    g = gpu_time(ctx, plan_state(p))
    assert old.exposed_optimizer_s - new.exposed_optimizer_s >= g.forward_before(host[0])
    assert new.step_s < 0.88 * old.step_s
    # the first streamed block's refill overlaps the forward of the resident blocks before it, and turn
    # holds keep the last ones over the turn: little of the link's time is left exposed, less than when
    # the streamed blocks start the forward
    assert new.exposed_transfer_s < 0.02 * new.step_s and new.exposed_transfer_s < old.exposed_transfer_s


def test_a_host_update_waits_only_for_the_forward_up_to_its_block(qwen1_5b_untied_census):
    """One host-updated block, a slow host (its update is late wherever it sits): at the top of the stack
    it is late by exactly the backward of blocks 0-26 less than at the bottom (its gradient lands that much
    earlier) and by their forward less again (the next forward reaches it that much later)."""
    c = qwen1_5b_untied_census
    n = len(c.blocks)
    ctx = _context(c, h200(host_update_params_per_s=1e8), PlanConfig(**BATCH, recompute=True))

    def exposed(i: int) -> tuple[float, GpuTime]:
        s = State("exact", "fp32", [True] * n, ["recompute"] * n, [j != i for j in range(n)], True)
        g = gpu_time(ctx, s)
        rate = host_update_rate(ctx, "fp32")
        return exposed_host_update_s(ctx, s, g, rate, 55e9, 55e9), g

    bottom, g = exposed(0)
    top, _ = exposed(n - 1)
    assert top > 0
    assert bottom - top == pytest.approx(sum(g.block_backward_s[: n - 1]) + g.forward_before(n - 1), rel=1e-9)


@pytest.mark.parametrize("moment", ["fp32", "bf16"])
def test_every_budget_keeps_the_overlap_order(qwen1_5b_untied_census, moment, overlap_order):
    """Over budgets from all-streamed to all-resident the planner's own plans already have the order
    wrap() imposes, and streamed blocks update on the host."""
    seen = set()
    for gib in (6, 8, 12, 16, 20, 24, 28, 32, 40):
        try:
            p = plan(
                qwen1_5b_untied_census,
                h200(),
                PlanConfig(vram_budget=f"{gib}GiB", moment_dtype=moment, **BATCH),
            )
        except InfeasiblePlan:
            continue
        overlap_order(p)
        assert not any(b.weights == "streamed" and b.optimizer == "gpu" for b in p.blocks)
        seen.add((p.optimizer.placement, bool(p.streamed_blocks)))
    assert ("split", True) in seen, seen  # the sweep covers plans that stream


# ---- 2. keep / recompute / offload ------------------------------------------------------------------------


def test_recompute_beats_offload_when_the_link_would_bound_the_step(qwen1_5b_untied_census):
    """Qwen2.5-1.5B shape, bf16 moments, 24 GiB: the optimizer fits on the GPU, the activations (212 MiB
    a block at 2048 tokens) do not. Offloading all 28 blocks sends 6.2 GB each way, 113 ms at 55 GB/s in
    forward, whose compute is ~40 ms: the GPU machine measured a forward of 145 ms and a backward of 149 ms
    that way. Recomputing costs one more forward of the block; the planner recomputes (or keeps)."""
    c = qwen1_5b_untied_census
    cfg = dict(vram_budget="24GiB", moment_dtype="bf16", **BATCH)
    p = plan(c, h200(), PlanConfig(**cfg))
    print(p.explain())
    acts = [b.activations for b in p.blocks]
    assert p.optimizer.placement == "gpu" and not p.streamed_blocks
    assert acts.count("offload") <= 3 and acts.count("recompute") + acts.count("keep") >= 25, p.explain()
    assert p.prediction.bound == "compute" and p.prediction.exposed_transfer_s == 0.0

    off = plan(c, h200(), PlanConfig(activation_offload=True, **cfg))
    print(off.explain())
    assert all(b.activations == "offload" for b in off.blocks)
    assert off.prediction.bound == "pcie"
    # the copies to the host cannot start before forward makes them nor wait for backward: what forward's
    # compute cannot hide is exposed, however much compute the rest of the step has
    ctx = _context(c, h200(), PlanConfig(**cfg))
    g = gpu_time(ctx, plan_state(off))
    act_bytes = sum(b.activation_bytes_per_token for b in c.blocks) * 2048
    assert off.prediction.exposed_transfer_s >= act_bytes / 55e9 - g.forward_s > 0
    assert p.prediction.step_s < 0.8 * off.prediction.step_s


def test_offload_is_chosen_where_compute_hides_it(build_meta_lm):
    """A slow GPU (its forward far longer than the copies) and a budget that keeps few activations:
    offloading is then free and saves the recompute, so the planner offloads — a decision by cost,
    not a rule against offloading."""
    from tidal_plan import census

    c = census(build_meta_lm("qwen2", hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, vocab_size=256))  # fmt: skip
    slow = HardwareProfile.synthetic(matmul_tflops=20.0, hbm_gbps=400.0)
    act = c.blocks[0].keep_bytes(4096, 4096)
    fixed = dict(batch_tokens=4096, headroom_bytes=256 * MiB, moment_dtype="fp32", offload=False)
    # weights, their gradients, fp32 masters and moments on the GPU, the loss, and about three blocks'
    # activations
    budget = c.trainable_params * 2 * 8 + 3 * act + 600 * MiB
    p = plan(c, slow, PlanConfig(vram_budget=budget, **fixed))
    print(p.explain())
    acts = [b.activations for b in p.blocks]
    assert p.optimizer.placement == "gpu" and acts.count("offload") >= 3, p.explain()
    assert p.prediction.exposed_transfer_s == pytest.approx(0.0, abs=1e-4)
    rec = plan(c, slow, PlanConfig(vram_budget=budget, activation_offload=False, **fixed))
    assert "recompute" in [b.activations for b in rec.blocks]
    assert p.prediction.step_s < rec.prediction.step_s
