"""GatherPlan: a gather's copies, and for quantized pages its dequantization with the partial page's copy, each
issued eagerly once, then captured and replayed as one graph ([Note: gather graphs], [Note: dequantization
off the link])."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

from tidal_kv import slots as slots_mod
from tidal_kv.slots import GatherPlan, GatherRun


class FakeGraph:
    """Stands in for tidal_arena.StreamGraph: capture runs the work once to see what it queues."""

    captured: ClassVar[list[list[str]]] = []
    launches: ClassVar[list[str]] = []

    def __init__(self, queued: list[str]) -> None:
        self.queued = queued

    @classmethod
    def capture(cls, stream, issue):
        seen: list[str] = []
        log = Op.log
        Op.log = seen
        try:
            issue()
        finally:
            Op.log = log
        cls.captured.append(seen)
        return cls(seen)

    def launch(self, stream) -> None:
        FakeGraph.launches.append(stream)


class Op:
    """A copy or decode that logs its call (to Op.log) instead of moving bytes."""

    log: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, stream=None) -> None:
        Op.log.append(self.name)


def _plan(runs: int, quantized: bool) -> GatherPlan:
    dst = torch.empty(0)
    out = []
    for i in range(runs):
        copies = (Op(f"data{i}"), Op(f"scale{i}")) if quantized else (Op(f"data{i}"),)
        out.append(GatherRun(2, dst, copies, Op(f"decode{i}") if quantized else None))
    return GatherPlan((0, 2 * runs), out, Op("tail") if quantized else None)


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(slots_mod, "StreamGraph", FakeGraph)
    monkeypatch.setattr(slots_mod, "_capture_failed", [])
    monkeypatch.setattr(slots_mod, "on", lambda stream: _Null())
    FakeGraph.captured, FakeGraph.launches, Op.log = [], [], []
    return FakeGraph


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_quantized_gather_copies_then_finishes_each_eager_once_then_captured_and_replayed(fake_graphs):
    plan = _plan(1, quantized=True)
    plan.issue("h2d")  # first use: eager, the copies only
    assert Op.log == ["data0", "scale0"] and not fake_graphs.captured
    plan.finish.issue("compute", "h2d")  # the layer's update: dequantize, then the partial page
    assert Op.log == ["data0", "scale0", "decode0", "tail"]
    plan.issue("h2d")  # second: captured (nothing runs while capturing), then launched
    plan.finish.issue("compute", "h2d")  # captured on the side stream, launched on the compute stream
    assert fake_graphs.captured == [["data0", "scale0"], ["decode0", "tail"]]
    assert fake_graphs.launches == ["h2d", "compute"]
    for _ in range(3):  # later: launches only
        plan.issue("h2d")
        plan.finish.issue("compute", "h2d")
    assert len(fake_graphs.captured) == 2 and fake_graphs.launches == ["h2d", "compute"] * 4
    assert Op.log == ["data0", "scale0", "decode0", "tail"]
    plan.decode_now()  # a page boundary's update: the dequantization alone, eagerly
    assert Op.log[-1] == "decode0" and len(Op.log) == 5


def test_native_pages_have_nothing_to_finish():
    plan = _plan(2, quantized=False)
    assert plan.finish is None and plan.tail_copy is None


def test_a_single_copy_is_never_captured_and_the_cpu_never_captures(fake_graphs):
    one = _plan(1, quantized=False)  # native pages in one chunk: one copy, no cheaper as a graph
    two = _plan(2, quantized=False)  # across two chunks: two copies
    cpu = _plan(1, quantized=True)
    for _ in range(3):
        one.issue("h2d")
        two.issue("h2d")
        cpu.issue(None)
        cpu.finish.issue(None)
    assert one.graph is None and cpu.graph is None and cpu.finish.graph is None and two.graph is not None
    assert Op.log.count("data0") == 3 + 1 + 3 and Op.log.count("decode0") == 3


def test_a_failed_capture_stays_eager_for_the_whole_process_and_says_why_once(
    fake_graphs, caplog, monkeypatch
):
    class Failing(FakeGraph):
        @classmethod
        def capture(cls, stream, issue):
            raise RuntimeError("StreamGraph.capture: the captured work allocated device memory")

    monkeypatch.setattr(slots_mod, "StreamGraph", Failing)
    a, b = _plan(1, quantized=True), _plan(1, quantized=True)
    with caplog.at_level(logging.WARNING, logger="tidal_kv.slots"):
        for _ in range(3):
            for plan in (a, b):
                plan.issue("h2d")
                plan.finish.issue("compute", "h2d")
    assert a.graph is None and b.graph is None and a.finish.graph is None
    assert Op.log.count("decode0") == 6  # every gather still ran, eagerly
    warnings = [r for r in caplog.records if "uncaptured" in r.message]
    assert len(warnings) == 1 and "allocated device memory" in warnings[0].message
