"""Properties every plan keeps, over budgets, machines and model shapes (full, LoRA, LoRA on a stored base).

The main one: a streamed block never keeps its optimizer on the GPU. Its weights live in pinned host
memory between uses, so its trainable parameters update there; tidal_stream refuses any other plan.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal_plan import (
    BlockCensus,
    HardwareProfile,
    InfeasiblePlan,
    ModelCensus,
    Plan,
    PlanConfig,
    PlanConfigError,
    plan,
)
from tidal_plan.units import GiB, MiB

STORED_BYTES_PER_WEIGHT = 0.5 + 1 / 64  # an nf4-like stored base: 4 bits and an absmax per 64


def synthetic_census(
    n_blocks: int, hidden: int, ffn_mult: int, vocab: int, mode: str, rank: int, dtype_bytes: int
) -> ModelCensus:
    """A decoder-shaped census without a model. ``mode``: ``"full"`` (everything trains), ``"lora"``
    (frozen exact base + rank-``rank`` adapters) or ``"qlora"`` (the base's linears already stored as
    4-bit buffers, as a ``QuantLinear`` holds them, + adapters)."""
    h, f = hidden, ffn_mult * hidden
    linears = [(h, h)] * 4 + [(h, f)] * 2 + [(f, h)]  # (in, out): q, k, v, o, gate, up, down
    lin = sum(i * o for i, o in linears)
    norms = 2 * h
    adapters = sum(rank * (i + o) for i, o in linears)
    blocks = []
    for idx in range(n_blocks):
        if mode == "full":
            tp, fp, qp, buf = lin + norms, 0, 0, 0
            shapes = tuple((i, o, True) for i, o in linears)
        elif mode == "lora":
            tp, fp, qp, buf = adapters, lin + norms, lin, 0
            shapes = tuple((i, o, False) for i, o in linears)
        else:
            tp, fp, qp, buf = adapters, norms, 0, round(lin * STORED_BYTES_PER_WEIGHT)
            shapes = tuple((i, o, False) for i, o in linears)
        if mode != "full":
            shapes += tuple(s for i, o in linears for s in ((i, rank, True), (rank, o, True)))
        blocks.append(
            BlockCensus(
                index=idx,
                name=f"layers.{idx}",
                trainable_bytes=tp * dtype_bytes,
                frozen_bytes=fp * dtype_bytes,
                buffer_bytes=buf,
                trainable_params=tp,
                frozen_params=fp,
                activation_bytes_per_token=(16 * h + 3 * f) * dtype_bytes,
                quantizable_params=qp,
                quantizable_bytes=qp * dtype_bytes,
                input_bytes_per_token=h * dtype_bytes,
                matmul_params=sum(i * o for i, o, _ in shapes),
                matmul_shapes=shapes,
                attention_width=h,
                forward_kernels=40,
            )
        )
    embed = vocab * h
    out_train = embed + h if mode == "full" else 0
    return ModelCensus(
        stack_name="layers",
        block_type="Block",
        blocks=tuple(blocks),
        outside_trainable_bytes=out_train * dtype_bytes,
        outside_frozen_bytes=(embed + h - out_train) * dtype_bytes,
        outside_buffer_bytes=0,
        outside_trainable_params=out_train,
        outside_frozen_params=embed + h - out_train,
        outside_quantizable_params=0,
        outside_quantizable_bytes=0,
        outside_matmul_params=embed,
        outside_activation_bytes_per_token=2 * h * dtype_bytes,
        tied=(),
        outside_matmul_shapes=((h, vocab, mode == "full"),),
        param_dtype_bytes=dtype_bytes,
        activation_source="override",
    )


def _bpw(fmt: str) -> float:
    return {"int8": 1.0 + 4 / 64, "nf4": STORED_BYTES_PER_WEIGHT, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}[fmt]


def check_plan(p: Plan, c: ModelCensus) -> None:
    """What every plan must satisfy: placement rules and VRAM / host accounting that adds up."""
    by_index = {b.index: b for b in p.blocks}
    both = [b.index for b in p.blocks if b.weights == "streamed" and b.optimizer == "gpu"]
    assert not both, f"streamed blocks with a GPU optimizer: {both}\n{p.explain()}"
    assert all(by_index[i].weights == "resident" for i in p.optimizer.gpu_blocks), p.explain()
    assert set(p.optimizer.gpu_blocks) == {b.index for b in p.blocks if b.optimizer == "gpu"}
    for b in p.blocks:
        assert (b.optimizer == "none") == (c.blocks[b.index].trainable_params == 0)
    # VRAM: under the budget, and the parts are the plan's own decisions
    v = p.vram_breakdown
    assert p.tiers["vram"] == sum(v.values()) <= p.vram_budget_bytes
    assert v["resident weights"] == sum(b.weight_bytes for b in p.blocks if b.weights == "resident")
    spp = (8 if p.optimizer.moment_dtype == "fp32" else 4) + (4 if p.optimizer.master_weights else 0)
    gpu_params = sum(c.blocks[i].trainable_params for i in p.optimizer.gpu_blocks)
    gpu_params += c.outside_trainable_params if p.optimizer.outside_on_gpu else 0
    assert v["optimizer state"] == p.optimizer.gpu_state_bytes == gpu_params * spp
    # the host optimizer always keeps an fp32 master (for fp32 weights too: the device holds the weight)
    host_spp = spp + (4 if c.param_dtype_bytes >= 4 and not p.optimizer.master_weights else 0)
    host_params = c.trainable_params - gpu_params
    assert p.optimizer.host_state_bytes == host_params * host_spp
    streamed = [b for b in p.blocks if b.weights == "streamed"]
    assert (v["stream window"] > 0) == bool(streamed)
    if streamed and p.max_inflight_bytes:
        assert p.max_inflight_bytes >= max(b.weight_bytes for b in streamed)  # one whole block fits
    # host: the streamed blocks' every byte (adapters included) is held there
    assert p.tiers["pinned_host"] + p.tiers["pageable_host"] >= sum(b.weight_bytes for b in streamed)
    assert p.tiers["pinned_host"] + p.tiers["pageable_host"] <= p.host_ram_bytes
    assert Plan.from_json(p.to_json()) == p


# shapes x budgets x machines x policies; every example runs the whole planner on a synthetic census
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n_blocks=st.integers(1, 12),
    hidden=st.sampled_from([64, 256, 1024, 4096]),
    ffn_mult=st.integers(2, 4),
    vocab=st.sampled_from([256, 32000]),
    mode=st.sampled_from(["full", "lora", "qlora"]),
    rank=st.sampled_from([4, 16]),
    dtype_bytes=st.sampled_from([2, 4]),
    budget_mib=st.integers(64, 48 * 1024),
    ram_gib=st.integers(4, 256),
    h2d_gbps=st.sampled_from([2.0, 25.0, 55.4]),
    adamw_rate=st.sampled_from([2e8, 4e9]),
    tokens=st.sampled_from([128, 2048, 16384]),
    depth=st.integers(1, 3),
    prefer=st.sampled_from(["memory", "speed"]),
    quantize=st.sampled_from([None, "auto", "nf4"]),
    param_offload=st.sampled_from(["auto", "auto", True, 0.5]),
)
def test_no_plan_streams_a_block_whose_optimizer_is_on_the_gpu(
    n_blocks, hidden, ffn_mult, vocab, mode, rank, dtype_bytes, budget_mib, ram_gib, h2d_gbps,
    adamw_rate, tokens, depth, prefer, quantize, param_offload, overlap_order
):  # fmt: skip
    c = synthetic_census(n_blocks, hidden, ffn_mult, vocab, mode, rank, dtype_bytes)
    prof = HardwareProfile.synthetic(
        vram_budget_bytes=budget_mib * MiB,
        host_ram_bytes=ram_gib * GiB,
        h2d_gbps=h2d_gbps,
        host_adamw_params_per_s=adamw_rate,
    )
    cfg = PlanConfig(
        batch_tokens=tokens,
        prefetch_depth=depth,
        prefer=prefer,
        quantize=quantize if mode == "lora" else None,
        bytes_per_weight=_bpw,
        param_offload=param_offload,
        headroom_bytes=min(256 * MiB, budget_mib * MiB // 8),
    )
    try:
        p = plan(c, prof, cfg)
    except InfeasiblePlan as e:
        assert e.needed_bytes > e.available_bytes and e.suggestions
        return
    check_plan(p, c)
    if param_offload == "auto":  # (a forced share streams the leading blocks, as tidal_stream reads it)
        overlap_order(p)


@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_cheap_adapters_of_streamed_blocks_still_update_on_the_host(mode):
    """The shape that broke the GPU demo: adapters tiny next to a streamed base, AdamW on the host slow.
    Keeping their state on the GPU is cheap, yet a streamed block's adapters update on the host; the
    planner makes a block resident first when its GPU update is worth it."""
    c = synthetic_census(8, 512, 4, 256, mode, 8, 2)
    prof = HardwareProfile.synthetic(host_adamw_params_per_s=2e8)
    streaming = 0
    for budget_mib in range(260, 900, 5):
        cfg = PlanConfig(
            vram_budget=budget_mib * MiB, batch_tokens=4096, headroom_bytes=256 * MiB, bytes_per_weight=_bpw
        )
        try:
            p = plan(c, prof, cfg)
        except InfeasiblePlan:
            continue
        check_plan(p, c)
        streaming += bool(p.streamed_blocks)
    assert streaming >= 3  # the sweep really covers streaming plans


def test_offload_false_keeps_every_trained_block_resident():
    c = synthetic_census(6, 256, 4, 256, "qlora", 8, 2)
    prof = HardwareProfile.synthetic()
    p = plan(c, prof, PlanConfig(vram_budget=GiB, offload=False, batch_tokens=512, headroom_bytes=64 * MiB))
    check_plan(p, c)
    assert p.optimizer.placement == "gpu" and not p.streamed_blocks
    with pytest.raises(PlanConfigError, match=r"param_offload=\[1, 2\].*blocks 1-2 train"):
        plan(c, prof, PlanConfig(vram_budget=GiB, offload=False, param_offload=[1, 2]))


def test_a_plan_that_streams_a_gpu_updated_block_is_refused_on_load():
    c = synthetic_census(2, 64, 2, 256, "lora", 4, 2)
    p = plan(c, HardwareProfile.synthetic(), PlanConfig(vram_budget=GiB, param_offload=[0], batch_tokens=64))
    text = p.to_json().replace('"optimizer": "host"', '"optimizer": "gpu"')
    with pytest.raises(PlanConfigError, match="streamed with their optimizer on the GPU"):
        Plan.from_json(text)


@pytest.mark.parametrize("budget_gib", [3, 6, 12, 24])
def test_transformer_shapes_keep_the_rules(qwen14b_lora_census, llama8b_census, budget_gib, bpw):
    """The meta-device Qwen2.5-14B + LoRA (exact and nf4 base) and Llama-3-8B full fine-tune shapes."""
    prof = HardwareProfile.synthetic(vram_budget_bytes=budget_gib * GiB, host_ram_bytes=256 * GiB)
    for c, cfg in (
        (qwen14b_lora_census, PlanConfig()),
        (qwen14b_lora_census, PlanConfig(quantize="nf4", bytes_per_weight=bpw)),
        (llama8b_census, PlanConfig(loss_chunk_tokens=1024)),
    ):
        try:
            p = plan(c, prof, cfg)
        except InfeasiblePlan as e:
            assert e.needed_bytes > e.available_bytes and e.suggestions
            continue
        check_plan(p, c)
