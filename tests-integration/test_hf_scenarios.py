"""quant -> hf -> stream -> kv: the README's Hugging Face uses, end to end on a tiny saved Qwen2 checkpoint.

- QLoRA-style: ``from_pretrained(quantization_config=TidalQuantizationConfig("nf4"))``, PEFT adapters on the
  ``QuantLinear`` layers, ``wrap_hf`` with the host optimizer: the adapters train, the quantized base and
  every frozen tensor stay bit-identical, and the losses equal an unwrapped run with torch's AdamW.
- Generation with ``TidalCache`` (half the layers' K/V in host pages) gives the tokens of transformers'
  own cache.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _reference import ATTENTION, HostAdamW, reference_attention

import tidal
from tidal_testing import devices

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 (2 layers, hidden 64) with random weights, saved as safetensors."""
    from tidal_hf import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _text_batches(vocab: int, steps: int, device: str) -> list[torch.Tensor]:
    """Token ids from real text (standard-library source bytes folded into the vocabulary)."""
    from tidal.demo.data import ByteBatches, stdlib_bytes

    text, _ = stdlib_bytes(max_bytes=50_000)
    data = ByteBatches(text, seq_len=24, batch_size=2, seed=3)
    return [(data.next(torch.device(device))[0] % vocab) for _ in range(steps)]


def _qlora(path, device: str):
    from tidal_hf import lora_config

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=tidal.TidalQuantizationConfig("nf4"), dtype=torch.float32
    ).to(device)
    assert isinstance(model.model.layers[0].self_attn.q_proj, tidal.QuantLinear)
    return peft.get_peft_model(model, lora_config(r=4, lora_alpha=8, target_modules=TARGETS))


def _train(model, opt, batches) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if hasattr(opt, "synchronize"):
        opt.synchronize()  # the last host update has landed
    return losses


@pytest.mark.parametrize("device", devices())
def test_qlora_readme_flow_trains_adapters_on_a_frozen_nf4_base(checkpoint, device):
    reference = _qlora(checkpoint, device)
    model = copy.deepcopy(reference)
    batches = _text_batches(reference.config.vocab_size, 6, device)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in reference.named_parameters() if p.requires_grad)
    # the kernels tidal runs with offload=True: torch's fused CPU AdamW on host copies, SDPA on ATTENTION
    # (torch's fused CUDA AdamW rounds differently, ~1e-6 apart after 6 steps: see _reference.py)
    with reference_attention():
        ref_losses = _train(reference, HostAdamW(trainable, lr=1e-2), batches)

    frozen_before = {n: t.detach().clone() for n, t in model.named_buffers()}
    model, opt = tidal.wrap_hf(model, None, lr=1e-2, device=device, offload=True, attention=ATTENTION)
    losses = _train(model, opt, batches)

    assert ref_losses[-1] < ref_losses[0]  # the adapters learn
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (ref_losses, losses)
    assert tidal.memory_report(model)["d2h_bytes"] > 0  # the adapters' gradients went to the host
    model = tidal.unwrap(model)
    for n, t in model.named_buffers():
        assert torch.equal(frozen_before[n], t), f"frozen {n} changed"
    ref = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert (ref[n] - p).abs().max() < 1e-6, n


@pytest.mark.parametrize("device", devices())
def test_generate_with_tidal_cache_matches_transformers(checkpoint, device):
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    )
    ids = _text_batches(model.config.vocab_size, 1, device)[0][:1, :12]
    want = model.generate(ids, max_new_tokens=16, do_sample=False)
    cache = tidal.TidalCache(model, max_tokens=64, resident_layers=1, page_tokens=8)
    from tidal_hf import generate_kwargs_for_cache  # cache= on newer 5.x, past_key_values= on 4.57

    got = model.generate(ids, max_new_tokens=16, do_sample=False, **generate_kwargs_for_cache(model, cache))
    assert torch.equal(want, got)
    assert len(cache.paged.offloaded_layers) == 1
    assert cache.paged.stats.pages_flushed > 0  # the offloaded layer's K/V really went to host pages
