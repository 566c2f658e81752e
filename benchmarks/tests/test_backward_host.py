"""benchmarks/quant/backward_host.py on the CPU: every layer kind in both autograd modes, the table's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal_testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))

import backward_host as bh


def test_cpu_run_times_every_layer_in_both_modes(capsys) -> None:
    pytest.importorskip("tidal_quant")
    with torch_threads(1):
        bh.main(["--device", "cpu", "--tokens", "4", "--dim", "64", "128", "--reps", "2"])
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "µs" not in line
    ]
    assert len(rows) == 2 * 5  # five layer kinds, with device threads and in the calling thread
    for row in rows:
        _, _name, mode, fwd, bwd, _ = (c.strip() for c in row.split("|"))
        assert mode in ("device threads", "calling thread") and float(fwd) > 0 and float(bwd) > 0, row
    assert {r.split("|")[1].strip() for r in rows} == {
        "bf16 nn.Linear",
        "identity Function",
        "nf4 QuantLinear",
        "fp8 QuantLinear",
        "fp8-bwd8 QuantLinear",
    }
    import torch

    assert torch.autograd.is_multithreading_enabled()  # the script leaves autograd as it found it
