"""One-model DPO: chunked log-probs + adapters-off reference against a full-logits reference."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tidal_hf import causal_lm_logprobs, dpo_loss, lora_config, reference_logprobs
from tidal_hf.errors import OptionError

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny


def _pairs(vocab, seed=0, b=3, prompt=5, t=14):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):  # chosen, rejected: the same prompts, different answers
        ids = torch.randint(0, vocab, (b, t), generator=g)
        out.append(ids)
    out[1][:, :prompt] = out[0][:, :prompt]
    batches = []
    for ids in out:
        labels = ids.clone()
        labels[:, :prompt] = -100
        labels[1, -2:] = -100  # padding of a shorter answer
        mask = (labels != -100) | (torch.arange(t) < prompt)
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask.long()})
    return batches


def _full_logprobs(logits, labels):
    lp = F.log_softmax(logits.float()[:, :-1], -1)
    tgt = labels[:, 1:]
    return (lp.gather(-1, tgt.clamp_min(0)[..., None]).squeeze(-1) * (tgt != -100)).sum(-1)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_equals_full_logits_reference(arch, smoothing):
    from peft import get_peft_model

    targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"]
    cfg = lora_config(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=arch == "gpt2")
    model = get_peft_model(make_tiny(arch, seed=2), cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    chosen, rejected = _pairs(model.config.vocab_size)
    ref = reference_logprobs(model, [chosen, rejected], chunk_size=6)
    assert ref.dtype == torch.float32 and ref.device.type == "cpu" and not ref.requires_grad
    assert model.training  # restored
    pc = causal_lm_logprobs(
        model, chosen["input_ids"], chosen["labels"], 6, attention_mask=chosen["attention_mask"]
    )
    pr = causal_lm_logprobs(
        model, rejected["input_ids"], rejected["labels"], 6, attention_mask=rejected["attention_mask"]
    )
    loss, rc, _rr = dpo_loss(pc, pr, ref[:3], ref[3:], beta=0.3, label_smoothing=smoothing)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    # the full-logits reference
    with torch.no_grad(), model.disable_adapter():
        model.eval()
        r_c = _full_logprobs(
            model(input_ids=chosen["input_ids"], attention_mask=chosen["attention_mask"]).logits,
            chosen["labels"],
        )
        r_r = _full_logprobs(
            model(input_ids=rejected["input_ids"], attention_mask=rejected["attention_mask"]).logits,
            rejected["labels"],
        )
        model.train()
    p_c = _full_logprobs(
        model(input_ids=chosen["input_ids"], attention_mask=chosen["attention_mask"]).logits, chosen["labels"]
    )
    p_r = _full_logprobs(
        model(input_ids=rejected["input_ids"], attention_mask=rejected["attention_mask"]).logits,
        rejected["labels"],
    )
    z = 0.3 * ((p_c - p_r) - (r_c - r_r))
    want = (-F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing).mean()
    want.backward()
    torch.testing.assert_close(ref, torch.cat([r_c, r_r]), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rc, 0.3 * (p_c - r_c).detach(), rtol=1e-5, atol=1e-5)
    assert grads and all("lora_" in n for n in grads)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_reference_without_adapters_is_current_model():
    model = make_tiny("llama")
    chosen, _ = _pairs(model.config.vocab_size)
    ref = reference_logprobs(model, [chosen])
    with torch.no_grad():
        want = _full_logprobs(
            model(input_ids=chosen["input_ids"], attention_mask=chosen["attention_mask"]).logits,
            chosen["labels"],
        )
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-4)


def test_reference_bad_batches():
    model = make_tiny("llama")
    with pytest.raises(OptionError, match="batches"):
        reference_logprobs(model, [])
    with pytest.raises(OptionError, match=r"batches\[0\]"):
        reference_logprobs(model, [{"input_ids": torch.zeros(1, 3, dtype=torch.long)}])
