"""benchmarks/kv/overlap.py: the interval arithmetic of its summary, and a CPU run of the script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv"))

import overlap as ov


def test_merged_overlap_and_total() -> None:
    a = ov.merged([(5, 7), (0, 2), (1, 3)])
    assert a == [(0, 3), (5, 7)] and ov.total(a) == 5
    assert ov.overlap(a, [(2, 6)]) == 2  # [2, 3) and [5, 6)
    assert ov.overlap(a, []) == 0 and ov.overlap([(0, 1)], [(1, 2)]) == 0


def test_summary_of_a_step_whose_copy_half_hides() -> None:
    """One step of 10 ms: a kernel [0, 4) ms, a pinned copy [2, 6) ms issued by the host at 1 ms, a
    pageable copy [8, 9) ms, and a 3 ms stream synchronization on the host."""
    ms = 1e3  # events are in microseconds
    evs = [
        ov.Ev("gemm", 0, 4 * ms, True, 7),
        ov.Ev("cudaMemcpyAsync", 1 * ms, 1.01 * ms, False, corr=11),
        ov.Ev("Memcpy HtoD (Pinned -> Device)", 2 * ms, 6 * ms, True, 9, corr=11),
        ov.Ev("Memcpy HtoD (Pageable -> Device)", 8 * ms, 9 * ms, True, 9, corr=12),
        ov.Ev("cudaStreamSynchronize", 6 * ms, 9 * ms, False),
        ov.Ev("aten::mm", 0, 1 * ms, False),
        ov.Ev("tidal::kv_gather", 2 * ms, 6 * ms, True, 9),  # an annotation on the GPU's timeline
    ]
    s = ov.summarize(evs, steps=1, wall_ms=10.0)
    assert s["kernel_ms"] == pytest.approx(4) and s["h2d_ms"] == pytest.approx(5)
    assert s["h2d_under_kernels_ms"] == pytest.approx(2)
    assert s["gpu_idle_ms"] == pytest.approx(2)  # [6, 8) ms: neither kernels nor copies
    assert s["h2d_copies"] == 2 and s["pageable_h2d"] == 1
    assert s["h2d_queue_ms"]["median"] == pytest.approx(1.0)  # issued at 1 ms, started at 2 ms
    assert list(s["runtime_ms"]) == ["cudaStreamSynchronize", "cudaMemcpyAsync"]
    assert s["runtime_ms"]["cudaStreamSynchronize"] == pytest.approx(3)
    assert s["top_kernels"] == [
        {"name": "gemm", "ms": pytest.approx(4), "calls": 1}
    ]  # copies are not kernels


def test_cpu_smoke_run() -> None:
    with torch_threads(1):
        rows = ov.main(["--smoke", "--engines", "dynamic,tidal", "--warmup", "1", "--steps", "2"])
    assert [r["engine"] for r in rows] == ["dynamic", "tidal"]
    assert all(r["step_ms"] > 0 and r["steps"] == 2 and r["pageable_h2d"] == 0 for r in rows)


def test_gpu_idle_gaps_name_what_the_host_did_in_them() -> None:
    """Kernels [0, 2) and [5, 6) and [6.5, 7) ms: the 3 ms gap holds a 2 ms wait for an update on the main
    thread and a stream synchronization; the 0.5 ms gap holds nothing."""
    from trace_intervals import Ev, annotation_ms, gpu_idle_gaps

    ms = 1e3
    evs = [
        Ev("gemm", 0, 2 * ms, True, 7),
        Ev("gemm", 5 * ms, 6 * ms, True, 7),
        Ev("gemm", 6.5 * ms, 7 * ms, True, 7),
        Ev("Memcpy HtoD (Pinned -> Device)", 2 * ms, 4 * ms, True, 9),  # copies do not fill a gap
        Ev("tidal::wait_update", 2.5 * ms, 4.5 * ms, False, thread=1),
        Ev("tidal::stream.fetch[3]", 1 * ms, 3 * ms, False, thread=1),
        Ev("tidal::stream.fetch[4]", 9 * ms, 10 * ms, False, thread=1),
        Ev("cudaStreamSynchronize", 4.5 * ms, 5 * ms, False, thread=2),
    ]
    gaps = gpu_idle_gaps(evs, top=5)
    assert [round(g["ms"], 3) for g in gaps] == [3.0, 0.5]
    assert gaps[0]["start_ms"] == pytest.approx(2.0)
    assert gaps[0]["host"] == pytest.approx(
        {"tidal::wait_update": 2.0, "tidal::stream.fetch": 1.0, "cudaStreamSynchronize": 0.5}
    )
    assert gaps[1]["host"] == {}
    per_thread = annotation_ms(evs)
    assert per_thread.keys() == {"tidal::wait_update", "tidal::stream.fetch"}
    assert per_thread["tidal::wait_update"] == pytest.approx({1: 2.0})
    assert per_thread["tidal::stream.fetch"] == pytest.approx({1: 3.0})
