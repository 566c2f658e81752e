"""Chunked causal-LM loss and log-probs against transformers' own loss (full logits)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tidal_hf import causal_lm_logprobs, causal_lm_loss
from tidal_hf.errors import OptionError, UnsupportedModelError

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny

# fp32 model: the chunked sums differ from one full-logits reduction only in summation order
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5


def _batch(vocab: int, b: int = 3, t: int = 17, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that does not count
    labels[2, -3:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, -3:] = 0
    return ids, labels, mask


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("num_items", [None, 37])
def test_chunked_loss_equals_transformers(arch, num_items):
    model = make_tiny(arch)
    ids, labels, mask = _batch(model.config.vocab_size)
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
    ref.backward()
    g_ref = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, ids, labels, attention_mask=mask, chunk_size=7, **kw)
    loss.backward()
    g = _grads(model)
    assert abs(loss.item() - ref.item()) <= LOSS_TOL * max(1.0, abs(ref.item()))
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        scale = g_ref[n].abs().max().clamp_min(1e-3)
        assert (g[n] - g_ref[n]).abs().max() <= GRAD_TOL * scale, n


def test_logprobs_equal_full_logits(arch):
    model = make_tiny(arch, seed=3)
    ids, labels, mask = _batch(model.config.vocab_size, seed=4)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, T, V]
    lp = F.log_softmax(logits[:, :-1], -1)
    tgt = labels[:, 1:]
    valid = tgt != -100
    tok = lp.gather(-1, tgt.clamp_min(0)[..., None]).squeeze(-1) * valid
    want_sum = tok.sum(-1)
    got_sum = causal_lm_logprobs(model, ids, labels, chunk_size=5, attention_mask=mask)
    got_avg = causal_lm_logprobs(model, ids, labels, chunk_size=5, average=True, attention_mask=mask)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_avg, want_sum / valid.sum(-1), rtol=1e-5, atol=1e-5)
    assert got_sum.requires_grad


def test_bad_inputs():
    model = make_tiny("llama")
    ids, labels, _ = _batch(model.config.vocab_size)
    with pytest.raises(OptionError, match="labels"):
        causal_lm_loss(model, ids, labels[:, 1:])
    with pytest.raises(OptionError, match="chunk_size"):
        causal_lm_logprobs(model, ids, labels, chunk_size=0)
    with pytest.raises(OptionError, match="average"):
        causal_lm_logprobs(model, ids, labels, average="yes")


def test_refuses_wrapped_head():
    model = make_tiny("llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    ids, labels, _ = _batch(model.config.vocab_size)
    with pytest.raises(UnsupportedModelError, match=r"nn\.Linear"):
        causal_lm_loss(model, ids, labels)
