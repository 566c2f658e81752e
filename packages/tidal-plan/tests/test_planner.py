import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal_plan import (
    HardwareProfile,
    InfeasiblePlan,
    Plan,
    PlanConfig,
    PlanConfigError,
    compare_prediction,
    plan,
)
from tidal_plan.cost import KERNEL_OVERHEAD_S, gpu_time
from tidal_plan.planner import _context
from tidal_plan.predict import plan_state
from tidal_plan.stream_schedule import streamed_step_s
from tidal_plan.units import GiB


def _show(title: str, p: Plan) -> None:
    print(f"\n=== {title} ===\n{p.explain()}")


def _check_invariants(p: Plan, budget: int, host: int) -> None:
    assert p.tiers["vram"] <= budget
    assert not any(b.weights == "streamed" and b.optimizer == "gpu" for b in p.blocks), p.explain()
    assert p.tiers["pinned_host"] + p.tiers["pageable_host"] <= host
    assert p.prediction.step_s >= p.prediction.compute_s > 0
    assert Plan.from_json(p.to_json()) == p
    json.loads(p.to_json())


def _h200(budget: str, ram: int) -> HardwareProfile:
    return HardwareProfile.synthetic(vram_budget_bytes=budget, host_ram_bytes=ram)


# ---- acceptance: Qwen2.5-14B shape with LoRA -------------------------------------------------------------


def test_acceptance_qwen14b_lora_24gib(qwen14b_lora_census, bpw):
    prof = _h200("24GiB", 64 * 10**9)
    p = plan(qwen14b_lora_census, prof, PlanConfig())
    _show("Qwen2.5-14B LoRA r=16, 24 GiB, 64 GB RAM, exact", p)
    _check_invariants(p, 24 * GiB, 64 * 10**9)
    assert p.training == "lora" and p.quantize is None
    # 27.6 GiB of weights cannot all stay: some blocks stream, the rest stay resident.
    assert 0 < len(p.streamed_blocks) < 48
    assert all(b.storage == "exact" for b in p.blocks)
    assert {b.optimizer for b in p.blocks} <= {"gpu", "host"}
    assert p.optimizer.moment_dtype == "fp32"

    # int8 weights fit resident beside a chunked loss, not beside the full [4096, 152064] logits (7 GiB at
    # the loss's peak).
    full_int8 = plan(qwen14b_lora_census, prof, PlanConfig(quantize="int8", bytes_per_weight=bpw))
    assert full_int8.vram_breakdown["loss"] == 12 * 4096 * 152064 and full_int8.streamed_blocks
    # quantize="auto" under prefer="speed" takes a smaller format only for a step at least 10 % shorter.
    # At 4096 tokens exact storage streams 32 blocks, spread between the resident ones: replayed block by
    # block (tidal_plan.stream_schedule) their refills cannot start before the window frees, so the step is
    # longer than its link time. With the full logits a smaller format keeps more blocks resident and gains
    # more than 10 %: "auto" takes one, and says why; beside a chunked loss exact streams 26 spread blocks
    # and no format gains 10 %: "auto" stays exact.
    for chunk in (None, 1024):
        exact = p if chunk is None else plan(qwen14b_lora_census, prof, PlanConfig(loss_chunk_tokens=chunk))
        # longer than the link's time and than the compute's: neither hides the other whole
        assert exact.prediction.step_s > max(exact.prediction.transfer_s, exact.prediction.compute_s)
        faster = []
        for fmt in ("int8", "nf4"):
            alt = plan(
                qwen14b_lora_census,
                prof,
                PlanConfig(quantize=fmt, bytes_per_weight=bpw, loss_chunk_tokens=chunk),
            )
            if fmt == "int8" and chunk:
                assert not alt.streamed_blocks  # int8 keeps every block resident beside a chunked loss
            if alt.prediction.step_s < 0.9 * exact.prediction.step_s:
                faster.append(fmt)
        q = plan(
            qwen14b_lora_census,
            prof,
            PlanConfig(quantize="auto", bytes_per_weight=bpw, loss_chunk_tokens=chunk),
        )
        _show(f"Qwen2.5-14B LoRA, 24 GiB, quantize='auto', prefer='speed', loss chunk {chunk}", q)
        _check_invariants(q, 24 * GiB, 64 * 10**9)
        if chunk is None:
            assert faster and q.quantize in faster
            assert q.prediction.step_s < 0.9 * exact.prediction.step_s
            assert any(n.startswith("quantize='auto', prefer='speed'") for n in q.notes), q.notes
        else:
            assert not faster and q.quantize is None

    m = plan(qwen14b_lora_census, prof, PlanConfig(quantize="auto", bytes_per_weight=bpw, prefer="memory"))
    assert m.quantize is None  # exact fits: "auto" quantizes only when it must


