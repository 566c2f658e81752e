"""load_model: exact state dicts from sharded checkpoints, quantize-while-reading, random shapes, refusals,
and peak host memory on a ~1 GB checkpoint (measured in a subprocess)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tidal_hf import load_model
from tidal_hf.errors import CheckpointError, OptionError
from tidal_quant import QuantLinear, quantize_model_

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny


@pytest.fixture
def saved(arch, tmp_path):
    model = make_tiny(arch, seed=11)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    return model, tmp_path


def test_sharded_state_dict_is_exact(saved):
    model, path = saved
    got = load_model(path, quantize=None, dtype=torch.float32, progress=False, device="cpu")
    want = model.state_dict()
    have = got.state_dict()
    assert want.keys() == have.keys()
    for k in want:
        assert want[k].dtype == have[k].dtype and torch.equal(want[k], have[k]), k
    if model.config.tie_word_embeddings:
        assert got.get_output_embeddings().weight is got.get_input_embeddings().weight


def test_quantize_while_reading_equals_quantize_model(saved):
    model, path = saved
    got = load_model(path, quantize="nf4", dtype=torch.float32, progress=False, device="cpu")
    stack = "transformer.h." if model.config.model_type == "gpt2" else "model.layers."
    ref = quantize_model_(model, "nf4", filter=lambda n, m: n.startswith(stack))
    assert ref.state_dict().keys() == got.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    n_quant = sum(isinstance(m, QuantLinear) for m in got.modules())
    assert n_quant == (0 if model.config.model_type == "gpt2" else 14)  # GPT-2 blocks use Conv1D
    assert type(got.get_output_embeddings()) is torch.nn.Linear


def test_bf16_cast(tmp_path):
    model = make_tiny("llama", seed=2)
    model.save_pretrained(tmp_path)
    got = load_model(tmp_path, quantize=None, dtype=torch.bfloat16, progress=False, device="cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), got.state_dict()[k]), k


def test_random_weights_exact_shapes():
    from tidal_hf import tiny_config

    cfg = tiny_config("qwen2")
    got = load_model(cfg, random_weights=True, quantize="int8", device="cpu", progress=False, seed=3)
    ref = make_tiny("qwen2")
    quantize_model_(ref, "int8", filter=lambda n, m: n.startswith("model.layers."))
    assert {k: tuple(v.shape) for k, v in ref.state_dict().items()} == {
        k: tuple(v.shape) for k, v in got.state_dict().items()
    }
    w = got.model.embed_tokens.weight.float()
    assert 0.01 < w.std().item() < 0.04  # the model's initializer_range (0.02)
    norm = got.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    again = load_model(cfg, random_weights=True, quantize="int8", device="cpu", progress=False, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), again.state_dict().values()))


def test_refusals(tmp_path):
    model = make_tiny("llama")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(tmp_path, progress=False, device="cpu")
    got = load_model(
        tmp_path, quantize=None, dtype=torch.float32, allow_pickle=True, progress=False, device="cpu"
    )
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), got.state_dict().values()))
    with pytest.raises(CheckpointError, match="local"):
        load_model("no-such-org/no-such-model-xyz", progress=False)
    with pytest.raises(OptionError, match="quantize"):
        load_model(tmp_path, quantize="int3", allow_pickle=True, progress=False, device="cpu")
    with pytest.raises(OptionError, match="dtype"):
        load_model(tmp_path, dtype=torch.int8, progress=False)
    with pytest.raises(OptionError, match="random_weights"):
        load_model(model.config, progress=False)


def test_incomplete_checkpoint(tmp_path):
    model = make_tiny("mistral")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path, progress=False, device="cpu")


_RSS_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys, torch
    torch.set_num_threads(2)
    from tidal_hf import load_model
    import transformers, accelerate  # imported before the baseline is taken
    base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # resident now
    m = load_model(sys.argv[1], quantize=None, dtype=torch.bfloat16, progress=False, device="cpu")
    model_bytes = sum(t.nbytes for t in m.state_dict().values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(model_bytes, peak - base)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_peak_rss_of_a_1gb_checkpoint(tmp_path):
    from safetensors.torch import save_file

    from tidal_hf import tiny_config

    cfg = tiny_config(
        "llama",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=36,
        vocab_size=16000,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    g = torch.Generator().manual_seed(0)
    from tidal_hf.loading import _meta_model

    meta = _meta_model(cfg, torch.bfloat16)
    names = list(meta.state_dict().keys())
    shard, n = {}, 0
    for i, name in enumerate(names):  # ~1 GB of bf16 in shards of ~256 MB, written one shard at a time
        t = meta.state_dict()[name]
        shard[name] = torch.randn(t.shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
        if sum(v.nbytes for v in shard.values()) > 2**28 or i == len(names) - 1:
            save_file(shard, str(tmp_path / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            shard, n = {}, n + 1
    cfg.save_pretrained(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    model_bytes, grown = map(int, out.stdout.split()[-2:])
    assert model_bytes > 0.9e9
    print(f"load_model peak RSS growth {grown / model_bytes:.3f}x of {model_bytes / 1e9:.2f} GB")
    assert grown <= 1.3 * model_bytes, grown / model_bytes


@pytest.mark.gpu
def test_cuda_load_equals_cpu_load(tmp_path):
    model = make_tiny("qwen2", seed=6, hidden_size=128, intermediate_size=256)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    for fmt in (None, "nf4", "int8"):
        cpu = load_model(tmp_path, quantize=fmt, dtype=torch.bfloat16, progress=False, device="cpu")
        gpu = load_model(tmp_path, quantize=fmt, dtype=torch.bfloat16, progress=False, device="cuda")
        for k, v in cpu.state_dict().items():
            got = gpu.state_dict()[k]
            assert got.device.type == "cuda" and torch.equal(v, got.cpu()), (fmt, k)
    rnd = load_model(model.config, random_weights=True, quantize="nf4", device="cuda", progress=False)
    assert all(t.device.type == "cuda" for t in rnd.state_dict().values())


def test_quantize_auto_follows_the_plan():
    from tidal_hf import qwen25_config
    from tidal_hf.loading import _choose_format, _decide, _meta_model, _weight_bytes
    from tidal_plan import HardwareProfile

    meta = _meta_model(qwen25_config("14b"), torch.bfloat16)
    cuda = torch.device("cuda")
    big = HardwareProfile.synthetic(vram_budget_bytes="139GiB")
    small = HardwareProfile.synthetic(vram_budget_bytes="24GiB")
    assert _choose_format(meta, "auto", cuda, big) is None  # 28 GB of bf16 fits: stays exact
    assert _decide(meta, "auto", cuda, big).streamed == frozenset()
    # at 24 GiB the bf16 base does not fit: quantized, or exact with the blocks that do not fit on the host
    fit = _decide(meta, "auto", cuda, small)
    layers = meta.model.layers
    resident = _weight_bytes(meta, fit.fmt) - sum(
        _weight_bytes(layers[i], fit.fmt) if fit.fmt is None else _quantized_block_bytes(layers[i], fit.fmt)
        for i in fit.streamed
    )
    assert fit.fmt in ("int8", "nf4") or fit.streamed, fit
    assert resident <= 24 * 2**30, (fit, resident / 2**30)
    assert all(p.requires_grad for p in meta.parameters())  # flags restored
    assert _choose_format(meta, "auto", torch.device("cpu")) is None
    assert _decide(meta, "nf4", torch.device("cpu")) == _decide(meta, "nf4", torch.device("cpu"), small)


def _quantized_block_bytes(block, fmt):
    from tidal_quant import bytes_per_weight

    return sum(
        int(p.numel() * (bytes_per_weight(fmt) if p.dim() == 2 else p.element_size()))
        for p in block.parameters()
    )


def test_host_blocks_are_matched_by_whole_index():
    from tidal_hf import tiny_config
    from tidal_hf.loading import _Filler, _meta_model

    meta = _meta_model(
        tiny_config("qwen2", num_hidden_layers=12, layer_types=["full_attention"] * 12), torch.float32
    )
    f = _Filler(meta, None, torch.float32, torch.device("cpu"), frozenset({1, 3}))
    assert f.on_host("model.layers.1") and f.on_host("model.layers.3.mlp.up_proj")
    assert not f.on_host("model.layers.11.mlp.up_proj")  # "1" is not a prefix of "11"
    assert not f.on_host("model.layers.0.self_attn") and not f.on_host("model.embed_tokens")
    assert not _Filler(meta, None, torch.float32, torch.device("cpu")).on_host("model.layers.1")


def _storage_bytes(tensors, baseline=None):
    """Bytes of each CPU storage among ``tensors`` (by data pointer), those in ``baseline`` left out; fake
    tensors (left alive by an earlier test's tracing) have no storage of their own and are skipped."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen = {}
    for o in tensors:
        if (
            issubclass(type(o), torch.Tensor)
            and not isinstance(o, FakeTensor)
            and not o.is_meta
            and o.device.type == "cpu"
        ):
            st = o.untyped_storage()
            if st.nbytes() and (baseline is None or st.data_ptr() not in baseline):
                seen[st.data_ptr()] = st.nbytes()
    return seen


def test_random_fill_holds_no_replaced_linear(monkeypatch):
    """While filling, live memory is the model so far: no replaced bf16 linear outlives its module."""
    import gc

    from tidal_hf import tiny_config
    from tidal_hf.loading import _Filler

    cfg = tiny_config(
        "qwen2",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        layer_types=["full_attention"] * 4,
    )
    gc.collect()
    base = _storage_bytes(gc.get_objects())
    excess = []
    settle = _Filler.settle

    def measured(self, module_name):
        settle(self, module_name)
        model = self.model
        live = sum(_storage_bytes(gc.get_objects(), base).values())
        excess.append(live - sum(_storage_bytes([*model.parameters(), *model.buffers()]).values()))

    monkeypatch.setattr(_Filler, "settle", measured)
    got = load_model(cfg, random_weights=True, quantize="int8", device="cpu", progress=False)
    assert sum(isinstance(m, QuantLinear) for m in got.modules()) == 4 * 7
    assert len(excess) > 4 * 7 and max(excess) <= 64 * 1024, max(excess)  # a replaced linear is 128 KiB+


def test_vram_budget_is_validated():
    from tidal_hf import tiny_config

    for bad in (0, -5, "lots", True):
        with pytest.raises(OptionError, match="vram_budget"):
            load_model(
                tiny_config("qwen2"), random_weights=True, device="cpu", progress=False, vram_budget=bad
            )
    got = load_model(
        tiny_config("qwen2"), random_weights=True, device="cpu", progress=False, vram_budget="24GiB"
    )
    assert all(t.device.type == "cpu" for t in got.state_dict().values())


def _over_budget_config():
    """A Qwen2 of 8 blocks of 90 MB (bf16) for :data:`_OVER_BUDGET` (see the test that uses both)."""
    from tidal_hf import tiny_config

    return tiny_config(
        "qwen2",
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
        layer_types=["full_attention"] * 8,
    )


# 8 blocks (720 MB), the loss (384 MiB) and the stream window do not all fit, even with every block
# recomputing. At 2 GiB they did: the plan then streamed nothing where it measured a slower link (40 GB/s),
# and the GPU test failed in a suite run whose measured link was slow. At 1.75 GiB they fit under
# transformers 5.24 (its smaller activation census), not under 4.57; 1.5 GiB streams blocks under both.
_OVER_BUDGET = int(1.5 * 2**30)


@pytest.mark.parametrize("link_gbps", [25.0, 40.0, 55.0])
def test_the_over_budget_case_streams_blocks_whatever_the_measured_link(link_gbps):
    """The premise of the GPU test below: at its budget the LoRA plan keeps blocks on the host for any
    link speed a profile may measure (the placement otherwise trades streaming for recomputation)."""
    transformers = pytest.importorskip("transformers")
    from tidal_hf.structure import find_block_stack
    from tidal_plan import HardwareProfile, PlanConfig, census, plan
    from tidal_quant import bytes_per_weight

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_over_budget_config(), dtype=torch.bfloat16)
    stack = find_block_stack(model)
    # LoRA, as load_model plans it: the blocks' 1-D parameters stand in for the adapters
    for t in model.parameters():
        t.requires_grad_(t.dim() == 1 and any(t is q for q in stack.parameters()))
    hw = HardwareProfile.synthetic(
        vram_budget_bytes=_OVER_BUDGET, h2d_gbps=link_gbps, d2h_gbps=link_gbps, host_update_params_per_s=1.1e9
    )
    p = plan(census(model, blocks=stack), hw, PlanConfig(training="lora", bytes_per_weight=bytes_per_weight))
    assert p.streamed_blocks, p


