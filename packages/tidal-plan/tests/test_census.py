import logging

import pytest
import torch
from torch import nn

from tidal_plan import ModelCensus, PlanConfigError, census


def _tiny_qwen(device="meta", dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def test_qwen14b_shape_counts(qwen14b_lora_census):
    c: ModelCensus = qwen14b_lora_census
    h, inter, kv, r = 5120, 13824, 1024, 16
    base = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    lora = r * (h + h) + 2 * r * (h + kv) + r * (h + h) + 2 * r * (h + inter) + r * (inter + h)
    assert c.stack_name == "model.layers" and len(c.blocks) == 48 and c.block_type == "Qwen2DecoderLayer"
    b = c.blocks[7]
    assert (b.frozen_params, b.trainable_params) == (base, lora)
    assert (b.frozen_bytes, b.trainable_bytes) == (2 * base, 2 * lora)
    assert b.quantizable_params == base - (h + 2 * kv) - 2 * h  # all but biases and norms
    assert c.outside_frozen_params == 2 * 152064 * h + h and c.outside_trainable_params == 0
    assert c.outside_quantizable_params == 152064 * h  # the untied LM head
    assert c.param_to_block["model.layers.7.mlp.down_proj.base.weight"] == 7
    assert c.param_to_block["lm_head.weight"] is None
    assert c.activation_source == "meta-trace" and not c.notes
    # A LoRA block saves at least its input and every linear's adapter input, per token.
    assert b.activation_bytes_per_token > 10 * h * 2
    assert b.input_bytes_per_token == h * 2


def test_gemm_shapes_attention_width_and_kernels(qwen14b_lora_census):
    c, h, inter, kv, r = qwen14b_lora_census, 5120, 13824, 1024, 16
    b = c.blocks[0]
    # every 2-D weight as (in, out, trainable): the frozen projections and their rank-16 adapters
    frozen = sorted(s for s in b.matmul_shapes if not s[2])
    projections = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    assert frozen == sorted((i, o, False) for i, o in projections)
    adapters = [pair for i, o in projections for pair in ((i, r), (r, o))]
    assert sorted(s[:2] for s in b.matmul_shapes if s[2]) == sorted(adapters)
    assert c.outside_matmul_shapes == ((h, 152064, False),)  # the untied LM head
    assert b.attention_width == 40 * 128  # q_proj's output features (through the LoRA wrapper)
    # the traced forward runs the 7 frozen matmuls, 14 adapter matmuls and the elementwise work between
    assert 21 < b.forward_kernels < 200


def test_tied_parameters_are_counted_once(qwen1_5b_census):
    c = qwen1_5b_census
    assert ("model.embed_tokens.weight", "lm_head.weight") in c.tied
    assert c.outside_trainable_params == 151936 * 1536 + 1536
    assert (
        c.param_to_block["lm_head.weight"] is None and c.param_to_block["model.embed_tokens.weight"] is None
    )


def test_meta_trace_equals_measurement_on_real_weights():
    meta = census(_tiny_qwen("meta"))
    real = census(_tiny_qwen("cpu"), activation_trace="device")
    assert meta.activation_source == "meta-trace" and real.activation_source == "measured"
    # a model with real weights is traced on meta stand-ins by default: the same bytes, no arithmetic
    assert census(_tiny_qwen("cpu")).activation_source == "meta-trace"
    # Both sides save what a fused attention kernel saves (the meta trace stands one in, writing its output
    # token-major as the kernels do) and take transformers' own dispatch for an unpadded batch: equal bytes.
    for mb, rb in zip(meta.blocks, real.blocks):
        assert mb.activation_bytes_per_token == rb.activation_bytes_per_token
        assert mb.activation_bytes_per_token > 10 * 64 * 4  # far more than the log-sum-exp
    assert meta.total_bytes == real.total_bytes


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_meta_trace_runs_without_falling_back(kind, build_meta_lm, caplog):
    """transformers 5 reads position ids and masks by value while it builds the causal mask; on the meta
    device that must not push the census to the per-linear heuristic (nor leak a warning)."""
    cfg = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with caplog.at_level(logging.WARNING, logger="tidal_plan"):
        c = census(build_meta_lm(kind, **cfg))
    assert c.activation_source == "meta-trace" and not c.notes
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The trace sees the block's real saved tensors: more than the heuristic's linear inputs and outputs
    # of the MLP alone, and q, k, v and the output of attention at the least (bf16).
    h, inter, kv = 64, 160, 32
    assert c.blocks[0].activation_bytes_per_token >= 2 * (3 * h + 2 * kv + 3 * inter)
    assert c.blocks[0].activation_bytes_per_token == c.blocks[1].activation_bytes_per_token


def test_meta_trace_of_a_masked_batch_still_refuses_value_reads():
    """Only yes/no reads are answered on the meta device; a forward that needs a number still fails and
    is recorded (per-linear heuristic, with a note)."""

    class _NeedsANumber(_Net):
        def forward(self, x):
            steps = int(x.abs().sum())  # a value read a meta tensor cannot answer
            return self.blocks(self.inp(x)) * steps

    with torch.device("meta"):
        net = _NeedsANumber()
    c = census(net, example_inputs={"x": torch.empty(2, 8, 16, device="meta")})
    assert c.activation_source == "heuristic" and "meta" in c.notes[0]


def test_frozen_blocks_save_less_than_trainable_ones():
    full = census(_tiny_qwen())
    frozen_model = _tiny_qwen()
    frozen_model.requires_grad_(False)
    frozen = census(frozen_model)
    assert 0 < frozen.blocks[0].activation_bytes_per_token < full.blocks[0].activation_bytes_per_token


def test_blocks_by_name_module_and_override():
    m = _tiny_qwen()
    by_name = census(m, "model.layers", activation_bytes_per_token=1234)
    by_mod = census(m, m.model.layers)
    assert by_name.stack_name == by_mod.stack_name == "model.layers"
    assert by_name.activation_source == "override"
    assert all(b.activation_bytes_per_token == 1234 for b in by_name.blocks)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))  # [B, T, d]