def test_acceptance_qwen14b_lora_4gib(qwen14b_lora_census, bpw):
    prof = _h200("4GiB", 64 * 10**9)
    with pytest.raises(InfeasiblePlan) as e:
        plan(qwen14b_lora_census, prof, PlanConfig())
    print(f"\n=== Qwen2.5-14B LoRA, 4 GiB, exact, 4096 tokens: refused ===\n{e.value}")
    assert e.value.resource == "vram" and e.value.needed_bytes > e.value.available_bytes == 4 * GiB
    assert "quantize='auto'" in str(e.value)

    with pytest.raises(InfeasiblePlan) as e:
        plan(qwen14b_lora_census, prof, PlanConfig(quantize="auto", bytes_per_weight=bpw))
    print(f"\n=== Qwen2.5-14B LoRA, 4 GiB, quantize='auto', 4096 tokens: refused ===\n{e.value}")
    assert "batch_tokens <=" in str(e.value)

    # the full logits of 1024 tokens (1.7 GiB at the loss's peak) do not fit beside the weights: chunk them
    with pytest.raises(InfeasiblePlan, match="loss_chunk_tokens=256"):
        plan(qwen14b_lora_census, prof, PlanConfig(quantize="auto", bytes_per_weight=bpw, batch_tokens=1024))
    p = plan(
        qwen14b_lora_census,
        prof,
        PlanConfig(quantize="auto", bytes_per_weight=bpw, batch_tokens=1024, loss_chunk_tokens=256),
    )
    _show("Qwen2.5-14B LoRA, 4 GiB, quantize='auto', 1024 tokens, chunked loss", p)
    _check_invariants(p, 4 * GiB, 64 * 10**9)
    assert p.quantize in ("int8", "nf4") and p.streamed_blocks
    # Every block streams twice a step (forward, backward) at 1024 tokens: the link carries about as long
    # as the GPU computes (LoRA's many small kernels at 1024 tokens), so either may bound the step.
    assert p.prediction.bound in ("pcie", "compute")
    assert p.prediction.transfer_s > 0.5 * p.prediction.compute_s


# ---- acceptance: Llama-3-8B shape, full fine-tune ---------------------------------------------------------


def test_acceptance_llama8b_full_24gib_128gb(llama8b_census):
    p = plan(llama8b_census, _h200("24GiB", 128 * 10**9), PlanConfig())
    _show("Llama-3-8B full fine-tune, 24 GiB, 128 GB RAM", p)
    _check_invariants(p, 24 * GiB, 128 * 10**9)
    assert p.training == "full" and p.optimizer.placement in ("host", "split")
    assert p.optimizer.host_state_bytes > 50 * GiB and p.streamed_blocks
    assert p.prediction.bound == "host_adamw"


def test_acceptance_llama8b_full_24gib_32gb_refused(llama8b_census):
    with pytest.raises(InfeasiblePlan) as e:
        plan(llama8b_census, _h200("24GiB", 32 * 10**9), PlanConfig())
    print(f"\n=== Llama-3-8B full fine-tune, 24 GiB, 32 GB RAM: refused ===\n{e.value}")
    assert e.value.resource == "host_ram"
    assert e.value.needed_bytes > 60 * GiB and e.value.available_bytes < 32 * 10**9
    assert "LoRA" in str(e.value) and "master_weights=False" in str(e.value)


