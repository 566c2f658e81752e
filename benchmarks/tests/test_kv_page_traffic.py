"""benchmarks/kv/page_traffic.py: a CPU run of the script (the traffic itself needs the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv"))

import page_traffic as pt


def test_cpu_smoke_run(capsys) -> None:
    with torch_threads(2):
        pt.main(["--smoke", "--steps", "2", "--link-mb", "2"])
    out = capsys.readouterr().out
    names = (
        "dynamic",
        "dynamic+big",
        "dynamic+copies",
        "dynamic+waits",
        "dynamic+query",
        "dynamic+link2",
        "tidal-resident",
        "tidal",
    )
    for name in names:
        assert f"\n{name} " in out
    assert "waits inserted: 0 (" in out  # the CPU has no side stream: nothing is issued
