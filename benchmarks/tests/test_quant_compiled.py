"""benchmarks/quant/compiled.py on the CPU: every kind and mode timed, and a compiled stack that disagrees
with its eager run is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))

import compiled as qc

# inductor's import path uses torch.jit.script_method, deprecated in torch 2.13: torch's, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def test_cpu_run_times_each_kind_eager_and_compiled(capsys) -> None:
    pytest.importorskip("tidal_quant")
    with torch_threads(1):
        qc.main(
            [
                "--device",
                "cpu",
                "--tokens",
                "8",
                "--dim",
                "32",
                "64",
                "--layers",
                "1",
                "--modes",
                "eager,compile",
                "--windows",
                "2",
            ]
        )
    rows = [
        line.split("|")[1:4]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "ms" not in line
    ]
    assert [(k.strip(), m.strip()) for k, m, _ in rows] == [
        ("bf16", "eager"),
        ("bf16", "compile"),
        ("nf4", "eager"),
        ("nf4", "compile"),
    ]
    assert all(float(ms) > 0 for _, _, ms in rows)


def test_a_compiled_stack_that_disagrees_is_not_timed(monkeypatch) -> None:
    monkeypatch.setattr(qc, "MIN_SQNR_DB", float("inf"))  # no stack can agree that well
    with torch_threads(1), pytest.raises(AssertionError, match="bf16 compile: output"):
        list(qc.run(["bf16"], ["compile"], (32, 64), 8, 1, "cpu", 2))


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(SystemExit, match="--modes"):
        qc.main(["--device", "cpu", "--modes", "eager,fast"])