def test_moments_fall_back_to_bf16_only_when_fp32_does_not_fit(llama8b_census):
    prof = _h200("24GiB", 96 * 10**9)
    p = plan(llama8b_census, prof, PlanConfig())
    assert p.optimizer.moment_dtype == "bf16" and any("bf16" in n for n in p.notes)
    with pytest.raises(InfeasiblePlan) as e:
        plan(llama8b_census, prof, PlanConfig(moment_dtype="fp32"))
    print(f"\n=== Llama-3-8B full, 96 GB RAM, moment_dtype='fp32': refused ===\n{e.value}")
    assert "moment_dtype='bf16'" in str(e.value) and "fp32 moments" in str(e.value)


# ---- acceptance: a model that fits entirely ----------------------------------------------------------------


def test_acceptance_fits_entirely_plain_gpu_adamw(qwen1_5b_census):
    p = plan(qwen1_5b_census, _h200("80GiB", 128 * 10**9), PlanConfig())
    _show("Qwen2.5-1.5B full fine-tune, 80 GiB: fits", p)
    _check_invariants(p, 80 * GiB, 128 * 10**9)
    assert p.optimizer.placement == "gpu" and p.optimizer.host_state_bytes == 0
    assert all(b.weights == "resident" and b.activations == "keep" and b.optimizer == "gpu" for b in p.blocks)
    assert p.tiers["pinned_host"] == p.tiers["pageable_host"] == 0
    assert p.prediction.bound == "compute" and p.prediction.step_s == p.prediction.compute_s
    parts = p.prediction.parts
    assert sum(parts.values()) == pytest.approx(p.prediction.compute_s, rel=1e-12)
    # matmuls: 6 FLOP per weight per token at the matmul rate (every GEMM of these shapes at 4096 tokens
    # is compute-bound), plus one kernel overhead per GEMM (forward, input and weight gradients)
    c = qwen1_5b_census
    mm = sum(b.matmul_params for b in c.blocks) + c.outside_matmul_params
    gemms = 3 * (sum(len(b.matmul_shapes) for b in c.blocks) + len(c.outside_matmul_shapes))
    assert parts["matmul"] == pytest.approx(6 * mm * 4096 / 780e12 + gemms * KERNEL_OVERHEAD_S, rel=1e-9)
    # GPU AdamW with fp32 masters of bf16 weights: 40 bytes per parameter at HBM bandwidth
    assert parts["gpu_adamw"] == pytest.approx(c.trainable_params * 40 / 4200e9, rel=1e-12)
    # the loss pass over [4096, vocab] logits; attention over one 4096-token sequence
    assert parts["loss"] == pytest.approx(36 * 4096 * 151936 / 4200e9, rel=1e-12)
    assert parts["attention"] > 0 and parts["elementwise"] > 0 and parts["launch"] > 0


def test_full_finetune_of_1_5b_at_24gib_splits_the_optimizer(qwen1_5b_census):
    p = plan(qwen1_5b_census, _h200("24GiB", 128 * 10**9), PlanConfig())
    _show("Qwen2.5-1.5B full fine-tune, 24 GiB", p)
    _check_invariants(p, 24 * GiB, 128 * 10**9)
    assert p.optimizer.placement == "split"
    assert (
        0 < len(p.optimizer.gpu_blocks) < 28
        and p.optimizer.gpu_state_bytes > 0 < p.optimizer.host_state_bytes
    )


# ---- the search and the cost model ------------------------------------------------------------------------


def test_more_budget_never_predicts_a_slower_step(qwen14b_lora_census):
    steps = []
    for gib in (12, 16, 24, 32, 48, 80):
        # a chunked loss: with the full logits (7 GiB at 4096 tokens) 12 GiB is infeasible
        p = plan(qwen14b_lora_census, _h200(f"{gib}GiB", 128 * 10**9), PlanConfig(loss_chunk_tokens=1024))
        steps.append(p.prediction.step_s)
        assert p.tiers["vram"] <= gib * GiB
    assert all(b <= a * 1.001 for a, b in itertools.pairwise(steps)), steps
    assert steps[-1] < steps[0]


