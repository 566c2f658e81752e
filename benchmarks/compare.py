"""Side-by-side comparison of tidal and the engines users would pick instead, one process per engine.

    python benchmarks/compare.py --scenario lora14b --vram-gb 24            # every engine, 24 GiB card
    python benchmarks/compare.py --scenario full1.5b --engines stock,ds-zero2,tidal-bf16
    python benchmarks/compare.py --smoke                                   # tiny model on the CPU

Each engine runs in its own subprocess: a filler leaves exactly the budget free, the engine builds the
same model (exact architecture, seeded random weights) and trains on the same batch with the same LoRA
settings and learning rate; step time is the median after warm-up. Rows are JSON lines (``--out``);
the Markdown table (ratio to the fastest) is printed at the end; ``--live`` streams progress as JSON
lines; ``--report`` regenerates docs/benchmarks.md, its chart and the README's results block.

An out-of-memory row explains itself: CUDA workers record allocation stacks through setup and warm-up,
and the row's ``detail_extra`` lists the biggest live allocation sites at the failure
(``BENCH_CUDA_MEMORY_HISTORY=0`` turns the recording off; see ``engines/memtrace.py``). A build that had
to free replaced weights something still referenced says so in ``build_notes``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
# the GPU machine runs from a checkout with nothing installed: tidal's packages come from their src
# folders (appended, so installed copies win); worker processes inherit it through PYTHONPATH
_SRC = [str(p) for p in sorted((HERE.parent / "packages").glob("*/src"))]
sys.path.extend(p for p in _SRC if p not in sys.path)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)), *_SRC]
)

from engines import ENGINES, Engine, select  # noqa: E402
from engines.runner import PREFIX  # noqa: E402
from engines.scenarios import SCENARIOS, Scenario, get_scenario  # noqa: E402

RESULTS = HERE / "results"
MIN_ENGINE_S = 45.0  # an engine is not started with less run time than this left before --deadline-s


def parse_vram(text: str) -> float:
    """``--vram-gb``: a positive number of GiB, or ``none`` (the whole device), given as 0.0."""
    if text.strip().lower() in ("none", "0", "off"):
        return 0.0
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--vram-gb: got {text!r}; accepted: a positive number of GiB, or 'none' for the whole device"
        ) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"--vram-gb: got {text!r}; accepted: a positive number or 'none'")
    return v


def static_row(
    engine: Engine, scenario: Scenario, budget: float | None, outcome: str, detail: str
) -> dict[str, Any]:
    """A row decided without starting a process (``n/a``, ``not installed``)."""
    return {
        "event": "result",
        "scenario": scenario.name,
        "engine": engine.name,
        "label": engine.label,
        "mode": scenario.mode,
        "budget_gib": budget,
        "outcome": outcome,
        "detail": detail,
        "step_s": None,
        "step_times": [],
        "time": now(),
    }


def now() -> str:
    """UTC timestamp of a row (the report keeps the latest row per scenario and engine)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def parse_line(line: str) -> dict[str, Any] | None:
    """The event of a protocol line (``@bench {...}``), else None."""
    if not line.startswith(PREFIX):
        return None
    try:
        ev = json.loads(line[len(PREFIX) :])
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) else None


def outcome_without_record(
    rc: int | None, timed_out: bool, stderr_tail: list[str], timeout_s: float
) -> tuple[str, str]:
    """(outcome, detail) of a worker that died before printing its record."""
    if timed_out:
        return "killed", f"timeout after {timeout_s:.4g} s"
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        return "killed", f"signal {name}" + (" (host out of memory?)" if name == "SIGKILL" else "")
    text = [ln.strip() for ln in stderr_tail if ln.strip()]
    last = text[-1] if text else f"exit status {rc}"
    if any("out of memory" in ln.lower() for ln in text):
        return "OOM", last
    return "error", last


