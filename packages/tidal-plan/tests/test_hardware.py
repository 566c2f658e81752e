import json
import statistics
from pathlib import Path

import pytest
import torch

from tidal_plan import UNLIMITED, HardwareProfile, PlanConfigError, measure, profile_hardware
from tidal_plan.units import GiB, MiB


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


def test_optional_rates_default_to_none_and_round_trip(tmp_path, monkeypatch):
    p = HardwareProfile.synthetic()
    assert p.matmul_sustained_tflops is None and p.host_update_params_per_s is None
    d = p.to_dict()
    del d["matmul_sustained_tflops"], d["host_update_params_per_s"]  # a profile saved before they existed
    assert HardwareProfile.from_dict(d) == p
    q = HardwareProfile.synthetic(matmul_sustained_tflops=690.0, host_update_params_per_s=1.5e9)
    assert HardwareProfile.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    assert "690 sustained" in q.summary() and "whole bf16 update 1.50 G params/s" in q.summary()
    for bad in (0.0, -1.0, True):
        with pytest.raises(PlanConfigError, match="host_update_params_per_s"):
            HardwareProfile.synthetic(host_update_params_per_s=bad)
        with pytest.raises(PlanConfigError, match="matmul_sustained_tflops"):
            HardwareProfile.synthetic(matmul_sustained_tflops=bad)
    # a CPU profile measures the whole update (pageable) and caches it; it has no sustained matmul figure
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    cpu = profile_hardware("cpu", force=True)
    assert cpu.host_update_params_per_s > 1e5 and cpu.matmul_sustained_tflops is None
    assert any(n.startswith("host update ") and "pageable" in n for n in cpu.notes)
    assert profile_hardware("cpu").host_update_params_per_s == cpu.host_update_params_per_s


def test_the_profiled_fused_adamw_is_torch_adamw():
    """The probes time the kernel torch.optim.AdamW(fused=True) runs, with its hyper-parameters."""
    torch.manual_seed(0)
    p0 = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(3)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    mine, m, v, step = p0.clone(), torch.zeros(1000), torch.zeros(1000), torch.zeros(())
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        measure._fused_adamw([mine], [g.clone()], [m], [v], [step])
    assert torch.equal(mine, ref.detach()) and step.item() == 3


def test_host_update_probe_runs_the_update_on_a_worker_thread(monkeypatch):
    torch.set_num_threads(1)
    seen = []
    real = measure._fused_adamw

    def spy(params, *rest):
        import threading

        seen.append((threading.current_thread().name, params[0].dtype, params[0].numel()))
        real(params, *rest)

    monkeypatch.setattr(measure, "_fused_adamw", spy)
    rate, note = measure.host_update_rate(64_000, 2, pin=False, pieces=4)
    assert rate > 0 and "widen" in note and "narrow" in note and "pageable" in note
    # one warm-up and two timed steps over 4 slot-sized pieces, off the calling thread, on fp32 masters
    assert len(seen) == 12 and {s[0] for s in seen} == {"tidal-profile-host-update"}
    assert {s[1] for s in seen} == {torch.float32} and {s[2] for s in seen} == {16_000}


def test_device_memory_bandwidth_default_and_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    assert HardwareProfile.synthetic().hbm_gbps == 4200.0  # the documented H200-class default
    d = HardwareProfile.synthetic().to_dict()
    del d["hbm_gbps"]  # a profile saved before the field existed reads back with the default
    assert HardwareProfile.from_dict(d).hbm_gbps == 4200.0
    torch.set_num_threads(1)
    p = profile_hardware("cpu", force=True)
    # On the CPU stand-in the "device memory" is host memory: a copy, read and write counted.
    assert p.hbm_gbps == pytest.approx(2 * p.h2d_gbps) and "device memory" in p.summary()
    with pytest.raises(PlanConfigError, match="hbm_gbps"):
        HardwareProfile.synthetic(hbm_gbps=-1.0)


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


