"""The cost model against what the GPU machine measured: host dispatch, the host update's timeline, rates."""

import dataclasses

import pytest

from tidal_plan import HardwareProfile, PlanConfig, plan
from tidal_plan.cost import (
    BACKWARD_KERNELS_PER_FORWARD,
    HOST_DISPATCH_S,
    KERNEL_OVERHEAD_S,
    State,
    adamw_bytes,
    evaluate,
    gpu_time,
    host_update_rate,
)
from tidal_plan.planner import _context

# benchmarks/plan/predict_vs_measured.py's model (a ~0.4 B Qwen2 shape) and batch
QWEN_04B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)
BATCH = dict(batch_tokens=2048, seq_len=512, recompute=False, activation_offload=False)


def _state(n: int, host_blocks: set[int], *, outside_on_gpu: bool = True, streamed: set[int] = frozenset()):
    """Every block kept, its optimizer on the host when in ``host_blocks``."""
    return State(
        "exact",
        "fp32",
        [i not in streamed for i in range(n)],
        ["keep"] * n,
        [i not in host_blocks for i in range(n)],
        outside_on_gpu,
    )


def test_a_block_pass_takes_the_longer_of_host_dispatch_and_gpu_time(qwen1_5b_census):
    c = qwen1_5b_census
    assert c.blocks[0].forward_kernels > len(c.blocks[0].matmul_shapes)  # counted by the census
    cfg = PlanConfig(**BATCH)
    n = len(c.blocks)
    # a GPU so fast that only the host's launches count: every block's pass is its host time
    fast = HardwareProfile.synthetic(matmul_tflops=1e9, hbm_gbps=1e12)
    g = gpu_time(_context(c, fast, cfg), _state(n, set()))
    host_block = c.blocks[0].forward_kernels * HOST_DISPATCH_S * (1 + BACKWARD_KERNELS_PER_FORWARD)
    assert g.parts["dispatch"] > 0
    assert sum(g.block_backward_s) + n * c.blocks[0].forward_kernels * HOST_DISPATCH_S == pytest.approx(
        n * host_block, rel=1e-9
    )
    # a slow GPU hides the host entirely: no dispatch wait
    slow = HardwareProfile.synthetic(matmul_tflops=10.0, hbm_gbps=100.0)
    assert gpu_time(_context(c, slow, cfg), _state(n, set())).parts["dispatch"] == 0.0
    # a CPU stand-in runs each kernel on the dispatching thread: the host time adds to the compute
    cpu = HardwareProfile.synthetic(device_kind="cpu", compute_capability=None, has_fp8_tensor_cores=False)
    on_cpu = gpu_time(_context(c, cpu, cfg), _state(n, set())).parts["dispatch"]
    assert on_cpu == pytest.approx(n * host_block, rel=1e-9)
    # a census without kernel counts (saved before they existed) predicts no dispatch wait either
    old = dataclasses.replace(c, blocks=tuple(dataclasses.replace(b, forward_kernels=0) for b in c.blocks))
    assert gpu_time(_context(old, fast, cfg), _state(n, set())).parts["dispatch"] == 0.0


def test_gpu_only_step_matches_the_gpu_machine(build_meta_lm):
    """predict_vs_measured 'gpu' on the H200 (profile: 766 TFLOP/s, 4076 GB/s): 26.1 ms measured (median of 5).
    Before the host-dispatch term the model said 15.9 ms."""
    from tidal_plan import census

    c = census(build_meta_lm("qwen2", **QWEN_04B))
    prof = HardwareProfile.synthetic(matmul_tflops=766.0, hbm_gbps=4076.0)
    cfg = PlanConfig(**BATCH, offload=False, param_offload=False, master_weights=False, moment_dtype="bf16")
    p = plan(c, prof, cfg)
    assert p.optimizer.placement == "gpu"
    assert p.prediction.step_s == pytest.approx(26.1e-3, rel=0.25)
    assert sum(p.prediction.parts.values()) == pytest.approx(p.prediction.compute_s, rel=1e-12)


def test_host_blocks_at_the_bottom_of_the_stack_overlap_less(qwen1_5b_census):
    """Backward reaches block 0 last: host updates of the first blocks start when backward is nearly done;
    the same number of parameters at the top of the stack overlaps most of backward."""
    c = qwen1_5b_census
    n = len(c.blocks)
    prof = HardwareProfile.synthetic(host_update_params_per_s=1.4e9)
    ctx = _context(c, prof, PlanConfig(**BATCH))
    bottom = evaluate(ctx, _state(n, set(range(10)))).prediction
    top = evaluate(ctx, _state(n, set(range(n - 10, n)))).prediction
    assert bottom.host_adamw_s == pytest.approx(top.host_adamw_s, rel=1e-12)
    assert bottom.exposed_optimizer_s > top.exposed_optimizer_s
    g = gpu_time(ctx, _state(n, set(range(10))))
    # the bottom blocks' updates start no earlier than block 9's backward ends; only blocks 8..0's
    # backward and the GPU's own AdamW are left to hide them
    hidden_at_most = sum(g.block_backward_s[:9]) + g.parts["gpu_adamw"]
    assert bottom.exposed_optimizer_s >= bottom.host_adamw_s - hidden_at_most
    # the top blocks' updates run during almost all of backward
    assert top.exposed_optimizer_s < bottom.exposed_optimizer_s - 0.5 * sum(g.block_backward_s[:18])


