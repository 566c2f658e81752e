"""``plan/predict_vs_measured.py --smoke``: the three configurations run, are planned as asked, and land
in one table with the prediction beside the measurement."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "plan" / "predict_vs_measured.py"


def _load():
    spec = importlib.util.spec_from_file_location("predict_vs_measured", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_runs_three_configurations(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "rows.json"
    assert _load().main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["gpu", "split", "stream"]
    assert rows[0]["placement"] == "gpu" and rows[0]["streamed_blocks"] == 0
    assert rows[1]["placement"] in ("split", "host") and rows[1]["streamed_blocks"] == 0
    assert rows[2]["placement"] == "host" and rows[2]["streamed_blocks"] == 3
    for r in rows:
        assert r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 and len(r["steps_s"]) == 2
        assert r["ratio"] == pytest.approx(r["measured_step_s"] / r["predicted_step_s"])
        assert r["planned_host_params"] == r["actual_host_params"]  # the wrapped runs follow the plan
    text = capsys.readouterr().out
    assert "| config | optimizer |" in text and text.count("| stream |") == 1


def test_bad_configs_are_refused():
    with pytest.raises(SystemExit):
        _load().main(["--smoke", "--configs", "gpu,fast"])
