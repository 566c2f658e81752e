"""Pure logic shared by every engine process: filler sizing, seeded materialization, data, outcomes."""

from __future__ import annotations

import pytest
import torch
from engines.common import (
    FILLER_GRANULARITY,
    BudgetError,
    Timing,
    add_lora,
    build_meta_model,
    canonical,
    decoder_layers,
    filler_bytes,
    first_line,
    is_oom,
    make_batch,
    materialize,
    run_steps,
)
from engines.scenarios import SCENARIOS, GiB

MiB = 1 << 20


def test_filler_leaves_exactly_the_budget_rounded_to_pages() -> None:
    free = 139 * GiB + 123 * MiB
    f = filler_bytes(free, 24 * GiB)
    assert f % FILLER_GRANULARITY == 0
    left = free - f
    assert 24 * GiB <= left < 24 * GiB + FILLER_GRANULARITY
    assert filler_bytes(24 * GiB, 24 * GiB) == 0


def test_filler_refuses_a_budget_larger_than_free_memory() -> None:
    with pytest.raises(BudgetError, match=r"--vram-gb: 80.00 GiB asked but only 40.00 GiB is free"):
        filler_bytes(40 * GiB, 80 * GiB)
    with pytest.raises(BudgetError, match="positive"):
        filler_bytes(40 * GiB, 0)


