"""``benchmarks/distributed/scaling.py`` end to end on the CPU (gloo, torchrun): the soak figures, the
scenario path with the smoke shape, the command-line resolution and the soak verdict's exit status."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "distributed" / "scaling.py"
ROOT = SCRIPT.parents[2]
METRICS = ("rss_bytes", "pinned_bytes", "vram_allocated_bytes")


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("dp_scaling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


scaling = _load()


def _run(tmp: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """Run the driver with ``flags`` (plus ``--json``); its JSON and stdout."""
    out = tmp / "dp.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    flags = ("--smoke", "--worlds", "1,2", "--modes", "lora", "--soak", "--steps", "3")
    return _run(tmp_path_factory.mktemp("soak"), *flags)


def test_soak_run_reports_every_rank(soak_run: tuple[dict[str, Any], str]) -> None:
    data, stdout = soak_run
    assert data["soak"] is True
    assert [(r["mode"], r["world"]) for r in data["rows"]] == [("lora", 1), ("lora", 2)]
    for row in data["rows"]:
        assert isinstance(row["soak_flat"], bool)
        assert len(row["rss_gib_per_rank"]) == row["world"]
    for world in (1, 2):
        ranks = data["ranks"]["lora"][str(world)]
        assert [r["rank"] for r in ranks] == list(range(world))
        for r in ranks:
            assert r["world"] == world
            assert len(r["step_times"]) == 3  # --steps 3 after --smoke's 1 warm-up step
            soak = r["soak"]
            assert soak["samples"] == 3 and soak["tolerance"] == 0.01
            assert set(soak["metrics"]) == set(METRICS)
            for name, m in soak["metrics"].items():
                assert len(m["samples"]) == 3
                assert m["min"] == min(m["samples"]) and m["max"] == max(m["samples"])
                assert m["flat"] == (m["spread"] <= soak["tolerance"]), name
            assert soak["metrics"]["rss_bytes"]["min"] > 50 * 2**20  # a Python process with torch loaded
            assert soak["metrics"]["vram_allocated_bytes"]["max"] == 0  # CPU
            assert soak["flat"] == all(m["flat"] for m in soak["metrics"].values())
    assert "soak" in stdout.splitlines()[1]  # the table's header has the verdict column
    assert "soak [lora W=2 rank 1]" in stdout


def test_scenario_smoke_keeps_the_tiny_shape(tmp_path: Path) -> None:
    """A scenario at world 2 with --placeholders: rank 1 builds no frozen weights of its own and trains on
    the copy rank 0 filled (its log says so); the smoke shape wins over the scenario's."""
    data, stdout = _run(tmp_path, "--scenario", "lora14b", "--smoke", "--worlds", "2", "--placeholders")
    assert data["scenario"] == "lora14b" and data["vram_gb"] == 24.0
    assert [(r["mode"], r["world"]) for r in data["rows"]] == [("lora", 2)]
    rank, other = data["ranks"]["lora"]["2"]
    assert any("placeholders on the meta device filled from it" in m for m in other["decisions"])
    assert not any("placeholders" in m for m in rank["decisions"])
    assert other["params"] == rank["params"] and other["trainable"] == rank["trainable"]
    assert rank["scenario"] == "lora14b" and rank["model_class"] == "Qwen2ForCausalLM"
    assert rank["shape"] == scaling.SMOKE_SHAPE and rank["batch"] == 2
    assert rank["params"] < 10**6  # the smoke shape, not 14.8 B
    assert 0 < rank["trainable"] < rank["params"] // 4  # PEFT LoRA adapters only
    assert rank["vram_budget_bytes"] == 24 * 2**30
    assert rank["loss_first"] > 0
    assert stdout.startswith("scenario lora14b: lora;")