def test_lora_compute_is_4_frozen_plus_6_trainable(qwen14b_lora_census):
    # With HBM far faster than the matmul rate, every GEMM's roofline is its FLOPs: the matmul part is then
    # 4 FLOP per frozen weight per token (forward, input gradient), 6 per trainable one (+ weight gradient)
    # and 2 more per recomputed weight, plus one kernel overhead per GEMM.
    prof = HardwareProfile.synthetic(vram_budget_bytes="80GiB", host_ram_bytes=128 * 10**9, hbm_gbps=1e12)
    p = plan(qwen14b_lora_census, prof, PlanConfig())
    c = qwen14b_lora_census
    frozen = sum(b.quantizable_params for b in c.blocks) + c.outside_quantizable_params
    trainable = sum(b.matmul_params - b.quantizable_params for b in c.blocks)
    recompute = sum(b.matmul_params for b in c.blocks if p.blocks[b.index].activations == "recompute")
    expected = (4 * frozen + 6 * trainable + 2 * recompute) * 4096 / 780e12
    gemms = 0
    for b in c.blocks:
        passes = 2 if p.blocks[b.index].activations == "recompute" else 1
        gemms += sum(passes + (2 if trainable else 1) for _, _, trainable in b.matmul_shapes)
    gemms += sum(1 + (2 if trainable else 1) for _, _, trainable in c.outside_matmul_shapes)
    assert p.prediction.parts["matmul"] == pytest.approx(expected + gemms * KERNEL_OVERHEAD_S, rel=1e-9)


def test_small_gemms_run_below_the_peak_rate(qwen1_5b_census):
    # Fewer tokens per step: the same weights are read for less work, and kernel overheads stay, so the
    # predicted matmul rate falls; it never exceeds the measured peak.
    prof = _h200("80GiB", 128 * 10**9)
    c = qwen1_5b_census
    mm = sum(b.matmul_params for b in c.blocks) + c.outside_matmul_params
    rates = []
    for tokens in (64, 512, 4096):
        p = plan(c, prof, PlanConfig(batch_tokens=tokens, recompute=False))
        rates.append(6 * mm * tokens / p.prediction.parts["matmul"] / 1e12)
    assert rates[0] < rates[1] < rates[2] < 780
    assert rates[0] < 0.2 * 780 and rates[2] > 0.8 * 780


def test_fp32_weights_multiply_without_tensor_cores(qwen1_5b_census):
    import dataclasses

    prof = _h200("80GiB", 128 * 10**9)
    cfg = PlanConfig(recompute=False, offload=False)
    bf16 = plan(qwen1_5b_census, prof, cfg).prediction.parts["matmul"]
    fp32_census = dataclasses.replace(qwen1_5b_census, param_dtype_bytes=4, compute_dtype_bytes=4)
    fp32 = plan(fp32_census, prof, cfg).prediction.parts
    # compute-bound GEMMs at 1/15 of the bf16 rate; the kernel overheads stay the same
    assert 10 * bf16 < fp32["matmul"] < 15 * bf16


def test_attention_grows_with_the_sequence(qwen1_5b_census):
    prof = _h200("80GiB", 128 * 10**9)
    att = [
        plan(qwen1_5b_census, prof, PlanConfig(seq_len=n, recompute=False)).prediction.parts["attention"]
        for n in (512, 4096)
    ]
    # causal attention over 4096 tokens: 8 sequences of 512 do about 1/8 of one sequence of 4096's work
    assert att[0] == pytest.approx(att[1] * (513 / 4097), rel=1e-9)
    with pytest.raises(PlanConfigError, match="seq_len="):
        PlanConfig(seq_len=0)


