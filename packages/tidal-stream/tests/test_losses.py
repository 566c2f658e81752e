import pytest
import torch
import torch.nn.functional as F

from tidal_stream.losses import LossError, chunked_cross_entropy, dpo_loss, sequence_logprobs
from tidal_testing import assert_sqnr, devices

torch.set_num_threads(1)

V, D = 97, 24


def inputs(dtype, device, b=3, t=11, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(device, dtype).requires_grad_()
    b_ = (torch.randn(V, generator=g) * 0.1).to(device, dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (b, t), generator=g).to(device)
    labels[0, :3] = -100
    labels[-1, -1] = -100
    return hidden, weight, b_, labels


def grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None])


# fp32: identical math, only the order of fp32 sums across chunks differs
FP32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("chunk", [1, 4, 7, 33, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_full_logits_fp32(device, chunk, bias, reduction):
    h, w, b, y = inputs(torch.float32, device, bias=bias)
    ref = F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), y.flatten(), reduction=reduction)
    got = chunked_cross_entropy(h, w, y, bias=b, chunk_size=chunk, reduction=reduction)
    torch.testing.assert_close(got.flatten(), ref.flatten(), **FP32)
    gw = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(device)
    for a, r in zip(grads((got.flatten() * gw).sum(), h, w, b), grads((ref * gw).sum(), h, w, b)):
        torch.testing.assert_close(a, r, **FP32)


@pytest.mark.parametrize("device", devices())
def test_cross_entropy_bf16_within_rounding(device):
    h, w, _, y = inputs(torch.bfloat16, device, b=4, t=32)
    ref = F.cross_entropy(F.linear(h, w).float().flatten(0, 1), y.flatten())
    got = chunked_cross_entropy(h, w, y, chunk_size=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # forward: same bf16 logits, fp32 math
    for a, r, name in zip(grads(got, h, w), grads(ref, h, w), ("hidden", "weight")):
        # grads: bf16 rounding of d(logits) can differ by one ulp (fp32 op order), weight sums by chunk
        assert_sqnr(r.float(), a.float(), 40.0, f"bf16 grad {name}")


def full_seq_logprobs(h, w, y, average=False):
    logp = torch.log_softmax(F.linear(h, w).float(), -1)  # [B, T, V]
    valid = y != -100
    tok = logp.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1) * valid
    s = tok.sum(-1)
    return s / valid.sum(-1) if average else s


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs_matches(average):
    h, w, _, y = inputs(torch.float32, "cpu")
    got = sequence_logprobs(h, w, y, chunk_size=5, average=average)
    ref = full_seq_logprobs(h, w, y, average)
    assert got.shape == (3,)
    torch.testing.assert_close(got, ref, **FP32)
    for a, r in zip(grads(got.sum(), h, w), grads(ref.sum(), h, w)):
        torch.testing.assert_close(a, r, **FP32)


def ref_dpo(pc, pr, rc, rr, beta, ls):
    z = beta * ((pc - pr) - (rc - rr))
    return (-F.logsigmoid(z) * (1 - ls) - F.logsigmoid(-z) * ls).mean()


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_dpo_end_to_end_matches_full_logits(ls):
    hc, w, _, yc = inputs(torch.float32, "cpu", seed=1)
    hr, _, _, yr = inputs(torch.float32, "cpu", seed=2)
    with torch.no_grad():
        w_ref = w + 0.05 * torch.randn_like(w)
    pc, pr = sequence_logprobs(hc, w, yc, 4), sequence_logprobs(hr, w, yr, 4)
    rc, rr = sequence_logprobs(hc.detach(), w_ref, yc, 4), sequence_logprobs(hr.detach(), w_ref, yr, 4)
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=ls)
    fpc, fpr = full_seq_logprobs(hc, w, yc), full_seq_logprobs(hr, w, yr)
    frc, frr = full_seq_logprobs(hc.detach(), w_ref, yc), full_seq_logprobs(hr.detach(), w_ref, yr)
    ref = ref_dpo(fpc, fpr, frc, frr, 0.3, ls)
    torch.testing.assert_close(loss, ref, **FP32)
    # rewards difference two fp32 sums of magnitude ~50: the absolute error scales with that, not the result
    assert float(fpc.detach().abs().max()) < 100
    torch.testing.assert_close(cr, (0.3 * (fpc - frc)).detach(), rtol=0, atol=100 * 2e-7)
    assert not rj.requires_grad
    for a, r in zip(grads(loss, hc, hr, w), grads(ref, hc, hr, w)):
        torch.testing.assert_close(a, r, **FP32)


def test_no_full_logits_saved():
    # what autograd keeps for backward: hidden, weight, labels, mask — never a [N, V] tensor
    h, w, _, y = inputs(torch.float32, "cpu", b=2, t=64)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        chunked_cross_entropy(h, w, y, chunk_size=8)
    assert shapes and all(V not in s or s == (V, D) for s in shapes), shapes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"chunk_size": 2.0}, "chunk_size=2.0"),
        ({"reduction": "avg"}, "reduction='avg'"),
    ],
)
def test_bad_options(kwargs, match):
    h, w, _, y = inputs(torch.float32, "cpu")
    with pytest.raises(LossError, match=match):
        chunked_cross_entropy(h, w, y, **kwargs)


def test_bad_shapes_and_dpo_args():
    h, w, _, y = inputs(torch.float32, "cpu")
    with pytest.raises(LossError, match="labels"):
        chunked_cross_entropy(h, w, y[:, :-1])
    with pytest.raises(LossError, match="weight"):
        chunked_cross_entropy(h, w.t(), y)
    p = torch.randn(3)
    with pytest.raises(LossError, match="beta=0"):
        dpo_loss(p, p, p, p, beta=0)
    with pytest.raises(LossError, match=r"label_smoothing=0\.5"):
        dpo_loss(p, p, p, p, label_smoothing=0.5)
    with pytest.raises(LossError, match="shapes"):
        dpo_loss(p, p, p, torch.randn(4))
