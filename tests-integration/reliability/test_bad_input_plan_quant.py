"""Fuzzed bad input to the planner (``PlanConfig``, ``plan``, ``census``, ``profile_hardware``,
``HardwareProfile.synthetic``) and the quantizer (``quantize``, ``dequantize``, ``quantize_model_``).

Each generated value must be refused with a ``ValueError`` / ``TypeError`` / the package's error class whose
message names the option.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _common import NoStack, make_model
from _fuzz import (
    bad_bool,
    bad_bytes,
    bad_choice,
    bad_fraction,
    bad_pos_int,
    floats_any,
    fuzz,
    junk_text,
    refused,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tidal_plan import HardwareProfile, PlanConfig, census, plan, profile_hardware
from tidal_quant import QuantizedWeight, dequantize, quantize, quantize_model_

pytestmark = pytest.mark.timeout(120)

PLAN_VALUES = {
    "vram_budget": bad_bytes(),
    "host_ram": bad_bytes(zero_ok=True),
    "batch_tokens": bad_pos_int(none_ok=False),
    "training": bad_choice(("full", "lora", "auto")),
    "quantize": bad_choice((None, "auto", "int8", "nf4", "fp8", "nvfp4")),
    "prefer": bad_choice(("memory", "speed")),
    "moment_dtype": bad_choice(("auto", "fp32", "bf16")),
    "offload": bad_choice(("auto",)).filter(lambda v: not isinstance(v, bool)),
    "param_offload": bad_fraction(list_ok=True),
    "activation_offload": bad_fraction(list_ok=False),
    "recompute": bad_fraction(list_ok=True),
    "prefetch_depth": bad_pos_int(none_ok=False),
    "max_inflight_bytes": bad_bytes(zero_ok=True),
    "bytes_per_weight": st.one_of(st.integers(), junk_text, floats_any),
    "headroom_bytes": bad_bytes(zero_ok=True),
    "master_weights": bad_choice(("auto",)).filter(lambda v: not isinstance(v, bool)),
    "seq_len": bad_pos_int(none_ok=True),
    "loss_chunk_tokens": bad_pos_int(none_ok=True),
    "cuda_graphs": bad_bool(),
}


def test_every_plan_option_is_fuzzed():
    assert set(PLAN_VALUES) == {f.name for f in dataclasses.fields(PlanConfig)}


@pytest.mark.parametrize("option", sorted(PLAN_VALUES))
def test_plan_config_option(option, fuzz_count):
    @fuzz(25)
    @given(value=PLAN_VALUES[option])
    def run(value):
        fuzz_count("PlanConfig(option=...)")
        refused(lambda: PlanConfig(**{option: value}), option)

    run()


@fuzz(30)
@given(
    which=st.sampled_from(["census", "profile", "config"]),
    value=st.one_of(
        st.none(), st.integers(), junk_text, st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)
    ),
)
def test_plan_arguments(which, value, fuzz_count):
    """``plan(census, profile, config)`` with a wrong type in one place: refused naming that argument."""
    fuzz_count("plan(...)")
    cen = census(make_model(layers=2))
    prof = HardwareProfile.synthetic()
    args = {"census": cen, "profile": prof, "config": PlanConfig()}
    if which == "config" and value is None:
        return  # None is the default config
    args[which] = value
    refused(lambda: plan(args["census"], args["profile"], args["config"]), which)


@fuzz(20)
@given(model=st.one_of(st.none(), st.integers(), junk_text, st.just(torch.ones(2))))
def test_census_non_module(model, fuzz_count):
    fuzz_count("census(model=...)")
    refused(lambda: census(model), "model")


def test_census_no_block_stack(fuzz_count):
    fuzz_count("census(no block stack)")
    refused(lambda: census(NoStack()), "blocks")


def test_census_empty_model(fuzz_count):
    fuzz_count("census(empty model)")
    refused(lambda: census(nn.Module()), "blocks")


@fuzz(30)
@given(
    blocks=st.one_of(
        st.integers(),
        st.from_regex(r"[a-z]{1,5}(\.[a-z]{1,3})?", fullmatch=True).filter(lambda s: s != "blocks"),
        st.just(nn.ModuleList()),
        st.just(nn.Linear(2, 2)),
    )
)
def test_census_bad_blocks(blocks, fuzz_count):
    fuzz_count("census(blocks=...)")
    refused(lambda: census(make_model(layers=2), blocks=blocks), "blocks")


PROFILE_VALUES = {
    "device": st.sampled_from(["tpu", "meta", "", "cpu:zz", "mps", "xla", "cuda:-1"]) | st.just(3.5),
    "vram_budget": bad_bytes(zero_ok=True),
    "host_ram": bad_bytes(zero_ok=True),
    "headroom": bad_bytes(zero_ok=True),
    "host_threads": bad_pos_int(none_ok=True),
}


@pytest.mark.parametrize("option", sorted(PROFILE_VALUES))
def test_profile_hardware_option(option, fuzz_count, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    # a cached profile so that an accepted value does not start a measurement
    profile_hardware("cpu")

    @fuzz(15)
    @given(value=PROFILE_VALUES[option])
    def run(value):
        fuzz_count("profile_hardware(option=...)")
        kw = {option: value} if option != "device" else {}
        refused(lambda: profile_hardware(value if option == "device" else "cpu", **kw), option)

    run()


def test_profile_hardware_zero_budget(fuzz_count, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    fuzz_count("profile_hardware(option=...)")
    refused(lambda: profile_hardware("cpu", vram_budget=0), "vram_budget")


@fuzz(30)
@given(
    field=st.sampled_from(
        [
            "vram_budget_bytes",
            "host_ram_bytes",
            "pagelock_limit_bytes",
            "h2d_gbps",
            "matmul_tflops",
            "device_kind",
            "host_threads",
        ]
    ),
    value=st.one_of(
        st.integers(max_value=-1),
        st.just(0.0),
        st.just(-1.5),
        junk_text.filter(lambda s: s not in ("cuda", "cpu")),
    ),
)
def test_synthetic_profile_fields(field, value, fuzz_count):
    if field.endswith("_bytes") and isinstance(value, str):
        value = value + "?"  # never a parseable size
    if field in ("host_threads",) and isinstance(value, str):
        return
    fuzz_count("HardwareProfile.synthetic(field=...)")
    refused(lambda: HardwareProfile.synthetic(**{field: value}), field)


# ----------------------------------------------------------------- quantizer

FMTS = ("int8", "nf4", "fp8", "nvfp4")


@fuzz(40)
@given(fmt=bad_choice(FMTS))
def test_quantize_bad_format(fmt, fuzz_count):
    fuzz_count("quantize(fmt=...)")
    refused(lambda: quantize(torch.randn(16, 64), fmt), "fmt", match="fmt|format")


@fuzz(60)
@given(
    fmt=st.sampled_from(FMTS),
    block=st.one_of(
        st.integers(max_value=1),
        st.integers(2500, 10**9).map(lambda x: 2 * x + 1),
        st.sampled_from([3, 7, 33, 101]),
        floats_any,
        junk_text,
        st.booleans(),
    ),
)
def test_quantize_bad_block_size(fmt, block, fuzz_count):
    fuzz_count("quantize(block_size=...)")
    refused(lambda: quantize(torch.randn(16, 64), fmt, block_size=block), "block_size")


@fuzz(60)
@given(
    fmt=st.sampled_from(FMTS),
    kind=st.sampled_from(["nan", "inf", "-inf"]),
    row=st.integers(0, 15),
    col=st.integers(0, 63),
)
def test_quantize_non_finite(fmt, kind, row, col, fuzz_count):
    fuzz_count("quantize(non-finite tensor)")
    w = torch.randn(16, 64)
    w[row, col] = float(kind)
    refused(lambda: quantize(w, fmt), "tensor", match="finite|nan|inf")


@fuzz(60)
@given(
    fmt=st.sampled_from(FMTS),
    shape=st.one_of(
        st.lists(st.integers(1, 8), min_size=0, max_size=1),
        st.lists(st.integers(1, 4), min_size=3, max_size=4),
        st.tuples(st.integers(0, 3), st.just(0)),
        st.tuples(st.just(0), st.integers(1, 3)),
    ),
)
def test_quantize_bad_shape(fmt, shape, fuzz_count):
    fuzz_count("quantize(shape)")
    refused(
        lambda: quantize(torch.randn(*shape) if shape else torch.randn(()), fmt),
        "shape",
        match="shape|tensor|in_features|dim",
    )


@fuzz(40)
@given(
    fmt=st.sampled_from(FMTS),
    dtype=st.sampled_from(
        [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64, torch.complex64]
    ),
)
def test_quantize_bad_dtype(fmt, dtype, fuzz_count):
    fuzz_count("quantize(dtype)")
    t = (torch.randn(16, 64) * 10).to(dtype)
    refused(lambda: quantize(t, fmt), "dtype", match="dtype|tensor")


@fuzz(20)
@given(
    tensor=st.one_of(st.none(), st.integers(), junk_text, st.lists(st.floats(-1, 1), min_size=1, max_size=4))
)
def test_quantize_not_a_tensor(tensor, fuzz_count):
    fuzz_count("quantize(tensor=non-tensor)")
    refused(lambda: quantize(tensor, "int8"), "tensor")


@fuzz(30)
@given(fmt=st.sampled_from(FMTS), dq=st.one_of(st.integers(), junk_text, st.none(), floats_any))
def test_quantize_bad_double_quant(fmt, dq, fuzz_count):
    fuzz_count("quantize(double_quant=...)")
    refused(lambda: quantize(torch.randn(16, 64), fmt, double_quant=dq), "double_quant")


@fuzz(30)
@given(
    qw=st.one_of(st.none(), st.integers(), junk_text, st.just(torch.randn(4, 4))),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_dequantize_not_quantized(qw, dtype, fuzz_count):
    fuzz_count("dequantize(qw=...)")
    refused(lambda: dequantize(qw, dtype), "qw", match="qw|QuantizedWeight")


@fuzz(20)
@given(
    fmt=st.sampled_from(FMTS),
    dtype=st.one_of(st.sampled_from([torch.int8, torch.float64, torch.uint8]), junk_text, st.none()),
)
def test_dequantize_bad_dtype(fmt, dtype, fuzz_count):
    fuzz_count("dequantize(dtype=...)")
    qw = quantize(torch.randn(16, 64), fmt)
    assert isinstance(qw, QuantizedWeight)
    refused(lambda: dequantize(qw, dtype), "dtype")


@fuzz(20)
@given(fmt=bad_choice(FMTS), model=st.sampled_from(["tiny", "empty"]))
def test_quantize_model_bad_format(fmt, model, fuzz_count):
    fuzz_count("quantize_model_(fmt=...)")
    m = make_model(layers=1) if model == "tiny" else nn.Module()
    refused(lambda: quantize_model_(m, fmt), "fmt", match="fmt|format")
