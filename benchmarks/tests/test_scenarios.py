"""The scenario table: exact public shapes, defaults, and errors that name the option."""

from __future__ import annotations

import pytest
import torch
from engines import ENGINES, get_engine, select
from engines.common import build_meta_model
from engines.scenarios import SCENARIOS, get_scenario, hf_config


@pytest.mark.parametrize(
    ("name", "billions"),
    [("lora14b", 14.77), ("full1.5b", 1.54), ("full8b", 8.03), ("lora72b", 72.7), ("lora110b", 111.2)],
)
def test_param_counts_match_the_published_models(name: str, billions: float) -> None:
    assert SCENARIOS[name].param_count() / 1e9 == pytest.approx(billions, abs=0.01 * billions)


@pytest.mark.parametrize("name", ["smoke", "full1.5b", "lora14b", "full8b"])
def test_param_count_formula_agrees_with_transformers(name: str) -> None:
    sc = SCENARIOS[name]
    model = build_meta_model(sc, torch.bfloat16)  # meta: no memory, exact shapes
    assert sum(p.numel() for p in model.parameters()) == sc.param_count()


def test_issue_scenarios_and_settings() -> None:
    want = {"lora14b", "lora14b_2k", "full1.5b", "full8b", "lora72b", "lora110b", "decode8b"}
    assert want <= set(SCENARIOS)
    assert SCENARIOS["lora14b"].batch == 1 and SCENARIOS["lora14b"].seq == 512
    assert SCENARIOS["lora14b_2k"].seq == 2048
    assert (SCENARIOS["full8b"].batch, SCENARIOS["full8b"].seq) == (4, 2048)
    assert SCENARIOS["lora72b"].vram_gb == 80 and SCENARIOS["lora110b"].vram_gb is None
    assert SCENARIOS["lora14b"].lr == 2e-4 and SCENARIOS["full1.5b"].lr == 2e-5
    assert hf_config(SCENARIOS["full1.5b"]).tie_word_embeddings is True


def test_unknown_names_list_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"--scenario: got 'lora13b'; accepted: lora14b"):
        get_scenario("lora13b")
    with pytest.raises(ValueError, match=r"--engines: got 'zero9'.*stock"):
        get_engine("zero9")


def test_select_keeps_table_order_and_all() -> None:
    assert [e.name for e in select("all")] == list(ENGINES)
    assert [e.name for e in select("tidal-nf4, stock")] == ["tidal-nf4", "stock"]


def test_every_peer_of_the_issue_has_a_row() -> None:
    names = set(ENGINES)
    assert {
        "stock",
        "bnb-nf4",
        "bnb-nf4-ckpt",
        "trainstream",
        "ds-zero2",
        "ds-zero3",
        "blockstreamer",
    } <= names
    assert {"tidal", "tidal-bf16", "tidal-nf4", "tidal-fp8", "tidal-nvfp4"} <= names
    assert not ENGINES["bnb-nf4"].applies(SCENARIOS["full1.5b"])
    assert ENGINES["ds-zero3"].applies(SCENARIOS["full1.5b"])


@pytest.mark.parametrize(
    ("field", "value"), [("mode", "train"), ("arch", "gpt2"), ("batch", 0), ("vram_gb", -1.0)]
)
def test_bad_scenario_fields_are_rejected(field: str, value: object) -> None:
    import dataclasses

    with pytest.raises(ValueError, match=field.split("_")[0]):
        dataclasses.replace(SCENARIOS["smoke"], **{field: value})


def test_tidal_is_told_the_batch_only_when_it_exceeds_the_plans_default():
    """full8b steps 8,192 tokens, more than the 4,096 the plan assumes unless told: the engine passes
    batch_tokens (else the plan sizes the loss for half the logits and the first step runs out of memory);
    the LoRA scenarios step fewer tokens and keep the default."""
    from engines.tidal_engine import _batch_tokens

    assert _batch_tokens(SCENARIOS["full8b"]) == {"batch_tokens": 4 * 2048}
    for name in ("lora14b", "lora14b_2k", "full1.5b", "lora72b"):
        assert _batch_tokens(SCENARIOS[name]) == {}


def test_tidal_wraps_again_with_the_models_host_bytes_only_after_a_host_ram_refusal(monkeypatch):
    """The engine follows the refusal's note: a plan refused for host RAM is retried once with host_ram =
    the plan's usable host RAM plus the model's own host bytes; a VRAM refusal, or a host RAM refusal
    with host_ram already given, stands."""
    from engines.tidal_engine import _wrap_as_the_note_says
    from torch import nn

    import tidal_stream
    from tidal_plan import InfeasiblePlan

    model = nn.Linear(256, 256)
    held = (256 * 256 + 256) * 4  # its fp32 weight and bias, in host memory
    calls, refusing = [], {"resource": "host_ram", "until": "retry"}

    def fake_wrap(m, opt, **options):
        calls.append(options)
        if refusing["until"] != "retry" or "host_ram" not in options:
            res = refusing["resource"]
            raise InfeasiblePlan(res, 10 * 2**30, 2**30, f"not enough {res}")
        return m, opt

    monkeypatch.setattr(tidal_stream, "wrap", fake_wrap)
    assert _wrap_as_the_note_says(model, None, {"device": "cpu"}) == (model, None)
    assert calls == [{"device": "cpu"}, {"device": "cpu", "host_ram": 2**30 + held}]
    refusing.update(resource="vram", until="never")
    for options in ({}, {"host_ram": "5GiB"}):
        calls.clear()
        with pytest.raises(InfeasiblePlan):
            _wrap_as_the_note_says(model, None, options)
        assert len(calls) == 1
    refusing.update(resource="host_ram")
    calls.clear()
    with pytest.raises(InfeasiblePlan):
        _wrap_as_the_note_says(model, None, {"host_ram": "5GiB"})
    assert len(calls) == 1


def test_host_work_note_reports_completed_steps_waits_and_the_largest_idle_gaps():
    from engines.tidal_engine import host_work_note

    work = {
        "steps": 4,
        "updates": 30,
        "steps_done": 3,
        "update_s_per_step": 7.5,
        "worker_busy_s_per_step": 7.75,
        "land_wait_s": 1.0,
        "update_wait_s": 4.0,
        "last_step_idle": [(0.5, 0.25), (2.0, 1.5), (3.0, 0.002)],
    }
    note = host_work_note(work)
    assert "30 parameter updates in 4 steps; over the 3 whose updates all ran, 7.500 s of AdamW" in note
    assert "busy 7.750 s per step" in note and "(mean of 4) it waited 0.250 s" in note
    assert "forward 1.000 s for updates" in note and "idle 1.752 s in 3 gaps" in note
    assert "(largest: 0.250 s at +0.500 s, 1.500 s at +2.000 s, 0.002 s at +3.000 s)" in note
