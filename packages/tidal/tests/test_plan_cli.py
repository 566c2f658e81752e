"""``tidal plan``: plans for config folders and presets on the meta device, refusals with numbers, bad input."""

from __future__ import annotations

import json

import pytest

from tidal.cli import main
from tidal.errors import CLIError
from tidal.plan_cli import PRESETS, PlanRequest, build_meta_model, load_config

TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return tmp_path


def test_plan_for_a_config_folder(config_dir, capsys):
    assert main(["plan", str(config_dir), "--vram-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "4 x Qwen2DecoderLayer" in out and "full fine-tune" in out
    assert "blocks" in out and "step:" in out  # Plan.explain()'s table and prediction


def test_plan_json_for_a_config_file_with_lora(config_dir, capsys):
    assert main(["plan", str(config_dir / "config.json"), "--vram-budget", "1GiB", "--lora", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] is True
    cen = data["census"]
    # LoRA r=16 on q,k,v,o,gate,up,down of 4 layers: (in+out)*16 per projection
    h, i, kv = 64, 128, 2 * (64 // 4)
    per_layer = 16 * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    assert sum(b["trainable_params"] for b in cen["blocks"]) == 4 * per_layer
    assert cen["outside_trainable_params"] == 0  # the base is frozen


def test_lora_adapter_shapes_match_peft():
    _, cfg = load_config("1.5b")
    model = build_meta_model(cfg, lora=True, lora_rank=8)
    q = model.model.layers[0].self_attn.q_proj
    assert q.lora_A.shape == (8, q.in_features) and q.lora_B.shape == (q.out_features, 8)
    assert q.lora_A.requires_grad and not q.weight.requires_grad
    assert q.weight.is_meta


def test_preset_shapes_are_exact():
    _, cfg = load_config("14b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (5120, 13824, 48)
    assert set(PRESETS) == {"1.5b", "7b", "8b", "14b", "32b", "72b", "110b"}


def test_preset_8b_full_fine_tune_is_refused_with_numbers(capsys):
    rc = main(["plan", "8b", "--vram-budget", "24GiB", "--host-ram", "32GB"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "no plan fits" in out and "GiB" in out and "host" in out


def test_bad_input_names_the_option(config_dir, capsys):
    assert main(["plan", "does-not-exist", "--vram-budget", "24GiB"]) == 2
    assert "CONFIG: 'does-not-exist' is neither a preset" in capsys.readouterr().err
    assert main(["plan", str(config_dir), "--vram-budget", "lots"]) == 2
    assert "--vram-budget" in capsys.readouterr().err
    with pytest.raises(CLIError, match=r"--quantize nf4: .* add --lora"):
        PlanRequest(config="7b", vram_budget="24GiB", quantize="nf4")
    with pytest.raises(CLIError, match="--quantize: got 'int3'"):
        PlanRequest(config="7b", vram_budget="24GiB", lora=True, quantize="int3")


def test_config_without_model_type_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CLIError, match="model_type"):
        load_config(str(tmp_path))


def test_missing_transformers_names_the_extra(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    assert main(["plan", "7b", "--vram-budget", "24GiB"]) == 2
    assert 'pip install "tidal[hf]"' in capsys.readouterr().err


def test_budget_beyond_the_synthetic_card_plans_for_a_card_that_has_it(config_dir, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("with a GPU the plan uses its measured profile")
    assert main(["plan", str(config_dir), "--vram-budget", "200GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["device_total_bytes"] == 200 * 2**30
    assert data["plan"]["vram_budget_bytes"] == 200 * 2**30
