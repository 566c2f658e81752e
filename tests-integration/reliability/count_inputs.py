"""Print the bad inputs tried per entry point, from the JSON the reliability suite writes.

Usage::

    TIDAL_FUZZ_COUNTS=/tmp/fuzz.json .venv/bin/pytest -q tests-integration/reliability
    python tests-integration/reliability/count_inputs.py /tmp/fuzz.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    data = json.loads(Path(path).read_text())
    rows = data["by_entry_point"]
    width = max(len(k) for k in rows)
    for name, n in sorted(rows.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{name:{width}s}  {n:6d}")
    print(f"{'total':{width}s}  {sum(rows.values()):6d}  ({len(rows)} entry points)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "fuzz_counts.json"))