def test_scenario_fills_shape_batch_and_budget() -> None:
    args = scaling.parse(["--scenario", "full8b"])
    assert (args.mode, args.modes) == ("full", "full")
    assert (args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads) == (
        4096,
        14336,
        32,
        32,
        8,
    )
    assert (args.vocab, args.seq, args.batch, args.vram_gb) == (128256, 2048, 4, 24.0)
    assert args.param_offload == "auto" and args.moment_dtype is None
    sc = scaling.scenario_of(args)
    assert sc.arch == "llama" and sc.param_count() == scaling.SCENARIOS["full8b"].param_count()


def test_flags_win_over_the_scenario_and_smoke_over_both() -> None:
    args = scaling.parse(["--scenario", "lora14b", "--batch", "3", "--seq", "256", "--vram-gb", "40"])
    assert (args.batch, args.seq, args.vram_gb, args.hidden) == (3, 256, 40.0, 5120)
    args = scaling.parse(["--scenario", "lora14b", "--smoke", "--moment-dtype", "bf16"])
    assert {k: getattr(args, k) for k in scaling.SMOKE_SHAPE} == scaling.SMOKE_SHAPE
    assert args.batch == 2 and args.moment_dtype == "bf16"
    args = scaling.parse([])
    assert args.modes == "lora,full" and args.param_offload == 0.5 and args.hidden == 1024


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--scenario", "nope"], ["--scenario", "'nope'", "lora14b", "full8b"]),
        (["--scenario", "decode8b"], ["--scenario", "'decode8b'", "lora14b"]),
        (["--scenario", "full8b", "--modes", "lora"], ["--modes", "'lora'", "'full'"]),
        (["--vram-gb", "0"], ["--vram-gb", "0"]),
        (["--param-offload", "1.5"], ["--param-offload", "'1.5'", "auto"]),
    ],
)
def test_bad_flags_name_the_option(flags: list[str], words: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        scaling.parse(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_soak_summary_flags_growth() -> None:
    grow = [{"rss_bytes": 100 + 2 * i, "pinned_bytes": 64, "vram_allocated_bytes": 0} for i in range(5)]
    s = scaling.soak_summary(grow, 0.01)
    assert not s["flat"] and not s["metrics"]["rss_bytes"]["flat"]
    assert s["metrics"]["rss_bytes"]["spread"] == pytest.approx(8 / 108)
    assert s["metrics"]["pinned_bytes"]["flat"] and s["metrics"]["vram_allocated_bytes"]["flat"]
    assert scaling.soak_summary(grow, 0.1)["flat"]


def test_exit_status_follows_the_soak_verdict(
    soak_run: tuple[dict[str, Any], str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The driver on the smoke run's real rank results: 0 when flat, 1 when one rank's RSS grew."""
    ranks = soak_run[0]["ranks"]["lora"]
    flat = {int(w): copy.deepcopy(r) for w, r in ranks.items()}
    for rs in flat.values():
        for r in rs:
            samples = [{k: 1000 for k in METRICS} for _ in range(4)]
            r["soak"] = scaling.soak_summary(samples, 0.01)
    grown = copy.deepcopy(flat)
    grown[2][1]["soak"] = scaling.soak_summary(
        [{"rss_bytes": 1000 + 50 * i, "pinned_bytes": 1000, "vram_allocated_bytes": 0} for i in range(4)],
        0.01,
    )
    monkeypatch.delenv("RANK", raising=False)
    flags = ["--worlds", "1,2", "--modes", "lora", "--soak", "--json", str(tmp_path / "x.json")]
    for runs, want in ((flat, 0), (grown, 1)):
        monkeypatch.setattr(scaling, "run_world", lambda args, mode, world, runs=runs: runs[world])
        assert scaling.main(flags) == want
        rows = json.loads((tmp_path / "x.json").read_text())["rows"]
        assert [r["soak_flat"] for r in rows] == [True, want == 0]
    assert scaling.main([*flags, "--smoke"]) == 0  # --smoke: the verdict is printed, not enforced
