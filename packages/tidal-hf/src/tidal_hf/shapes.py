"""Model shapes without downloads: the Qwen2.5 family's configs by size, and tiny configs for tests.

Build them with :func:`tidal_hf.load_model` (``random_weights=True``) to get exact architectures with
random weights.
"""

from __future__ import annotations

from typing import Any, Literal

from tidal_hf.errors import bad_option

__all__ = ["QWEN25_SIZES", "TINY_ARCHS", "qwen25_config", "tiny_config"]

#: Qwen2.5 shapes: hidden, intermediate, layers, attention heads, key/value heads, vocabulary, tied head.
QWEN25_SIZES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
    "72b": (8192, 29568, 80, 64, 8, 152064, False),
}

TINY_ARCHS = ("qwen2", "llama", "mistral", "gpt2")
Arch = Literal["qwen2", "llama", "mistral", "gpt2"]


def qwen25_config(size: str, **overrides: Any) -> Any:
    """A ``transformers.Qwen2Config`` with the shape of Qwen2.5-``size`` (e.g. ``"14b"``).

    Args:
        size: one of :data:`QWEN25_SIZES`.
        **overrides: config fields to change (e.g. ``num_hidden_layers=2``).
    """
    if size not in QWEN25_SIZES:
        raise bad_option("qwen25_config", "size", size, f"one of {list(QWEN25_SIZES)}")
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv, vocab, tied = QWEN25_SIZES[size]
    fields: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


def tiny_config(arch: Arch, **overrides: Any) -> Any:
    """A 2-layer config of ``arch`` with hidden size 64 and vocabulary 128 (tests and examples).

    Args:
        arch: ``"qwen2"``, ``"llama"``, ``"mistral"`` or ``"gpt2"``.
        **overrides: config fields to change.
    """
    import transformers as tf

    if arch == "gpt2":
        fields: dict[str, Any] = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128)
        fields.update(dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        fields.update(overrides)
        return tf.GPT2Config(**fields)
    classes = {"qwen2": tf.Qwen2Config, "llama": tf.LlamaConfig, "mistral": tf.MistralConfig}
    if arch not in classes:
        raise bad_option("tiny_config", "arch", arch, f"one of {list(TINY_ARCHS)}")
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=arch == "qwen2",
    )
    fields.update(overrides)
    return classes[arch](**fields)
