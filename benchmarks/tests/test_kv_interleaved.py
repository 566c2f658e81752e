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
    times = il.rounds(steppers, 3, lambda: syncs.append(1))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each engine first once
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert len(syncs) == 2 * 9  # before and after every timed call


def test_cpu_smoke_run(tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    with torch_threads(1):
        rows = il.main(["--smoke", "--engines", "dynamic,tidal-resident", "--steps", "2", "--json", str(out)])
    assert [r["engine"] for r in rows] == ["dynamic", "tidal-resident"]
    assert all(r["steps"] == 2 and r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["x_dynamic"] == 1.0 and rows[1]["x_dynamic"] > 0
    assert len(out.read_text().splitlines()) == 2
