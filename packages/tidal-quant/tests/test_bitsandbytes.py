"""NF4 bytes identical to bitsandbytes ``quantize_4bit(quant_type="nf4", blocksize=64)``.

Runs wherever bitsandbytes is importable (its CPU backend works; on the GPU machine when its wheel is
installed there). Skipped otherwise.
"""

import pytest
import torch

import tidal_quant as tq
from tidal_testing import devices

bnb_f = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed (optional)")


def _cases(device):
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(96, 320, generator=g) * 0.02
    w[0, :64] = 0.0  # an all-zero block
    w[1, :64] = tq.reference.nf4_midpoints().repeat(5)[:64] * 0.5  # exact midpoints once scaled…
    w[1, 0] = 0.5  # …by absmax 0.5 (a power of two: the scaling is exact)
    w[2, 5], w[2, 6] = 3.0, -3.0  # ±max
    odd = torch.randn(37, 61, generator=g)  # numel not a multiple of 64 nor even
    return [w.to(device), w.to(device, torch.bfloat16), odd.to(device), (torch.randn(64, 256) * 5).to(device)]


@pytest.mark.parametrize("device", devices())
def test_nf4_bytes_match_bitsandbytes(device):
    for w in _cases(device):
        ours = tq.quantize(w, "nf4", block_size=64)
        packed, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
        # all-zero blocks: bitsandbytes' CUDA kernel computes 0 * (1/0) = NaN → code 0; we (and its
        # CPU backend) store code 7 (exact zero). Compare the other blocks' bytes on CUDA.
        theirs = packed.view(-1).view(torch.uint8)
        keep = torch.ones_like(theirs, dtype=torch.bool)
        if w.is_cuda:
            zero_blocks = (state.absmax == 0).repeat_interleave(32)[: theirs.numel()]
            keep &= ~zero_blocks
        assert ours.data.shape == theirs.shape
        assert torch.equal(ours.data[keep], theirs[keep]), f"{tuple(w.shape)} {w.dtype}"
        assert torch.equal(ours.scales, state.absmax)
        if w.shape[-1] % 2:
            continue  # bitsandbytes dequantizes odd widths through torch.compile: slow, and bytes already match
        back = bnb_f.dequantize_4bit(packed, state)
        assert torch.equal(
            tq.dequantize(ours, back.dtype)[keep.repeat_interleave(2)[: w.numel()].view(w.shape)],
            back[keep.repeat_interleave(2)[: w.numel()].view(w.shape)],
        )
