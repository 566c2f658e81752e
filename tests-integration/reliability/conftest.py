"""Reliability scenarios: the fuzz-input counter (written to JSON and summarised at the end of the run).

Each hypothesis test calls ``fuzz_count(entry_point)`` once per generated input. At the end of the run
the counts are written to ``$TIDAL_FUZZ_COUNTS`` (default: ``fuzz_counts.json`` in pytest's base
temporary folder) and their total is printed in the terminal summary; ``count_inputs.py`` prints the
same table from the JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the scenarios share _common.py (tests are not a package)

_COUNTS: Counter[str] = Counter()
_OUT: list[Path] = []


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        # without pytest-timeout (the GPU machine) the per-test limits are inert, not collection errors
        config.addinivalue_line("markers", "timeout(seconds): per-test time limit (pytest-timeout)")


@pytest.fixture
def fuzz_count():
    """``fuzz_count(entry_point)`` records one bad input tried against that entry point."""

    def add(entry: str) -> None:
        _COUNTS[entry] += 1

    return add


@pytest.fixture(autouse=True)
def _counts_path(tmp_path_factory):
    if not _OUT:
        env = os.environ.get("TIDAL_FUZZ_COUNTS")
        _OUT.append(Path(env) if env else tmp_path_factory.getbasetemp() / "fuzz_counts.json")


def pytest_sessionfinish(session, exitstatus):
    if _COUNTS and _OUT:
        _OUT[0].parent.mkdir(parents=True, exist_ok=True)
        _OUT[0].write_text(
            json.dumps(
                {"by_entry_point": dict(sorted(_COUNTS.items())), "total": sum(_COUNTS.values())}, indent=1
            )
        )


def pytest_terminal_summary(terminalreporter):
    if _COUNTS:
        terminalreporter.write_line(
            f"tidal reliability: {sum(_COUNTS.values())} bad inputs tried over {len(_COUNTS)} entry points"
            + (f" (counts in {_OUT[0]})" if _OUT else "")
        )
