"""Out-of-memory rows name where the live CUDA memory was allocated: the snapshot summary and its switch."""

from __future__ import annotations

import pytest
import torch
from engines import memtrace

MiB = 1 << 20
GiB = 1 << 30


def _frame(file: str, line: int, name: str) -> dict:
    return {"filename": file, "line": line, "name": name}


TORCH = _frame("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1340, "_apply")
BUILD = _frame("/repo/benchmarks/engines/common.py", 278, "materialize")
BNB = _frame("/repo/benchmarks/engines/bnb.py", 70, "build_model")
STEP = _frame("/repo/benchmarks/engines/common.py", 370, "step")


def _block(size: int, frames: list[dict], state: str = "active_allocated") -> dict:
    return {"size": size + 512, "requested_size": size, "state": state, "frames": frames}


SNAPSHOT = {
    "segments": [
        {
            "blocks": [_block(550 * MiB, [TORCH, BUILD, BNB]) for _ in range(20)]
            + [_block(64 * MiB, [], "inactive")]
        },
        {"blocks": [_block(140 * MiB, [BUILD, BNB]), _block(2 * MiB, [STEP]), _block(1 * MiB, [STEP])]},
        {"blocks": [_block(4 * MiB, [TORCH])]},
    ]
}


def test_summary_groups_live_blocks_by_their_creating_site_biggest_first() -> None:
    lines = memtrace.summarize(SNAPSHOT, top=10, depth=2)
    total = 20 * 550 * MiB + 140 * MiB + 3 * MiB + 4 * MiB
    assert (
        lines[0] == f"live at OOM: {total / GiB:.2f} GiB in 24 blocks, 3 allocation sites"
    )  # inactive left out
    # torch's own frames are skipped, so the 140 MiB block counts at the same site as the 550 MiB ones
    assert lines[1] == (
        f"{(20 * 550 + 140) * MiB / GiB:.2f} GiB in 21 x (largest 550.0 MiB): "
        "engines/common.py:278 materialize < engines/bnb.py:70 build_model"
    )
    assert lines[2].endswith("(no Python frame recorded)") and "in 1 x (largest 4.0 MiB)" in lines[2]
    assert lines[3] == "3.0 MiB in 2 x (largest 2.0 MiB): engines/common.py:370 step"
    assert memtrace.summarize(SNAPSHOT, top=1)[1:] == lines[1:2]


def test_summary_of_an_empty_snapshot() -> None:
    assert memtrace.summarize({"segments": []}) == ["live at OOM: 0.0 MiB in 0 blocks, 0 allocation sites"]


def test_reserved_memory_is_split_between_the_shared_pool_and_graph_pools() -> None:
    snap = {
        "segments": [
            {
                "segment_pool_id": (0, 0),
                "total_size": 2 * GiB,
                "blocks": [
                    _block(GiB - 512, []),
                    {"size": 600 * MiB, "state": "inactive"},
                    {"size": 424 * MiB, "state": "inactive"},
                ],
            },
            {"segment_pool_id": (1, 3), "total_size": 512 * MiB, "blocks": [_block(512 * MiB - 512, [])]},
            {
                "segment_pool_id": (1, 4),
                "total_size": 512 * MiB,
                "blocks": [{"size": 512 * MiB, "state": "inactive"}],
            },
        ]
    }
    assert memtrace.reserved_by_pool(snap) == (
        "reserved: 2.00 GiB in the shared pool (1.00 GiB live, largest free block 600.0 MiB); "
        "1.00 GiB in CUDA graph pools (512.0 MiB live, largest free block 512.0 MiB)"
    )
    assert memtrace.reserved_by_pool({"segments": []}) == "reserved: nothing"


def test_history_is_on_by_default_and_switched_by_the_environment() -> None:
    assert memtrace.history_entries({}) == memtrace.DEFAULT_MAX_ENTRIES
    assert memtrace.history_entries({memtrace.ENV: "0"}) == 0
    assert memtrace.history_entries({memtrace.ENV: " 5000 "}) == 5000
    for bad in ("yes", "-1"):
        with pytest.raises(ValueError, match=memtrace.ENV):
            memtrace.history_entries({memtrace.ENV: bad})


def test_nothing_is_recorded_off_cuda() -> None:
    cpu = torch.device("cpu")
    assert memtrace.start(cpu, 1000) is False
    assert memtrace.oom_report(cpu) == []


@pytest.mark.gpu
def test_a_cuda_oom_report_names_the_allocating_line() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    assert memtrace.start(dev, 1000)
    try:
        held = [torch.empty(64 * MiB, dtype=torch.uint8, device=dev) for _ in range(3)]  # the site to find
        lines = memtrace.oom_report(dev)
    finally:
        memtrace.stop(dev)
    assert any("3 x (largest 64.0 MiB)" in ln and "test_memtrace.py:" in ln for ln in lines[1:]), lines
    del held