class _Net(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[_Block(d) for _ in range(n)])
        self.side = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])  # smaller: not the stack

    def forward(self, x):
        return self.blocks(self.inp(x))


def test_plain_module_stack_and_example_inputs():
    net = _Net()
    c = census(net, example_inputs={"x": torch.randn(2, 8, 16)})
    assert c.stack_name == "blocks" and len(c.blocks) == 4
    # saved: fc1 input (16), relu output (64, used by fc2 and relu backward), fc1 output is not kept
    # separately by relu (it saves its result) -> 16 + 64 floats per token, each 4 bytes
    assert c.blocks[0].activation_bytes_per_token == (16 + 64) * 4
    assert c.outside_trainable_params == 16 * 16 + 16 + 2 * (16 * 16 + 16)


def test_heuristic_when_the_forward_cannot_run():
    net = _Net()
    c = census(net)  # default input_ids do not fit this model: heuristic, recorded
    assert c.activation_source == "heuristic" and c.notes
    assert c.blocks[0].activation_bytes_per_token == (16 + 64 + 64 + 16) * 4


def test_bad_blocks_and_models():
    m = _tiny_qwen()
    with pytest.raises(PlanConfigError, match="blocks="):
        census(m, "model.nope")
    with pytest.raises(PlanConfigError, match="blocks="):
        census(m, "model.norm")
    with pytest.raises(PlanConfigError, match="blocks="):
        census(nn.Linear(3, 3))
    with pytest.raises(PlanConfigError, match="model="):
        census("not a model")
    with pytest.raises(PlanConfigError, match="activation_bytes_per_token="):
        census(m, activation_bytes_per_token=-5)


def test_census_dict_round_trip(qwen1_5b_census):
    assert ModelCensus.from_dict(qwen1_5b_census.to_dict()) == qwen1_5b_census


def test_peft_lora_model_on_meta():
    peft = pytest.importorskip("peft")
    m = _tiny_qwen()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules=targets))
    c = census(pm)
    assert c.stack_name == "base_model.model.model.layers" and len(c.blocks) == 3
    h, inter, kv = 64, 128, 32
    lora = 8 * ((h + h) * 2 + (h + kv) * 2 + 2 * (h + inter) + (inter + h))
    assert c.blocks[0].trainable_params == lora and c.outside_trainable_params == 0
    assert c.blocks[0].quantizable_params == h * h * 2 + 2 * h * kv + 3 * h * inter
    assert c.activation_source == "meta-trace"
    name = "base_model.model.model.layers.2.mlp.down_proj.lora_A.default.weight"
    assert c.param_to_block[name] == 2


class _StoredLinear(nn.Module):
    """A frozen linear already held quantized, the way ``tidal_quant.QuantLinear`` holds it: packed 4-bit
    bytes and per-64 scales as buffers, ``fmt`` naming the format, no weight Parameter."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = "nf4", k, n
        self.register_buffer("packed", torch.randint(0, 255, (n * k // 2,), dtype=torch.uint8))
        self.register_buffer("absmax", torch.rand(n * k // 64) + 0.5)
        self.proj = nn.Parameter(torch.randn(n, k) * 0.1, requires_grad=False)  # dequantized stand-in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.t()  # [..., k] -> [..., n]


class _AdaptedBlock(nn.Module):
    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.up, self.down = _StoredLinear(d, 4 * d), _StoredLinear(4 * d, d)
        self.a = nn.Parameter(torch.randn(r, d) * 0.1)  # [r, d]
        self.b = nn.Parameter(torch.randn(d, r) * 0.1)  # [d, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) + (x @ self.a.t()) @ self.b.t()


def test_census_sees_linears_stored_quantized_and_plans_their_format():
    from tidal_plan import HardwareProfile, PlanConfig, plan

    d, r = 64, 4
    model = nn.Sequential(nn.Embedding(256, d), nn.Sequential(*(_AdaptedBlock(d, r) for _ in range(3))))
    c = census(model, blocks="1", example_inputs={"input": torch.randint(0, 256, (1, 16))})
    b = c.blocks[0]
    stored = 2 * 4 * d * d
    assert (b.stored_format, b.stored_params) == ("nf4", stored)
    assert b.stored_bytes == stored // 2 + 4 * stored // 64  # packed nibbles + fp32 absmax per 64
    assert b.buffer_bytes == b.stored_bytes
    assert b.quantizable_params == 0  # nothing left to quantize
    assert {(d, 4 * d, False), (4 * d, d, False)} <= set(b.matmul_shapes)
    assert b.matmul_params >= stored
    assert ModelCensus.from_dict(c.to_dict()) == c
    p = plan(c, HardwareProfile.synthetic(), PlanConfig(vram_budget="1GiB", batch_tokens=64))
    assert all(blk.storage == "nf4" for blk in p.blocks) and p.quantize is None
    assert "storage nf4 (as the model holds it)" in p.explain()
    assert p.prediction.parts["dequant"] > 0  # the stored weights are dequantized for each use
    with pytest.raises(PlanConfigError, match="already stored as nf4; leave quantize=None"):
        plan(c, HardwareProfile.synthetic(), PlanConfig(quantize="int8", bytes_per_weight=lambda f: 1.0))
