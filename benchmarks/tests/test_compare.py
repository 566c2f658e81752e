"""compare.py: protocol parsing, rows for engines that can't run, dead workers, and a CPU run end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import compare
import pytest
import torch
from engines import Engine
from engines.runner import PREFIX, run_engine
from engines.scenarios import SCENARIOS

COMPARE = Path(compare.__file__)


def test_parse_line_reads_only_protocol_lines() -> None:
    assert compare.parse_line(PREFIX + '{"event": "step", "step_s": 0.5}') == {"event": "step", "step_s": 0.5}
    assert compare.parse_line("Loading checkpoint shards: 100%") is None
    assert compare.parse_line(PREFIX + "{broken") is None


@pytest.mark.parametrize(
    ("rc", "timed_out", "tail", "outcome", "detail"),
    [
        (None, True, [], "killed", "timeout after 300 s"),
        (-9, False, [], "killed", "signal SIGKILL (host out of memory?)"),
        (
            1,
            False,
            ["Traceback", "torch.OutOfMemoryError: CUDA out of memory. Tried"],
            "OOM",
            "torch.OutOfMemoryError",
        ),
        (1, False, ["Traceback", "RuntimeError: boom", ""], "error", "RuntimeError: boom"),
        (3, False, [], "error", "exit status 3"),
    ],
)
def test_dead_worker_outcomes(rc, timed_out, tail, outcome, detail) -> None:
    got = compare.outcome_without_record(rc, timed_out, tail, 300.0)
    assert got[0] == outcome and got[1].startswith(detail)


def test_vram_argument() -> None:
    assert compare.parse_vram("24") == 24.0
    assert compare.parse_vram("none") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="--vram-gb: got 'lots'"):
        compare.parse_vram("lots")


def _args(**kw) -> argparse.Namespace:
    a = compare.build_parser().parse_args(["--device", "cpu", "--warmup", "0", "--steps", "1"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_not_installed_and_not_applicable_rows_without_a_process(monkeypatch) -> None:
    fake = {
        "ghost": Engine("ghost", "stock", "no_such_engine_pkg_xyz", ("lora",), "Ghost 1.0"),
        "fullonly": Engine("fullonly", "stock", None, ("full",), "Full only"),
    }
    monkeypatch.setattr(compare, "select", lambda spec: list(fake.values()))
    monkeypatch.setattr(compare, "run_worker", lambda *a, **k: pytest.fail("no process may start"))
    rows = compare.run(_args(scenario="smoke", engines="ghost,fullonly"))
    by = {r["engine"]: r for r in rows}
    assert by["ghost"]["outcome"] == "not installed" and "no_such_engine_pkg_xyz" in by["ghost"]["detail"]
    assert by["fullonly"]["outcome"] == "n/a" and by["fullonly"]["step_s"] is None


def test_worker_reports_missing_peer_and_wrong_device_in_process() -> None:
    rec = run_engine("bnb-nf4", "smoke", device="cpu", vram_gb=None, warmup=0, steps=1)
    assert rec["outcome"] in ("n/a", "not installed")
    assert rec["step_s"] is None and rec["engine"] == "bnb-nf4"


def test_worker_killed_at_timeout() -> None:
    args = _args(timeout=0.5)
    row = compare.run_worker(compare.ENGINES["stock"], SCENARIOS["smoke"], None, args, None)
    assert row["outcome"] == "killed" and row["detail"] == "timeout after 0.5 s"


def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(COMPARE), "--smoke", "--live", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # --live: stdout is JSON lines only
    steps = [e for e in events if e.get("event") == "step"]
    assert len(steps) == 3 and sum(e["warmup"] for e in steps) == 1
    assert events[-1]["event"] == "done"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["engine"] == "stock" and row["outcome"] == "ok", row
    assert row["step_s"] > 0 and len(row["step_times"]) == 3
    assert row["losses"][-1] < row["losses"][0]  # LoRA at 2e-4 lowers the loss on a repeated batch
    assert "| PyTorch + PEFT (stock) | ok |" in proc.stderr and "1.00" in proc.stderr


def test_builds_overlap_other_engines_and_report_failures(tmp_path: Path) -> None:
    slow = compare.Build("import time, sys; time.sleep(0.5); print('nvcc: boom'); sys.exit(2)", tmp_path)
    a = Engine("a", "stock", None, ("lora",), "A", build=slow.code)
    b = Engine("b", "stock", None, ("lora",), "B")
    assert compare.next_engine([a, b], {slow.code: slow}) is b  # a waits for its build, b goes first
    assert compare.next_engine([a], {slow.code: slow}) is None
    rc, secs = slow.wait()
    assert rc == 2 and secs >= 0.5 and slow.done()
    assert compare.next_engine([a, b], {slow.code: slow}) is a
    assert slow.log_tail() == ["nvcc: boom"]


def test_merged_rows_keep_engines_not_rerun(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    first = [{"scenario": "lora14b", "engine": e, "outcome": "ok"} for e in ("tidal-nf4", "stock")]
    compare.write_rows(out, first, merge=True)
    again = [{"scenario": "lora14b", "engine": "stock", "outcome": "OOM"}]
    every = compare.write_rows(out, again, merge=True)
    assert [(r["engine"], r["outcome"]) for r in every] == [("stock", "OOM"), ("tidal-nf4", "ok")]
    assert len(out.read_text().splitlines()) == 2
    assert compare.write_rows(out, again, merge=False) == again


def test_missing_submodule_is_an_error_not_a_missing_package() -> None:
    from engines.runner import _missing_package

    assert _missing_package(
        ModuleNotFoundError("No module named 'trainstream'", name="trainstream"), "trainstream"
    )
    assert not _missing_package(ModuleNotFoundError("x", name="tidal_hf.loading"), "tidal_hf")
    assert not _missing_package(ModuleNotFoundError("x", name="pynvml"), "deepspeed")


@pytest.mark.parametrize("scenario", ["smoke_full", "smoke_decode"])
def test_stock_engine_full_and_decode_in_process(scenario: str) -> None:
    rec = run_engine("stock", scenario, device="cpu", vram_gb=None, warmup=1, steps=2)
    assert rec["outcome"] == "ok", rec["detail"]
    assert rec["step_s"] > 0 and len(rec["losses"]) == 3
    if scenario == "smoke_full":
        assert rec["losses"][-1] < rec["losses"][0]
    else:  # decode: negative log-prob of each greedy token, finite and positive
        assert all(0 < x < 20 for x in rec["losses"])


def test_oom_row_carries_the_allocation_sites_and_timed_steps_run_unrecorded(monkeypatch) -> None:
    import engines.stock
    from engines import memtrace

    calls: list[str] = []
    monkeypatch.setattr(memtrace, "start", lambda dev, n: calls.append(f"start {n}") or True)
    monkeypatch.setattr(memtrace, "stop", lambda dev: calls.append("stop"))
    monkeypatch.setattr(
        memtrace, "oom_report", lambda dev: ["live at OOM: 23.90 GiB in 9 blocks, 1 allocation sites"]
    )
    monkeypatch.setenv(memtrace.ENV, "1234")
    monkeypatch.setattr("engines.runner.torch.cuda.set_device", lambda dev: None)
    monkeypatch.setattr("engines.runner.torch.cuda.reset_peak_memory_stats", lambda dev: None)
    monkeypatch.setattr("engines.runner.torch.cuda.max_memory_allocated", lambda dev: 0)
    monkeypatch.setattr("engines.runner.torch.cuda.max_memory_reserved", lambda dev: 0)
    monkeypatch.setattr("engines.runner.torch.cuda.get_device_name", lambda dev: "test device")
    monkeypatch.setattr("engines.runner.DevicePeak", lambda dev: None)

    def oom(ctx, **variant):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 MiB")

    monkeypatch.setattr(engines.stock, "setup", oom)
    rec = run_engine("stock", "smoke", device="cuda:0", vram_gb=None, warmup=1, steps=1)
    assert rec["outcome"] == "OOM" and rec["detail_extra"][0].startswith("live at OOM: 23.90 GiB"), rec
    assert calls == ["start 1234"]
