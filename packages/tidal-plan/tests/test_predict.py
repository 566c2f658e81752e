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
    small = predict(qwen14b_lora_census, prof, p, cfg, batch_tokens=512)
    assert small.compute_s < p.prediction.compute_s
    # the streamed weights cross the link whatever the batch (no activations offload in this plan)
    assert not any(b.activations == "offload" for b in p.blocks)
    assert small.transfer_s == pytest.approx(p.prediction.transfer_s, rel=0.01)


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
