"""Meta-device model shapes for the planner tests (no weights are allocated)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn


class LoRALinear(nn.Module):
    """A frozen linear plus a rank-r adapter (the shapes PEFT LoRA adds)."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(
            base.in_features, r, bias=False, device=base.weight.device, dtype=base.weight.dtype
        )
        self.lora_B = nn.Linear(
            r, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))  # [..., out]


def add_lora(model: nn.Module, r: int = 16, adapter_dtype: torch.dtype | None = None) -> nn.Module:
    """Freeze every parameter, then wrap each linear inside the block stack with a trainable adapter (in
    ``adapter_dtype``: PEFT's default casts adapters to fp32; default None keeps the base's dtype)."""
    model.requires_grad_(False)
    layers = model.model.layers
    for layer in layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                lora = LoRALinear(mod, r)
                if adapter_dtype is not None:
                    lora.lora_A.to(adapter_dtype)
                    lora.lora_B.to(adapter_dtype)
                setattr(parent, name.rsplit(".", 1)[-1], lora)
    return model


def meta_causal_lm(kind: str, **cfg) -> nn.Module:
    """A transformers causal LM of the given config on the meta device, in bf16."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[kind](**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def decoder_shape(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, **more
) -> dict:
    """Config values of a decoder-only transformer (``more``: extra config keys)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        **more,
    )


QWEN_14B = decoder_shape(5120, 13824, 48, 40, 8, 152064)
QWEN_72B = decoder_shape(8192, 29568, 80, 64, 8, 152064)
LLAMA3_8B = decoder_shape(4096, 14336, 32, 32, 8, 128256)
QWEN_1_5B = decoder_shape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True)
# benchmarks/stream/full_finetune.py's model: the same shape with an untied head (1.777 B parameters)
QWEN_1_5B_UNTIED = decoder_shape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=False)


@functools.cache
def _census_of(name: str):
    """Censuses are immutable, so each shape is built and counted once per test run."""
    from tidal_plan import census

    if name == "qwen14b_lora":
        return census(add_lora(meta_causal_lm("qwen2", **QWEN_14B)))
    if name == "qwen14b_lora_fp32":
        return census(add_lora(meta_causal_lm("qwen2", **QWEN_14B), adapter_dtype=torch.float32))
    if name == "qwen72b_lora_fp32":
        return census(add_lora(meta_causal_lm("qwen2", **QWEN_72B), adapter_dtype=torch.float32))
    if name == "llama8b":
        return census(meta_causal_lm("llama", **LLAMA3_8B))
    if name == "qwen1_5b_untied":
        return census(meta_causal_lm("qwen2", **QWEN_1_5B_UNTIED))
    return census(meta_causal_lm("qwen2", **QWEN_1_5B))


@pytest.fixture
def qwen14b_lora_census():
    return _census_of("qwen14b_lora")


@pytest.fixture
def qwen14b_lora_fp32_census():
    """Qwen2.5-14B shape with fp32 adapters on its bf16 base (as PEFT builds them)."""
    return _census_of("qwen14b_lora_fp32")


@pytest.fixture
def qwen72b_lora_fp32_census():
    """Qwen2.5-72B shape with fp32 adapters on its bf16 base (as PEFT builds them)."""
    return _census_of("qwen72b_lora_fp32")


@pytest.fixture
def llama8b_census():
    return _census_of("llama8b")


@pytest.fixture
def qwen1_5b_census():
    return _census_of("qwen1_5b")


@pytest.fixture
def qwen1_5b_untied_census():
    return _census_of("qwen1_5b_untied")


def fake_bytes_per_weight(fmt: str) -> float:
    """Bytes per weight of each format with its scales (int8: absmax per 64; nf4: absmax per 64, double
    quantized; fp8: one scale per row ~ 0; nvfp4: e4m3 per 16 + global)."""
    return {"int8": 1.0 + 4 / 64, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}[
        fmt
    ]


@pytest.fixture
def bpw():
    return fake_bytes_per_weight


@pytest.fixture
def build_meta_lm():
    """``build_meta_lm(kind, lora_rank=None, **config)`` -> a meta-device causal LM (LoRA-wrapped if asked)."""

    def build(kind: str, lora_rank: int | None = None, **cfg) -> nn.Module:
        m = meta_causal_lm(kind, **cfg)
        return add_lora(m, lora_rank) if lora_rank else m

    return build


def assert_overlap_order(p) -> None:
    """Host-updated blocks are the last trained blocks, leaving out streamed ones of a LoRA plan, and
    streamed blocks the last blocks, or in a LoRA plan (nothing trained streams) the last blocks or spread
    through the stack (see the planner's [Note: overlap order] and ``search._spread_streamed_blocks``)."""
    from tidal_plan.stream_schedule import spread_streamed

    n = len(p.blocks)
    streamed = list(p.streamed_blocks)
    last = list(range(n - len(streamed), n))
    spread = p.training == "lora" and streamed != last
    if spread:
        assert streamed == spread_streamed(range(n), len(streamed), n), p.explain()
    else:
        assert streamed == last, p.explain()
    skip = set(streamed) if spread else set()
    trained = [b.index for b in p.blocks if b.optimizer != "none" and b.index not in skip]
    host = [b.index for b in p.blocks if b.optimizer == "host" and b.index not in skip]
    assert host == trained[len(trained) - len(host) :], p.explain()


@pytest.fixture
def overlap_order():
    """``overlap_order(plan)`` asserts the planner's block order (:func:`assert_overlap_order`)."""
    return assert_overlap_order
