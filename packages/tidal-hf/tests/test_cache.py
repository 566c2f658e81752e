"""TidalCache inside model.generate(): the same tokens as DynamicCache, paging edge cases, refusals."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from tidal_hf import OptionError, UnsupportedModelError
from tidal_hf.cache import TidalCache, generate_kwargs_for_cache
from tidal_kv import KVConfigError
from tidal_testing import devices, torch_threads

# tiny shapes; fp32 so CPU greedy decoding is deterministic
_COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _few_threads():
    with torch_threads(1):
        yield


def _model(kind: str, device: str, **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**_COMMON, **overrides})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**{**_COMMON, **overrides})
        model = transformers.Qwen2ForCausalLM(cfg)
    # larger init than the default 0.02 so the logits are far from ties and the tokens vary
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval().to(device)


def _forward_kw(model) -> str:
    """The forward argument for the cache: ``cache`` after transformers 5.x renamed it, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generate(model, ids, cache, mask=None, new=64, **kw):
    kw.update(generate_kwargs_for_cache(model, cache))  # cache= (newer 5.x) or past_key_values= (4.57)
    gen = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0, **kw}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **gen)


def _prompt(batch, length, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 96, (batch, length), generator=g).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_same_tokens_as_dynamic_cache(kind, device):
    model = _model(kind, device)
    ids = _prompt(1, 21, device)
    ref = _generate(model, ids, transformers.DynamicCache())
    # pages of 16 tokens: the prompt spans a page boundary and decoding crosses four more
    # half the layers offloaded: three offloaded layers share two device slots, so pages really travel
    cache = TidalCache(model, 128, resident_layers=3, page_tokens=16)
    out = _generate(model, ids, cache)
    assert torch.equal(out, ref)
    assert len(set(ref[0, 21:].tolist())) > 4  # a real sequence, not one token repeated
    assert cache.paged.offloaded_layers == [1, 3, 5]
    assert cache.stats.pages_flushed == 3 * ((21 + 63) // 16)
    assert cache.stats.prefetched > 0 and cache.stats.pages_gathered > 0
    assert cache.stats.gathered_on_demand == 0
    assert cache.stats.inspections == 0  # generate() never took the slow copy path
    assert cache.get_seq_length() == 21 + 63


def test_sampling_same_tokens_as_dynamic_cache():
    model = _model("llama", "cpu")
    ids = _prompt(2, 9, "cpu")
    torch.manual_seed(3)
    ref = _generate(model, ids, transformers.DynamicCache(), new=24, do_sample=True, top_k=20)
    torch.manual_seed(3)
    out = _generate(
        model, ids, TidalCache(model, 64, resident_layers=3, page_tokens=8), new=24, do_sample=True, top_k=20
    )
    assert torch.equal(out, ref)


def test_batch_with_left_padding_and_growth_past_max_tokens():
    model = _model("qwen2", "cpu")
    ids = _prompt(3, 12, "cpu", seed=5)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding of different lengths
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = _generate(model, ids, transformers.DynamicCache(), mask=mask, new=40)
    cache = TidalCache(model, 20, resident_layers=[1, 2, 4], page_tokens=8)  # 12 + 40 tokens > 20: grows
    out = _generate(model, ids, cache, mask=mask, new=40)
    assert torch.equal(out, ref)
    assert cache.stats.reallocations >= 1
    assert cache.paged.offloaded_layers == [0, 3, 5]


def test_reset_and_reuse_for_a_second_generate():
    model = _model("llama", "cpu")
    a, b = _prompt(1, 10, "cpu", seed=7), _prompt(1, 17, "cpu", seed=8)
    cache = TidalCache(model, 96, resident_layers=1, page_tokens=8)
    _generate(model, a, cache, new=16)
    cache.reset()
    assert cache.get_seq_length() == 0
    out = _generate(model, b, cache, new=32)
    assert torch.equal(out, _generate(model, b, transformers.DynamicCache(), new=32))


@pytest.mark.parametrize("storage", ["fp8", "nf4"])
def test_quantized_storage_generates(storage):
    # head_dim 32: whole NF4 blocks per row
    model = _model("llama", "cpu", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    ids = _prompt(1, 20, "cpu")
    cache = TidalCache(model, 64, resident_layers=3, page_tokens=8, storage=storage)
    out = _generate(model, ids, cache, new=16)
    assert out.shape == (1, 36)
    assert cache.stats.d2h_bytes > 0 and cache.stats.pages_gathered > 0


def test_nf4_storage_is_refused_for_a_head_dim_it_cannot_store():
    model = _model("llama", "cpu")  # head_dim 8: NF4 pages need multiples of 32
    with pytest.raises(KVConfigError, match='storage="nf4" is not accepted with head_dim=8'):
        TidalCache(model, 64, resident_layers=3, storage="nf4")


def test_legacy_indexing_returns_the_cached_tensors():
    model = _model("llama", "cpu")
    ids = _prompt(1, 11, "cpu")
    cache = TidalCache(model, 32, resident_layers=2, page_tokens=4)
    ref = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, **{_forward_kw(model): cache})
        model(ids, **{_forward_kw(model): ref})
    for i in range(6):
        assert torch.equal(cache.layers[i].keys, ref.layers[i].keys)
        assert torch.equal(cache.layers[i].values, ref.layers[i].values)


def test_generate_kwargs_for_cache_hand_the_cache_to_generate():
    peft = pytest.importorskip("peft")
    model = _model("qwen2", "cpu")
    ids = _prompt(1, 9, "cpu")
    wrapped = peft.get_peft_model(_model("qwen2", "cpu"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for m in (model, wrapped):
        cache = TidalCache(model, 32, resident_layers=3, page_tokens=4)
        kwargs = generate_kwargs_for_cache(m, cache)
        assert list(kwargs) in (["cache"], ["past_key_values"]) and kwargs[next(iter(kwargs))] is cache
        # warnings are errors: the deprecated name would fail here, and a name generate() does not know raises
        with torch.no_grad():
            out = m.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)
        assert out.shape == (1, 15)
        assert cache.get_seq_length() == 14  # the cache really served the decode (prompt + 5 fed back)
    with pytest.raises(OptionError, match="cache='dict' is invalid; accepted: a transformers Cache"):
        generate_kwargs_for_cache(model, {})
    with pytest.raises(OptionError, match="model='Linear' is invalid"):
        generate_kwargs_for_cache(torch.nn.Linear(2, 2), transformers.DynamicCache())


def test_refuses_beam_search():
    model = _model("llama", "cpu")
    with pytest.raises(UnsupportedModelError, match="beam search"):
        _generate(model, _prompt(1, 5, "cpu"), TidalCache(model, 32, resident_layers=2), new=4, num_beams=2)


def test_refuses_sliding_window_and_hybrid_models():
    cfg = transformers.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        TidalCache(cfg, 64)
    mistral = transformers.MistralConfig(**_COMMON, sliding_window=32)
    with pytest.raises(UnsupportedModelError, match="full-attention layers only"):
        TidalCache(mistral, 64)


def test_forward_with_grad_is_refused_clearly():
    """A forward in grad mode (the model's weights require grad) is refused with the fix, not an autograd
    error from inside the cache; the same forward under no_grad fills it."""
    model = _model("llama", "cpu")
    cache = TidalCache(model, 32, resident_layers=3, page_tokens=4)
    kw = {_forward_kw(model): cache}
    with pytest.raises(KVConfigError, match=r"require grad.*torch\.no_grad\(\)"):
        model(input_ids=_prompt(1, 5, "cpu"), use_cache=True, **kw)
    cache.reset()
    with torch.no_grad():
        model(input_ids=_prompt(1, 5, "cpu"), use_cache=True, **kw)
    assert cache.get_seq_length() == 5


def test_bad_arguments():
    cfg = transformers.LlamaConfig(**_COMMON)
    with pytest.raises(OptionError, match="model_or_config=str"):
        TidalCache("llama", 64)
    with pytest.raises(KVConfigError, match="max_tokens=0"):
        TidalCache(cfg, 0)
    with pytest.raises(KVConfigError, match="resident_layers=\\[9\\]"):
        TidalCache(cfg, 64, resident_layers=[9])
    with pytest.raises(KVConfigError, match="storage='int8'"):
        TidalCache(cfg, 64, storage="int8")


def test_import_tidal_hf_stays_cheap():
    import subprocess
    import sys

    code = "import sys, tidal_hf; assert 'transformers' not in sys.modules; tidal_hf.TidalCache; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
