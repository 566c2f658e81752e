"""BlockStreamer 0.2: the decoder blocks run through ``StreamedModel`` (pinned host masters, bounded window).

Its API takes an ordered block list and streams each block's state to the device just before it runs
(``prefetch_ahead`` blocks ahead), re-fetching in backward; gradients of the blocks' trainable tensors
come back to host RAM, so their optimizer runs on the CPU. The parts outside the block stack
(embeddings, final norm, head) stay on the device with a fused AdamW when they train. The driver below
is the embedding → streamed blocks → norm → head path of a transformers causal LM, with the same loss
as transformers' (shifted cross-entropy, mean over tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engines import RunContext
from engines.common import NotApplicable, add_lora, build_meta_model, decoder_layers, materialize

PREFETCH_AHEAD = 1


def version() -> str:
    """BlockStreamer's version."""
    from importlib.metadata import version as dist_version

    return f"block-streamer {dist_version('block-streamer')}"


def causal_lm_loss(
    base: torch.nn.Module, run_blocks: Callable[..., Any], ids: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """transformers' causal-LM loss with the block stack replaced by ``run_blocks(h, **block_kwargs)``.

    Args:
        base: the (unwrapped) transformers causal LM: ``base.model.embed_tokens / rotary_emb / norm``,
            ``base.lm_head``.
        run_blocks: runs every decoder block in order on ``h`` with the same keyword arguments.
        ids: tokens ``[B, T]`` (also the labels).
        pos: positions ``[B, T]``.
    """
    inner = base.model
    h = inner.embed_tokens(ids)  # [B, T, D]
    rope = inner.rotary_emb(h, pos)  # (cos, sin), each [B, T, head_dim]
    # attention_mask=None: transformers' sdpa path is then causal
    h = run_blocks(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
    h = h[0] if isinstance(h, tuple) else h
    logits = base.lm_head(inner.norm(h)).float()  # [B, T, V]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def setup(ctx: RunContext) -> Callable[[], float]:
    """Blocks to pinned host under ``StreamedModel``; the rest on the device; CPU + device AdamW."""
    import block_streamer

    sc = ctx.scenario
    if ctx.device.type != "cuda":
        raise NotApplicable("BlockStreamer streams to CUDA devices only")
    model = build_meta_model(sc, torch.bfloat16)
    materialize(model, "cpu", device=ctx.device, seed=ctx.seed, rest_where="device")
    if sc.mode == "lora":
        model = add_lora(model, ctx.seed)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    streamed = block_streamer.StreamedModel(
        decoder_layers(model), device=ctx.device, prefetch_ahead=PREFETCH_AHEAD
    )
    streamed.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    host = [p for p in trainable if p.device.type == "cpu"]
    dev = [p for p in trainable if p.device.type == "cuda"]
    opts = []
    if host:
        opts.append(torch.optim.AdamW(host, lr=ctx.lr, weight_decay=0.0))
    if dev:
        opts.append(torch.optim.AdamW(dev, lr=ctx.lr, weight_decay=0.0, fused=True))
    ids = ctx.batch()  # [B, T]
    bsz, seq = ids.shape
    pos = torch.arange(seq, device=ctx.device).unsqueeze(0).expand(bsz, -1)  # [B, T]

    def step() -> float:
        loss = causal_lm_loss(base, streamed, ids, pos)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    return step
