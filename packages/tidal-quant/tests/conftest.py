"""Shared fixtures: few CPU threads (the CI box is shared), seeded RNG, scripts in Triton's interpreter."""

import os
import subprocess
import sys

import pytest
import torch

from tidal_testing import torch_threads


@pytest.fixture(autouse=True)
def _few_threads_and_seed():
    with torch_threads(2):
        torch.manual_seed(0)
        yield


@pytest.fixture
def run_in_triton_interpreter():
    """Run a script in a fresh Python with ``TRITON_INTERPRET=1`` (Triton's kernels on the CPU); it must exit
    cleanly and print "ok" last."""

    def run(script: str) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

    return run