def test_host_adamw_costs_its_bytes_at_the_profiled_rate(qwen1_5b_census):
    # bf16 weights with fp32 masters: the host widens each gradient and narrows each new weight besides
    # the fp32 update the profile timed (28 bytes a parameter): 40 bytes, so 28/40 of the profiled rate.
    p = plan(qwen1_5b_census, _h200("24GiB", 128 * 10**9), PlanConfig(offload=True, param_offload=False))
    c = qwen1_5b_census
    assert p.optimizer.placement == "host"
    assert p.prediction.host_adamw_s == pytest.approx(c.trainable_params * 40 / 28 / 4.0e9, rel=1e-12)
    # the host work starts with backward and the next forward waits for all of it: at least the host
    # time not hidden by backward is exposed
    assert p.prediction.exposed_optimizer_s >= p.prediction.host_adamw_s - p.prediction.compute_s
    assert p.prediction.bound == "host_adamw"


def test_forced_policies(qwen14b_lora_census):
    prof = _h200("24GiB", 64 * 10**9)
    p = plan(qwen14b_lora_census, prof, PlanConfig(param_offload=True, recompute=True))
    assert len(p.streamed_blocks) == 48 and all(b.activations == "recompute" for b in p.blocks)
    assert p.optimizer.gpu_blocks == ()  # streamed blocks update on the host
    # every update on the GPU and every block streamed contradict each other: refused, naming both ways out
    with pytest.raises(PlanConfigError, match=r"param_offload=True .* blocks 0-47 train.*offload='auto'"):
        plan(qwen14b_lora_census, prof, PlanConfig(param_offload=True, offload=False))
    with pytest.raises(InfeasiblePlan, match="activation_offload=False") as e:
        plan(qwen14b_lora_census, prof, PlanConfig(activation_offload=True, param_offload=True))
    assert e.value.resource == "host_ram"
    big = _h200("24GiB", 128 * 10**9)
    p = plan(
        qwen14b_lora_census,
        big,
        PlanConfig(param_offload=list(range(0, 48, 2)), activation_offload=True, loss_chunk_tokens=1024),
    )
    assert p.streamed_blocks == tuple(range(0, 48, 2)) and all(b.activations == "offload" for b in p.blocks)
    # no recompute: every block keeps or offloads its 0.9 GiB of saved tensors (one 4096-token sequence)
    p = plan(qwen14b_lora_census, _h200("24GiB", 72 * 10**9), PlanConfig(param_offload=0.75, recompute=False))
    assert p.streamed_blocks == tuple(range(36)) and all(b.activations != "recompute" for b in p.blocks)
    p = plan(qwen14b_lora_census, prof, PlanConfig(offload=True))
    assert p.optimizer.placement == "host" and p.optimizer.gpu_state_bytes == 0
    with pytest.raises(InfeasiblePlan, match="VRAM"):
        plan(qwen14b_lora_census, prof, PlanConfig(param_offload=False))


def test_small_pagelock_limit_spills_to_pageable(qwen14b_lora_census):
    prof = HardwareProfile.synthetic(
        vram_budget_bytes="24GiB", host_ram_bytes=64 * 10**9, pagelock_limit_bytes=GiB
    )
    p = plan(qwen14b_lora_census, prof, PlanConfig())
    assert p.tiers["pinned_host"] <= GiB
    assert any("page-lock" in n for n in p.notes)


def test_fp8_needs_the_cores_and_nvfp4_is_noted(qwen14b_lora_census, bpw):
    prof = _h200("24GiB", 64 * 10**9)
    p = plan(qwen14b_lora_census, prof, PlanConfig(quantize="fp8", bytes_per_weight=bpw))
    assert p.quantize == "fp8" and all(b.storage == "fp8" for b in p.blocks)
    old = HardwareProfile.synthetic(
        vram_budget_bytes="24GiB", compute_capability=(8, 0), has_fp8_tensor_cores=False
    )
    with pytest.raises(PlanConfigError, match="quantize='fp8'"):
        plan(qwen14b_lora_census, old, PlanConfig(quantize="fp8", bytes_per_weight=bpw))
    n = plan(qwen14b_lora_census, prof, PlanConfig(quantize="nvfp4", bytes_per_weight=bpw))
    assert any("FP4 tensor cores" in x for x in n.notes)


