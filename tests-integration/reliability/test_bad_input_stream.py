"""Fuzzed bad input to ``tidal_stream.wrap``: every option, the model and the optimizer.

Each generated value must be refused with a ``ValueError`` / ``TypeError`` (the package's ``OptionError``
is a ``ValueError``) whose message names the option — never another exception type, never a hang.
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

from tidal_stream import WrapOptions, unwrap, wrap

pytestmark = pytest.mark.timeout(120)

OPTION_VALUES = {
    "vram_budget": bad_bytes(),
    "device": st.sampled_from(["tpu", "gpu", "meta", "xla:0", "", "cpu:zz", "mps", "cuda:-1", "npu"]),
    "threads": bad_pos_int(none_ok=True),
    "verbose": bad_bool(),
    "accumulation_steps": bad_pos_int(none_ok=False),
    "max_grad_norm": st.one_of(
        st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf")]), junk_text, st.booleans()
    ),
    "moment_dtype": st.one_of(
        bad_choice(("fp32", "bf16", "auto")), st.sampled_from([torch.float32, torch.bfloat16])
    ),
    "offload": bad_choice(("auto",)).filter(lambda v: not isinstance(v, bool)),
    "delayed_update": bad_bool(),
    "rollback": bad_bool(),
    "lr": st.one_of(
        st.floats(max_value=0.0, exclude_max=True), st.just(float("nan")), junk_text, st.booleans()
    ),
    "seed": st.one_of(floats_any, junk_text, st.none(), st.booleans()),
    "plan": st.one_of(
        st.integers(), junk_text, st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    ),
    "batch_tokens": bad_pos_int(none_ok=True),
    "host_ram": bad_bytes(),
    "loss_chunk_tokens": bad_pos_int(none_ok=True),
    "param_offload": bad_fraction(list_ok=True),
    "activation_offload": bad_fraction(list_ok=False),
    "recompute": bad_fraction(list_ok=True),
    "prefetch_depth": bad_pos_int(none_ok=True, minimum=0),
    "max_inflight_bytes": bad_bytes(),
    "blocks": st.one_of(
        st.integers(), st.just([]), st.lists(st.integers(), min_size=1, max_size=3), floats_any
    ),
    "attention": st.one_of(
        junk_text.filter(lambda s: s not in ("auto", "flash", "efficient", "cudnn", "math")), st.integers()
    ),
    "distributed": bad_choice(("auto",)).filter(lambda v: not isinstance(v, bool)),
    "cuda_graphs": bad_choice(("auto",)).filter(lambda v: not isinstance(v, bool)),
}


def test_every_option_is_fuzzed():
    assert set(OPTION_VALUES) == {f.name for f in dataclasses.fields(WrapOptions)}


@pytest.mark.parametrize("option", sorted(OPTION_VALUES))
def test_wrap_option(option, fuzz_count):
    model = make_model(layers=2)

    @fuzz(25)
    @given(value=OPTION_VALUES[option])
    def run(value):
        fuzz_count("wrap(option=...)")
        try:
            refused(lambda: wrap(model, None, **{option: value}), option)
        finally:
            if hasattr(model, "_tidal_session"):
                unwrap(model)

    run()


@fuzz(40)
@given(name=st.from_regex(r"[a-z][a-z_]{0,14}", fullmatch=True))
def test_wrap_unknown_option(name, fuzz_count):
    if name in {f.name for f in dataclasses.fields(WrapOptions)}:
        return
    fuzz_count("wrap(unknown option)")
    refused(lambda: wrap(make_model(layers=1), None, **{name: 1}), name)


@fuzz(20)
@given(
    model=st.one_of(st.none(), st.integers(), junk_text, st.just(torch.ones(3)), st.just([nn.Linear(2, 2)]))
)
def test_wrap_non_module_model(model, fuzz_count):
    fuzz_count("wrap(model=non-module)")
    refused(lambda: wrap(model), "model")


def test_wrap_empty_model(fuzz_count):
    fuzz_count("wrap(model=empty)")
    refused(lambda: wrap(nn.Module(), None, offload=True), "model", match="param")


@pytest.mark.parametrize("option", ["param_offload", "recompute"])
def test_wrap_model_without_block_stack(option, fuzz_count):
    """Streaming or recompute asked for a model that has no block stack: refused, naming ``blocks``."""
    fuzz_count("wrap(no block stack)")
    refused(lambda: wrap(NoStack(), None, offload=True, **{option: True}), option, match="block")


@fuzz(20)
@given(
    indices=st.lists(st.integers(min_value=2, max_value=10**6), min_size=1, max_size=3),
    option=st.sampled_from(["param_offload", "recompute"]),
)
def test_wrap_block_index_out_of_range(indices, option, fuzz_count):
    fuzz_count("wrap(block index out of range)")
    model = make_model(layers=2)
    try:
        refused(lambda: wrap(model, None, offload=True, blocks=model.blocks, **{option: indices}), option)
    finally:
        if hasattr(model, "_tidal_session"):
            unwrap(model)


@fuzz(20)
@given(path=st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,2}", fullmatch=True))
def test_wrap_blocks_path_missing(path, fuzz_count):
    fuzz_count("wrap(blocks=missing path)")
    model = make_model(layers=2)
    if path == "blocks":
        return
    try:
        refused(lambda: wrap(model, None, offload=True, param_offload=True, blocks=path), "blocks")
    finally:
        if hasattr(model, "_tidal_session"):
            unwrap(model)


@pytest.mark.parametrize(
    "make_opt, option",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "optimizer"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True), "amsgrad"),
    ],
)
def test_wrap_unsupported_optimizer(make_opt, option, fuzz_count):
    fuzz_count("wrap(optimizer)")
    model = make_model(layers=1)
    refused(lambda: wrap(model, make_opt(model.parameters()), offload=True), option)


def test_wrap_lr_with_optimizer(fuzz_count):
    fuzz_count("wrap(lr with optimizer)")
    model = make_model(layers=1)
    refused(lambda: wrap(model, torch.optim.AdamW(model.parameters()), lr=0.1), "lr")


def test_wrap_twice(fuzz_count):
    fuzz_count("wrap(already wrapped)")
    model = make_model(layers=1)
    wrap(model, None, offload=True)
    try:
        refused(lambda: wrap(model, None, offload=True), "model")
    finally:
        unwrap(model)
