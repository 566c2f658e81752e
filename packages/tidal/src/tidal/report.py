"""``tidal report DIR``: the summary and memory report a demo run left in its output folder, as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tidal.errors import CLIError

METRICS_FILE = "metrics.json"


def load_report(out_dir: str | Path, *, steps: bool = False) -> dict[str, Any]:
    """Read ``metrics.json`` of a demo output folder.

    Args:
        out_dir: the folder given to ``tidal demo --out``.
        steps: keep the per-step records (dropped by default: the summary is what people read).

    Raises:
        CLIError: the folder or its ``metrics.json`` is missing or not a demo's.
    """
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        raise CLIError(
            f"report: {str(out_dir)!r} has no {METRICS_FILE}; give the folder a `tidal demo --out DIR` wrote "
            "(default ./demo-out), or run `tidal demo` first"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CLIError(f"report: {path} is not valid JSON ({exc}); rerun `tidal demo` to rewrite it") from exc
    if not isinstance(data, dict) or "summary" not in data:
        raise CLIError(f"report: {path} has no 'summary'; it was not written by `tidal demo`")
    if not steps:
        data.pop("steps", None)
    return data
