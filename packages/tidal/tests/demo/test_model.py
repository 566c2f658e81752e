"""The demo's byte-level GPT, its data and its LoRA adapters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.demo.data import ByteBatches, stdlib_bytes
from tidal.demo.lora import LoRA, add_lora_
from tidal.demo.model import SIZES, GPTConfig, TinyGPT


def test_param_count_formula_matches_the_module():
    for name in ("tiny", "small"):
        cfg = SIZES[name]
        assert cfg.n_params() == sum(p.numel() for p in TinyGPT(cfg).parameters()), name


def test_forward_shapes_and_loss_equals_reference():
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    model = TinyGPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert torch.equal(model(x, y), ref)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256  # change only the future of position 9
    assert torch.equal(model(x)[0, :10], model(x2)[0, :10])
    assert not torch.equal(model(x)[0, 10:], model(x2)[0, 10:])


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"n_heads.*does not divide"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match=r"GPTConfig\.n_layers"):
        GPTConfig(n_layers=0)


def test_stdlib_text_and_batches():
    text, n_files = stdlib_bytes(max_bytes=200_000)
    assert len(text) == 200_000 and n_files >= 1
    assert b"def " in text  # it is Python source
    b = ByteBatches(text, seq_len=32, batch_size=3, seed=1)
    x, y = b.next(torch.device("cpu"))
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert int(x.max()) < 256
    again = ByteBatches(text, seq_len=32, batch_size=3, seed=1).next(torch.device("cpu"))[0]
    assert torch.equal(x, again)  # same seed, same data order


def test_lora_starts_as_the_base_and_trains_only_adapters():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    before = model(x)
    n = add_lora_(model.blocks, r=4)
    assert n == 2 * 4  # qkv, proj, fc, out per block
    assert torch.equal(model(x), before)  # B = 0: the update is zero at start
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(("lora_" in t) or not t.startswith("blocks.") for t in trainable)
    assert isinstance(model.blocks[0].qkv, LoRA)
    model(x, torch.randint(0, 256, (2, 16))).backward()
    assert model.blocks[0].qkv.lora_b.grad is not None and model.blocks[0].qkv.lora_b.grad.abs().sum() > 0
    assert model.blocks[0].qkv.base.weight.grad is None
