"""StreamGraph: a stream's copies and kernels captured once, replayed with one launch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tidal_arena import ArenaConfig, PinnedArena, RowCopy, StreamGraph
from tidal_arena import graphs as graphs_mod

MiB = 1 << 20


class FakeRuntime:
    """CuPy's runtime calls StreamGraph makes, logged."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            return {"streamEndCapture": 11, "graphInstantiate": 22}.get(name)

        return call


class FakeStream:
    cuda_stream = 7
    device = torch.device("cuda:0")


@pytest.fixture
def fake(monkeypatch):
    runtime = FakeRuntime()
    allocations = [0]
    monkeypatch.setattr(graphs_mod, "cuda_runtime", lambda: runtime)
    monkeypatch.setattr(graphs_mod.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs_mod.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(graphs_mod, "_current_device", lambda: 0)
    monkeypatch.setattr(
        graphs_mod.torch.cuda, "memory_stats", lambda device: {"allocation.all.allocated": allocations[0]}
    )
    return runtime, allocations


def test_capture_brackets_the_work_and_launch_replays_it_on_the_stream(fake):
    runtime, _ = fake
    graph = StreamGraph.capture(FakeStream(), lambda: runtime.calls.append(("work",)))
    graph.launch(FakeStream())
    assert [c[0] for c in runtime.calls] == [
        "streamBeginCapture",
        "work",
        "streamEndCapture",
        "graphInstantiate",
        "graphLaunch",
    ]
    assert runtime.calls[-1] == ("graphLaunch", 22, 7)
    del graph
    assert [c[:2] for c in runtime.calls[-2:]] == [("graphExecDestroy", 22), ("graphDestroy", 11)]


def test_a_failing_capture_leaves_capture_mode_and_raises_its_own_error(fake):
    runtime, _ = fake

    def boom():
        raise ValueError("a kernel that cannot be captured")

    with pytest.raises(ValueError, match="cannot be captured"):
        StreamGraph.capture(FakeStream(), boom)
    assert [c[0] for c in runtime.calls] == ["streamBeginCapture", "streamEndCapture", "graphDestroy"]


def test_work_that_allocates_is_refused(fake):
    runtime, allocations = fake

    def allocating():
        allocations[0] += 1

    with pytest.raises(RuntimeError, match="allocated device memory"):
        StreamGraph.capture(FakeStream(), allocating)
    assert [c[0] for c in runtime.calls] == ["streamBeginCapture", "streamEndCapture", "graphDestroy"]


def test_without_cuda_there_is_no_graph(monkeypatch):
    monkeypatch.setattr(graphs_mod, "cuda_runtime", lambda: None)
    assert StreamGraph.capture(FakeStream(), lambda: pytest.fail("nothing may be queued")) is None


@pytest.mark.gpu
def test_gpu_a_replay_moves_the_host_bytes_of_launch_time_and_runs_its_kernel():
    """Captured: a strided H2D copy from page-locked memory and an in-place kernel; each launch re-reads the
    host rows (as they are when it runs) and allocates nothing."""
    side = torch.cuda.Stream()
    with PinnedArena(ArenaConfig(backend="cupy", slab_bytes=8 * MiB)) as arena:
        host = arena.alloc(2 * 8 * 256 * 128 * 2).tensor(torch.bfloat16, (2, 1, 8, 256, 128))
        slot = torch.zeros(2, 1, 8, 512, 128, dtype=torch.bfloat16, device="cuda")
        dst = slot[:, :, :, 128:384]
        copy = RowCopy(dst, host, 3)
        side.wait_stream(torch.cuda.current_stream())  # why: the slot's zero fill comes first

        def work():
            copy(side)
            dst.mul_(2)  # in place: no allocation

        graph = StreamGraph.capture(side, work)
        assert graph is not None
        for value in (1.0, -3.0, 0.5):
            side.synchronize()  # why: the previous replay must finish reading the host rows before they change
            host.fill_(value)
            before = torch.cuda.memory_stats()["allocation.all.allocated"]
            graph.launch(side)
            side.synchronize()  # why: the replay must land before the slot is read
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
            assert torch.equal(dst.cpu(), torch.full_like(host, 2 * value))
        assert not slot[:, :, :, :128].any() and not slot[:, :, :, 384:].any()


@pytest.mark.gpu
def test_gpu_capturing_an_allocation_is_refused_and_the_stream_still_works():
    side = torch.cuda.Stream()
    x = torch.ones(1024, device="cuda")
    side.wait_stream(torch.cuda.current_stream())  # why: x's fill comes first
    with pytest.raises(RuntimeError):
        StreamGraph.capture(side, lambda: x * 2)  # a new output tensor: an allocation
    with torch.cuda.stream(side):
        x.mul_(3)
    side.synchronize()  # why: the stream's work must finish before x is read
    assert torch.equal(x.cpu(), torch.full((1024,), 3.0))


def test_a_launch_while_another_device_is_current_switches_to_the_graphs_device(fake, monkeypatch):
    runtime, _ = fake
    graph = StreamGraph.capture(FakeStream(), lambda: None)
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(graphs_mod.torch.cuda, "device", device)
    graph.launch(FakeStream())  # cuda:0 current: no switch
    monkeypatch.setattr(graphs_mod, "_current_device", lambda: 1)
    graph.launch(FakeStream())
    assert entered == [0] and [c[0] for c in runtime.calls].count("graphLaunch") == 2
