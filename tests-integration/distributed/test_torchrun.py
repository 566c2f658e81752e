"""``torchrun --nproc_per_node=2`` of a plain ``tidal.wrap`` job: detection, shards, shared copy, checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL run needs two GPUs"),
            ],
        ),
    ],
)
def test_torchrun_two_ranks(tmp_path: pathlib.Path, backend: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(HERE / "torchrun_job.py"),
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDAL_TEST_BACKEND=backend)
    # nccl: under the GPU suite's 100 s per test, so a hung job fails here with the ranks' output
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=28 if backend == "gloo" else 90
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    assert [r["local_rank_env"] for r in res] == [0, 1]
    assert all(r["optimizer"] == "ShardedHostAdamW" and r["dist"]["world"] == 2 for r in res)
    assert [r["dist"]["local_rank"] for r in res] == [0, 1]  # found from host names, agrees with torchrun
    # the two shards tile the trainable parameters
    assert res[0]["dist"]["shard_hi"] == res[1]["dist"]["shard_lo"] == -(-res[0]["dist"]["numel"] // 2)
    assert all(r["dist"]["backend"] == backend for r in res)
    if backend == "gloo":  # the frozen base stays in host memory: one copy, counted once on the machine
        assert sum(r["shared_counted"] for r in res) == res[0]["shared_bytes"] > 128 * 128 * 4
    else:  # the frozen base is resident on each rank's GPU: no host copy; no block stack, so no plan
        assert [r["base_device"] for r in res] == ["cuda:0", "cuda:1"]
        assert all(r["shared_bytes"] is None for r in res)
        assert all(any("no plan" in m and "no block stack" in m for m in r["events"]) for r in res)
    w0, w1 = (torch.load(tmp_path / f"weights{r}.pt", weights_only=True) for r in range(2))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert set(ck["optim"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert all(float(s["step"]) == 3 for s in ck["optim"]["state"].values())
