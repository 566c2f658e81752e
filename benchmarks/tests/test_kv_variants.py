"""benchmarks/kv/variants.py: each variant edits what it says, and a CPU run of every engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal_testing import torch_threads

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import variants  # noqa: E402 - from benchmarks/kv, put on the path above


def _sources() -> dict[str, str]:
    return {f.name: f.read_text() for f in variants.SRC.joinpath("tidal_kv").glob("*.py")}


@pytest.mark.parametrize("engine", sorted(variants.VARIANTS))
def test_each_variant_changes_the_current_sources(engine) -> None:
    files = _sources()
    before = dict(files)
    variants.VARIANTS[engine](files)
    changed = {name for name in files if files[name] != before[name]}
    want = {
        "tidal-nocopy": {"transfers.py"},
        "tidal-noev": {"streams.py"},
        "tidal-bare": {"transfers.py", "streams.py"},
        "tidal-onestream": {"paged.py", "streams.py"},
    }[engine]
    assert changed == want


def test_a_variant_that_no_longer_applies_says_so() -> None:
    with pytest.raises(SystemExit, match="no longer contains"):
        variants.no_copies({"transfers.py": "nothing to replace"})


def test_cpu_smoke_run() -> None:
    names = [m for m in sys.modules if m.startswith("tidal_kv_")]
    with torch_threads(1):
        rows = variants.main(["--smoke", "--steps", "2"])
    assert [r["engine"] for r in rows] == variants.DEFAULT_ENGINES.split(",")
    assert all(r["steps"] == 2 and r["ms_per_step"] > 0 for r in rows)
    for name in [m for m in sys.modules if m.startswith("tidal_kv_") and m not in names]:
        del sys.modules[name]
