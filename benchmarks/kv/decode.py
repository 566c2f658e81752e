"""decode8b: decode tokens/s of a Llama-3-8B-shaped model with half its layers' K/V on the host.

    python3 benchmarks/kv/decode.py --out results.jsonl   # the GPU machine: the whole table, ~3 min, <= 4 min
    python3 benchmarks/kv/decode.py --smoke               # tiny model on the CPU (checks the script, not speed)
    python3 benchmarks/kv/decode.py --engines tidal --contexts 4096 --batches 1

Engines, each in its own process, in this order (the slow one last): ``dynamic`` (transformers'
DynamicCache, every layer's K/V in VRAM), ``tidal`` (TidalCache, half the layers' K/V in pinned host pages,
prefetched into two device slots while earlier layers compute), optionally ``tidal-fp8`` / ``tidal-nf4`` (the same with
e4m3 / NF4 host pages) and ``tidal-resident`` (TidalCache with every layer resident: its own cost without any
copy, to split tidal's gap to DynamicCache into the cache's host time and the offloaded layers'), and ``offloaded`` (transformers' DynamicCache(offloading=True): every layer's K/V on
the host, one layer prefetched ahead). The shape is the harness scenario ``decode8b`` (Llama-3-8B, sdpa).
Each process builds the random bf16 weights on the GPU once (16 GB) and runs the four (context, batch)
cases, smallest first.

What is measured: the cache is filled with *synthesized* random K/V through ``cache.update`` (the same
call a prefill makes; the prefill's own compute is not measured), ``context - warmup - steps`` tokens, so
the last timed step attends over exactly ``context`` tokens. Then ``--warmup`` untimed steps and up to
``--steps`` timed ones (the offloaded engine: ``--offloaded-warmup`` / ``--offloaded-steps``), each
ended by a device-wide synchronize (stricter than ``generate()``, which waits for the compute stream:
``generate_rounds.py`` times ``generate()`` itself); tokens/s = batch / median step time. Decode VRAM peak = the peak
during the timed steps minus the weights (K/V plus temporaries).

Time boxes: a per-case limit (``--case-timeout``, and never past the engine's share of ``--budget-s``)
turns an overlong case into a ``timeout`` row; each engine process is killed at its deadline and its
missing cases become ``timeout`` rows. The table is always printed.

Reading the result: a decode step of TidalCache must copy the offloaded layers' full pages over PCIe
(``pcie_floor_ms`` at 55.4 GB/s). Where that floor exceeds DynamicCache's step time, 0.9x is out of
reach by physics, not by overhead; the table shows the floor next to the measurement. At batch 1 the
step is bound by the host, whose speed on the GPU machine moved by tens of milliseconds between
processes: ``interleaved.py`` steps the engines in turn in one process for ratios that drift cannot move.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _p in (HERE, HERE.parent):  # benchmarks/kv (decode_worker) and benchmarks/ (engines: the scenario)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from decode_worker import PAGE_BYTES, PREFIX, SDPA_BACKENDS, GiB, Shape, cases, estimate  # noqa: E402

ENGINES = (
    "dynamic",
    "tidal",
    "tidal-fp8",
    "tidal-nf4",
    "tidal-resident",
    "offloaded",
)  # run order: the slow offloaded cache last
DEFAULT_ENGINES = ("dynamic", "tidal", "offloaded")
#: seconds kept back for each later engine when giving an engine its deadline
RESERVE_S = {
    "dynamic": 35.0,
    "tidal": 60.0,
    "tidal-fp8": 45.0,
    "tidal-nf4": 40.0,
    "tidal-resident": 35.0,
    "offloaded": 75.0,
}
_GRACE_S = 15.0  # past an engine's deadline before its process is killed (its own limits come first)


def model_config(smoke: bool) -> Any:
    """The transformers config: scenario ``decode8b`` (Llama-3-8B), or a tiny Llama for ``--smoke``."""
    import transformers

    if smoke:
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096,
        )  # fmt: skip
        # head_dim 32 (above): whole NF4 blocks per row for the tidal-nf4 engine
        cfg._attn_implementation = "sdpa"
        return cfg
    from engines.scenarios import get_scenario, hf_config

    return hf_config(get_scenario("decode8b"))


def shape_of(smoke: bool) -> Shape:
    """The K/V geometry of :func:`model_config` without building anything."""
    c = model_config(smoke)
    return Shape(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                 c.num_attention_heads, 4 if smoke else 2)  # fmt: skip


def estimates_text(args: argparse.Namespace, shape: Shape, weights_gib: float | None) -> str:
    """The up-front memory table: K/V per case and what each engine should need, with fit verdicts."""
    lines = [
        "| context | batch | K/V all layers GiB | dynamic VRAM GiB | tidal VRAM / host GiB | offloaded VRAM / "
        "pinned host GiB | tidal PCIe floor ms/step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ctx, batch in cases(args.contexts, args.batches):
        e = estimate(shape, batch, ctx, shape.layers // 2, args.slots, args.page_tokens)
        lines.append(
            f"| {ctx} | {batch} | {e['kv']:.2f} | {e['dynamic_vram']:.2f} | {e['tidal_vram']:.2f} / "
            f"{e['tidal_host']:.2f} | {e['offloaded_vram']:.2f} / {e['offloaded_host']:.2f} | "
            f"{e['pcie_floor_ms']:.1f} |"
        )
    if weights_gib is not None:
        worst = max(
            estimate(shape, b, c, shape.layers // 2, args.slots, args.page_tokens)["dynamic_vram"]
            for c, b in cases(args.contexts, args.batches)
        )
        lines.append(
            f"\nweights {weights_gib:.1f} GiB + largest dynamic case {worst:.1f} GiB = {weights_gib + worst:.1f} GiB "
            "(H200: 139.8 GiB usable; each worker re-checks against free VRAM and writes a 'skipped' row if not)"
        )
    return "\n".join(lines)


def weights_gib(smoke: bool) -> float | None:
    """bf16 bytes of the decode8b weights (None for the smoke model)."""
    if smoke:
        return None
    from engines.scenarios import get_scenario

    return get_scenario("decode8b").param_count() * 2 / GiB


# ---------------------------------------------------------------------------------------------- parent


def run_engine(
    engine: str, fwd: list[str], deadline: float, rows: list[dict[str, Any]]
) -> tuple[int | None, str]:
    """Run one worker until it exits or its deadline (+ grace) passes; rows stream into ``rows`` as printed.

    Returns:
        (exit code or None if killed, the tail of its stderr).
    """
    cmd = [sys.executable, str(HERE / "decode.py"), "--worker", engine, "--deadline", f"{deadline:.3f}", *fwd]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PREFIX):
                    try:
                        rows.append(json.loads(line[len(PREFIX) :]))
                    except json.JSONDecodeError:  # a line cut by the kill: the case gets a timeout row
                        continue
                    print(line.rstrip(), flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=max(1.0, deadline + _GRACE_S - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
            proc.wait()
            rc = None
        reader.join(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
        err.seek(0)
        tail = err.read()[-3000:]
    return rc, tail


def fill_missing(engine: str, args: argparse.Namespace, rows: list[dict[str, Any]], why: str) -> None:
    """A ``timeout``/``error`` row for every case of ``engine`` that printed nothing."""
    have = {(r["context"], r["batch"]) for r in rows if r.get("engine") == engine and "context" in r}
    status = "timeout" if "deadline" in why else "error"
    for ctx, batch in cases(args.contexts, args.batches):
        if (ctx, batch) not in have:
            rows.append({"engine": engine, "context": ctx, "batch": batch, "status": status, "detail": why})


# ---------------------------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]], args: argparse.Namespace, shape: Shape) -> str:
    """The result table: one row per engine and case, ratios to DynamicCache and to the offloaded cache."""
    ok = {(r["engine"], r["context"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    lines = [
        "| engine | context | batch | status | tokens/s | ms/step | × dynamic | × offloaded | PCIe floor ms "
        "| decode VRAM peak GiB | KV host GiB | note |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    cases_rows = [r for r in rows if "context" in r]
    order = {e: i for i, e in enumerate(ENGINES)}
    cases_rows.sort(key=lambda r: (r["context"], r["batch"], order.get(r["engine"], 9)))
    for r in cases_rows:
        key = (r["context"], r["batch"])
        dyn, off = ok.get(("dynamic", *key)), ok.get(("offloaded", *key))
        tps = r.get("tokens_per_s")
        x_dyn = tps / dyn["tokens_per_s"] if tps and dyn and r["engine"] != "dynamic" else None
        x_off = tps / off["tokens_per_s"] if tps and off and r["engine"] != "offloaded" else None
        floor = None
        if r["engine"] in PAGE_BYTES:
            e = estimate(shape, r["batch"], r["context"], shape.layers // 2, args.slots, args.page_tokens)
            floor = e["pcie_floor_ms"] * PAGE_BYTES[r["engine"]]
        lines.append(
            f"| {r['engine']} | {r['context']} | {r['batch']} | {r['status']} | {_fmt(tps, '.1f')} | "
            f"{_fmt(r.get('ms_per_step'), '.1f')} | {_fmt(x_dyn)} | {_fmt(x_off)} | {_fmt(floor, '.1f')} | "
            f"{_fmt(r.get('decode_vram_peak_gib'))} | {_fmt(r.get('kv_host_gib'))} | {r.get('detail', '')} |"
        )
    return "\n".join(lines)


def goals(rows: list[dict[str, Any]], args: argparse.Namespace, shape: Shape) -> list[str]:
    """One line per case and TidalCache engine (tidal, tidal-fp8, tidal-nf4, those that ran): against the goals
    (>= 0.9x dynamic, >= 2x offloaded), the VRAM saved, and the ratio the PCIe floor of its page format allows."""
    ok = {(r["engine"], r["context"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    ran = [e for e in PAGE_BYTES if any(r["engine"] == e for r in rows)] or ["tidal"]
    out = []
    for ctx, batch in cases(args.contexts, args.batches):
        d, o = ok.get(("dynamic", ctx, batch)), ok.get(("offloaded", ctx, batch))
        for engine in ran:
            t = ok.get((engine, ctx, batch))
            if t is None:
                out.append(f"context {ctx} batch {batch}: {engine} has no measurement")
                continue
            out.append(_goal_line(engine, t, d, o, ctx, batch, args, shape))
    return out


def _goal_line(
    engine: str, t: dict, d: dict | None, o: dict | None, ctx: int, batch: int, args, shape
) -> str:
    """:func:`goals`' line for one engine's row ``t`` (``d``, ``o``: DynamicCache's and the offloaded cache's)."""
    parts = [f"context {ctx} batch {batch}: {engine} {t['tokens_per_s']:.1f} tok/s"]
    if d:
        r = t["tokens_per_s"] / d["tokens_per_s"]
        e = estimate(shape, batch, ctx, shape.layers // 2, args.slots, args.page_tokens)
        bound = d["ms_per_step"] / max(d["ms_per_step"], e["pcie_floor_ms"] * PAGE_BYTES[engine])
        parts.append(
            f"{r:.2f}x dynamic (goal 0.9: {'met' if r >= 0.9 else 'missed'}; PCIe allows <= {bound:.2f}x)"
        )
        saved = d["decode_vram_peak_gib"] - t["decode_vram_peak_gib"] if "decode_vram_peak_gib" in d else None
        if saved is not None:
            parts.append(
                f"VRAM saved {saved:.2f} GiB measured ({d['decode_vram_peak_gib']:.2f} -> {t['decode_vram_peak_gib']:.2f}), "
                f"{t['all_resident_gib'] - t['kv_device_gib']:.2f} GiB by the cache's own accounting"
            )
    else:
        parts.append("dynamic: no measurement")
    if o:
        r = t["tokens_per_s"] / o["tokens_per_s"]
        parts.append(f"{r:.2f}x offloaded (goal 2: {'met' if r >= 2 else 'missed'})")
    else:
        parts.append("offloaded: no measurement")
    parts.append(
        f"prefetched {t['prefetched']}, on demand {t['gathered_on_demand']}, slow-path copies "
        f"{t.get('inspections', 0)}, H2D {t['h2d_gb_per_s']:.1f} GB/s"
    )
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The command line (workers get the same options plus ``--worker`` and ``--deadline``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", default=",".join(DEFAULT_ENGINES), help="comma-separated subset of " + ",".join(ENGINES)
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="context lengths (default 4096 32768)"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 16)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps (dynamic, tidal)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (dynamic, tidal)")
    ap.add_argument("--offloaded-steps", type=int, default=3, help="timed steps of the offloaded cache")
    ap.add_argument("--offloaded-warmup", type=int, default=1, help="untimed steps of the offloaded cache")
    ap.add_argument(
        "--case-timeout", type=float, default=80.0, help="seconds per (context, batch) case at most"
    )
    ap.add_argument("--budget-s", type=float, default=200.0, help="seconds for all engines together")
    ap.add_argument("--page-tokens", type=int, default=256, help="TidalCache page size")
    ap.add_argument("--slots", type=int, default=2, choices=(2, 3), help="TidalCache prefetch slots")
    ap.add_argument(
        "--sdpa",
        choices=list(SDPA_BACKENDS),
        default="default",
        help="attention backends torch may pick from: 'default' is torch's own order (cuDNN's first on Hopper, "
        "which builds a graph per new sequence length: tens of ms of host time per batch-1 step); "
        "'no-cudnn' leaves it out",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse and complete the options (smoke defaults, validation)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.contexts is None:
        args.contexts = [96, 200] if args.smoke else [4096, 32768]
    if args.batches is None:
        args.batches = [1, 3] if args.smoke else [1, 16]
    if args.smoke:
        args.page_tokens = min(args.page_tokens, 16)
    for name in ("steps", "offloaded_steps", "page_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: >= 1")
    for name in ("warmup", "offloaded_warmup"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: >= 0")
    need = max(args.warmup + args.steps, args.offloaded_warmup + args.offloaded_steps) + 1
    if min(args.contexts) <= need:
        ap.error(f"--contexts: got {args.contexts}; each must exceed warmup + steps + 1 = {need}")
    args.engine_list = [e for e in args.engines.split(",") if e]
    bad = [e for e in args.engine_list if e not in ENGINES]
    if bad:
        ap.error(f"--engines: unknown {bad}; accepted {list(ENGINES)}")
    timed = [e for e in args.engine_list if not (args.smoke and e == "offloaded")]  # see main
    floor = sum(RESERVE_S[e] for e in timed)
    if not args.worker and args.budget_s < floor:
        # why: each engine's deadline keeps the later engines' reserves back, so a short budget would leave the
        # first engines a few seconds and turn their cases into timeout rows
        ap.error(
            f"--budget-s: got {args.budget_s:g}; the engines {','.join(timed)} need at least {floor:g} s together "
            f"({', '.join(f'{e} {RESERVE_S[e]:g}' for e in timed)}): pass --budget-s {floor:g} or more, or fewer --engines"
        )
    return args


def forward_args(args: argparse.Namespace) -> list[str]:
    """The options a worker needs, as command-line words."""
    fwd = ["--contexts", *map(str, args.contexts), "--batches", *map(str, args.batches)]
    for name in (
        "steps",
        "warmup",
        "offloaded_steps",
        "offloaded_warmup",
        "case_timeout",
        "page_tokens",
        "slots",
        "sdpa",
    ):
        fwd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return fwd + (["--smoke"] if args.smoke else [])


def main(argv: list[str] | None = None) -> int:
    """Run the engines (or, with ``--worker``, one engine) and print the tables; 1 if an engine failed."""
    import engines as _engines  # puts packages/*/src on the path of this process and of the workers

    del _engines

    args = parse(argv)
    if args.worker:
        from decode_worker import worker

        args.deadline = args.deadline or time.time() + args.budget_s
        worker(args.worker, model_config(args.smoke), args)
        return 0
    engines = [e for e in ENGINES if e in args.engine_list]  # fixed order: the offloaded cache last
    if args.smoke and "offloaded" in engines:
        engines.remove("offloaded")  # transformers' offloaded cache needs CUDA streams
        print("[offloaded] skipped: transformers' offloaded cache needs CUDA", file=sys.stderr)
    shape = shape_of(args.smoke)
    print("K/V memory estimates (GiB; half the layers resident for tidal):")
    print(estimates_text(args, shape, weights_gib(args.smoke)), flush=True)
    print()
    start = time.time()
    end = start + args.budget_s
    rows: list[dict[str, Any]] = []
    status = 0
    for i, engine in enumerate(engines):
        later = sum(RESERVE_S[e] for e in engines[i + 1 :])
        deadline = max(time.time() + 20.0, end - later)
        t0 = time.time()
        rc, tail = run_engine(engine, forward_args(args), deadline, rows)
        print(f"[{engine}] {'killed at its deadline' if rc is None else f'exit {rc}'} in {time.time() - t0:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        if rc:
            status = 1
            print(tail, file=sys.stderr)
        if rc is None:
            fill_missing(engine, args, rows, f"engine process killed at its deadline ({deadline - t0:.0f} s)")
        elif rc:
            fill_missing(engine, args, rows, f"engine exited with {rc}: {tail.strip().splitlines()[-1:]}")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"\ndecode8b ({'smoke' if args.smoke else 'Llama-3-8B bf16, sdpa'}), wall {time.time() - start:.0f} s\n"
    )
    print(table(rows, args, shape))
    print()
    for line in goals(rows, args, shape):
        print("- " + line)
    for r in rows:
        if "parity_error" in r:
            print(f"- parity: FAILED to run: {r['parity_error']}")
        if "parity_max_abs_logit_diff" in r:
            print(f"- parity: TidalCache vs DynamicCache max |Δ logits| = {r['parity_max_abs_logit_diff']}")
        if r.get("setup"):
            print(f"- [{r['engine']}] weights {r['weights_gib']:.2f} GiB built in {r['build_s']:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
