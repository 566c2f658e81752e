"""The curated API of ``import tidal``: every listed name resolves to its package's own object."""

from __future__ import annotations

import importlib

import pytest

import tidal

CURATED = sorted(set(tidal.__all__) - {"__version__", "MissingComponentError"})


@pytest.mark.parametrize("name", CURATED)
def test_curated_name_is_the_sibling_object(name):
    module_name, _ = tidal._EXPORTS[name]
    module = importlib.import_module(module_name)
    assert name in module.__all__, f"{module_name} does not export {name}"
    assert getattr(tidal, name) is getattr(module, name)


def test_the_issue_list_is_covered():
    wanted = {
        "wrap", "unwrap", "memory_report", "OffloadAdamW", "StreamedBlocks", "quantize_model_", "QuantLinear",
        "plan", "profile_hardware", "PagedKVCache", "load_model", "TidalTrainer", "TidalQuantizationConfig",
        "TidalCache",
    }  # fmt: skip
    assert wanted <= set(tidal.__all__)
