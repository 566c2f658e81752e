"""benchmarks/kv/ab.py: the baseline copy, and a CPU run of the A/B."""

from __future__ import annotations

import sys
from pathlib import Path

from tidal_testing import torch_threads

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import ab  # noqa: E402 - from benchmarks/kv, put on the path above


def _forget_baseline() -> None:
    for name in [m for m in sys.modules if m == ab.BASE_NAME or m.startswith(ab.BASE_NAME + ".")]:
        del sys.modules[name]


def test_the_baseline_is_a_separate_package_that_imports_only_itself(tmp_path) -> None:
    _forget_baseline()
    try:
        base = ab.load_baseline(ROOT / "packages" / "tidal-kv" / "src", tmp_path)
        import tidal_kv

        assert base.PagedKVCache is not tidal_kv.PagedKVCache
        assert base.PagedKVCache.__module__ == "tidal_kv_base.paged"
        for f in (tmp_path / ab.BASE_NAME).rglob("*.py"):
            assert "from tidal_kv." not in f.read_text() and "import tidal_kv\n" not in f.read_text()
    finally:
        _forget_baseline()
        sys.path.remove(str(tmp_path))


def test_cpu_smoke_run() -> None:
    _forget_baseline()
    try:
        with torch_threads(1):
            src = str(ROOT / "packages" / "tidal-kv" / "src")
            rows = ab.main(
                ["--baseline", src, "--smoke", "--steps", "2", "--engines", "dynamic,tidal,tidal-base"]
            )
        assert [r["engine"] for r in rows] == ["dynamic", "tidal", "tidal-base"]
        assert all(r["steps"] == 2 and r["ms_per_step"] > 0 for r in rows)
    finally:
        _forget_baseline()
