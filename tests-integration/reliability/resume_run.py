"""A training process for the resume scenario: trains a wrapped model, checkpoints at step N, and (with
``--resume``) restarts from that checkpoint. Run by test_resume.py as a subprocess.

Usage: ``python resume_run.py --device cpu --steps 2N --ckpt-at N --ckpt PATH --out PATH [--resume] [--slow]``

It prints ``CHECKPOINT <step>`` once the checkpoint file is complete (written to a temporary name, then
renamed), and writes the final weights and optimizer state to ``--out`` when it reaches ``--steps``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from _common import batches, loss_of, make_model

from tidal_stream import wrap


def _save(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: a kill never leaves a half-written checkpoint under the real name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-at", type=int, required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--slow", action="store_true", help="sleep after each step past the checkpoint")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    model = make_model(device=a.device)
    start = 0
    ckpt = None
    if a.resume:
        ckpt = torch.load(a.ckpt, weights_only=True)  # never unpickles code
        model.load_state_dict(ckpt["model"])
        start = ckpt["step"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = wrap(model, opt, offload=True, max_grad_norm=1.0)
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
    data = batches(a.steps, seed=3, device=a.device)
    for step in range(start, a.steps):
        loss_of(model, data[step]).backward()
        opt.step()
        opt.zero_grad()
        done = step + 1
        if done == a.ckpt_at and not a.resume:
            _save(a.ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done})
            print(f"CHECKPOINT {done}", flush=True)
        if a.slow and done > a.ckpt_at:
            time.sleep(0.2)
    opt.synchronize()
    _save(a.out, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": a.steps})
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
