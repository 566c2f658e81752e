"""docs/options.md names every ``wrap()`` option with its current default (generated from tidal-stream)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("options_doc", HERE / "options_doc.py")
options_doc = importlib.util.module_from_spec(spec)
sys.modules["options_doc"] = options_doc
spec.loader.exec_module(options_doc)


def _doc_rows() -> dict[str, str]:
    text = options_doc.DOC.read_text(encoding="utf-8")
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.MULTILINE)}


def test_every_wrap_option_is_documented_with_its_default():
    rows = _doc_rows()
    cls = options_doc.wrap_options_class()
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in rows]
    assert not missing, f"docs/options.md lacks {missing}; run `python tests-integration/options_doc.py`"
    for f in dataclasses.fields(cls):
        assert f"`{f.default!r}`" in rows[f.name], (
            f"docs/options.md shows a stale default for {f.name} (now {f.default!r}); "
            "run `python tests-integration/options_doc.py`"
        )


def test_no_documented_option_is_unknown_to_wrap():
    names = {f.name for f in dataclasses.fields(options_doc.wrap_options_class())}
    extra = sorted(set(_doc_rows()) - names)
    assert not extra, f"docs/options.md documents options wrap() does not have: {extra}"
