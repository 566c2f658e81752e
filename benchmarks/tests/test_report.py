"""report.py: tables with ratios to the fastest, the README block, the chart and the doc, from fixture rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import report

ROWS = [
    {
        "scenario": "lora14b",
        "engine": "stock",
        "label": "PyTorch + PEFT (stock)",
        "mode": "lora",
        "budget_gib": 24.0,
        "outcome": "OOM",
        "detail": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "step_s": None,
        "warmup": 3,
        "steps": 5,
        "device": "NVIDIA H200",
    },
    {
        "scenario": "lora14b",
        "engine": "bnb-nf4",
        "label": "bitsandbytes NF4 QLoRA",
        "mode": "lora",
        "budget_gib": 24.0,
        "outcome": "ok",
        "step_s": 0.416,
        "tokens_per_s": 1230.8,
        "peak_vram_gib": 12.34,
        "peak_alloc_gib": 11.0,
        "setup_s": 21.5,
        "warmup": 3,
        "steps": 5,
        "device": "NVIDIA H200",
    },
    {
        "scenario": "lora14b",
        "engine": "tidal-fp8",
        "label": "tidal FP8",
        "mode": "lora",
        "budget_gib": 24.0,
        "outcome": "ok",
        "step_s": 0.208,
        "tokens_per_s": 2461.5,
        "peak_vram_gib": 20.0,
        "peak_alloc_gib": 18.5,
        "setup_s": 30.0,
        "warmup": 3,
        "steps": 5,
        "device": "NVIDIA H200",
    },
    {
        "scenario": "full1.5b",
        "engine": "ds-zero2",
        "label": "DeepSpeed ZeRO-2",
        "mode": "full",
        "budget_gib": 24.0,
        "outcome": "error",
        "detail": "RuntimeError: a | pipe\nsecond line",
        "step_s": None,
    },
]


def test_ratio_to_fastest_and_outcomes() -> None:
    table = report.markdown_table(ROWS[:3])
    lines = table.splitlines()
    assert lines[0].startswith("| engine | outcome | s/step | × fastest |")
    assert "| tidal FP8 | ok | 0.208 | 1.00 | 2462 | 20.0 | 18.5 | 30.0 |" in lines
    assert "| bitsandbytes NF4 QLoRA | ok | 0.416 | 2.00 | 1231 | 12.3 | 11.0 | 21.5 |" in lines
    assert any(
        ln.startswith("| PyTorch + PEFT (stock) | OOM: OutOfMemoryError: CUDA out of memory") for ln in lines
    )


def test_error_text_cannot_break_the_table() -> None:
    line = report.markdown_table([ROWS[3]]).splitlines()[-1]
    assert "a \\| pipe second line" in line and line.count(" | ") == 7


def test_tables_grouped_by_scenario_with_captions() -> None:
    text = report.markdown_tables(ROWS)
    assert text.index(
        "**lora14b** — 24 GiB budget; median of 5 steps after 3 warm-up; NVIDIA H200"
    ) < text.index("**full1.5b**")


def test_readme_block_replacement() -> None:
    readme = f"# tidal\n\nintro\n\n{report.START}\nold table\n{report.END}\n\nfooter\n"
    new = report.replace_block(readme, report.readme_block(ROWS))
    assert "old table" not in new and "| tidal FP8 | ok | 0.208 | 1.00 |" in new
    assert new.startswith("# tidal\n\nintro\n\n") and new.endswith(f"{report.END}\n\nfooter\n")
    assert report.replace_block(new, report.readme_block(ROWS)) == new  # idempotent
    with pytest.raises(ValueError, match="markers"):
        report.replace_block("# no markers\n", "x")


def test_main_writes_doc_chart_and_readme(tmp_path: Path) -> None:
    res = tmp_path / "results"
    res.mkdir()
    (res / "compare-lora14b.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    quality = [
        {
            "event": "result",
            "format": "bf16",
            "bytes_per_weight": 2.0,
            "ppl_before": 3.10,
            "ppl_after": 2.90,
            "model": "Llama-style 136M",
            "train_minutes": 5,
            "lora_steps": 200,
        },
        {
            "event": "result",
            "format": "nf4",
            "bytes_per_weight": 0.5625,
            "ppl_before": 3.25,
            "ppl_after": 2.98,
        },
    ]
    (res / "quality.jsonl").write_text("\n".join(json.dumps(r) for r in quality) + "\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{report.START}\n{report.END}\n")
    doc = tmp_path / "docs" / "benchmarks.md"
    assert (
        report.main(["--results", str(res), "--doc", str(doc), "--readme", str(readme), "--update-readme"])
        == 0
    )
    text = doc.read_text()
    assert "![step time per engine](benchmarks.png)" in text
    assert "| nf4 | 0.562 | 3.250 | 0.150 | 2.980 | 0.080 |  |" in text
    png = doc.parent / "benchmarks.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "| tidal FP8 | ok |" in readme.read_text()


def test_latest_row_per_engine_wins() -> None:
    old = {
        "scenario": "lora14b",
        "engine": "tidal-nf4",
        "outcome": "skipped",
        "time": "2026-11-29T12:00:00+00:00",
    }
    new = {"scenario": "lora14b", "engine": "tidal-nf4", "outcome": "ok", "time": "2026-11-29T12:10:00+00:00"}
    other = {"scenario": "lora14b", "engine": "stock", "outcome": "OOM", "time": "2026-11-29T11:00:00+00:00"}
    assert report.latest([old, other, new]) == [other, new]
    assert report.latest([new, old]) == [new]


def test_prediction_table_sets_the_logged_prediction_beside_the_measured_step():
    note = (
        "measured first step: peak 9.44 GiB allocated; blocks 0-47 KEEP their activations; the cost model "
        "predicts 588 ms per step of this placement at the measured 512 tokens"
    )
    rows = [
        {
            "scenario": "lora14b",
            "engine": "tidal-nf4",
            "label": "tidal NF4",
            "outcome": "ok",
            "step_s": 0.603,
            "engine_notes": ["tidal plan: ...", note],
        },
        {"scenario": "lora14b", "engine": "bnb-nf4", "outcome": "ok", "step_s": 0.494},  # a peer: no notes
        {"scenario": "lora14b", "engine": "tidal", "outcome": "OOM", "step_s": None, "engine_notes": [note]},
    ]
    table = report.prediction_table(rows)
    assert table.splitlines()[2:] == ["| lora14b | tidal NF4 | 512 | no | 588 | 603 | 1.03 |"]
    rows[0]["engine_notes"].append("captured CUDA graphs of blocks 0-47 at input shape (1, 512, 5120): ...")
    assert report.prediction_table(rows).splitlines()[2:] == [
        "| lora14b | tidal NF4 | 512 | 0-47 | 588 | 603 | 1.03 |"
    ]
    # graphs the capture-step check gave up: the timed steps ran eagerly
    rows[0]["engine_notes"].append(
        "CUDA graphs released: the step that captured them peaked at 23.24 GiB ..."
    )
    assert report.prediction_table(rows).splitlines()[2:] == [
        "| lora14b | tidal NF4 | 512 | released (0-47 captured) | 588 | 603 | 1.03 |"
    ]
    # released, then captured again on fewer blocks: the second capture is what the timed steps replayed
    rows[0]["engine_notes"].append("captured CUDA graphs of blocks 0-8 at input shape (1, 512, 5120): ...")
    assert report.prediction_table(rows).splitlines()[2:] == [
        "| lora14b | tidal NF4 | 512 | 0-8 | 588 | 603 | 1.03 |"
    ]
    rows[0]["engine_notes"].pop()
    rows[0]["engine_notes"].pop()
    assert report.prediction_table(rows[1:]) == ""
    doc = report.render_doc(rows, [], None)
    assert "## tidal's cost model at the measured batch" in doc and "| lora14b | tidal NF4 | 512 |" in doc
    assert "cost model at the measured batch" not in report.render_doc(rows[1:], [], None)
