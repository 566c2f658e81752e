"""benchmarks/kv/generate_rounds.py on the CPU: every engine generates in every round and gets a paired ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import generate_rounds  # noqa: E402 - from benchmarks/kv, put on the path above

from tidal_testing import torch_threads  # noqa: E402


def test_smoke_times_every_engine_through_generate() -> None:
    with torch_threads(2):
        rows = generate_rounds.main(["--smoke"])
    assert [r["engine"] for r in rows] == ["dynamic", "tidal", "tidal-nf4"]
    # 2 rounds of 12 new tokens: 11 gaps between steps, the first 2 left out
    assert all(r["steps"] == 2 * 9 and r["ms_per_step"] > 0 for r in rows)
    for r in rows[1:]:
        lo, hi = r["x_dynamic_ci95"]
        assert lo <= r["x_dynamic_paired"] <= hi


def test_engines_without_dynamic_are_refused() -> None:
    with pytest.raises(SystemExit):
        generate_rounds.main(["--smoke", "--engines", "tidal"])
