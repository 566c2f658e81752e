"""from_pretrained(quantization_config=TidalQuantizationConfig(...)) with the installed transformers."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from tidal_hf import TidalQuantizationConfig
from tidal_hf.errors import OptionError
from tidal_quant import QuantLinear, quantize_model_

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_from_pretrained_gives_quant_linear(tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    model = make_tiny("qwen2", seed=4)
    model.save_pretrained(tmp_path)
    got = (
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=TidalQuantizationConfig(fmt), dtype=torch.float32
        )
        if _new_api()
        else AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=TidalQuantizationConfig(fmt), torch_dtype=torch.float32
        )
    )
    quant = [n for n, m in got.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 14 and all(n.startswith("model.layers.") for n in quant)
    assert got.is_quantized and got.hf_quantizer.is_trainable
    ref = quantize_model_(model, fmt, filter=lambda n, m: n.startswith("model.layers."))
    for k, v in ref.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_modules_to_not_convert(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny("llama").save_pretrained(tmp_path)
    got = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=TidalQuantizationConfig("int8", modules_to_not_convert=["mlp"])
    )
    assert isinstance(got.model.layers[0].self_attn.q_proj, QuantLinear)
    assert type(got.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_bad_config():
    with pytest.raises(OptionError, match="fmt"):
        TidalQuantizationConfig("int4")
    with pytest.raises(OptionError, match="modules_to_not_convert"):
        TidalQuantizationConfig("nf4", modules_to_not_convert="mlp")
    with pytest.raises(OptionError, match="fp8_compute"):
        TidalQuantizationConfig("fp8", fp8_compute=True)
    with pytest.raises(OptionError, match="fp8_compute"):
        TidalQuantizationConfig("nf4", fp8_compute="yes")
    with pytest.raises(OptionError, match="fp8_backward"):
        TidalQuantizationConfig("nf4", fp8_backward=True)


@pytest.mark.parametrize("fmt,flag", [("nf4", "fp8_compute"), ("fp8", "fp8_backward")])
def test_fp8_options_reach_every_layer(tmp_path, fmt, flag):
    from transformers import AutoModelForCausalLM

    make_tiny("llama").save_pretrained(tmp_path)
    cfg = TidalQuantizationConfig(fmt, **{flag: True})
    assert cfg.quantize_kwargs() == {flag: True}
    got = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=cfg)
    quant = [m for m in got.modules() if isinstance(m, QuantLinear)]
    assert quant and all(getattr(m, flag) for m in quant)


def _new_api() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5
