"""predict(): the cost model's step for an edited placement and another batch size."""

import dataclasses

import pytest

from tidal_plan import HardwareProfile, PlanConfig, PlanConfigError, plan, predict

CFG = dict(vram_budget="24GiB", batch_tokens=4096)


def _edit(p, **per_block):
    """``p`` with every block's fields replaced (``per_block``: field -> value)."""
    return dataclasses.replace(p, blocks=tuple(dataclasses.replace(b, **per_block) for b in p.blocks))


def test_predict_of_an_unchanged_plan_is_its_own_prediction(qwen14b_lora_census):
    prof = HardwareProfile.synthetic()
    cfg = PlanConfig(**CFG)
    p = plan(qwen14b_lora_census, prof, cfg)
    assert predict(qwen14b_lora_census, prof, p, cfg) == p.prediction


def test_fewer_tokens_predict_less_compute_and_the_same_transfers(qwen14b_lora_census):
    prof = HardwareProfile.synthetic()
    cfg = PlanConfig(**CFG)
    p = plan(qwen14b_lora_census, prof, cfg)
    assert p.streamed_blocks  # 14B in bf16 does not fit 24 GiB: some blocks stream
    # the streamed weights cross the link whatever the batch (activations recomputed: none offloaded)
    p = _edit(p, activations="recompute")
    large = predict(qwen14b_lora_census, prof, p, cfg)
    small = predict(qwen14b_lora_census, prof, p, cfg, batch_tokens=512)
    assert small.compute_s < large.compute_s
    assert small.transfer_s == pytest.approx(large.transfer_s, rel=0.01)


def test_keeping_recomputed_activations_drops_the_recompute(qwen14b_lora_census):
    prof = HardwareProfile.synthetic()
    cfg = PlanConfig(**CFG)
    p = plan(qwen14b_lora_census, prof, cfg)
    recompute = _edit(p, activations="recompute")
    keep = _edit(p, activations="keep")
    a = predict(qwen14b_lora_census, prof, recompute, cfg, batch_tokens=512)
    b = predict(qwen14b_lora_census, prof, keep, cfg, batch_tokens=512)
    assert b.compute_s < a.compute_s
    # and unstreaming every block removes the weights' traffic
    resident = _edit(p, weights="resident")
    assert predict(qwen14b_lora_census, prof, resident, cfg, batch_tokens=512).transfer_s < a.transfer_s


def test_predict_refuses_another_census_and_bad_tokens(qwen14b_lora_census, qwen1_5b_census):
    prof = HardwareProfile.synthetic()
    p = plan(qwen14b_lora_census, prof, PlanConfig(**CFG))
    with pytest.raises(PlanConfigError, match="placement"):
        predict(qwen1_5b_census, prof, p)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(PlanConfigError, match="batch_tokens"):
            predict(qwen14b_lora_census, prof, p, batch_tokens=bad)


def _graph_parts(census, prof, placement, graphs):
    cfg = PlanConfig(**CFG, cuda_graphs=graphs)
    return predict(census, prof, placement, cfg, batch_tokens=512).parts


def test_cuda_graphs_take_the_host_dispatch_of_resident_blocks_away(qwen14b_lora_census):
    """Resident blocks that keep their activations and update on the GPU replay graphs: no host dispatch,
    shorter kernel gaps; a streamed block or an offloading one keeps both."""
    from tidal_plan.cost import GRAPH_KERNEL_GAP_S, KERNEL_OVERHEAD_S

    prof = HardwareProfile.synthetic()
    p = plan(qwen14b_lora_census, prof, PlanConfig(**CFG))
    resident = _edit(p, weights="resident", activations="keep", optimizer="gpu")
    eager = _graph_parts(qwen14b_lora_census, prof, resident, False)
    graphed = _graph_parts(qwen14b_lora_census, prof, resident, True)
    assert eager["dispatch"] > 0 and graphed["dispatch"] == 0
    assert graphed["launch"] == pytest.approx(eager["launch"] * GRAPH_KERNEL_GAP_S / KERNEL_OVERHEAD_S)
    assert graphed["matmul"] < eager["matmul"]  # the GEMMs launch from the graph too
    for edit in (dict(weights="streamed", optimizer="host"), dict(activations="offload")):
        not_graphed = _edit(resident, **edit)
        assert _graph_parts(qwen14b_lora_census, prof, not_graphed, True)["dispatch"] > 0, edit
    # on a CPU stand-in there is nothing to graph
    cpu = HardwareProfile.synthetic(device_kind="cpu")
    assert _graph_parts(qwen14b_lora_census, cpu, resident, True) == _graph_parts(
        qwen14b_lora_census, cpu, resident, False
    )


def test_fp8_on_tensor_cores_dequantizes_for_the_input_gradient(qwen14b_lora_census):
    """FP8 weights multiply on FP8 tensor cores as they are, but the input gradient dequantizes them once
    per backward: the dequant part is the frozen weights' fp8 bytes read plus their bf16 bytes written."""
    prof = HardwareProfile.synthetic(has_fp8_tensor_cores=True)
    cfg = PlanConfig(**CFG, quantize="fp8", bytes_per_weight=lambda fmt: 1.0)  # fp8 codes; scales aside
    p = plan(qwen14b_lora_census, prof, cfg)
    parts = predict(qwen14b_lora_census, prof, p, cfg, batch_tokens=512).parts
    frozen = sum(b.quantizable_params for b in qwen14b_lora_census.blocks)
    expected = frozen * (1.0 + 2) / (prof.hbm_gbps * 1e9)
    assert parts["dequant"] == pytest.approx(expected, rel=1e-9)


def test_cuda_graphs_option_is_checked():
    with pytest.raises(PlanConfigError, match="cuda_graphs"):
        PlanConfig(cuda_graphs="yes")