# ---- bad input --------------------------------------------------------------------------------------------


def test_bad_plans_give_clear_errors(qwen14b_lora_census, llama8b_census, bpw):
    prof = _h200("24GiB", 64 * 10**9)
    with pytest.raises(PlanConfigError, match="vram_budget="):
        plan(qwen14b_lora_census, prof, PlanConfig(vram_budget="200GiB"))
    with pytest.raises(PlanConfigError, match="headroom_bytes="):
        plan(qwen14b_lora_census, prof, PlanConfig(vram_budget="1GiB", headroom_bytes="2GiB"))
    with pytest.raises(PlanConfigError, match="quantize="):
        plan(llama8b_census, prof, PlanConfig(quantize="nf4", bytes_per_weight=bpw))
    with pytest.raises(PlanConfigError, match="training="):
        plan(llama8b_census, prof, PlanConfig(training="lora"))
    with pytest.raises(PlanConfigError, match="param_offload="):
        plan(qwen14b_lora_census, prof, PlanConfig(param_offload=[99]))
    with pytest.raises(PlanConfigError, match="config="):
        plan(qwen14b_lora_census, prof, {"vram_budget": "24GiB"})
    with pytest.raises(PlanConfigError, match="census="):
        plan("model", prof)
    with pytest.raises(PlanConfigError, match="profile="):
        plan(qwen14b_lora_census, "H200")


def test_no_trainable_parameters_is_an_error():
    import torch
    from torch import nn

    from tidal_plan import census

    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    net.requires_grad_(False)
    c = census(net, example_inputs={"input": torch.randn(2, 8)})
    with pytest.raises(PlanConfigError, match="model="):
        plan(c, _h200("24GiB", 64 * 10**9))


def test_a_72b_shape_is_planned_without_memory(bpw, build_meta_lm):
    from tidal_plan import census

    qwen72b = dict(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
    )
    c = census(build_meta_lm("qwen2", lora_rank=8, **qwen72b))
    assert 72e9 < c.frozen_params < 73e9 and len(c.blocks) == 80
    p = plan(
        c, _h200("80GiB", 256 * 10**9), PlanConfig(quantize="auto", bytes_per_weight=bpw, batch_tokens=2048)
    )
    _show("Qwen2.5-72B LoRA r=8, 80 GiB, 256 GB RAM, quantize='auto'", p)
    _check_invariants(p, 80 * GiB, 256 * 10**9)
    # exact storage streams 42 of 80 blocks over PCIe; under prefer="speed" a smaller format that predicts a
    # step at least 10 % shorter wins.
    exact = plan(c, _h200("80GiB", 256 * 10**9), PlanConfig(batch_tokens=2048))
    assert exact.streamed_blocks and exact.prediction.bound == "pcie"
    assert p.quantize in ("int8", "nf4") and p.prediction.step_s < 0.9 * exact.prediction.step_s
    assert any("prefer='speed'" in n for n in p.notes)


def test_zero_budget_is_an_error(qwen1_5b_census):
    prof = HardwareProfile.synthetic(vram_budget_bytes=0)
    with pytest.raises(PlanConfigError, match="vram_budget="):
        plan(qwen1_5b_census, prof)


