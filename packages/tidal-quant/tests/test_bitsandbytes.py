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


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """NF4 codes (high nibble first) of the first ``n`` elements, int64."""
    b = packed.reshape(-1).view(torch.uint8).cpu().long()
    return torch.stack([b >> 4, b & 15], dim=1).view(-1)[:n]


def _codes_with_nudged_reciprocal(w: torch.Tensor, ulps: int) -> torch.Tensor:
    """Reference NF4 codes if ``1 / absmax`` were off by ``ulps`` units in the last place."""
    x = w.reshape(-1).float().cpu()
    x = torch.nn.functional.pad(x, (0, -x.numel() % 64)).view(-1, 64)  # [nb, 64]
    inv = 1.0 / x.abs().amax(dim=1).clamp(min=tq.reference.NF4_ABSMAX_FLOOR)
    inv = (inv.view(torch.int32) + ulps).view(torch.float32)
    s = (x * inv[:, None]).clamp(-1, 1)
    return torch.bucketize(s, tq.reference.nf4_midpoints()).view(-1)[: w.numel()].long()


@pytest.mark.parametrize("device", devices())
def test_nf4_bytes_match_bitsandbytes(device):
    for w in _cases(device):
        what = f"{tuple(w.shape)} {w.dtype}"
        ours = tq.quantize(w, "nf4", block_size=64)
        packed, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")
        assert ours.data.shape == packed.view(-1).shape
        assert torch.equal(ours.scales, state.absmax), what
        mine, theirs = _unpack(ours.data, w.numel()), _unpack(packed, w.numel())
        keep = torch.ones(w.numel(), dtype=torch.bool)  # elements whose codes must match exactly
        if w.is_cuda:
            # Two documented properties of bitsandbytes' CUDA build (compiled with --use_fast_math), and
            # only these, are exempted on CUDA: (1) an all-zero block scales by 1/0 → 0 * inf = NaN →
            # code 0 where we (and its CPU backend) store code 7 (exact zero); (2) `1.0f / absmax` is an
            # approximate reciprocal, so a value whose exact scaled position lies within 2 ulp of an NF4
            # midpoint (exact ties, as in row 1 here) may fall on either side. Such an element must still
            # get one of the two codes a ±2 ulp reciprocal gives, and they must stay rare.
            keep &= ~(state.absmax == 0).cpu().repeat_interleave(64)[: w.numel()]
            lo, hi = _codes_with_nudged_reciprocal(w, -2), _codes_with_nudged_reciprocal(w, 2)
            ambiguous = keep & ((lo != mine) | (hi != mine))
            assert ambiguous.float().mean() < 0.01, f"{what}: {int(ambiguous.sum())} near-tie elements"
            bad = ambiguous & (theirs != lo) & (theirs != hi) & (theirs != mine)
            assert not bad.any(), f"{what}: near-tie codes outside ±2 ulp at {bad.nonzero().flatten()[:8]}"
            keep &= ~ambiguous
        diff = keep & (mine != theirs)
        idx = diff.nonzero().flatten()[:8].tolist()
        assert not diff.any(), (
            f"{what}: {int(diff.sum())} codes differ, e.g. at {idx}: ours {mine[idx].tolist()}, "
            f"bitsandbytes {theirs[idx].tolist()}, values {w.reshape(-1)[idx].tolist()}"
        )
        if w.shape[-1] % 2:
            continue  # bitsandbytes dequantizes odd widths through torch.compile: slow, and bytes already match
        back = bnb_f.dequantize_4bit(packed, state)
        km = keep.view(w.shape).to(w.device)
        assert torch.equal(tq.dequantize(ours, back.dtype)[km], back[km]), what
