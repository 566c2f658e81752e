"""Results JSON → Markdown tables, a PNG bar chart, docs/benchmarks.md and the README's results block.

    python benchmarks/report.py                      # every benchmarks/results/*.jsonl → docs/benchmarks.md
    python benchmarks/report.py --update-readme      # also the block between the README's bench markers

Nothing in docs/benchmarks.md or the README block is typed by hand: both are regenerated from the rows
that ``compare.py`` and ``quality.py`` write.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def load_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Result rows (``event == "result"``) from JSON-lines files, in file order."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            ev = json.loads(line)
            if ev.get("event", "result") == "result":
                rows.append(ev)
    return rows


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, engine): the most recent (by its ``time``; later files win ties)."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r.get("scenario", ""), r.get("engine", ""))
        if key not in best or r.get("time", "") >= best[key].get("time", ""):
            best[key] = r
    keep = {id(r) for r in best.values()}
    return [r for r in rows if id(r) in keep]


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _outcome(row: dict[str, Any]) -> str:
    out = row.get("outcome", "error")
    detail = (row.get("detail") or "").replace("|", "\\|").replace("\n", " ")
    if out in ("ok",) or not detail:
        return out
    return f"{out}: {detail[:120]}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One scenario's rows as a Markdown table with the ratio of each step time to the fastest."""
    ok = [r["step_s"] for r in rows if r.get("outcome") == "ok" and r.get("step_s")]
    best = min(ok) if ok else None
    decode = any(r.get("mode") == "decode" for r in rows)
    unit = "s/token" if decode else "s/step"
    head = f"| engine | outcome | {unit} | × fastest | tokens/s | peak VRAM (GiB) | torch peak (GiB) | setup (s) |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step = r.get("step_s") if r.get("outcome") == "ok" else None
        ratio = step / best if step and best else None
        lines.append(
            "| {label} | {outcome} | {step} | {ratio} | {tps} | {vram} | {alloc} | {setup} |".format(
                label=r.get("label", r["engine"]),
                outcome=_outcome(r),
                step=_fmt(step),
                ratio=_fmt(ratio, 2),
                tps=_fmt(r.get("tokens_per_s"), 0) if step else "—",
                vram=_fmt(r.get("peak_vram_gib"), 1),
                alloc=_fmt(r.get("peak_alloc_gib"), 1),
                setup=_fmt(r.get("setup_s"), 1),
            )
        )
    return "\n".join(lines)


def by_scenario(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by scenario, scenarios in first-seen order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["scenario"], []).append(r)
    return groups


def _caption(rows: list[dict[str, Any]]) -> str:
    r = rows[0]
    budget = f"{r['budget_gib']:g} GiB budget" if r.get("budget_gib") else "no budget"
    steps = next((x for x in rows if x.get("warmup") is not None), {})
    timed = f"median of {steps['steps']} steps after {steps['warmup']} warm-up" if steps else ""
    device = next((x["device"] for x in rows if x.get("device")), "")
    return f"**{r['scenario']}** — {budget}; {timed}; {device}".rstrip("; ")


def markdown_tables(rows: list[dict[str, Any]]) -> str:
    """Every scenario's table under a caption line."""
    return "\n\n".join(f"{_caption(g)}\n\n{markdown_table(g)}" for g in by_scenario(rows).values())


