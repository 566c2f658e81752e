import json
from pathlib import Path

import pytest
import torch

from tidal_plan import UNLIMITED, HardwareProfile, PlanConfigError, profile_hardware
from tidal_plan.units import GiB


def test_synthetic_defaults_resemble_the_h200_box():
    p = HardwareProfile.synthetic()
    assert p.device_kind == "cuda" and p.compute_capability == (9, 0)
    assert p.has_fp8_tensor_cores and not p.has_fp4_tensor_cores
    assert p.vram_budget_bytes == p.device_free_bytes - GiB
    assert p.pagelock_limit_bytes == UNLIMITED
    assert "H2D 55.4 GB/s" in p.summary() and "unlimited" in p.summary()


def test_synthetic_overrides_and_round_trip():
    p = HardwareProfile.synthetic(vram_budget_bytes="24GiB", host_ram_bytes="64GB", h2d_gbps=25.0)
    assert p.vram_budget_bytes == 24 * GiB and p.host_ram_bytes == 64 * 10**9 and p.h2d_gbps == 25.0
    q = HardwareProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p


def test_synthetic_rejects_unknown_and_bad_fields():
    with pytest.raises(PlanConfigError, match="vram_budgt"):
        HardwareProfile.synthetic(vram_budgt="24GiB")
    with pytest.raises(PlanConfigError, match="h2d_gbps"):
        HardwareProfile.synthetic(h2d_gbps=0)
    with pytest.raises(PlanConfigError, match="device_kind"):
        HardwareProfile.synthetic(device_kind="tpu")
    with pytest.raises(PlanConfigError, match=r"HardwareProfile\.from_dict"):
        HardwareProfile.from_dict({**HardwareProfile.synthetic().to_dict(), "extra": 1})


def test_cpu_profile_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    p = profile_hardware("cpu", vram_budget="2GiB", host_ram="8GiB")
    assert p.device_kind == "cpu" and p.compute_capability is None
    assert p.vram_budget_bytes == 2 * GiB and p.host_ram_bytes == 8 * GiB
    assert p.h2d_gbps > 0.1 and p.matmul_tflops > 0 and p.host_adamw_params_per_s > 1e6
    assert p.host_threads == 1
    files = list(Path(tmp_path).glob("profile-cpu-*.json"))
    assert len(files) == 1
    cached = json.loads(files[0].read_text())
    cached["h2d_gbps"] = 123.0  # a cached figure is used instead of re-measuring
    files[0].write_text(json.dumps(cached))
    assert profile_hardware("cpu").h2d_gbps == 123.0
    assert profile_hardware("cpu", force=True).h2d_gbps != 123.0


def test_cpu_profile_budget_defaults_to_host_ram_minus_headroom(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    p = profile_hardware("cpu", host_ram="8GiB", headroom="1GiB")
    assert p.vram_budget_bytes == 7 * GiB


def test_profile_hardware_bad_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    with pytest.raises(PlanConfigError, match="device="):
        profile_hardware("tpu")
    with pytest.raises(PlanConfigError, match="vram_budget="):
        profile_hardware("cpu", vram_budget="lots")
    with pytest.raises(PlanConfigError, match="headroom="):
        profile_hardware("cpu", headroom=-1)
    with pytest.raises(PlanConfigError, match="host_threads="):
        profile_hardware("cpu", host_threads=0)


def test_host_threads_are_used_for_the_measurement_and_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(2)
    p = profile_hardware("cpu", host_threads=1)
    assert p.host_threads == 1 and torch.get_num_threads() == 2
    assert "none (CPU stand-in)" in p.summary()
    torch.set_num_threads(1)


# Figures of the GPU machine (H200, PCIe Gen5) measured independently; a fresh profile must agree within 10 %.
H200_FIGURES = {"h2d_gbps": 55.4, "d2h_gbps": 55.2, "bidir_gbps": 94.0, "matmul_tflops": 780.0}


@pytest.mark.gpu
def test_cuda_profile_matches_the_machine_figures(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.zeros(1, device="cuda")  # CUDA context creation is not part of the profile's time
    t0 = time.perf_counter()
    p = profile_hardware("cuda", force=True)
    elapsed = time.perf_counter() - t0
    print(f"\n{p.summary()}\nprofiled in {elapsed:.2f} s")
    assert p.device_kind == "cuda" and p.compute_capability is not None
    assert 0 < p.vram_budget_bytes <= p.device_free_bytes <= p.device_total_bytes
    assert elapsed < 3.0  # quick mode
    if "H200" in p.device_name:
        for k, ref in H200_FIGURES.items():
            assert abs(getattr(p, k) - ref) <= 0.10 * ref, (k, getattr(p, k), ref)
        assert 3.7e9 * 0.9 <= p.host_adamw_params_per_s <= 4.3e9 * 1.1
        assert p.has_fp8_tensor_cores and not p.has_fp4_tensor_cores


@pytest.mark.gpu
def test_cuda_budget_honours_memory_fraction(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        p = profile_hardware("cuda", headroom=0)
        assert p.vram_budget_bytes <= 0.25 * total
        assert p.vram_budget_bytes > 0.2 * total
        assert profile_hardware("cuda", vram_budget="24GiB").vram_budget_bytes == 24 * GiB
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