def test_pcie_arithmetic_of_an_all_streamed_plan(qwen14b_lora_census):
    c = qwen14b_lora_census
    prof = _h200("24GiB", 64 * 10**9)
    p = plan(c, prof, PlanConfig(param_offload=True, recompute=True, offload=True))
    # Streamed blocks stream every byte, adapters included (they update on the host), in forward and again
    # in backward, but for the window of 3 blocks (prefetch 2) that turn holds keep at each of the step's two
    # turns; the adapters' gradients land in pinned host buffers.
    block = [b.frozen_bytes + b.trainable_bytes + b.buffer_bytes for b in c.blocks]
    streamed, grads = sum(block), sum(b.trainable_bytes for b in c.blocks)
    assert c.outside_trainable_bytes == 0 and grads > 0
    assert p.tiers["pinned_host"] == streamed + grads
    h2d, d2h = 2 * streamed - 6 * block[0], grads
    expect = max(h2d / 55.4e9, d2h / 55.2e9, (h2d + d2h) / 94.0e9)
    assert p.prediction.transfer_s == pytest.approx(expect, rel=1e-12)
    # the weights' exposure is the block-by-block replay of the step's refills
    g = gpu_time(
        _context(c, prof, PlanConfig(param_offload=True, recompute=True, offload=True)), plan_state(p)
    )
    turn = g.total_s - sum(g.block_forward_s) - sum(g.block_backward_s)
    refill = [b / 55.4e9 for b in block]
    replay = streamed_step_s(g.block_forward_s, g.block_backward_s, turn, refill, 2, 3, [True] * len(block))
    compute = p.prediction.compute_s
    assert replay > compute + refill[0]  # the step's first refills wait for the window, not for compute
    exposed = max(expect - compute, replay - compute)
    assert p.prediction.exposed_transfer_s == pytest.approx(exposed, rel=1e-12)
    assert p.prediction.bound == "pcie" and p.max_inflight_bytes == 2 * block[0]


# The census fixture is immutable (cached once), so sharing it across examples is safe.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget_gib=st.floats(1.0, 100.0),
    ram_gb=st.integers(8, 512),
    tokens=st.sampled_from([256, 1024, 4096, 16384]),
    depth=st.integers(1, 4),
    prefer=st.sampled_from(["memory", "speed"]),
)
def test_any_plan_fits_or_is_refused_with_numbers(qwen1_5b_census, budget_gib, ram_gb, tokens, depth, prefer):
    c = qwen1_5b_census
    budget = int(budget_gib * GiB)
    cfg = PlanConfig(batch_tokens=tokens, prefetch_depth=depth, prefer=prefer)
    try:
        p = plan(c, _h200(budget, ram_gb * 10**9), cfg)
    except InfeasiblePlan as e:
        assert e.needed_bytes > e.available_bytes > 0 and e.suggestions
        return
    _check_invariants(p, budget, ram_gb * 10**9)
    assert p.prefetch_depth == depth


def test_compare_prediction_against_a_measured_step(qwen14b_lora_census):
    p = plan(qwen14b_lora_census, _h200("24GiB", 128 * 10**9), PlanConfig())
    pred = p.prediction.step_s
    # Up to 25 % either side of the measured time is in; beyond it is out.
    for measured, within in ((pred, True), (pred / 1.24, True), (pred / 0.76, True)):
        r = compare_prediction(p, measured)
        assert r["within_25pct"] is within, r
    slow = compare_prediction(p, pred / 0.74)  # measured much slower: the model is optimistic
    assert not slow["within_25pct"] and slow["error"] == pytest.approx(-0.26) and slow["ratio"] > 1
    fast = compare_prediction(p, pred / 1.26)
    assert not fast["within_25pct"] and fast["error"] == pytest.approx(0.26) and fast["ratio"] < 1
    assert slow["predicted_step_s"] == pred and slow["bound"] == p.prediction.bound
    assert slow["compute_s"] + slow["exposed_transfer_s"] + slow["exposed_optimizer_s"] == pytest.approx(pred)
    assert "outside +-25 %" in slow["summary"] and "measured/predicted 1.35" in slow["summary"]
    json.dumps(slow)  # benchmarks store it as is
    for bad in (0, -1.0, float("nan"), float("inf"), "1s", True):
        with pytest.raises(PlanConfigError, match="measured_step_s="):
            compare_prediction(p, bad)