def test_the_run_on_the_gpu_machine_with_host_updated_bottom_blocks(qwen1_5b_census):
    """Qwen2.5-1.5B full fine-tune on the GPU machine, 2048 tokens: blocks 0-9 streamed with their update on
    the host, 18 resident on the GPU's AdamW. Measured 466 ms a step: compute 123 ms, host update exposed
    344 ms (468 M parameters after the last of their gradients). At the host update rate that run implies
    (1.26 G params/s, the whole bf16 path), the model must land within 25 %; the old model's tail rule
    hid 85 ms of host work (all of backward) where only
    31 ms (the backward of blocks 8..0 and the GPU's AdamW) can hide it."""
    c = qwen1_5b_census
    n = len(c.blocks)
    prof = HardwareProfile.synthetic(
        matmul_tflops=780.0, matmul_sustained_tflops=683.0, host_update_params_per_s=1.26e9, host_threads=32
    )
    ctx = _context(c, prof, PlanConfig(**BATCH))
    pred = evaluate(ctx, _state(n, set(range(10)), streamed=set(range(10)))).prediction
    assert pred.compute_s == pytest.approx(0.123, rel=0.25)
    assert pred.step_s == pytest.approx(0.466, rel=0.25)
    assert pred.bound == "host_adamw"


def test_host_update_rate_comes_from_the_whole_update_when_measured(qwen1_5b_census):
    c = qwen1_5b_census
    cfg = PlanConfig(**BATCH)
    fused_only = _context(c, HardwareProfile.synthetic(host_adamw_params_per_s=4.0e9), cfg)
    # bf16 weights with fp32 masters: 40 bytes a parameter against the fused kernel's 28
    assert adamw_bytes(fused_only, "fp32") == 40
    assert host_update_rate(fused_only, "fp32") == pytest.approx(4.0e9 * 28 / 40, rel=1e-12)
    whole = _context(c, HardwareProfile.synthetic(host_update_params_per_s=1.5e9), cfg)
    assert host_update_rate(whole, "fp32") == pytest.approx(1.5e9, rel=1e-12)
    # bf16 moments: the measured share of the fp32 path (widening and stochastic rounding add passes)
    assert host_update_rate(whole, "bf16") == pytest.approx(1.5e9 * 0.1490 / 0.2101, rel=1e-12)
    n = len(c.blocks)
    pred = evaluate(whole, _state(n, set(range(n)), outside_on_gpu=False)).prediction
    assert pred.host_adamw_s == pytest.approx(c.trainable_params / 1.5e9, rel=1e-12)


def test_sustained_matmul_rate_is_used_when_measured(qwen1_5b_census):
    c = qwen1_5b_census
    cfg = PlanConfig(**BATCH)
    n = len(c.blocks)
    fast = HardwareProfile.synthetic(matmul_tflops=780.0, hbm_gbps=1e12)
    held = HardwareProfile.synthetic(matmul_tflops=780.0, matmul_sustained_tflops=390.0, hbm_gbps=1e12)
    a = gpu_time(_context(c, fast, cfg), _state(n, set())).parts["matmul"]
    b = gpu_time(_context(c, held, cfg), _state(n, set())).parts["matmul"]
    gemms = 3 * (sum(len(x.matmul_shapes) for x in c.blocks) + len(c.outside_matmul_shapes))
    assert b - gemms * KERNEL_OVERHEAD_S == pytest.approx(2 * (a - gemms * KERNEL_OVERHEAD_S), rel=1e-9)


def test_fp32_adapter_gemms_are_priced_by_their_kernel_time(qwen14b_lora_fp32_census):
    """``gemm.fp32_adapter_gemm_s``: a rank-16 factor of an fp32 adapter at 512 tokens takes the measured
    small-shape time, one at 65,536 tokens its fp32 roofline; a 16-bit model's GEMMs are unaffected."""
    from tidal_plan.gemm import FP32_ADAPTER_GEMM_S, fp32_adapter_gemm_s, gemm_s

    prof = HardwareProfile.synthetic(matmul_tflops=780.0, hbm_gbps=4000.0)
    ctx = _context(qwen14b_lora_fp32_census, prof, PlanConfig(batch_tokens=512))
    small = fp32_adapter_gemm_s(ctx, 512, 5120, 16)
    assert small == pytest.approx(FP32_ADAPTER_GEMM_S + KERNEL_OVERHEAD_S, rel=1e-12)
    # the bf16 roofline prices its kernel at about a microsecond
    assert small - KERNEL_OVERHEAD_S > 5 * (gemm_s(ctx, 512, 5120, 16) - KERNEL_OVERHEAD_S)
    big = fp32_adapter_gemm_s(ctx, 65536, 5120, 16)
    assert big - KERNEL_OVERHEAD_S == pytest.approx(
        4 * (65536 * 5120 + 5120 * 16 + 65536 * 16) / 4000e9, rel=1e-12
    )
