"""benchmarks/kv/page_quality.py: a CPU run; native host pages decode exactly as DynamicCache."""

from __future__ import annotations

import sys
from pathlib import Path

from tidal_testing import torch_threads

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import page_quality  # noqa: E402 - from benchmarks/kv, put on the path above


def test_cpu_smoke_run_native_pages_are_exact() -> None:
    with torch_threads(1):
        rows = {r["engine"]: r for r in page_quality.main(["--smoke"])}
    assert list(rows) == list(page_quality.ENGINES)
    native = rows["tidal"]
    assert native["max_abs_logit_diff"] == 0.0 and native["greedy_agreement"] == 1.0
    assert native["delta_bits_per_byte"] == 0.0
    for e in ("tidal-fp8", "tidal-nf4"):  # lossy pages: close, not identical
        assert 0.0 < rows[e]["max_abs_logit_diff"] < 1.0
    assert rows["dynamic"]["decoded_bytes"] == 16