def test_offloading_past_host_ram_is_traded_for_recompute(qwen14b_lora_census):
    """On a slower GPU (60 TFLOP/s) every block's activations hide their copies behind compute, so
    offloading all of them is the fastest plan, and it needs 42.5 GiB of host RAM at 4096 tokens. With
    40 GiB of RAM the planner gives up offloads for recompute until the plan fits, instead of refusing."""
    slow = dict(vram_budget_bytes=24 * GiB, matmul_tflops=60.0)
    roomy = plan(qwen14b_lora_census, HardwareProfile.synthetic(host_ram_bytes=400 * GiB, **slow))
    assert all(b.activations == "offload" for b in roomy.blocks)
    p = plan(qwen14b_lora_census, HardwareProfile.synthetic(host_ram_bytes=40 * GiB, **slow))
    _show("Qwen2.5-14B LoRA, 24 GiB, 40 GiB RAM, 60 TFLOP/s", p)
    _check_invariants(p, 24 * GiB, 40 * GiB)
    # offloads are given up only as far as the RAM needs: the early blocks keep theirs, and the plan beats
    # recomputing every block
    acts = [b.activations for b in p.blocks]
    assert "recompute" in acts and acts[0] == "offload"
    assert p.prediction.step_s >= roomy.prediction.step_s
    no_offload = plan(
        qwen14b_lora_census,
        HardwareProfile.synthetic(host_ram_bytes=40 * GiB, **slow),
        PlanConfig(activation_offload=False),
    )
    assert p.prediction.step_s < no_offload.prediction.step_s


def test_lora_fp32_adapters_on_a_bf16_base_plan_bf16_matmuls(qwen14b_lora_census, qwen14b_lora_fp32_census):
    """PEFT's fp32 adapters make the trained dtype fp32, but the base's matmuls still run in bf16 on
    tensor cores: the predicted matmul time is the bf16 model's plus the adapters' own fp32 GEMMs
    (``gemm.fp32_adapter_gemm_s``), not 15 times it."""
    c = qwen14b_lora_fp32_census
    assert (c.param_dtype_bytes, c.matmul_dtype_bytes) == (4, 2)
    assert qwen14b_lora_census.matmul_dtype_bytes == 2
    prof = _h200("80GiB", 128 * 10**9)
    fp32_adapters = plan(c, prof, PlanConfig(recompute=False)).prediction
    bf16_adapters = plan(qwen14b_lora_census, prof, PlanConfig(recompute=False)).prediction
    # 4096 tokens: 2,016 adapter GEMMs at the fp32 roofline add 8 % to the bf16 model's 341 ms
    assert (
        bf16_adapters.parts["matmul"] < fp32_adapters.parts["matmul"] < 1.15 * bf16_adapters.parts["matmul"]
    )


def test_lora72b_fp32_adapters_at_80gib_plans_within_a_rank_share(qwen72b_lora_fp32_census):
    """Qwen2.5-72B LoRA at 80 GiB per GPU with one rank's share of a 256 GiB machine (two ranks, one
    shared host copy): the plan streams part of the base and fits the share."""
    host = 135 * GiB
    p = plan(qwen72b_lora_fp32_census, _h200("80GiB", host), PlanConfig(offload=True))
    _show("Qwen2.5-72B LoRA, fp32 adapters, 80 GiB, 135 GiB RAM", p)
    _check_invariants(p, 80 * GiB, host)
    assert 0 < len(p.streamed_blocks) < 80
    assert p.prediction.compute_s < 10.0  # bf16 tensor-core matmuls: seconds, not tens of seconds


def test_forced_offloads_are_not_traded_for_host_ram(qwen14b_lora_census):
    """Blocks the user forces to offload stay offloaded while fitting host RAM: the others give way, or
    the plan is refused naming activation_offload."""
    slow = dict(vram_budget_bytes=24 * GiB, matmul_tflops=60.0)
    p = plan(
        qwen14b_lora_census,
        HardwareProfile.synthetic(host_ram_bytes=40 * GiB, **slow),
        PlanConfig(activation_offload=0.25),
    )
    assert all(b.activations == "offload" for b in p.blocks[:12])  # a share takes the leading blocks
    _check_invariants(p, 24 * GiB, 40 * GiB)
    with pytest.raises(InfeasiblePlan, match="activation_offload=False"):
        plan(
            qwen14b_lora_census,
            HardwareProfile.synthetic(host_ram_bytes=40 * GiB, **slow),
            PlanConfig(activation_offload=True),
        )