class _FakeCuda:
    """Memory figures of a CUDA device, for checking the budget arithmetic without one."""

    def __init__(self, monkeypatch, *, total, free, reserved, allocated, fraction=1.0):
        self.fraction = fraction
        props = type("Props", (), {"name": "Fake GPU", "major": 9, "minor": 0, "total_memory": total})
        for name, fn in {
            "is_available": lambda: True,
            "current_device": lambda: 0,
            "get_device_properties": lambda i: props,
            "mem_get_info": lambda i: (free, total),
            "memory_reserved": lambda i: reserved,
            "memory_allocated": lambda i: allocated,
            "get_per_process_memory_fraction": lambda i: self.fraction,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(measure, "driver_version", lambda: "fake")
        # The rates are timed elsewhere (test_cpu_profile_measures_and_caches); only memory is checked here.
        rates = {"h2d_gbps": 50.0, "d2h_gbps": 50.0, "bidir_gbps": 90.0, "matmul_tflops": 700.0}
        monkeypatch.setattr(
            measure, "measure_rates", lambda dev, quick: ({**rates, "host_adamw_params_per_s": 4e9}, [])
        )


def test_cuda_budget_counts_torch_cache_and_stays_allocatable(tmp_path, monkeypatch):
    """The failure seen on the H200: 5 GiB sat in torch's cache, so the budget passed the driver's free figure.
    The budget may count that cache (torch reuses it) but never more than the process can allocate."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    fake = _FakeCuda(monkeypatch, total=140 * GiB, free=134 * GiB, reserved=6 * GiB, allocated=1 * GiB)
    p = profile_hardware("cuda", headroom="512MiB")
    assert p.device_free_bytes == 134 * GiB
    assert p.device_allocatable_bytes == 139 * GiB  # free + (reserved - allocated)
    assert p.vram_budget_bytes == 139 * GiB - 512 * MiB
    assert "allocatable 139.0 GiB" in p.summary()
    fake.fraction = 0.25  # the fraction caps reserved memory: 35 GiB, of which 1 GiB is allocated
    p = profile_hardware("cuda", headroom=0)
    assert p.device_allocatable_bytes == p.vram_budget_bytes == 34 * GiB
    # An explicit budget may count what the process already holds (1 GiB), but no more than that.
    assert profile_hardware("cuda", vram_budget="35GiB").vram_budget_bytes == 35 * GiB
    with pytest.raises(PlanConfigError, match=r"vram_budget=.*holds 1\.0 GiB and can allocate 34\.0 GiB"):
        profile_hardware("cuda", vram_budget="36GiB")


def test_synthetic_allocatable_defaults_to_free():
    p = HardwareProfile.synthetic(device_free_bytes="20GiB")
    assert p.device_allocatable_bytes == 20 * GiB and p.vram_budget_bytes == 19 * GiB
    p = HardwareProfile.synthetic(device_free_bytes="20GiB", device_allocatable_bytes="22GiB")
    assert p.vram_budget_bytes == 21 * GiB


# Figures of the GPU machine (H200, PCIe Gen5) measured independently; a fresh profile must agree within 10 %.
H200_FIGURES = {
    "h2d_gbps": 55.4,
    "d2h_gbps": 55.2,
    "matmul_tflops": 780.0,
    "hbm_gbps": 4200.0,
}


def _both_directions_gbps() -> tuple[float, list[tuple[float, float, float]]]:
    """H2D and D2H of 256 MiB at once (pinned, one stream each), median of 5, timed on the device.

    Both copies are queued behind a device-side sleep before either can start, so a busy host issuing the
    second copy late cannot serialize them; the time runs from the gate opening to the later copy's end.

    Returns:
        The median rate (GB/s; the profile reports a median too) and every counted round as (GB/s, H2D end ms, D2H end ms) after the gate: the
        copies overlapped when both end near the later one's time, and ran one after the other when one end
        is about half of the other (suite runs have read ~56 GB/s, one direction's rate, in most rounds).
    """
    n = 256 * MiB
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(n, dtype=torch.uint8, device="cuda")
    # why: one stream per direction, so the two copy engines run at once
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    rounds = []
    for round_ in range(6):  # the first round warms both paths up and is not counted
        torch.cuda.synchronize()  # why: nothing else may share the link while timing
        torch.cuda._sleep(20_000_000)  # ~10 ms on the device: both copies are queued before the gate opens
        gate = torch.cuda.Event(enable_timing=True)
        gate.record()  # why: both copies wait for it, and the time is measured from it
        ends = []
        for stream, dst, src in ((up, dev_in, host_in), (down, host_out, dev_out)):
            stream.wait_event(gate)  # why: see `gate`
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)  # why: this direction's copy finished
            ends.append(end)
        torch.cuda.synchronize()  # why: every event must have completed before reading times
        if round_:
            up_ms, down_ms = (gate.elapsed_time(e) for e in ends)
            rounds.append((round(2 * n / max(up_ms, down_ms) / 1e6, 1), round(up_ms, 2), round(down_ms, 2)))
    return statistics.median(r[0] for r in rounds), rounds


@pytest.mark.gpu
def test_cuda_profile_matches_the_machine_figures(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    torch.zeros(1, device="cuda")  # CUDA context creation is not part of the profile's time
    cached = torch.cuda.memory_reserved()  # read before the profile, which empties torch's cache at its end
    t0 = time.perf_counter()
    p = profile_hardware("cuda", force=True)
    elapsed = time.perf_counter() - t0
    print(f"\n{p.summary()}\nprofiled in {elapsed:.2f} s")
    assert p.device_kind == "cuda" and p.compute_capability is not None
    # Earlier tests in this process leave blocks in torch's cache: allocatable, though not free to the driver.
    assert 0 < p.device_free_bytes <= p.device_total_bytes
    assert 0 < p.vram_budget_bytes == p.device_allocatable_bytes - 512 * MiB
    assert p.device_free_bytes <= p.device_allocatable_bytes <= p.device_free_bytes + cached
    assert p.device_allocatable_bytes <= p.device_total_bytes
    assert elapsed < 3.0  # quick mode
    if "H200" in p.device_name:
        # Both directions at once moved with the host's state: the machine README measured 94 GB/s, suite runs
        # of 2026-11-30 measured 78.3, 82.5 and 85.3 on the same kind of host. The profile's claim is that it
        # measures this host now, so it is checked against an independent measurement taken right after it,
        # before anything else here touches the device. The whole-budget allocation below used to come
        # between them; in suite order (after tidal-plan's census test) the copies measured after it ran one
        # after the other (55-56 GB/s) in the first or in every round, and the test failed; measured first,
        # it read 95-102 GB/s in every round (benchmarks/results/diag-link-order-h200-2026-11-30.txt). Both
        # sides are medians: against the best of the five rounds, a profile of 91.0 failed by 0.3 GB/s in a
        # suite run whose rounds read 96.2-101.4 (median 97.7; gpu-suite-h200-2026-11-30-z.txt).
        direct, rounds = _both_directions_gbps()
        print(f"both directions: profile {p.bidir_gbps:.1f} GB/s, direct {direct:.1f} GB/s, rounds {rounds}")
        assert abs(p.bidir_gbps - direct) <= 0.10 * direct, (p.bidir_gbps, direct, rounds)
    # The budget can really be allocated, on top of what this process holds.
    whole_budget = torch.empty(p.vram_budget_bytes, dtype=torch.uint8, device="cuda")
    del whole_budget
    torch.cuda.empty_cache()
    # the power limit lowers the clocks under sustained load; never above the peak
    assert 0.6 * p.matmul_tflops < p.matmul_sustained_tflops <= 1.02 * p.matmul_tflops
    # the whole bf16 update moves 40 bytes a parameter against the fused fp32 kernel's 28
    assert 0 < p.host_update_params_per_s < p.host_adamw_params_per_s
    if "H200" in p.device_name:
        for k, ref in H200_FIGURES.items():
            assert abs(getattr(p, k) - ref) <= 0.10 * ref, (k, getattr(p, k), ref)
        assert p.has_fp8_tensor_cores and not p.has_fp4_tensor_cores
        # both directions at once beat either alone on any host, and never reach their sum
        assert max(p.h2d_gbps, p.d2h_gbps) < p.bidir_gbps < p.h2d_gbps + p.d2h_gbps
        if p.host_threads == 16:  # the host the machine README describes (16 cores)
            # the machine README measured 3.7-4.3 G params/s; one of two suite runs of 2026-11-30 on such a
            # host measured 5.18 (the other stayed under 4.73): the rate varies by run, the band holds both
            assert 3.7e9 * 0.9 <= p.host_adamw_params_per_s <= 5.2e9 * 1.1


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
