"""bench_common (what the stream/ and distributed/ scripts share): timing, table, random weights, shape options."""

from __future__ import annotations

import argparse

import pytest
import torch
from bench_common import (
    QWEN2_ARGS,
    add_qwen2_args,
    fill_random_,
    markdown_table,
    random_blocks,
    random_qwen2,
    time_calls,
)
from torch import nn

CPU = torch.device("cpu")
TINY = dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=128, seq=16)


def test_time_calls_warms_up_then_times_each_call() -> None:
    calls: list[int] = []
    times = time_calls(lambda: calls.append(len(calls)), CPU, repeat=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_markdown_table_leaves_missing_cells_empty() -> None:
    got = markdown_table([{"a": 1, "b": 2.5}, {"a": "x"}], ["a", "b"])
    assert got.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2.5 |", "| x |  |"]


def test_fill_random_sets_norms_and_draws_the_rest_in_order() -> None:
    m = nn.ModuleDict({"proj": nn.Linear(8, 4), "norm": nn.LayerNorm(4)})
    g = torch.Generator().manual_seed(3)
    fill_random_(m, g)
    assert torch.equal(m["norm"].weight, torch.ones(4)) and torch.equal(m["norm"].bias, torch.zeros(4))
    g = torch.Generator().manual_seed(3)
    expect_w = torch.empty(4, 8).normal_(0.0, 0.02, generator=g)
    expect_b = torch.empty(4).normal_(0.0, 0.02, generator=g)
    assert torch.equal(m["proj"].weight, expect_w) and torch.equal(m["proj"].bias, expect_b)


def test_random_blocks_follow_the_global_seed() -> None:
    torch.manual_seed(0)
    a = random_blocks(lambda: nn.Linear(8, 8), 3, CPU, torch.bfloat16)
    torch.manual_seed(0)
    b = random_blocks(lambda: nn.Linear(8, 8), 3, CPU, torch.bfloat16)
    assert len(a) == 3 and a[0].weight.dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[0].weight, a[1].weight)


def test_qwen2_options_and_model() -> None:
    ap = argparse.ArgumentParser()
    add_qwen2_args(ap, TINY)
    args = ap.parse_args(["--layers", "1"])
    assert {k: getattr(args, k) for k in QWEN2_ARGS} == {**TINY, "layers": 1}
    m1 = random_qwen2(args, CPU, torch.Generator().manual_seed(0))
    m2 = random_qwen2(args, CPU, torch.Generator().manual_seed(0))
    assert m1.training and len(m1.model.layers) == 1 and m1.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, TINY["vocab"], (1, 8))
    with torch.no_grad():
        assert torch.equal(m1(input_ids=ids).logits, m2(input_ids=ids).logits)
        assert torch.isfinite(m1(input_ids=ids).logits.float()).all()
    with pytest.raises(ValueError, match=r"add_qwen2_args\(defaults=\): got .*accepted: exactly"):
        add_qwen2_args(argparse.ArgumentParser(), {k: v for k, v in TINY.items() if k != "seq"})
