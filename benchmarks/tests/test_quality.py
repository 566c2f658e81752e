"""quality.py: corpus split, and the CPU smoke run end to end (every format through tidal_quant)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import quality


def test_held_out_split_is_stable_and_small() -> None:
    files = quality.stdlib_files()
    root = Path(quality.sysconfig.get_paths()["stdlib"])
    held = [p for p in files if quality.is_held_out(str(p.relative_to(root)))]
    assert len(files) > 500
    assert 0.02 < len(held) / len(files) < 0.09
    train, test = quality.load_corpus(files[:300])
    assert train.dtype == quality.torch.int64 and train.max() < 256 and test.numel() > 1000


def test_smoke_mode_runs_on_cpu(tmp_path: Path) -> None:
    tq = pytest.importorskip("tidal_quant")
    if not hasattr(tq, "quantize_model_"):
        pytest.skip("tidal_quant.quantize_model_ is not there yet")
    out = tmp_path / "q.jsonl"
    proc = subprocess.run(
        [sys.executable, str(Path(quality.__file__)), "--smoke", "--formats", "bf16,nf4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["format"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"bf16", "nf4"}
    bf16, nf4 = rows["bf16"], rows["nf4"]
    assert "note" not in nf4, nf4
    # a trained byte model beats the uniform 256-way guess; NF4 storage moves perplexity, but not far
    assert bf16["ppl_before"] < 256 and nf4["ppl_before"] < 256
    assert nf4["ppl_before"] != bf16["ppl_before"]
    assert abs(nf4["ppl_before"] - bf16["ppl_before"]) / bf16["ppl_before"] < 0.1
    assert nf4["bytes_per_weight"] < bf16["bytes_per_weight"] == 2.0
    assert "| nf4 |" in proc.stdout


@pytest.mark.parametrize(
    "variant,stored,flag", [("fp8-bwd8", "fp8", "fp8_backward"), ("nf4-fp8", "nf4", "fp8_compute")]
)
def test_variants_store_their_format_with_their_option(variant, stored, flag) -> None:
    tq = pytest.importorskip("tidal_quant")
    from engines.tidal_engine import quantize_base_

    fmt, cfg = quality.VARIANTS[variant]
    assert fmt == stored and fmt in quality.FORMATS and variant in quality.FORMATS
    block = quality.torch.nn.Sequential(quality.torch.nn.Linear(32, 16), quality.torch.nn.Linear(16, 32))
    quantize_base_(block, fmt, **cfg)
    assert all(isinstance(m, tq.QuantLinear) and m.fmt.value == stored and getattr(m, flag) for m in block)
    plain = quality.torch.nn.Sequential(quality.torch.nn.Linear(32, 16))
    quantize_base_(plain, fmt)
    assert isinstance(plain[0], tq.QuantLinear) and not getattr(plain[0], flag)
