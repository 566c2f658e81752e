"""benchmarks/kv/variants.py: each variant edits what it says, and a CPU run of every engine."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from tidal_testing import torch_threads

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kv"))

import torch  # noqa: E402
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
        "tidal-nocopy": {"slots.py"},
        "tidal-noev": {"streams.py"},
        "tidal-bare": {"slots.py", "streams.py"},
        "tidal-onestream": {"paged.py", "streams.py"},
        "tidal-eager": {"slots.py"},
        "tidal-3slots": {"paged.py"},
        "tidal-compute": {"paged.py"},
        "tidal-side": {"paged.py"},
    }[engine]
    assert changed == want


def test_a_variant_that_no_longer_applies_says_so() -> None:
    with pytest.raises(SystemExit, match="no longer contains"):
        variants.no_copies({"slots.py": "nothing to replace"})
    with pytest.raises(SystemExit, match="no longer contains"):
        variants.no_copies({})  # the module itself is gone


@pytest.mark.parametrize(("flags", "measured"), [([], "tidal"), (["--storage", "nf4"], "tidal-nf4")])
def test_cpu_smoke_run(flags: list[str], measured: str) -> None:
    names = [m for m in sys.modules if m.startswith("tidal_kv_")]
    with torch_threads(1):
        rows = variants.main(["--smoke", "--steps", "2", *flags])
    expected = variants.DEFAULT_ENGINES.split(",")
    expected[1] = measured
    assert [r["engine"] for r in rows] == expected
    assert all(r["steps"] == 2 and r["ms_per_step"] > 0 for r in rows)
    for name in [m for m in sys.modules if m.startswith("tidal_kv_") and m not in names]:
        del sys.modules[name]


def test_a_variant_copy_keeps_the_measured_engines_page_format() -> None:
    import ab
    import decode
    import decode_worker

    with tempfile.TemporaryDirectory() as tmp:
        pkg = ab.load_baseline(variants.SRC, Path(tmp), "tidal_kv_fmtcheck", variants.no_events)
        make = ab.with_packages(decode_worker.make_cache, {"tidal-noev": pkg}, "tidal-fp8")
        model = decode_worker.build_model(decode.model_config(True), "cpu", torch.float32)
        cache = make("tidal-noev", model, 64, 16, 2)
        assert type(cache.paged).__module__.startswith("tidal_kv_fmtcheck")
        assert cache.paged.config.storage == "fp8"
    del sys.modules["tidal_kv_fmtcheck"]
    for name in [m for m in sys.modules if m.startswith("tidal_kv_fmtcheck.")]:
        del sys.modules[name]


def test_a_bad_storage_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="--storage='int3' is not accepted"):
        variants.main(["--smoke", "--storage", "int3"])