@pytest.mark.gpu
def test_blocks_over_the_budget_are_filled_on_the_device_and_kept_on_the_host():
    cfg = _over_budget_config()
    block = 2 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632)  # bf16 bytes of one block's linears
    budget = _OVER_BUDGET
    from tidal_plan import profile_hardware

    profile_hardware("cuda", vram_budget=budget)  # measured (probe buffers) and cached before the peak counts
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got = load_model(
        cfg, random_weights=True, quantize=None, device="cuda", progress=False, vram_budget=budget
    )
    peak = torch.cuda.max_memory_allocated() - start
    where = {i: {p.device.type for p in b.parameters()} for i, b in enumerate(got.model.layers)}
    host = [i for i, d in where.items() if d == {"cpu"}]
    assert host, where
    # pageable: wrap() pins streamed blocks in its own arena, a pinned copy here would stay cached beside it
    assert not any(p.is_pinned() for i in host for p in got.model.layers[i].parameters())
    assert all(d in ({"cpu"}, {"cuda"}) for d in where.values()), where
    resident = torch.cuda.memory_allocated() - start
    assert resident <= (8 - len(host)) * block + 2 * 2 * 8192 * 2048 + 2**20, (resident, host)
    assert peak <= resident + block, (peak, resident)  # filled one module at a time: at most a block over


def test_hub_id_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    model = make_tiny("llama", seed=8)
    snapshot = tmp_path / "models--tidal-test--tiny" / "snapshots" / ("a" * 40)
    model.save_pretrained(snapshot)
    (tmp_path / "models--tidal-test--tiny" / "refs").mkdir()
    (tmp_path / "models--tidal-test--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    got = load_model("tidal-test/tiny", quantize=None, dtype=torch.float32, progress=False, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), got.state_dict().values()))
    with pytest.raises(CheckpointError, match="no download"):
        load_model("tidal-test/not-cached", progress=False, device="cpu")
