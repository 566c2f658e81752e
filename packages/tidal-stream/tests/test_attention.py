import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tidal_stream.activations import install_activation_policy
from tidal_stream.attention import install_attention, time_sdpa_backends
from tidal_stream.errors import OptionError

torch.set_num_threads(1)


class Attn(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        b, t, d = x.shape
        q, k, v = (
            self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )  # [B, H, T, Dh]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + o.transpose(1, 2).reshape(b, t, d)


def test_timing_picks_a_timed_backend_and_caches():
    c = time_sdpa_backends(
        (1, 2, 16, 8), dtype=torch.float32, device="cpu", candidates=("flash", "math"), repeats=2
    )
    assert c.backend in ("flash", "math")
    assert set(c.times_ms) == {"flash", "math"} and all(t > 0 for t in c.times_ms.values())
    again = time_sdpa_backends(
        (1, 2, 16, 8), dtype=torch.float32, device="cpu", candidates=("flash", "math"), repeats=2
    )
    assert again is c


def test_unsupported_and_deterministic_exclusions():
    c = time_sdpa_backends(
        (1, 2, 8, 8),
        dtype=torch.float32,
        device="cpu",
        candidates=("efficient", "math"),
        deterministic=False,
        repeats=1,
    )
    assert c.backend == "math" and c.excluded["efficient"].startswith("unsupported")
    d = time_sdpa_backends(
        (1, 2, 8, 8),
        dtype=torch.float32,
        device="cpu",
        candidates=("cudnn", "math"),
        deterministic=True,
        repeats=1,
    )
    assert "non-deterministic" in d.excluded["cudnn"]
    with pytest.raises(OptionError, match="attention"):
        time_sdpa_backends(
            (1, 2, 8, 8), dtype=torch.float32, device="cpu", candidates=("efficient",), repeats=1
        )
    with pytest.raises(OptionError, match="'fast'"):
        time_sdpa_backends((1, 2, 8, 8), device="cpu", candidates=("fast",))


@pytest.mark.parametrize("backend", ["auto", "math", "flash"])
def test_routed_model_matches_that_backend(backend):
    torch.manual_seed(0)
    blocks = nn.ModuleList([Attn(), Attn()])
    x = torch.randn(2, 12, 32)
    log = []
    h = install_attention(blocks, backend, record=lambda kind, msg, **d: log.append((kind, msg, d)))
    outs = []
    for _ in range(2):  # the second forward reuses the backend found for these input shapes
        y = x
        for blk in blocks:
            y = blk(y)
        outs.append(y)
    chosen = backend if backend != "auto" else next(iter(h.choices.values())).backend
    if backend == "auto":
        assert set(h._by_input.values()) == {chosen}
    h.remove()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref = x
    with sdpa_kernel([{"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[chosen]]):
        for blk in blocks:
            ref = blk(ref)
    for y in outs:
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert (len(log) == 1) == (backend == "auto")  # timed once for the one shape, logged once


def test_recompute_runs_under_the_same_backend():
    torch.manual_seed(0)
    blocks = nn.ModuleList([Attn(), Attn()])
    install_attention(blocks, "auto")
    install_activation_policy(blocks, ["recompute", "recompute"], device="cpu")
    x = torch.randn(2, 12, 32, requires_grad=True)
    y = x
    for blk in blocks:
        y = blk(y)
    y.square().mean().backward()  # checkpoint's determinism check would fail on a different backend
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_timing_inside_a_hooked_forward_is_private(policy):
    """Regression: a backend timed for the first time inside a checkpointed (or offloaded) block's forward
    times its own SDPA backward; the enclosing block is neither recomputed nor offloaded for it."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([Attn(), Attn()])
    ref = copy.deepcopy(blocks)
    h = install_attention(blocks, "auto")
    acts = install_activation_policy(blocks, [policy] * 2, device="cpu", min_offload_bytes=0)
    x = torch.randn(2, 11, 32)  # a shape no other test times: the cache is cold
    for step in range(2):
        y = x
        for blk in blocks:
            y = blk(y)
        st = acts.stats()
        if policy == "recompute":
            assert st["recomputed_forwards"] == 2 * step  # none during the forward
        else:  # block 0 timed (cold cache), block 1 not: the timing tensors were not offloaded with it
            assert st["block_offloaded_bytes"][0] == st["block_offloaded_bytes"][1] > 0
        y.square().mean().backward()
    assert acts.stats()["recomputed_forwards"] == (2 * 2 if policy == "recompute" else 0)
    chosen = next(iter(h.choices.values())).backend
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([{"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[chosen]]):
        y = x
        for blk in ref:
            y = blk(y)
        (y.square().mean() * 2).backward()  # two steps' gradients accumulated
    for p, q in zip(ref.parameters(), blocks.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_bad_backend_names():
    with pytest.raises(OptionError, match="attention='fastest'"):
        install_attention(nn.Linear(2, 2), "fastest")
    with pytest.raises(OptionError, match="deterministic"):
        install_attention(nn.Linear(2, 2), "efficient", deterministic=True)


@pytest.mark.gpu
def test_cuda_timing_and_deterministic_mode():
    shape = (2, 8, 512, 64)
    c = time_sdpa_backends(shape, dtype=torch.bfloat16, device="cuda", deterministic=False, repeats=3)
    print(f"SDPA backends on {shape} bf16: {c.times_ms}, chose {c.backend}, left out {c.excluded}")
    assert c.backend in c.times_ms and c.times_ms[c.backend] == min(c.times_ms.values())
    assert "flash" in c.times_ms  # Hopper runs flash attention on bf16 with Dh=64
    d = time_sdpa_backends(shape, dtype=torch.bfloat16, device="cuda", deterministic=True, repeats=3)
    assert d.backend in ("flash", "math")
    assert set(d.excluded) >= {"efficient", "cudnn"}