def test_canonical_names_ignore_peft_wrapping() -> None:
    assert canonical("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )


def _tiny(full: bool = False):
    return build_meta_model(SCENARIOS["smoke_full" if full else "smoke"], torch.float32)


def test_materialize_fills_every_tensor_block_by_block() -> None:
    model = _tiny()
    seen: list[int] = []
    materialize(model, "device", device=torch.device("cpu"), seed=3, block_hook=lambda b: seen.append(id(b)))
    assert seen == [id(b) for b in decoder_layers(model)]
    for name, p in model.named_parameters():
        assert p.device.type == "cpu", name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert 0.015 < p.std().item() < 0.025, name  # N(0, 0.02), never zeros
    inv = model.model.rotary_emb.inv_freq
    assert inv.device.type == "cpu" and torch.isfinite(inv).all() and inv[0] == 1.0


def test_same_values_with_lora_added_before_or_after_materialize() -> None:
    before = add_lora(_tiny(), seed=1)
    materialize(before, "device", device=torch.device("cpu"), seed=1)
    after = _tiny()
    materialize(after, "device", device=torch.device("cpu"), seed=1)
    after = add_lora(after, seed=1)
    a, b = dict(before.named_parameters()), dict(after.named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    lora_b = [p for n, p in a.items() if "lora_B" in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)  # standard LoRA init: B = 0


def test_tied_embeddings_stay_tied() -> None:
    model = _tiny()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    materialize(model, "device", device=torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"


def test_seed_changes_values() -> None:
    m0, m1 = _tiny(), _tiny()
    materialize(m0, "device", device=torch.device("cpu"), seed=0)
    materialize(m1, "device", device=torch.device("cpu"), seed=1)
    assert not torch.equal(m0.model.layers[0].mlp.up_proj.weight, m1.model.layers[0].mlp.up_proj.weight)


def test_batch_is_seeded_and_in_vocab() -> None:
    sc = SCENARIOS["smoke"]
    x, y = make_batch(sc, 256, "cpu", seed=0), make_batch(sc, 256, "cpu", seed=0)
    assert x.shape == (sc.batch, sc.seq) and torch.equal(x, y)
    assert x.min() >= 0 and x.max() < 256 and x.unique().numel() > 10
    assert not torch.equal(x, make_batch(sc, 256, "cpu", seed=1))


def test_oom_classification_and_first_line() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError("TrainStream: even with every block paged ..."))
    assert is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert first_line(ValueError("bad thing\nmore text")) == "ValueError: bad thing"


def test_run_steps_times_every_step_and_rejects_nan() -> None:
    losses = iter([3.0, 2.0, 1.5, 1.0])
    events: list[dict] = []
    t = run_steps(
        lambda: next(losses),
        warmup=1,
        steps=3,
        device=torch.device("cpu"),
        progress=events.append,
        timing=Timing(),
    )
    assert t.losses == [3.0, 2.0, 1.5, 1.0] and len(t.times) == 4
    assert t.peak_reserved == []  # CUDA only
    assert [e["warmup"] for e in events] == [True, False, False, False]
    assert t.median(1) == sorted(t.times[1:])[1]
    with pytest.raises(FloatingPointError, match="step 0: loss is nan"):
        run_steps(
            lambda: float("nan"),
            warmup=0,
            steps=1,
            device=torch.device("cpu"),
            progress=lambda e: None,
            timing=Timing(),
        )


def test_run_steps_counts_the_garbage_collectors_time_per_step() -> None:
    """A step that runs a full collection shows it (the lead on lora14b's one slow step in five)."""
    import gc

    def step(full: bool) -> float:
        if full:
            gc.collect(2)
        return 1.0

    plan = iter([False, True, False])
    t = run_steps(
        lambda: step(next(plan)),
        warmup=0,
        steps=3,
        device=torch.device("cpu"),
        progress=lambda e: None,
        timing=Timing(),
    )
    assert t.gc_full[1] >= 1 and t.gc_s[1] > 0  # the step that collected
    assert len(t.gc_full) == len(t.gc_s) == 3


@pytest.mark.gpu
def test_run_steps_reads_the_reserved_peak_after_every_step() -> None:
    """The peak so far after each step: the step holding the most lifts it, the later ones keep it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    sizes = iter([64, 512, 128])  # MiB held during each step

    def step() -> float:
        x = torch.ones(next(sizes) * MiB, dtype=torch.uint8, device=dev)
        return float(x[0])

    t = run_steps(step, warmup=0, steps=3, device=dev, progress=lambda e: None, timing=Timing())
    first, second, third = t.peak_reserved
    assert first >= 64 * MiB and second >= first + 448 * MiB and third == second


@pytest.mark.gpu
def test_filler_leaves_the_budget_free_and_device_peak_sees_allocations() -> None:
    from engines.common import DevicePeak, Filler

    dev = torch.device("cuda", torch.cuda.current_device())
    free0 = torch.cuda.mem_get_info(dev)[0]
    budget = min(8 * GiB, free0 // 2)
    filler = Filler(budget, dev)
    try:
        free = torch.cuda.mem_get_info(dev)[0]
        assert budget <= free < budget + 2 * FILLER_GRANULARITY, (free, budget)
        peak = DevicePeak(dev)
        x = torch.randn(256 * MiB, device=dev)  # 1 GiB of fp32, not zeros
        torch.cuda.synchronize(dev)
        used = peak.stop()
        assert GiB <= used < GiB + 64 * MiB, used
        del x
    finally:
        filler.release()


def test_bnb_block_quantization_replaces_linears_with_nf4() -> None:
    pytest.importorskip("bitsandbytes")
    from engines.bnb import quantize_block_
    from torch import nn

    torch.manual_seed(0)
    block = nn.ModuleDict({"proj": nn.Linear(256, 128, bias=False), "norm": nn.LayerNorm(256)}).to(
        torch.bfloat16
    )
    w = block["proj"].weight.detach().clone()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert quantize_block_(block, torch.device("cpu")) == 1
    q = block["proj"]
    assert type(q).__name__ == "Linear4bit" and q.weight.dtype == torch.uint8
    assert q.weight.numel() == w.numel() // 2  # two NF4 codes per byte
    assert isinstance(block["norm"], nn.LayerNorm)
    ref = (x @ w.t()).float()
    rel = ((q(x).float() - ref).norm() / ref.norm()).item()
    assert 0.02 < rel < 0.15  # 4-bit error: present, and bounded


def test_blockstreamer_driver_matches_transformers_loss() -> None:
    from engines.blockstreamer import causal_lm_loss

    model = add_lora(_tiny(), seed=0)
    materialize(model, "device", device=torch.device("cpu"), seed=0)
    base = model.get_base_model()
    sc = SCENARIOS["smoke"]
    ids = make_batch(sc, 256, "cpu")
    pos = torch.arange(sc.seq).unsqueeze(0).expand(sc.batch, -1)

    def run_blocks(h, **kw):  # what StreamedModel does: every block in order, the same kwargs
        for block in decoder_layers(model):
            h = block(h, **kw)
            h = h[0] if isinstance(h, tuple) else h
        return h

    ours = causal_lm_loss(base, run_blocks, ids, pos)
    ref = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
