"""The loss over the LM head's logits and the device update's workspace are planned VRAM.

The shape of ``benchmarks/stream/full_finetune.py``: Qwen2.5-1.5B with an untied head (1.777 B
parameters, bf16), full fine-tuning, 4 x 512 tokens, a 24 GiB budget on the H200. Its first GPU run
went out of memory: the plan left no room for the logits of 2048 tokens x 151936 words.
"""

from __future__ import annotations

import pytest

from tidal_plan import HardwareProfile, PlanConfig, plan
from tidal_plan.units import GiB

VOCAB, HIDDEN, TOKENS = 151936, 1536, 2048


def _plan(census, **cfg):
    prof = HardwareProfile.synthetic(device_free_bytes="24GiB", vram_budget_bytes="24GiB")
    return plan(census, prof, PlanConfig(vram_budget="24GiB", batch_tokens=TOKENS, **cfg))


def _by_hand(census, p) -> int:
    """Device bytes of the plan recomputed from the census and the plan's own per-block choices."""
    blocks = {b.index: b for b in census.blocks}
    master, moments = 4, 8  # fp32 master of bf16 weights, two fp32 moments
    gpu = [blocks[i] for i in p.optimizer.gpu_blocks]
    host = [blocks[b.index] for b in p.blocks if b.optimizer == "host"]
    outside_weights = (
        census.outside_trainable_bytes + census.outside_frozen_bytes + census.outside_buffer_bytes
    )
    resident = sum(b.weight_bytes for b in p.blocks if b.weights == "resident")
    streamed = [b.weight_bytes for b in p.blocks if b.weights == "streamed"]
    window = min(p.prefetch_depth + 1, len(streamed)) * max(streamed, default=0)
    n_gpu = (
        sum(b.trainable_params for b in gpu) + census.outside_trainable_params * p.optimizer.outside_on_gpu
    )
    state = n_gpu * (master + moments)
    grads = (
        sum(b.trainable_bytes for b in gpu)
        + 2 * max((b.trainable_bytes for b in host), default=0)
        + census.outside_trainable_bytes
    )
    recomputed = [blocks[b.index] for b in p.blocks if b.activations == "recompute"]
    acts = (
        sum(b.activation_bytes for b in p.blocks)
        + max((b.keep_bytes(TOKENS, TOKENS) for b in recomputed), default=0)
        + census.outside_activation_bytes(TOKENS, TOKENS)
    )
    headroom = max(256 * 2**20, 24 * GiB // 20)
    loss = p.vram_breakdown["loss"]
    return outside_weights + resident + window + state + grads + acts + loss + headroom


def test_census_is_the_benchmark_model(qwen1_5b_untied_census):
    c = qwen1_5b_untied_census
    assert round(c.trainable_params / 1e9, 3) == 1.777 and len(c.blocks) == 28
    assert c.outside_trainable_params == 2 * VOCAB * HIDDEN + HIDDEN  # embeddings, head, final norm


@pytest.mark.parametrize(
    ("chunk", "loss_bytes"),
    [
        # Hugging Face's labels= loss: saved fp32 log-softmax, its incoming and outgoing fp32 gradients
        (None, 12 * TOKENS * VOCAB),
        # chunked_cross_entropy(chunk_size=1024): backward's chunk (fp32 + bf16) beside the head's fp32
        # gradient accumulator and one chunk's bf16 product
        (1024, 6 * 1024 * VOCAB + 6 * HIDDEN * VOCAB),
    ],
)
def test_full_finetune_1_5b_at_24gib_fits_with_the_loss(qwen1_5b_untied_census, chunk, loss_bytes):
    p = _plan(qwen1_5b_untied_census, loss_chunk_tokens=chunk)
    print(f"\n=== Qwen2.5-1.5B untied, full fine-tune, 24 GiB, 2048 tokens, loss chunk {chunk} ===")
    print(p.explain())
    assert p.vram_breakdown["loss"] == loss_bytes
    assert sum(p.vram_breakdown.values()) == p.tiers["vram"] <= 24 * GiB
    # the numbers behind the total, counted again from the census and the plan's per-block choices
    hand = _by_hand(qwen1_5b_untied_census, p)
    assert hand == p.tiers["vram"] - p.vram_breakdown["update workspace"] <= 24 * GiB
    # the fp32 copies of the largest gradient (the embedding's) fit in the room activations and loss leave
    assert p.vram_breakdown["update workspace"] == max(
        0, 4 * VOCAB * HIDDEN - p.vram_breakdown["activations"] - loss_bytes
    )


def test_full_logits_leave_less_room_for_device_state(qwen1_5b_untied_census):
    full = _plan(qwen1_5b_untied_census)
    chunked = _plan(qwen1_5b_untied_census, loss_chunk_tokens=1024)
    ignored = full.vram_breakdown["loss"] - chunked.vram_breakdown["loss"]
    assert ignored > GiB
    assert full.optimizer.gpu_state_bytes < chunked.optimizer.gpu_state_bytes


def test_loss_chunk_tokens_is_validated():
    from tidal_plan import PlanConfigError

    for bad in (0, -3, 1.5, True):
        with pytest.raises(PlanConfigError, match="loss_chunk_tokens"):
            PlanConfig(loss_chunk_tokens=bad)
