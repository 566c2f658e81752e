"""benchmarks/kv/interleaved.py: the rotated rounds, and a CPU run of the script."""

from __future__ import annotations

import sys
from pathlib import Path

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv"))

import interleaved as il


def test_rounds_rotate_the_order_and_time_every_call() -> None:
    order = []
    steppers = {name: (lambda n=name: order.append(n)) for name in ("a", "b", "c")}
    syncs = []
    clock = il.rounds(steppers, 3, lambda: syncs.append(1))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each engine first once
    assert {k: len(v) for k, v in clock.wall.items()} == {"a": 3, "b": 3, "c": 3}
    assert len(syncs) == 2 * 9  # before and after every timed call


def test_the_clock_splits_issue_wait_and_gc_time() -> None:
    import gc
    import time

    def slow_sync() -> None:
        time.sleep(0.02)  # stands in for the device finishing the step

    def collecting() -> None:
        gc.collect()  # a cyclic collection inside the step: counted as its GC time

    calls = iter([0, 1])
    clock = il.StepClock(["x", "y"])
    clock.time("x", lambda: time.sleep(0.01), lambda: slow_sync() if next(calls, 1) else None)
    clock.time("y", collecting, lambda: None)
    assert 0.01 <= clock.issue["x"][0] < clock.wall["x"][0]
    assert clock.wall["x"][0] - clock.issue["x"][0] >= 0.02  # the wait after the call
    assert clock.gc["x"] == [0.0] and clock.gc["y"][0] > 0
    s = il.split(clock, "x")
    assert s["issue_ms"] >= 10 and s["wait_ms"] >= 20 and s["gc_ms_total"] == 0
    assert clock._on_gc not in gc.callbacks  # the hook is removed after each step


def test_cpu_smoke_run(tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    with torch_threads(1):
        rows = il.main(["--smoke", "--engines", "dynamic,tidal-resident", "--steps", "2", "--json", str(out)])
    assert [r["engine"] for r in rows] == ["dynamic", "tidal-resident"]
    assert all(r["steps"] == 2 and r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["x_dynamic"] == 1.0 and rows[1]["x_dynamic"] > 0
    assert all(r["issue_ms"] > 0 and r["wait_ms"] >= 0 for r in rows)
    assert len(out.read_text().splitlines()) == 2


def test_host_ops_profile_every_engine_alike_and_the_table_ranks_by_spread() -> None:
    import torch

    x = torch.ones(64, 64)
    steppers = {"one": lambda: x.add(1), "three": lambda: (x.add(1), x.add(1), x.mul(2))}
    ops = il.host_ops(steppers, 4, lambda: None)
    assert set(ops) == {"one", "three"}
    assert ops["one"]["aten::add"] > 0 and ops["three"]["aten::mul"] > 0 and "aten::mul" not in ops["one"]
    lines = il.ops_table(ops, top=100).splitlines()
    assert lines[0] == "| op (self host µs per step) | one | three |" and lines[-1].startswith(
        "| (all ops) |"
    )
    rows = {line.split(" | ")[0][2:]: line for line in lines[2:-1]}
    assert "aten::mul" in rows and rows["aten::mul"].split(" | ")[1] == "0"  # "one" never multiplies

    def spread(name: str) -> float:
        return abs(ops["one"].get(name, 0.0) - ops["three"].get(name, 0.0))

    spreads = [spread(name) for name in rows]
    assert spreads == sorted(spreads, reverse=True)  # the ops that differ most come first
    assert len(il.ops_table(ops, top=2).splitlines()) == 2 + 2 + 1  # header, rule, the top 2, the totals


def test_paired_ratio_is_the_median_of_round_ratios_with_an_interval_around_it() -> None:
    clock = il.StepClock(["dynamic", "x"])
    clock.wall["dynamic"] = [1.0, 2.0, 1.0, 4.0, 1.0]  # the host drifts between rounds ...
    clock.wall["x"] = [1.25, 2.5, 1.25, 5.0, 1.0]  # ... and reaches both engines alike
    med, lo, hi = il.paired_ratio(clock, "x", "dynamic")
    assert med == 0.8  # four rounds at 0.8, one at 1.0: the drift itself does not move the ratio
    assert lo == 0.8 and hi == 1.0  # every resample's median is one of the round ratios
    assert il.paired_ratio(clock, "x", "dynamic") == (med, lo, hi)  # seeded
    # a wider spread of round ratios widens the interval; the median ratio stays inside it
    clock.wall["x"] = [1.0 / r for r in (0.7, 0.8, 0.9, 1.0, 1.1, 0.85, 0.95, 0.75, 1.05, 0.9)]
    clock.wall["dynamic"] = [1.0] * 10
    med, lo, hi = il.paired_ratio(clock, "x", "dynamic")
    assert lo < med < hi and lo >= 0.7 and hi <= 1.1
    assert abs(med - 0.9) < 1e-12
