"""LoRA on QuantLinear through PEFT: equals the dequantized reference, trains adapters only, saves/loads."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from tidal_hf import lora_config, lora_config_from
from tidal_hf.errors import UnsupportedModelError
from tidal_quant import QuantLinear, quantize_model_

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _quantized(arch="llama", fmt="nf4"):
    model = make_tiny(arch, seed=9)
    return quantize_model_(model, fmt, filter=lambda n, m: n.startswith("model.layers."))


def _dequantized_copy(qmodel):
    """The same model with every QuantLinear replaced by an nn.Linear holding its dequantized weight."""
    import copy

    ref = copy.deepcopy(qmodel)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantLinear):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data = m.dequantize_weight(torch.float32)
            if m.bias is not None:
                lin.bias.data = m.bias.data.clone()
            parent, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(parent), attr, lin)
    return ref


def _nonzero_adapters(peft_model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_lora_on_quant_equals_dequantized_reference():
    from peft import LoraConfig, get_peft_model

    q = _quantized()
    ref = _dequantized_copy(q)
    pq = get_peft_model(q, lora_config(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    pr = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    _nonzero_adapters(pq)
    _nonzero_adapters(pr)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    out_q = pq(input_ids=ids, labels=ids)
    out_r = pr(input_ids=ids, labels=ids)
    # fp32 reference: the quantized matmul dequantizes to fp32 on the CPU, so only matmul order differs
    torch.testing.assert_close(out_q.logits, out_r.logits, rtol=1e-5, atol=1e-5)
    out_q.loss.backward()
    out_r.loss.backward()
    gq = {n: p.grad for n, p in pq.named_parameters() if p.grad is not None}
    gr = {n: p.grad for n, p in pr.named_parameters() if p.grad is not None}
    assert gq.keys() == gr.keys() and all("lora_" in n for n in gq)
    for n in gq:
        torch.testing.assert_close(gq[n], gr[n], rtol=1e-4, atol=1e-6)


def test_adapters_train_base_frozen_and_round_trip(tmp_path):
    from peft import PeftModel, get_peft_model

    q = _quantized(fmt="int8")
    pm = get_peft_model(q, lora_config(r=4, lora_alpha=8, target_modules=TARGETS, task_type="CAUSAL_LM"))
    base = {k: v.clone() for k, v in pm.state_dict().items() if "lora_" not in k}
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(5):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = pm.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())  # the base did not move
    pm.save_pretrained(tmp_path)
    pm.eval()
    want = pm(input_ids=ids).logits
    fresh = _quantized(fmt="int8")
    loaded = PeftModel.from_pretrained(fresh, tmp_path, config=lora_config_from(str(tmp_path)))
    loaded.eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)
    with pytest.raises(UnsupportedModelError, match="merg"):
        loaded.merge_and_unload()
