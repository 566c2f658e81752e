import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tidal_stream.errors import OptionError
from tidal_stream.options import WrapOptions
from tidal_stream.streamed_blocks import StreamingError
from tidal_stream.streams import device_streams
from tidal_stream.weights import (
    find_blocks,
    install,
    install_weight_streaming,
    rebalance,
    select_blocks,
)
from tidal_testing import assert_bitwise_equal, devices

torch.set_num_threads(1)


class Layer(nn.Module):
    """A small residual MLP layer with a frozen base projection and a trainable low-rank adapter."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(d, 2, bias=False)
        self.lora_b = nn.Linear(2, d, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # non-zero so gradients reach lora_a
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        h = self.norm(x)
        return x + torch.tanh(self.base(h) + self.lora_b(self.lora_a(h)))


class Net(nn.Module):
    def __init__(self, d: int = 24, n: int = 5) -> None:
        super().__init__()
        self.stack = nn.ModuleList(Layer(d) for _ in range(n))
        self.small = nn.ModuleList([nn.Linear(d, d), nn.ReLU()])  # not a same-type stack
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.stack:
            x = layer(x)
        return self.out(self.small[0](x)).square().mean()


def make(seed=0):
    torch.manual_seed(seed)
    ref = Net()
    return ref, copy.deepcopy(ref)


def step_pair(ref, model, gathered, opt_r, opt_m, step):
    x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(step))
    lr_, lm = ref(x), model(x)
    lr_.backward()
    lm.backward()
    assert_bitwise_equal(lr_.detach().reshape(1), lm.detach().reshape(1), f"loss {step}")
    for (name, pr), pm in zip(ref.named_parameters(), model.parameters()):
        if pr.grad is None:
            assert pm.grad is None
        else:
            assert_bitwise_equal(pr.grad, pm.grad, f"grad {name} step {step}")
    opt_r.step()
    opt_r.zero_grad()
    with gathered():
        opt_m.step()
    opt_m.zero_grad()


@pytest.mark.parametrize("indices", [[0, 2, 4], [1], [-1, 0]])
def test_subset_streaming_bit_exact(indices):
    ref, model = make()
    h = install_weight_streaming(model, model.stack, indices, "cpu", prefetch_depth=1)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt_m = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(5):
        step_pair(ref, model, h.sb.gathered, opt_r, opt_m, step)
    expect = sorted(i % 5 for i in indices)
    assert h.streamed == expect
    for i in range(5):
        released = model.stack[i].base.weight.untyped_storage().nbytes() == 0
        assert released == (i in expect)
    assert h.host_tensor(model.stack[expect[0]].base.weight) is not None
    assert h.host_tensor(model.out.weight) is None
    assert h.stats()["streamed"] == expect
    h.remove()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_adaptive_moves_blocks_between_vram_and_host_exactly():
    ref, model = make()
    h = install_weight_streaming(model, model.stack, [1, 3], "cpu", adaptive=True)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt_m = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step_pair(ref, model, h.sb.gathered, opt_r, opt_m, 0)
    assert model.stack[0].base.weight.untyped_storage().nbytes() > 0
    h.set_streamed([0, 1])  # block 3 comes back to VRAM, block 0 leaves (its updated weights kept)
    assert model.stack[0].base.weight.untyped_storage().nbytes() == 0
    assert model.stack[3].base.weight.untyped_storage().nbytes() > 0
    for step in range(1, 5):
        step_pair(ref, model, h.sb.gathered, opt_r, opt_m, step)
    assert h.streamed == [0, 1]
    assert h.stats()["kept_resident"] == (2, 3, 4)
    plain = install_weight_streaming(None, make()[1].stack, [0], "cpu")
    with pytest.raises(StreamingError, match="adaptive=False"):
        plain.set_streamed([1])


def test_stream_trainable_false_leaves_adapters_resident():
    ref, model = make()
    h = install_weight_streaming(model, model.stack, [0, 1, 2, 3, 4], "cpu", stream_trainable=False)
    assert model.stack[2].base.weight.untyped_storage().nbytes() == 0
    assert model.stack[2].lora_a.weight.untyped_storage().nbytes() > 0
    # the adapters are not streamed: a plain optimizer step needs no gathering
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt_m = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        step_pair(ref, model, _nothing, opt_r, opt_m, step)
    assert h.host_tensor(model.stack[2].lora_a.weight) is None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_rebalance_rule():
    sizes = [10, 10, 10, 10]
    # over budget by 15 (limit 90): stream the two earliest resident blocks
    assert rebalance(sizes, [3], peak_bytes=105, budget_bytes=100) == [0, 1, 3]
    # 25 bytes of room: bring back the latest two streamed blocks
    assert rebalance(sizes, [0, 1, 2, 3], peak_bytes=65, budget_bytes=100) == [0, 1]
    assert rebalance(sizes, [1], peak_bytes=90, budget_bytes=100) == [1]
    with pytest.raises(OptionError, match="headroom"):
        rebalance(sizes, [], 1, 1, headroom=1.5)


def test_find_and_select_blocks():
    _, model = make()
    assert find_blocks(model) == list(model.stack)
    with pytest.raises(StreamingError, match="blocks="):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
    assert select_blocks("param_offload", True, 4) == [0, 1, 2, 3]
    assert select_blocks("param_offload", 0.5, 4) == [0, 1]
    assert select_blocks("recompute", [3, -4], 4) == [0, 3]
    with pytest.raises(OptionError, match="param_offload"):
        select_blocks("param_offload", [4], 4)
    with pytest.raises(OptionError, match="distinct"):
        select_blocks("recompute", [1, 1], 4)
    with pytest.raises(OptionError, match="param_offload"):
        select_blocks("param_offload", 1.5, 4)


def fake_session(device="cpu", **opts):
    log = []
    return SimpleNamespace(
        device=torch.device(device),
        streams=device_streams(device),
        options=WrapOptions(**opts),
        record=lambda kind, msg, **data: log.append((kind, msg, data)),
        log=log,
    )


def test_install_from_wrap_options():
    ref, model = make()
    s = fake_session(param_offload=True, recompute=[0], activation_offload=0.4, prefetch_depth=2)
    ext = install(s, model, s.options)
    assert ext is not None
    assert ext.weights.streamed == [0, 1, 2, 3, 4]
    assert ext.activations.policies == ["recompute", "offload", "keep", "keep", "keep"]
    assert not ext.weights.sb.stream_trainable  # adapters stay resident
    assert [k for k, _, _ in s.log] == ["weights", "activations"]
    x = torch.randn(2, 5, 24)
    lr_, lm = ref(x), model(x)
    lr_.backward()
    lm.backward()
    assert_bitwise_equal(lr_.detach().reshape(1), lm.detach().reshape(1), "loss")
    rep = ext.report()
    # the forward fills all 5 blocks; its last 3 (prefetch 2 + 1) stay for the backward, which refills 2
    assert rep["weight_streaming"]["fetches"] == 7 and rep["activations"]["recomputed_forwards"] == 1
    assert rep["weight_streaming"]["turn_holds"] == 3 + 3  # and its last 3 stay for the next forward
    rec = ext.timeline_recorder()
    model(x).backward()
    assert len(rec.spans()) == 10 and rec.events[-1].h2d_bytes > 0
    rec.remove()
    seen = []
    ext.set_before_fetch(lambda i, ts: seen.append((i, len(ts))))
    with torch.no_grad():
        model(x)
    # 0-2 were held from the backward: no refill, no wait; the last two prefetch the next forward's 0, 1
    assert [i for i, _ in seen] == [3, 4, 0, 1]
    ext.remove()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_a_base_held_in_buffers_streams_without_its_adapters():
    """A quantized base is held in buffers (as tidal_quant's QuantLinear holds it): the adapters are still
    a small share of each block's bytes, so they stay resident while the base streams, and the base's
    first blocks wait on the device for the next forward."""
    ref, model = make()
    for net in (ref, model):
        for layer in net.stack:
            w = layer.base.weight.detach()
            del layer.base.weight
            layer.base.register_buffer("weight", w)
    s = fake_session(param_offload=True)
    ext = install(s, model, s.options)
    assert not ext.weights.sb.stream_trainable
    assert model.stack[0].lora_a.weight.untyped_storage().nbytes() > 0  # resident
    x = torch.randn(2, 5, 24)
    ref(x).backward()
    model(x).backward()
    for pr, pm in zip(ref.parameters(), model.parameters()):
        if pr.requires_grad:
            assert_bitwise_equal(pm.grad, pr.grad, "adapter gradient")
    assert ext.weights.stats()["resident_now"] == (0, 1)


def test_install_defaults_do_nothing_on_cpu_and_blocks_path():
    _, model = make()
    s = fake_session()
    assert install(s, model, s.options) is None
    s = fake_session(blocks="stack", param_offload=[1])
    ext = install(s, model, s.options)
    assert ext.weights.streamed == [1]
    s = fake_session(blocks="nope.layers", param_offload=True)
    with pytest.raises(OptionError, match="blocks"):
        install(s, make()[1], s.options)


def test_keep_latest_activations_rule():
    from tidal_stream.weights import keep_latest_activations

    pol = ["offload", "recompute", "offload", "offload"]
    assert keep_latest_activations(pol, [5, 5, 5, 5], room_bytes=11) == [
        "offload",
        "recompute",
        "keep",
        "keep",
    ]
    assert keep_latest_activations(pol, [5, 5, 5, 50], room_bytes=11) == pol  # the latest must fit first
    assert keep_latest_activations(["keep", "offload"], [9, 1], room_bytes=0) == ["keep", "offload"]
    with pytest.raises(OptionError, match="activation_bytes"):
        keep_latest_activations(pol, [1], 10)


def test_wrap_with_streamed_base_matches_plain_wrap():
    """wrap(param_offload=True, activation_offload=True) on a LoRA-like stack vs wrap() without them."""
    from tidal_stream.wrap import memory_report, unwrap, wrap

    ref, model = make()
    train_r = [p for p in ref.parameters() if p.requires_grad]
    train_m = [p for p in model.parameters() if p.requires_grad]
    ref, opt_r = wrap(ref, torch.optim.AdamW(train_r, lr=1e-2), device="cpu")
    model, opt_m = wrap(
        model,
        torch.optim.AdamW(train_m, lr=1e-2),
        device="cpu",
        param_offload=True,
        activation_offload=True,
        blocks="stack",
    )
    for step in range(5):
        # [16, 64, 24] fp32: saved tensors above the default 64 KiB offload threshold
        x = torch.randn(16, 64, 24, generator=torch.Generator().manual_seed(step))
        lr_, lm = ref(x), model(x)
        lr_.backward()
        lm.backward()
        assert_bitwise_equal(lr_.detach().reshape(1), lm.detach().reshape(1), f"loss {step}")
        opt_r.step()
        opt_m.step()
        opt_r.zero_grad()
        opt_m.zero_grad()
    rep = memory_report(model)
    assert rep["weight_streaming"]["streamed"] == [0, 1, 2, 3, 4]
    assert rep["activations"]["offloaded_tensors"] > 0
    # the frozen base streams: blocks 0 and 1 wait on the device for the next forward, block 2 is refilled
    assert rep["weight_streaming"]["resident_now"] == (0, 1)
    assert model.stack[2].base.weight.untyped_storage().nbytes() == 0
    unwrap(model)
    unwrap(ref)
    for (name, pr), pm in zip(ref.named_parameters(), model.parameters()):
        assert_bitwise_equal(pr.detach(), pm.detach(), f"weights after 5 steps: {name}")


def test_trained_weights_stream_only_with_a_host_updating_optimizer():
    _, model = make()
    model.requires_grad_(True)  # full fine-tuning: trainable weights dominate the blocks
    s = fake_session(param_offload=True)
    with pytest.raises(OptionError, match="param_offload=True"):
        install(s, model, s.options)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # left intact
    s.optimizer = SimpleNamespace(host_weight_updates=True)
    ext = install(s, model, s.options)
    assert ext.weights.sb.stream_trainable
    assert ext.host_tensor(model.stack[0].lora_a.weight) is not None


@pytest.mark.parametrize("device", devices())
def test_hf_llama_layers_stream_offload_recompute_exactly(device):
    """Real decoder layers (kwargs, tuple outputs, rotary embeddings, SDPA) streamed + offloaded + recomputed."""
    transformers = pytest.importorskip("transformers")
    from tidal_stream.activations import install_activation_policy
    from tidal_stream.attention import install_attention

    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).train().to(device)
    model = copy.deepcopy(ref)  # on `device`: the streamed layers' weights move to host copies
    layers = model.model.layers
    sb = install_weight_streaming(model, layers, range(4), device, prefetch_depth=1)
    policies = ["offload", "recompute", "keep", "offload"]
    acts = install_activation_policy(layers, policies, device=device, min_offload_bytes=256)
    install_attention(layers, "math")
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for step in range(3):
        with sdpa_kernel([SDPBackend.MATH]):
            lr_ = ref(input_ids=ids, labels=ids, use_cache=False).loss
        # no KV cache in training: a recompute would append to it a second time (as HF's checkpointing)
        lm = model(input_ids=ids, labels=ids, use_cache=False).loss
        lr_.backward()
        lm.backward()
        assert_bitwise_equal(lr_.detach().reshape(1), lm.detach().reshape(1), f"loss {step}")
        for (name, pr), pm in zip(ref.named_parameters(), model.parameters()):
            assert_bitwise_equal(pr.grad, pm.grad, f"grad {name} step {step}")
        opt_r.step()
        opt_r.zero_grad()
        with sb.sb.gathered():
            opt_m.step()
        opt_m.zero_grad()
    assert acts.stats()["recomputed_forwards"] == 3 and acts.stats()["offloaded_tensors"] > 0
    assert sb.stats()["resident_now"] == ()
