import pytest

from tidal_plan import PlanConfig, PlanConfigError


def _bpw(fmt: str) -> float:
    return {"int8": 1.0625, "nf4": 0.52, "fp8": 1.0, "nvfp4": 0.5625}[fmt]


def test_defaults_are_valid():
    c = PlanConfig()
    assert c.batch_tokens == 4096 and c.prefetch_depth == 2 and c.quantize is None
    assert c.bytes_or_none("vram_budget") is None
    assert PlanConfig(vram_budget="24GiB").bytes_or_none("vram_budget") == 24 * 1024**3


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"vram_budget": "lots"}, "vram_budget"),
        ({"vram_budget": 0}, "vram_budget"),
        ({"host_ram": -1}, "host_ram"),
        ({"batch_tokens": 0}, "batch_tokens"),
        ({"batch_tokens": 2.5}, "batch_tokens"),
        ({"training": "partial"}, "training"),
        ({"quantize": "int4", "bytes_per_weight": _bpw}, "quantize"),
        ({"quantize": "nf4"}, "bytes_per_weight"),
        ({"bytes_per_weight": 3}, "bytes_per_weight"),
        ({"prefer": "cheap"}, "prefer"),
        ({"moment_dtype": "fp16"}, "moment_dtype"),
        ({"offload": "yes"}, "offload"),
        ({"offload": 0.5}, "offload"),
        ({"param_offload": 1.5}, "param_offload"),
        ({"param_offload": [0, -1]}, "param_offload"),
        ({"activation_offload": [1]}, "activation_offload"),
        ({"recompute": "sometimes"}, "recompute"),
        ({"recompute": True, "activation_offload": True}, "recompute"),
        ({"prefetch_depth": 0}, "prefetch_depth"),
        ({"prefetch_depth": True}, "prefetch_depth"),
        ({"max_inflight_bytes": "1 parsec"}, "max_inflight_bytes"),
        ({"headroom_bytes": -5}, "headroom_bytes"),
        ({"master_weights": "maybe"}, "master_weights"),
    ],
)
def test_bad_options_name_the_option(kwargs, option):
    with pytest.raises(PlanConfigError) as e:
        PlanConfig(**kwargs)
    assert e.value.option == option
    assert f"{option}=" in str(e.value) and "accepted" in str(e.value)


def test_good_policies():
    PlanConfig(param_offload=0.5, recompute=[0, 3], activation_offload=0.25, offload=True)
    PlanConfig(quantize="auto", bytes_per_weight=_bpw, moment_dtype="bf16", max_inflight_bytes="2GiB")
