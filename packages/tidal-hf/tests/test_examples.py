"""The examples run: DPO on a tiny config (CPU and CUDA), LoRA on a small Qwen2.5 shape (CUDA)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tidal_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dpo_example_learns_the_preference(device):
    out = _load("dpo_lora").main(["--device", device, "--steps", "24", "--pairs", "4"])
    assert out["last_loss"] < out["first_loss"]
    assert out["last_margin"] > 0 and out["last_reward_accuracy"] == 1.0


@pytest.mark.gpu
def test_lora_large_model_example_small_shape(tmp_path):
    out = _load("lora_large_model").main(
        [
            "--size",
            "0.5b",
            "--layers",
            "2",
            "--quantize",
            "nf4",
            "--steps",
            "4",
            "--seq-len",
            "64",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert out["median_step_s"] > 0 and out["last_loss"] is not None