def quality_table(rows: list[dict[str, Any]]) -> str:
    """quality.py's rows: held-out perplexity per storage format, before and after the LoRA fine-tune."""
    lines = [
        "| format | bytes/weight | ppl before | Δ vs bf16 | ppl after LoRA | Δ vs bf16 | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    base = next((r for r in rows if r.get("format") == "bf16"), None)
    for r in rows:
        d0 = r["ppl_before"] - base["ppl_before"] if base and r.get("ppl_before") is not None else None
        d1 = (
            r["ppl_after"] - base["ppl_after"]
            if base and r.get("ppl_after") is not None and base.get("ppl_after") is not None
            else None
        )
        lines.append(
            f"| {r['format']} | {_fmt(r.get('bytes_per_weight'), 3)} | {_fmt(r.get('ppl_before'), 3)} | "
            f"{_fmt(d0, 3)} | {_fmt(r.get('ppl_after'), 3)} | {_fmt(d1, 3)} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


_PREDICTED = re.compile(
    r"the cost model predicts (\d+) ms per step of this placement at the measured (\d+) tokens"
)
_GRAPHED = re.compile(r"captured CUDA graphs of blocks (?!none)([\d,\- ]+)")


_RELEASED = "CUDA graphs released:"


def _graphed_blocks(notes: str) -> str:
    """The blocks a run replayed as CUDA graphs (from its last "graphs" capture), "no", or the captured
    blocks marked released when the capture-step check gave them up for good (the timed steps then ran
    eagerly). Graphs released and captured again on fewer blocks count as the second capture."""
    captures = list(_GRAPHED.finditer(notes))
    if not captures:
        return "no"
    last = captures[-1]
    blocks = last.group(1).strip()
    return f"released ({blocks} captured)" if notes.find(_RELEASED, last.end()) >= 0 else blocks


def prediction_table(rows: list[dict[str, Any]]) -> str:
    """tidal's rows whose notes carry the cost model's step of the refined placement at the measured
    tokens (the first step's decision line): predicted against measured. '' when no row has one."""
    lines = [
        "| scenario | engine | tokens/step | CUDA graphs | predicted (ms) | measured (ms) | measured/predicted |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        notes = " ".join(r.get("engine_notes") or [])
        m = _PREDICTED.search(notes)
        if m is None or r.get("outcome") != "ok" or not r.get("step_s"):
            continue
        predicted, measured = int(m.group(1)), 1e3 * r["step_s"]
        lines.append(
            f"| {r.get('scenario', '')} | {r.get('label', r.get('engine', ''))} | {m.group(2)} | "
            f"{_graphed_blocks(notes)} | {predicted} | {measured:.0f} | "
            f"{_fmt(measured / predicted, 2) if predicted else '—'} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """A horizontal bar chart of step time per engine, one panel per scenario (failed runs labelled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_scenario(rows)
    if not groups:
        return None
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(8, 0.45 * sum(len(g) for g in groups.values()) + 1.2 * len(groups))
    )
    axes = [axes] if len(groups) == 1 else list(axes)
    for ax, g in zip(axes, groups.values()):
        labels = [r.get("label", r["engine"]) for r in g]
        vals = [r["step_s"] if r.get("outcome") == "ok" and r.get("step_s") else 0.0 for r in g]
        best = min((v for v in vals if v > 0), default=None)
        colors = ["#1f77b4" if r["engine"].startswith("tidal") else "#999999" for r in g]
        ys = range(len(g))
        ax.barh(list(ys), vals, color=colors)
        top = max(vals) if any(vals) else 1.0
        for y, v, r in zip(ys, vals, g):
            text = f"{v:.3f} s ({v / best:.2f}×)" if v and best else r.get("outcome", "error")
            ax.text(v + 0.01 * top, y, text, va="center", fontsize=8)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.35)
        ax.set_xlabel("seconds per step (lower is better)")
        ax.set_title(_caption(g).replace("**", ""), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render_doc(
    compare_rows: list[dict[str, Any]], quality_rows: list[dict[str, Any]], chart: str | None
) -> str:
    """The whole of docs/benchmarks.md."""
    parts = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/report.py from benchmarks/results/*.jsonl; do not edit by hand -->",
        "",
        "Each engine ran in its own process on the same model shape (random weights), the same batch, LoRA",
        "settings and learning rate; a filler leaves exactly the budget free; step time is the median after",
        "warm-up; peak VRAM is the device memory the engine took after the filler was placed (polled with",
        "`cudaMemGetInfo`: its allocator, workspaces and native allocations; the CUDA context, created before,",
        "is not in it); torch peak is `torch.cuda.max_memory_allocated`. How to run: benchmarks/README.md.",
        "",
        "## Side by side (`benchmarks/compare.py`)",
        "",
    ]
    parts.append(markdown_tables(compare_rows) if compare_rows else "_no results yet_")
    if chart:
        parts += ["", f"![step time per engine]({chart})"]
    predicted = prediction_table(compare_rows)
    if predicted:
        parts += [
            "",
            "## tidal's cost model at the measured batch",
            "",
            "After its first step tidal logs what `tidal_plan.predict` expects of the placement it ends with, at",
            "the tokens that step measured (the plan itself was sized for 4,096); here against the measured step.",
            "A row's prediction is the cost model of its run's commit: the 2026-11-30 lora14b rows priced the",
            "CUDA graphs (blocks listed) but neither PEFT's fp32 adapter GEMMs (13 us each) nor the block-by-block",
            "replay of streamed refills (`tidal_plan.stream_schedule`, which prices turn holds);",
            "`python benchmarks/plan/lora14b_placements.py` prints the current model's prediction of those",
            "placements (NF4 149, FP8 162, exact bf16 498 ms).",
            "",
            predicted,
        ]
    parts += ["", "## Perplexity per storage format (`benchmarks/quality.py`)", ""]
    if quality_rows:
        meta = quality_rows[0]
        parts.append(
            f"Reference model: {meta.get('model', '?')}, trained {meta.get('train_minutes', '?')} min on the Python "
            f"standard library; held-out perplexity (bytes), before and after a {meta.get('lora_steps', '?')}-step "
            "LoRA fine-tune."
        )
        parts += ["", quality_table(quality_rows)]
    else:
        parts.append("_no results yet_")
    return "\n".join(parts) + "\n"


def readme_block(compare_rows: list[dict[str, Any]]) -> str:
    """The README's results block: the first scenario's table (lora14b when present)."""
    groups = by_scenario(compare_rows)
    if not groups:
        return "_no benchmark results yet_"
    name = "lora14b" if "lora14b" in groups else next(iter(groups))
    return f"{_caption(groups[name])}\n\n{markdown_table(groups[name])}\n\nMore: [docs/benchmarks.md](docs/benchmarks.md)."


def replace_block(text: str, block: str) -> str:
    """``text`` with everything between the bench markers replaced by ``block``.

    Raises:
        ValueError: when the markers are missing or out of order.
    """
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(
            f"README: markers {START} … {END} not found (in order); add them where the table goes"
        )
    return text[: i + len(START)] + "\n" + block + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python benchmarks/report.py``."""
    ap = argparse.ArgumentParser(
        description="regenerate docs/benchmarks.md (and the README block) from results"
    )
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--readme", type=Path, default=README)
    ap.add_argument("--update-readme", action="store_true")
    a = ap.parse_args(argv)
    compare_rows = latest(load_rows(sorted(a.results.glob("compare-*.jsonl"))))
    quality_rows = load_rows(sorted(a.results.glob("quality*.jsonl")))
    chart = None
    if compare_rows:
        png = plot(compare_rows, a.doc.parent / "benchmarks.png")
        chart = png.name if png else None
    a.doc.parent.mkdir(parents=True, exist_ok=True)
    a.doc.write_text(render_doc(compare_rows, quality_rows, chart))
    print(f"wrote {a.doc}")
    if a.update_readme:
        a.readme.write_text(replace_block(a.readme.read_text(), readme_block(compare_rows)))
        print(f"updated {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