class Build:
    """A native build (TrainStream, DeepSpeed CPU Adam) started ahead, in parallel with other engines."""

    def __init__(self, code: str, log_dir: Path) -> None:
        self.code = code
        self.log = (log_dir / f"build-{abs(hash(code))}.log").open("w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT)
        self.seconds: float | None = None

    def done(self) -> bool:
        """Whether the build process has ended."""
        return self.proc.poll() is not None

    def stop(self) -> None:
        """End the build if it still runs (the run is over or past its deadline)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()

    def log_tail(self, n: int = 5) -> list[str]:
        """The last lines of the build's output (for a failed build's row)."""
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace").splitlines()[-n:]

    def wait(self) -> tuple[int, float]:
        """Block until the build ends: (exit status, seconds it took)."""
        rc = self.proc.wait()
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.t0
            self.log.close()
        return rc, self.seconds


def run_worker(
    engine: Engine,
    scenario: Scenario,
    budget: float | None,
    args: argparse.Namespace,
    live: TextIO | None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run one engine in a subprocess with a timeout; its record, or one built from how it died."""
    timeout_s = args.timeout if timeout_s is None else timeout_s
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        engine.name,
        "--scenario",
        scenario.name,
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
    ]
    if budget is not None:
        cmd += ["--vram-gb", str(budget)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        events: list[dict[str, Any]] = []
        other = deque(maxlen=20)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                ev = parse_line(line)
                if ev is None:
                    other.append(line.rstrip())
                    continue
                events.append(ev)
                if live is not None and ev.get("event") != "result":
                    live.write(json.dumps({"scenario": scenario.name, "engine": engine.name, **ev}) + "\n")
                    live.flush()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the engine's children go too
            proc.wait()
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        err.seek(0)
        tail = err.read().splitlines()[-40:]
    results = [e for e in events if e.get("event") == "result"]
    if results:
        rec = results[-1]
    else:
        rec = static_row(
            engine,
            scenario,
            budget,
            *outcome_without_record(proc.returncode, timed_out, tail + list(other), timeout_s),
        )
        steps = [e for e in events if e.get("event") == "step"]
        rec["step_times"] = [e["step_s"] for e in steps]
        rec["losses"] = [e["loss"] for e in steps]
        timed = [e["step_s"] for e in steps if not e.get("warmup")]
        if timed:  # what it had measured before it died
            rec["detail"] += f" ({len(timed)} timed steps, median {statistics.median(timed):.3f} s)"
    rec["process_s"] = time.perf_counter() - t0
    rec.setdefault("time", now())
    if rec.get("outcome") not in ("ok", "n/a", "not installed"):
        rec["stderr_tail"] = tail[-8:]
    return rec


def next_engine(pending: list[Engine], builds: dict[str, Build]) -> Engine | None:
    """The first pending engine that can start now (no build, or its build finished); None: all wait."""
    for e in pending:
        if e.build is None or e.build not in builds or builds[e.build].done():
            return e
    return None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every selected engine on every selected scenario; rows in table order.

    Engines start in table order, except that one whose native build is still compiling lets the next
    ready engine go first (the build overlaps other engines' runs instead of idling the GPU). Past
    ``--deadline-s`` the remaining engines become ``skipped`` rows and running builds are stopped.
    """
    scenarios = [get_scenario(s.strip()) for s in args.scenario.split(",")]
    engines = select(args.engines)
    live = sys.stdout if args.live else None
    builds: dict[str, Build] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-builds-"))
    wanted = {e.build for e in engines if e.build and e.installed() and any(e.applies(s) for s in scenarios)}
    if args.device == "cuda" and args.prebuild:
        for code in sorted(wanted):
            builds[code] = Build(code, log_dir)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for sc in scenarios:
            budget = sc.vram_gb if args.vram_gb is None else (args.vram_gb or None)
            pending = list(engines)
            while pending:
                eng = next_engine(pending, builds)
                if eng is None:  # every remaining engine waits for a build: wait for the first one
                    builds[pending[0].build].wait()
                    continue
                pending.remove(eng)
                left = args.deadline_s - (time.perf_counter() - t0) if args.deadline_s else float("inf")
                row = _row(eng, sc, budget, args, live, builds, left)
                rows.append(row)
                _announce(row, live)
    finally:
        for b in builds.values():
            b.stop()
    position = {e.name: i for i, e in enumerate(engines)}
    order = {s.name: i for i, s in enumerate(scenarios)}
    rows.sort(key=lambda r: (order.get(r["scenario"], 99), position.get(r["engine"], 99)))
    return rows


def _row(
    eng: Engine,
    sc: Scenario,
    budget: float | None,
    args: argparse.Namespace,
    live: TextIO | None,
    builds: dict[str, Build],
    left_s: float,
) -> dict[str, Any]:
    """One engine's row: static when it can't run, else from its worker process."""
    if not eng.applies(sc):
        return static_row(eng, sc, budget, "n/a", f"{eng.label} has no {sc.mode} mode")
    if not eng.installed():
        return static_row(eng, sc, budget, "not installed", f"no module named {eng.package!r}")
    if left_s < MIN_ENGINE_S:
        return static_row(
            eng, sc, budget, "skipped", f"run deadline (--deadline-s {args.deadline_s:g}) reached"
        )
    note = {}
    if eng.build in builds:
        rc, secs = builds[eng.build].wait()
        note = {"build_s": secs, "build_rc": rc}
        if rc != 0:  # the engine will try to build again itself, inside its timeout
            note["build_log_tail"] = builds[eng.build].log_tail()
    row = run_worker(eng, sc, budget, args, live, timeout_s=min(args.timeout, left_s))
    row.update(note)
    return row


def _announce(row: dict[str, Any], live: TextIO | None) -> None:
    """A finished row: a JSON line with ``--live``, else one human line on stderr."""
    if live is None:
        print(_one_line(row), file=sys.stderr, flush=True)
        for extra in row.get("detail_extra") or []:  # where the memory of an OOM row went
            print(f"    {extra}", file=sys.stderr, flush=True)
        return
    keys = ("scenario", "engine", "outcome", "step_s", "peak_vram_gib", "detail", "detail_extra")
    live.write(json.dumps({"event": "row", **{k: row.get(k) for k in keys}}) + "\n")
    live.flush()


def _one_line(row: dict[str, Any]) -> str:
    step = f"{row['step_s']:.3f} s/step" if row.get("step_s") else ""
    return f"[{row['scenario']}] {row['engine']:<16} {row['outcome']:<13} {step} {row.get('detail', '')}"[
        :200
    ]


def write_rows(path: Path, rows: list[dict[str, Any]], merge: bool) -> list[dict[str, Any]]:
    """Write rows as JSON lines; with ``merge``, keep earlier rows of (scenario, engine) pairs not rerun.

    Returns:
        Every row now in the file, in scenario then table (``ENGINES``) order.
    """
    kept: list[dict[str, Any]] = []
    if merge and path.exists():
        new = {(r["scenario"], r["engine"]) for r in rows}
        for line in path.read_text().splitlines():
            if line.strip():
                old = json.loads(line)
                if (old.get("scenario"), old.get("engine")) not in new:
                    kept.append(old)
    position = {name: i for i, name in enumerate(ENGINES)}
    scenario_order = {name: i for i, name in enumerate(SCENARIOS)}
    every = sorted(
        kept + rows, key=lambda r: (scenario_order.get(r["scenario"], 99), position.get(r["engine"], 99))
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in every:
            f.write(json.dumps(r, default=str) + "\n")
    return every


def build_parser() -> argparse.ArgumentParser:
    """The command line of compare.py (the parent side)."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", default="lora14b", help=f"comma-separated; one of {', '.join(SCENARIOS)}")
    ap.add_argument("--engines", default="all", help=f"comma-separated or 'all'; of {', '.join(ENGINES)}")
    ap.add_argument(
        "--vram-gb", type=parse_vram, default=None, help="GiB; 'none': whole device; default: the scenario's"
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine before it is killed")
    ap.add_argument(
        "--deadline-s", type=float, default=0.0, help="whole-run limit: later engines are skipped"
    )
    ap.add_argument("--fresh", action="store_true", help="overwrite --out instead of merging rows into it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON lines (default benchmarks/results/compare-SCENARIO.jsonl)",
    )
    ap.add_argument("--live", action="store_true", help="stream progress and rows as JSON lines on stdout")
    ap.add_argument("--no-prebuild", dest="prebuild", action="store_false", help="don't compile peers ahead")
    ap.add_argument(
        "--report", action="store_true", help="regenerate docs/benchmarks.md and the README block"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU, stock engine: checks the harness"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python benchmarks/compare.py``."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        from engines.runner import main as worker_main

        rc = worker_main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # skip interpreter teardown: some engines hang in theirs (process groups, threads)
    args = build_parser().parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        raise SystemExit(f"--warmup >= 0 and --steps >= 1 needed, got {args.warmup} and {args.steps}")
    if args.smoke:
        args.scenario = "smoke" if args.scenario == "lora14b" else args.scenario
        args.device = "cpu"
        args.vram_gb = 0.0
        args.engines = "stock" if args.engines == "all" else args.engines
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run(args)
    # smoke rows stay out of the compare-*.jsonl files the docs are generated from
    stem = "smoke-compare" if args.smoke else f"compare-{args.scenario.replace(',', '+')}"
    out = args.out or RESULTS / f"{stem}.jsonl"
    every = write_rows(out, rows, merge=not args.fresh)
    import report

    table = report.markdown_tables(every)
    # with --live stdout carries only JSON lines; the table goes to stderr
    if args.live:
        sys.stdout.write(json.dumps({"event": "done", "out": str(out)}) + "\n")
    print(table + f"\n\nrows: {out}", file=sys.stderr if args.live else sys.stdout)
    if args.report:
        report.main(["--update-readme"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
