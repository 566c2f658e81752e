"""decode8b (benchmarks/kv/decode.py): memory estimates, case order, time limits, the table, a CPU run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv"))

import decode
import decode_worker as dw

LLAMA3_8B = dw.Shape(layers=32, kv_heads=8, head_dim=128, heads=32)


@pytest.fixture(autouse=True)
def _few_threads():
    with torch_threads(1):
        yield


def test_llama3_8b_kv_estimates() -> None:
    e = dw.estimate(LLAMA3_8B, batch=16, ctx=32768, resident=16, slots=2, page=256)
    assert e["kv"] == 64.0  # 128 KiB per token: 32 layers x K+V x 8 heads x 128 x bf16
    assert e["tidal_host"] == 32.0
    # 16 resident layers + 2 slots of 2 GiB, 16 partial pages of 16 MiB, 128 MiB of staging, the GQA copy
    assert e["tidal_vram"] == pytest.approx(16 * 2 + 2 * 2 + 16 / 64 + 1 / 8 + 8)
    assert e["dynamic_vram"] == pytest.approx(64 + 2 + 8)
    assert e["offloaded_host"] == 64.0
    small = dw.estimate(LLAMA3_8B, batch=1, ctx=4096, resident=16, slots=2, page=256)
    assert small["kv"] == 0.5
    assert small["pcie_floor_ms"] == pytest.approx(256 * 2**20 / 55.4e9 * 1e3)


def test_offloaded_host_estimate_rounds_to_powers_of_two() -> None:
    # 4097 tokens need a little more than 8 MiB per K: torch's pinned cache hands out 16 MiB blocks
    e = dw.estimate(LLAMA3_8B, batch=1, ctx=4097, resident=16, slots=2, page=256)
    assert e["offloaded_host"] == 32 * 2 * 16 / 1024


def test_cases_run_smallest_kv_first() -> None:
    assert dw.cases([32768, 4096], [16, 1]) == [(4096, 1), (32768, 1), (4096, 16), (32768, 16)]


def test_time_limit_interrupts_python_work() -> None:
    t0 = time.perf_counter()
    with pytest.raises(dw.CaseTimeout), dw.time_limit(0.2):
        while True:
            time.sleep(0.01)
    assert time.perf_counter() - t0 < 2.0
    with dw.time_limit(5.0):  # cancelled on exit: nothing fires later
        pass
    time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return dw.build_model(decode.model_config(smoke=True), "cpu", torch.float32)


def _args(**kw):
    args = decode.parse(["--smoke", "--contexts", "60", "--batches", "2", "--steps", "3", "--warmup", "1"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_run_case_tidal_is_prefetched_and_timed(tiny) -> None:
    row = dw.run_case("tidal", tiny, _args(), 60, 2, limit_s=60.0)
    assert row["status"] == "ok", row
    assert row["steps"] == 3 and row["tokens_per_s"] > 0
    assert row["offloaded_layers"] == 4 and row["prefetched"] > 0 and row["gathered_on_demand"] == 0
    assert row["kv_host_gib"] > 0 and row["all_resident_gib"] > 0 and row["h2d_gb_per_s"] > 0


def test_run_case_past_its_limit_gives_a_timeout_row(tiny, monkeypatch) -> None:
    real = dw.step

    def slow(*a):
        time.sleep(0.5)
        return real(*a)

    monkeypatch.setattr(dw, "step", slow)
    row = dw.run_case("dynamic", tiny, _args(), 60, 2, limit_s=0.3)
    assert row["status"] == "timeout" and row["phase"] == "warmup", row
    assert "tokens_per_s" not in row


def test_parity_of_tidal_and_dynamic_is_exact(tiny) -> None:
    assert dw.parity(tiny, page_tokens=16) == 0.0


def test_table_and_goals_show_ratios_timeouts_and_missing_engines() -> None:
    args = decode.parse(["--contexts", "4096", "--batches", "1", "16"])
    common = {"decode_vram_peak_gib": 1.0, "status": "ok"}
    tidal = {"prefetched": 32, "gathered_on_demand": 0, "h2d_gb_per_s": 50.0, "kv_device_gib": 0.3,
             "all_resident_gib": 0.5, "kv_host_gib": 0.25}  # fmt: skip
    rows = [
        {"engine": "dynamic", "context": 4096, "batch": 1, "tokens_per_s": 40.0, "ms_per_step": 25.0, **common},
        {"engine": "tidal", "context": 4096, "batch": 1, "tokens_per_s": 38.0, "ms_per_step": 26.3, **common,
         "decode_vram_peak_gib": 0.7, **tidal},
        {"engine": "offloaded", "context": 4096, "batch": 1, "tokens_per_s": 10.0, "ms_per_step": 100.0, **common},
        {"engine": "dynamic", "context": 4096, "batch": 16, "tokens_per_s": 500.0, "ms_per_step": 32.0, **common},
        {"engine": "tidal", "context": 4096, "batch": 16, "status": "timeout", "detail": "passed the 80 s case limit"},
    ]  # fmt: skip
    decode.fill_missing("offloaded", args, rows, "engine process killed at its deadline (90 s)")
    text = decode.table(rows, args, LLAMA3_8B)
    assert "| tidal | 4096 | 1 | ok | 38.0 | 26.3 | 0.95 | 3.80 |" in text
    assert "| tidal | 4096 | 16 | timeout |" in text and "passed the 80 s case limit" in text
    assert "| offloaded | 4096 | 16 | timeout |" in text and "killed at its deadline" in text
    lines = decode.goals(rows, args, LLAMA3_8B)
    assert "0.95x dynamic (goal 0.9: met" in lines[0] and "3.80x offloaded (goal 2: met)" in lines[0]
    assert "VRAM saved 0.30 GiB measured" in lines[0]
    assert lines[1] == "context 4096 batch 16: tidal has no measurement"


def test_estimates_text_says_whether_the_largest_case_fits() -> None:
    args = decode.parse([])
    text = decode.estimates_text(args, LLAMA3_8B, weights_gib=14.96)
    assert "| 32768 | 16 | 64.00 |" in text and "= 89.0 GiB" in text


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--engines", "dynamic,vllm"], "--engines: unknown"),
        (["--steps", "0"], "--steps"),
        (["--contexts", "8"], "--contexts"),
    ],
)
def test_bad_options_are_named(argv, match, capsys) -> None:
    with pytest.raises(SystemExit):
        decode.parse(argv)
    assert match in capsys.readouterr().err


def test_a_budget_too_short_for_the_engines_is_refused_with_what_they_need(capsys) -> None:
    four = ["--engines", "dynamic,tidal,tidal-nf4,offloaded"]
    with pytest.raises(SystemExit):
        decode.parse([*four, "--budget-s", "190"])
    err = capsys.readouterr().err
    assert "--budget-s: got 190" in err and "at least 210 s" in err and "offloaded 75" in err
    assert decode.parse([*four, "--budget-s", "210"]).budget_s == 210
    assert decode.parse([]).budget_s == 200  # the default engines fit the default budget
    assert decode.parse(["--smoke", *four, "--budget-s", "140"]).smoke  # no offloaded cache on the CPU


@pytest.mark.slow
def test_smoke_run_end_to_end(capsys) -> None:
    rc = decode.main(["--smoke", "--engines", "dynamic,tidal", "--contexts", "40", "--batches", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| tidal | 40 | 2 | ok |" in out and "| dynamic | 40 | 2 | ok |" in out
    assert "max |Δ logits| = 0.0" in out


def test_offloaded_engine_really_offloads(tiny) -> None:
    cache = dw.make_cache("offloaded", tiny, 64, 16, 2)
    assert getattr(cache, "offloading", False) is True  # the baseline is transformers' offloaded cache


def test_engines_run_in_fixed_order_with_the_offloaded_cache_last() -> None:
    args = decode.parse(["--engines", "offloaded,tidal,dynamic"])
    assert [e for e in decode.ENGINES if e in args.engine_list] == ["dynamic", "tidal", "offloaded"]
    fwd = decode.forward_args(args)
    assert fwd[fwd.index("--offloaded-steps") + 1] == "3" and fwd[fwd.index("--steps") + 1] == "8"
    assert fwd[fwd.index("--sdpa") + 1] == "default"  # torch's own attention backends unless asked
    no_cudnn = decode.forward_args(decode.parse(["--sdpa", "no-cudnn"]))
    assert no_cudnn[no_cudnn.index("--sdpa") + 1] == "no-cudnn"  # every worker runs with the same backends


def test_sdpa_choice_limits_the_backends_torch_may_pick(tiny) -> None:
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, 2, 1, 8)
    kv = torch.randn(1, 2, 5, 8)
    with dw.sdpa_backends("default"):
        ref = F.scaled_dot_product_attention(q, kv, kv)
    with dw.sdpa_backends("no-cudnn"):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.allclose(F.scaled_dot_product_attention(q, kv, kv), ref, atol=1e-6)
    with dw.sdpa_backends("flash"):
        assert not torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored on the way out
    with pytest.raises(KeyError):
        dw.sdpa_backends("cudnn-only")
