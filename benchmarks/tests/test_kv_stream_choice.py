"""benchmarks/kv/stream_choice.py on the CPU: every case runs, and with no link to time gathers stay on the side."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import stream_choice  # noqa: E402 - from benchmarks/kv, put on the path above

from tidal_testing import torch_threads  # noqa: E402


def test_smoke_reports_each_case_on_the_side_stream() -> None:
    with torch_threads(2):
        rows = stream_choice.main(["--smoke", "--steps", "4"])
    assert [(r["engine"], r["batch"]) for r in rows] == [("tidal", 1), ("tidal-nf4", 1)]
    assert all(r["stream"] == "side" and r["link_gbps"] is None and r["inline_gathers"] == 0 for r in rows)
