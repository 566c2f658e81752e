#!/usr/bin/env python3
"""Warn about source modules longer than --warn lines (DESIGN: modules stay under ~600 lines)."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--warn", type=int, default=600, help="line count above which a module is reported")
    args = ap.parse_args()
    long = []
    for f in sorted(ROOT.glob("packages/*/src/**/*.py")):
        n = sum(1 for _ in f.open(encoding="utf-8"))
        if n > args.warn:
            long.append((n, f.relative_to(ROOT)))
    for n, f in long:
        print(f"warning: {f} has {n} lines (> {args.warn}); consider splitting it")
    print(f"module sizes: {len(long)} module(s) over {args.warn} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
