"""The ``tidal`` command (console script and ``python -m tidal``).

Subcommands: ``demo`` (the main job), ``env``, ``plan``, ``report``. Each subcommand's heavy imports
(torch, transformers, matplotlib) happen only when it runs, so ``tidal --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tidal.__about__ import __version__
from tidal.errors import TidalError

EPILOG = "Run `tidal demo` first: it trains a small model under a VRAM budget and shows what tidal did."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal",
        description="tidal: train and fine-tune models larger than the GPU's memory, on one GPU.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"tidal {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log tidal's decisions as they are made")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="train a built-in byte-level GPT on the Python standard library under a VRAM budget",
        description=(
            "Train a built-in byte-level GPT (no download) on the Python standard library's source under a "
            "VRAM budget smaller than it needs, so tidal must stream weights and keep the optimizer on the "
            "host. Prints the plan, a progress bar, a summary; writes loss.png, timeline.png and "
            "metrics.json. Without a GPU the same pipeline runs on the CPU (with a note)."
        ),
    )
    d.add_argument(
        "--size", default="auto", help="tiny, small, base, large, xl, or auto (small on CPU, large on GPU)"
    )
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    d.add_argument(
        "--vram-budget",
        default=None,
        help="device memory budget, e.g. 2GiB (default: chosen from the plan so that blocks must stream)",
    )
    d.add_argument(
        "--quantize",
        default="none",
        help="none (full fine-tune) or int8, nf4, fp8, nvfp4: a frozen quantized base with LoRA adapters",
    )
    d.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default: 128 CPU, 512 GPU)")
    d.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8)")
    d.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    d.add_argument("--lr", type=float, default=None, help="learning rate (default depends on size and mode)")
    d.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default 0)")
    d.add_argument("--out", default="demo-out", help="output folder (default ./demo-out)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    e = sub.add_parser("env", help="versions, GPU, and what is missing with how to install it")
    e.add_argument("--json", action="store_true", help="print JSON instead of the table")

    pl = sub.add_parser(
        "plan",
        help="the plan for a transformers config (folder or config.json) or a size preset, without weights or GPU",
        description=(
            "Build the model on the meta device (no memory, no weights) and print tidal's plan for it under a "
            "VRAM budget, or why it cannot fit. CONFIG is a folder with config.json, a config.json file, or "
            "a preset: 1.5b, 7b, 8b, 14b, 32b, 72b, 110b."
        ),
    )
    pl.add_argument("config", metavar="CONFIG")
    pl.add_argument("--vram-budget", required=True, help="device memory budget, e.g. 24GiB")
    pl.add_argument("--lora", action="store_true", help="LoRA on every projection: the base is frozen")
    pl.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    pl.add_argument(
        "--quantize", default=None, help="frozen-base storage: auto, int8, nf4, fp8, nvfp4 (default exact)"
    )
    pl.add_argument(
        "--host-ram",
        default=None,
        help="host RAM to plan for, e.g. 64GB (default: the measured profile's; 128 GB without a GPU)",
    )
    pl.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    pl.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    r = sub.add_parser("report", help="print the JSON summary and memory report of a demo output folder")
    r.add_argument(
        "dir", nargs="?", default="demo-out", help="the folder `tidal demo --out` wrote (default demo-out)"
    )
    r.add_argument("--steps", action="store_true", help="include the per-step records")
    return p


def _options(a: argparse.Namespace, names: Sequence[str]) -> dict[str, object]:
    """The parsed options ``names`` as keyword arguments (each option's dest is its field's name)."""
    return {name: getattr(a, name) for name in names}


def _cmd_demo(a: argparse.Namespace) -> int:
    from tidal.demo.config import DemoConfig
    from tidal.demo.run import run_demo

    names = ("size", "steps", "vram_budget", "quantize", "seq_len", "batch_size", "device", "lr", "seed")
    cfg = DemoConfig(**_options(a, names), out=Path(a.out))
    run_demo(cfg, progress=not a.no_progress)
    return 0


def _cmd_env(a: argparse.Namespace) -> int:
    from tidal.env import collect, render

    rep = collect()
    print(json.dumps(rep.to_dict(), indent=2) if a.json else render(rep))
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    from tidal.plan_cli import PlanRequest, run_plan

    names = ("config", "vram_budget", "lora", "lora_rank", "quantize", "host_ram", "batch_size", "seq_len")
    req = PlanRequest(**_options(a, names))
    return run_plan(req, as_json=a.json)


def _cmd_report(a: argparse.Namespace) -> int:
    from tidal.report import load_report

    print(json.dumps(load_report(a.dir, steps=a.steps), indent=2))
    return 0


# base error class of each sibling package: a clear message from any of them is printed without a traceback
_SIBLING_ERRORS = {
    "tidal_arena": "ArenaError",
    "tidal_quant": "QuantError",
    "tidal_plan": "PlanError",
    "tidal_stream": "StreamError",
    "tidal_kv": "KVCacheError",
    "tidal_hf": "TidalHFError",
}


def _known_errors() -> tuple[type[BaseException], ...]:
    """tidal's own error classes, taken from the sibling packages this run has imported (none imported: none raised)."""
    found: list[type[BaseException]] = [TidalError]
    for module, name in _SIBLING_ERRORS.items():
        mod = sys.modules.get(module)
        if mod is not None and name in getattr(mod, "__all__", ()):
            found.append(getattr(mod, name))
    return tuple(found)


COMMANDS = {"demo": _cmd_demo, "env": _cmd_env, "plan": _cmd_plan, "report": _cmd_report}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 the plan is infeasible, 2 bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:
        if not isinstance(exc, _known_errors()):
            raise  # a bug, not bad input: keep the traceback
        infeasible = type(exc).__name__ == "InfeasiblePlan"
        print(
            f"tidal {args.command}: {'the plan is infeasible' if infeasible else 'error'}: {exc}",
            file=sys.stderr,
        )
        return 1 if infeasible else 2


if __name__ == "__main__":
    sys.exit(main())
