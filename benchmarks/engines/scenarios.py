"""The benchmark scenarios: exact public architectures (random weights), batch shapes, default budgets.

Every engine of a run sees the same scenario: the same transformers config, the same token batch
(seeded), the same LoRA settings and learning rate. Nothing is downloaded: the configs below reproduce
the published shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Mode = Literal["lora", "full", "decode"]

GiB = 1 << 30

#: LoRA settings shared by every engine: rank 16 on all projections of every block.
LORA_RANK = 16
LORA_ALPHA = 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Learning rates shared by every engine.
LR = {"lora": 2e-4, "full": 2e-5, "decode": 0.0}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One benchmark workload."""

    name: str
    """Scenario name used on the command line (``--scenario``)."""
    arch: Literal["qwen2", "llama"]
    """transformers architecture family."""
    shape: dict[str, Any]
    """Config fields that give the exact public shape (hidden size, layers, heads, vocabulary …)."""
    mode: Mode
    """``"lora"`` (frozen base, LoRA r=16 on all projections), ``"full"`` (every weight trained) or ``"decode"``."""
    batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence (for ``decode``: the prompt length)."""
    vram_gb: float | None
    """Default VRAM budget in GiB (None: the whole device)."""
    about: str
    """One line for the report."""

    def __post_init__(self) -> None:
        if self.mode not in ("lora", "full", "decode"):
            raise ValueError(f"Scenario.mode: got {self.mode!r}; accepted: 'lora', 'full', 'decode'")
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"Scenario.arch: got {self.arch!r}; accepted: 'qwen2', 'llama'")
        if self.batch < 1 or self.seq < 2:
            raise ValueError(
                f"Scenario {self.name}: batch >= 1 and seq >= 2 needed, got {self.batch}×{self.seq}"
            )
        if self.vram_gb is not None and self.vram_gb <= 0:
            raise ValueError(f"Scenario.vram_gb: got {self.vram_gb!r}; accepted: a positive number or None")

    @property
    def lr(self) -> float:
        """The learning rate every engine uses for this scenario."""
        return LR[self.mode]

    @property
    def tokens_per_step(self) -> int:
        """Tokens processed by one training step (one generated token per sequence for ``decode``)."""
        return self.batch * (1 if self.mode == "decode" else self.seq)

    def param_count(self) -> int:
        """Parameters of the architecture (exact for these decoder-only families)."""
        s = self.shape
        h, inter, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
        heads, kv = s["num_attention_heads"], s["num_key_value_heads"]
        hd = h // heads
        attn = h * h * 2 + 2 * h * kv * hd  # q, o + k, v
        if self.arch == "qwen2":
            attn += h + 2 * kv * hd  # q, k, v biases
        block = attn + 3 * h * inter + 2 * h  # MLP + two norms
        embed = v * h * (1 if s.get("tie_word_embeddings", False) else 2)
        return n * block + embed + h


def decoder_shape(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    rope_theta: float,
    rms_norm_eps: float,
    max_positions: int,
    tied: bool,
) -> dict[str, Any]:
    """The transformers config fields of a Qwen2 / Llama decoder shape (``Scenario.shape``)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
    )


# decoder_shape(hidden, intermediate, layers, heads, kv_heads, vocab, rope_theta, rms_norm_eps,
#               max_positions, tied)
QWEN25_14B = decoder_shape(5120, 13824, 48, 40, 8, 152064, 1_000_000.0, 1e-6, 32768, False)
QWEN25_1_5B = decoder_shape(1536, 8960, 28, 12, 2, 151936, 1_000_000.0, 1e-6, 32768, True)
QWEN25_72B = dict(
    QWEN25_14B, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64
)
QWEN15_110B = dict(
    QWEN25_14B,
    hidden_size=8192,
    intermediate_size=49152,
    num_hidden_layers=80,
    num_attention_heads=64,
    rope_theta=1_000_000.0,
)
LLAMA3_8B = decoder_shape(4096, 14336, 32, 32, 8, 128256, 500_000.0, 1e-5, 131072, False)
#: A tiny Qwen2 for ``--smoke`` (CPU, seconds): proves the harness end to end without a GPU.
TINY = decoder_shape(64, 128, 2, 4, 2, 256, 10_000.0, 1e-6, 512, False)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("lora14b", "qwen2", QWEN25_14B, "lora", 1, 512, 24.0, "LoRA r=16, Qwen2.5-14B shape, 1×512"),
        Scenario(
            "lora14b_2k", "qwen2", QWEN25_14B, "lora", 1, 2048, 24.0, "LoRA r=16, Qwen2.5-14B shape, 1×2048"
        ),
        Scenario(
            "full1.5b", "qwen2", QWEN25_1_5B, "full", 4, 512, 24.0, "full fine-tune, Qwen2.5-1.5B, 4×512"
        ),
        Scenario(
            "full8b", "llama", LLAMA3_8B, "full", 4, 2048, 24.0, "full fine-tune, Llama-3-8B shape, 4×2048"
        ),
        Scenario(
            "lora72b", "qwen2", QWEN25_72B, "lora", 1, 512, 80.0, "LoRA r=16, Qwen2.5-72B shape, bf16 base"
        ),
        Scenario("lora110b", "qwen2", QWEN15_110B, "lora", 1, 512, None, "LoRA r=16, Qwen1.5-110B shape"),
        Scenario("decode8b", "llama", LLAMA3_8B, "decode", 1, 32768, None, "decode, Llama-3-8B, 32k context"),
        Scenario("smoke", "qwen2", TINY, "lora", 2, 32, None, "tiny Qwen2 LoRA on CPU (harness check)"),
        Scenario("smoke_full", "qwen2", TINY, "full", 2, 32, None, "tiny Qwen2 full fine-tune on CPU"),
        Scenario("smoke_decode", "qwen2", TINY, "decode", 1, 32, None, "tiny Qwen2 decode on CPU"),
    ]
}


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name``; a ValueError lists the accepted names."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(
            f"--scenario: got {name!r}; accepted: {', '.join(SCENARIOS)}. Pick one of those names."
        ) from None


def hf_config(scenario: Scenario) -> Any:
    """The transformers config of ``scenario`` (sdpa attention, no KV cache in training)."""
    import transformers

    cls = transformers.Qwen2Config if scenario.arch == "qwen2" else transformers.LlamaConfig
    cfg = cls(**scenario.shape)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = scenario.mode == "decode"
    return cfg
