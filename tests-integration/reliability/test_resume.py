"""Resume: a training process killed with SIGKILL right after its checkpoint at step N, restarted from
it, reaches step 2N bit-identical (weights and optimizer state) to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal_testing import devices

SCRIPT = Path(__file__).with_name("resume_run.py")
N = 4
pytestmark = pytest.mark.timeout(240)


def _cmd(device: str, tmp: Path, out: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--device",
        device,
        "--steps",
        str(2 * N),
        "--ckpt-at",
        str(N),
        "--ckpt",
        str(tmp / "ckpt.pt"),
        "--out",
        str(tmp / out),
        *extra,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.parametrize("device", devices())
def test_sigkill_after_checkpoint_then_resume_is_bit_identical(device, tmp_path):
    (tmp_path / "full").mkdir()
    full = subprocess.run(
        _cmd(device, tmp_path / "full", "out.pt"), env=_env(), capture_output=True, text=True, timeout=200
    )
    assert full.returncode == 0, full.stderr[-2000:]

    run = tmp_path / "killed"
    run.mkdir()
    proc = subprocess.Popen(
        _cmd(device, run, "never.pt", "--slow"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("CHECKPOINT"):
                os.kill(proc.pid, signal.SIGKILL)  # the process gets no chance to clean up
                break
    finally:
        rc = proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert rc == -signal.SIGKILL, f"the training process was not killed (exit status {rc})"
    assert not (run / "never.pt").exists(), "the killed run reached its end before the kill"
    assert (run / "ckpt.pt").exists()

    resumed = subprocess.run(
        _cmd(device, run, "out.pt", "--resume"), env=_env(), capture_output=True, text=True, timeout=200
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    a = torch.load(tmp_path / "full" / "out.pt", weights_only=True)
    b = torch.load(run / "out.pt", weights_only=True)
    assert a["step"] == b["step"] == 2 * N
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), f"weight {name} differs after resume"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        for k, v in sa[i].items():
            w = sb[i][k]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (
                f"optimizer state {i}.{k} differs after resume"
            )
