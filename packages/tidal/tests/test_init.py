"""``import tidal``: lazy re-exports, cheap import (no torch, Triton or CuPy), clear errors for missing names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tidal
from tidal.errors import MissingComponentError

PROBE = """
import json, sys, time
t = time.perf_counter()
import tidal
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "loaded": sorted(m for m in ("torch", "triton", "cupy", "transformers",
    "tidal_stream", "tidal_plan", "tidal_quant", "tidal_arena", "tidal_kv", "tidal_hf") if m in sys.modules)}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_import_is_fast_and_loads_no_heavy_module():
    r = _probe()
    assert r["loaded"] == [], f"import tidal loaded {r['loaded']}"
    assert r["seconds"] < 2.0, f"import tidal took {r['seconds']:.2f} s"


@pytest.mark.gpu
def test_import_loads_no_heavy_module_where_triton_and_cupy_are_installed():
    """On the GPU machine Triton and CuPy exist, so this is where "loads neither" means something."""
    import importlib.util

    assert importlib.util.find_spec("triton") is not None  # the check below would be vacuous without it
    r = _probe()
    assert r["loaded"] == [], f"import tidal loaded {r['loaded']}"
    assert r["seconds"] < 2.0, f"import tidal took {r['seconds']:.2f} s"


def test_all_and_dir_list_the_curated_api():
    for name in ("wrap", "unwrap", "memory_report", "OffloadAdamW", "StreamedBlocks", "plan", "PagedKVCache"):
        assert name in tidal.__all__
        assert name in dir(tidal)
    assert "__version__" in tidal.__all__
    assert len(set(tidal.__all__)) == len(tidal.__all__)


def test_a_name_resolves_to_the_sibling_object_and_is_cached():
    import tidal_stream

    assert "wrap" in tidal_stream.__all__
    assert tidal.wrap is tidal_stream.wrap
    assert "wrap" in vars(tidal)  # cached after the first access


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_tidal_name'"):
        tidal.not_a_tidal_name  # noqa: B018
    assert not hasattr(tidal, "not_a_tidal_name")


def test_missing_package_names_package_and_install_command(monkeypatch):
    monkeypatch.setitem(tidal._EXPORTS, "ghost", ("tidal_ghost_pkg", "tidal-ghost"))
    with pytest.raises(MissingComponentError, match=r"tidal-ghost.*not installed.*pip install tidal-ghost"):
        tidal.ghost  # noqa: B018
    with pytest.raises(ImportError, match="tidal-ghost"):
        exec("from tidal import ghost", {})


def test_name_missing_from_a_package_says_which(monkeypatch):
    # tidal_testing is installed but has no "wrap": the error names the package, the name and its __all__
    monkeypatch.setitem(tidal._EXPORTS, "ghost_name", ("tidal_testing", "tidal-testing"))
    with pytest.raises(
        MissingComponentError, match=r"tidal-testing .* does not export 'ghost_name'.*devices"
    ):
        tidal.ghost_name  # noqa: B018


def test_python_dash_m_tidal_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "tidal", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"tidal {tidal.__version__}"
