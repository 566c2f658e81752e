"""``tidal report``: reads what the demo wrote, refuses what it did not write."""

from __future__ import annotations

import json

import pytest

from tidal.errors import CLIError
from tidal.report import load_report


def test_report_keeps_summary_and_drops_steps_unless_asked(tmp_path):
    data = {"summary": {"steps": 2, "tokens_per_s": 10.5}, "plan": "p", "steps": [{"step": 1}, {"step": 2}]}
    (tmp_path / "metrics.json").write_text(json.dumps(data))
    assert load_report(tmp_path) == {"summary": data["summary"], "plan": "p"}
    assert load_report(tmp_path, steps=True)["steps"] == data["steps"]


def test_report_errors_name_the_folder_and_the_fix(tmp_path):
    with pytest.raises(CLIError, match=r"has no metrics\.json.*tidal demo"):
        load_report(tmp_path)
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(CLIError, match="not valid JSON"):
        load_report(tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(CLIError, match="no 'summary'"):
        load_report(tmp_path)
