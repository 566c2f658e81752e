"""Peer pooling, the parts that need no GPU: block ownership under per-GPU room, the decision from the
measured facts, the room, the buffer layout, the IPC handle's device remap, and ``StreamedBlocks``
refilling a block from a per-block source instead of its host copies. The CUDA IPC runs are in
``test_distributed.py`` (gpu-marked, launched as 2 processes)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tidal_stream import OptionError
from tidal_stream.distributed import DistributedConfig
from tidal_stream.peer_pool import (
    PEER_CONTEXT_BYTES,
    _aligned,
    _open,
    _slot_views,
    assign_blocks,
    decide,
    install_peer_pool,
    pool_room,
)
from tidal_stream.streamed_blocks import StreamedBlocks, StreamingError
from tidal_testing import assert_bitwise_equal, torch_threads

MiB = 2**20


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def test_assign_blocks_round_robin_within_room() -> None:
    assert assign_blocks([10] * 6, [100, 100]) == [0, 1, 0, 1, 0, 1]
    assert assign_blocks([10] * 5, [100, 100, 100]) == [0, 1, 2, 0, 1]
    # rank 0 has room for two blocks, rank 1 for one: the others stay host-streamed (None)
    assert assign_blocks([10] * 6, [25, 15]) == [0, 1, 0, None, None, None]
    # a large block that does not fit does not stop a later small one of the same owner
    assert assign_blocks([50, 10, 5, 10], [20, 10]) == [None, 1, 0, None]
    assert assign_blocks([], [5, 5]) == []
    assert assign_blocks([10, 10], [0, 0]) == [None, None]
    for bad in (([1], []), ([1], [-1]), ([-1], [4])):
        with pytest.raises(ValueError):
            assign_blocks(*bad)


def _facts(L: int = 2, peer: float = 370.0, host: float = 55.0, room: int = 100, access: bool = True):
    return {
        "peer_access": [[access or i == j for j in range(L)] for i in range(L)],
        "peer_gbps": [[0.0 if i == j else peer for j in range(L)] for i in range(L)],
        "host_gbps": [host] * L,
        "block_bytes": [30] * 4,
        "room": [room] * L,
    }


def test_decide_every_branch_says_why_with_numbers() -> None:
    on = decide("auto", **_facts())
    assert on.on and on.owners == (0, 1, 0, 1)
    assert on.reason.startswith("peer pooling: on: 4 of 4 frozen streamed blocks pooled")
    assert "370.0 GB/s" in on.reason and "55.0 GB/s" in on.reason and "6.7x" in on.reason
    assert on.data["speedup"] == pytest.approx(370 / 55)
    off = decide(False, **_facts())
    assert not off.on and "peer_pooling=False" in off.reason
    one = decide("auto", **(_facts(L=1)))
    assert not one.on and "one rank on this machine" in one.reason
    none = decide("auto", **(_facts() | {"block_bytes": []}))
    assert not none.on and "no frozen streamed blocks" in none.reason
    # peer access missing one way: off, naming the pair
    f = _facts()
    f["peer_access"][1][0] = False
    noacc = decide(True, **f)
    assert not noacc.on and "no peer access" in noacc.reason and "1->0" in noacc.reason
    # rates: 100 GB/s is < 2 x 55 → off under 'auto'; True skips only the rate rule
    slow = decide("auto", **_facts(peer=100.0))
    assert not slow.on and "slower than host" in slow.reason and "100.0 GB/s" in slow.reason
    forced = decide(True, **_facts(peer=100.0))
    assert forced.on and "forced" in forced.reason
    # the slowest direction decides: one fast, one slow link
    f = _facts()
    f["peer_gbps"][0][1] = 90.0
    assert not decide("auto", **f).on
    # exactly 2x is enough
    assert decide("auto", **_facts(peer=110.0)).on
    # no room: every block exceeds its owner's room
    full = decide("auto", **_facts(room=29))
    assert not full.on and "no room" in full.reason and full.owners == ()
    # room for one block each: two pooled, two stay host-streamed
    part = decide("auto", **_facts(room=40))
    assert part.on and part.owners == (0, 1, None, None) and "2 of 4" in part.reason
    assert "2 stay host-streamed" in part.reason


def test_pool_room_sources() -> None:
    plan = types.SimpleNamespace(vram_budget_bytes=80 * 2**30, tiers={"vram": 70 * 2**30})
    room, src = pool_room(plan, None, 2)
    assert room == 10 * 2**30 - PEER_CONTEXT_BYTES and "plan" in src
    room, src = pool_room(plan, 4 * 2**30, 4)  # explicit bytes win; three peers open contexts here
    assert room == 4 * 2**30 - 3 * PEER_CONTEXT_BYTES and "peer_pool_bytes" in src
    assert pool_room(None, None, 2)[0] == 0
    assert pool_room(plan, 100, 2)[0] == 0  # never negative
    over = types.SimpleNamespace(vram_budget_bytes=10, tiers={"vram": 20})
    assert pool_room(over, None, 1)[0] == 0


def test_slot_views_layout_round_trip() -> None:
    """The owner's flat buffer holds each tensor aligned; views rebuilt from offsets read it back."""
    g = torch.Generator().manual_seed(0)
    hosts = [
        torch.randn(7, 3, generator=g),  # 84 bytes: the next one starts at 512
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int8),
        torch.randn(2, 2, generator=g, dtype=torch.float64),
    ]
    size = sum(_aligned(h.numel() * h.element_size()) for h in hosts)
    buf = torch.zeros(size + 1024, dtype=torch.uint8)
    views = _slot_views(buf, 1024, hosts)
    for v, h in zip(views, hosts):
        v.copy_(h)
    assert all(v.data_ptr() % 512 == buf.data_ptr() % 512 for v in views)
    for v, h in zip(_slot_views(buf, 1024, hosts), hosts):
        assert_bitwise_equal(v, h)
    assert int(buf[:1024].sum()) == 0  # nothing written before the offset


def test_open_remaps_the_device_index() -> None:
    """A handle names the owner's GPU in the owner's numbering; the reader opens it under its own."""

    def rebuild(tensor_cls, size, storage_device, handle):  # the shape of torch's rebuild function
        return (tensor_cls, size, storage_device, handle)

    assert _open((rebuild, ("T", (4,), 0, b"h")), 3) == ("T", (4,), 3, b"h")


def test_install_on_cpu_or_disabled_records_the_reason() -> None:
    events: list[tuple[str, str, dict]] = []
    record = lambda k, m, **d: events.append((k, m, d))  # noqa: E731
    session = types.SimpleNamespace(device=torch.device("cpu"), extensions=[], plan=None)
    ctx = types.SimpleNamespace(local_rank=0, local_world=2, node=0)
    assert install_peer_pool(session, ctx, "auto", None, record) is None
    assert events[-1][1] == "peer pooling: off (training on cpu: needs CUDA)"
    session.device = torch.device("cuda", 0)  # nothing CUDA is touched when the option is False
    assert install_peer_pool(session, ctx, False, None, record) is None
    assert events[-1][1] == "peer pooling: off (DistributedConfig.peer_pooling=False)"


def test_config_validation() -> None:
    assert DistributedConfig().peer_pooling is False
    assert DistributedConfig(peer_pooling="auto", peer_pool_bytes=2**30).peer_pool_bytes == 2**30
    for bad in (
        {"peer_pooling": "on"},
        {"peer_pooling": 1},
        {"peer_pool_bytes": 0},
        {"peer_pool_bytes": 1.5},
    ):
        with pytest.raises(OptionError, match=r"distributed\.peer_pool"):
            DistributedConfig(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- StreamedBlocks.set_source (CPU)
class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16).requires_grad_(False)
        self.adapter = nn.Linear(16, 16, bias=False)  # trainable, not streamed (stream_trainable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.adapter(x))  # [B, 16]


def _stack(seed: int = 0, n: int = 3) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Frozen() for _ in range(n))


def _loss(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = b(x)
    return x.square().mean()


def test_set_source_same_bytes_is_bitwise_and_moves_the_counters() -> None:
    ref, blocks = _stack(), _stack()
    sb = StreamedBlocks(list(blocks), "cpu", prefetch_ahead=1, stream_trainable=False)
    # block 1 reads a separate copy of its host bytes (as a pooled device copy would be)
    sb.set_source(1, [h.clone() for h in sb.host_copies(1)])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        a, b = _loss(ref, x), _loss(blocks, x)
        a.backward()
        b.backward()
        assert_bitwise_equal(b.detach().reshape(1), a.detach().reshape(1))
        for pr, ps in zip(ref.parameters(), blocks.parameters()):
            if pr.requires_grad:
                assert_bitwise_equal(ps.grad, pr.grad)
    st = sb.stats()
    per = st["block_bytes"]
    assert per[0] == per[1] == per[2] == (16 * 16 + 16) * 4
    # each block is fetched once in forward and once in backward per step: 2 steps x 2 fetches
    assert st["source_bytes"] == 4 * per[1] and st["h2d_bytes"] == 4 * (per[0] + per[2])
    sb.set_source(1, None)
    sb.reset_stats()
    _loss(blocks, x).backward()
    assert sb.stats()["source_bytes"] == 0 and sb.stats()["h2d_bytes"] == 2 * sum(per)
    sb.remove()


def test_set_source_is_what_the_block_reads() -> None:
    """A source with other values changes the block's output: the refill reads it, not the host copy."""
    blocks = _stack()
    sb = StreamedBlocks(list(blocks), "cpu", prefetch_ahead=0, stream_trainable=False)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = _loss(blocks, x)
        sb.set_source(0, [2 * h for h in sb.host_copies(0)])
        doubled = _loss(blocks, x)
        sb.set_source(0, None)
        again = _loss(blocks, x)
    assert not torch.equal(doubled, before)
    assert_bitwise_equal(again, before)
    sb.remove()


def test_set_source_refuses_wrong_tensors_and_trained_blocks() -> None:
    blocks = _stack()
    sb = StreamedBlocks(list(blocks), "cpu", stream_trainable=False)
    hosts = sb.host_copies(0)
    for bad in (hosts[:1], [hosts[0], hosts[1].double()], [hosts[0].t().contiguous()[:4], hosts[1]]):
        with pytest.raises(StreamingError, match="set_source"):
            sb.set_source(0, bad)
    sb.remove()
    trained = _stack()
    sb = StreamedBlocks(list(trained), "cpu", stream_trainable=True)  # the adapters stream too
    with pytest.raises(StreamingError, match="trainable"):
        sb.set_source(0, sb.host_copies(0))
    sb.remove()


# ------------------------------------------------------- the whole setup, two ranks simulated on the CPU
class _ThreadCtx:
    """Two ranks of one machine as two threads: ``all_objects`` and ``barrier`` meet on a thread barrier."""

    def __init__(self, rank: int, slots: list, meet: object) -> None:
        self.rank = self.local_rank = rank
        self.local_world, self.node, self.world = 2, 0, 2
        self.slots, self.meet = slots, meet

    def all_objects(self, obj: object, what: str) -> list:
        self.slots[self.rank] = obj
        self.meet.wait()
        out = list(self.slots)
        self.meet.wait()  # nobody overwrites a slot before every rank has read them
        return out

    def barrier(self, what: str) -> None:
        self.meet.wait()


_BLOCK = (16 * 16 + 16) * 4  # 1088 bytes of a Frozen block's base; 1536 in a pool buffer (aligned)


def _in_threads(fn, n: int = 2) -> None:
    import threading

    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _simulate(
    monkeypatch: pytest.MonkeyPatch,
    mode: object = "auto",
    room: tuple[int, int] = (2 * 1536, 1536),
    rates: tuple[float, float] = (370.0, 360.0),
    access: bool = True,
) -> types.SimpleNamespace:
    """Two ranks of one machine as threads over CPU ``StreamedBlocks`` of 4 frozen blocks, every CUDA call
    replaced (IPC: the tensor itself; rates: given; 55 GB/s host link). ``room``: beyond the contexts."""
    import threading

    from tidal_stream import peer_pool

    calls = {"probe": 0, "open": 0}

    def probe(dev: torch.device) -> tuple[torch.Tensor, float]:
        calls["probe"] += 1
        return torch.full((8,), 7, dtype=torch.uint8), 55.0

    def open_(h: object, idx: int) -> object:
        calls["open"] += 1
        return h

    monkeypatch.setattr(peer_pool, "_probe", probe)
    monkeypatch.setattr(peer_pool, "_peer_rate", lambda view, dev: rates[dev.index])
    monkeypatch.setattr(peer_pool, "_share", lambda t: t)
    monkeypatch.setattr(peer_pool, "_open", open_)
    monkeypatch.setattr(peer_pool, "_gpu_uuid", lambda i: f"GPU-{i}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access)
    for name in ("synchronize", "ipc_collect", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    slots: list = [None, None]
    meet = threading.Barrier(2, timeout=20)
    stacks = [_stack(n=4), _stack(n=4)]  # the same weights on both ranks
    sbs = [StreamedBlocks(list(s), "cpu", stream_trainable=False) for s in stacks]
    events: list[list[str]] = [[], []]
    pools: list = [None, None]

    def rank(r: int) -> None:
        session = types.SimpleNamespace(
            device=torch.device("cuda", r),
            extensions=[types.SimpleNamespace(weights=types.SimpleNamespace(sb=sbs[r]))],
            plan=None,
        )
        pools[r] = install_peer_pool(
            session,
            _ThreadCtx(r, slots, meet),
            mode,
            PEER_CONTEXT_BYTES + room[r],
            lambda k, m, **d: events[r].append(m),
        )

    _in_threads(rank)
    return types.SimpleNamespace(stacks=stacks, sbs=sbs, pools=pools, events=events, calls=calls)


def _host_only(sim: types.SimpleNamespace) -> None:
    """Off: nothing sourced, every block over the host link; the decision is the same on both ranks."""
    assert sim.events[0][-1] == sim.events[1][-1]
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    for s, sb, pool in zip(sim.stacks, sim.sbs, sim.pools):
        assert not pool.summary()["on"] and pool.own is None and not pool.views
        _loss(s, x).backward()
        assert sb.stats()["source_bytes"] == 0 and sb.stats()["h2d_bytes"] == 4 * 2 * _BLOCK
        sb.remove()


def test_install_off_without_peer_access(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulate(monkeypatch, access=False)
    assert "no peer access" in sim.events[0][-1] and "0->1" in sim.events[0][-1]
    assert sim.calls["open"] == 0  # no peer memory opened (that would create a context on its GPU)
    _host_only(sim)


def test_install_off_when_slower_than_host(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulate(monkeypatch, rates=(300.0, 100.0))
    line = sim.events[0][-1]
    assert "slower than host" in line and "100.0 GB/s" in line and "55.0 GB/s" in line, line
    _host_only(sim)


def test_install_off_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulate(monkeypatch, room=(1000, 1000))  # a block needs 1536
    assert "no room" in sim.events[0][-1]
    assert sim.calls["probe"] == 0 and sim.calls["open"] == 0  # nothing measured where nothing fits
    _host_only(sim)


def test_install_two_simulated_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks 0 and 2 owned by rank 0, 1 by rank 1 (room for 2 and 1 blocks), block 3 stays on the host;
    each rank's training is bitwise that without pooling and its host link carries only block 3."""
    sim = _simulate(monkeypatch)
    pools, sbs, block = sim.pools, sim.sbs, _BLOCK
    for r in range(2):
        line = sim.events[r][-1]
        assert line.startswith("peer pooling: on: 3 of 4 frozen streamed blocks pooled"), line
        assert "1 stay host-streamed" in line and "360.0 GB/s" in line and "55.0 GB/s" in line
        assert pools[r].decision.owners == (0, 1, 0, None)
        rep = pools[r].summary()
        assert rep["on"] and rep["pooled_blocks"] == [0, 1, 2]
        assert rep["owned_blocks"] == ([0, 2] if r == 0 else [1])
        assert rep["owned_bytes"] == (2 if r == 0 else 1) * 1536
    assert sim.calls["probe"] == 2 and sim.calls["open"] == 2 + 2  # the probes, then the pool buffers
    # rank 1 reads block 0 out of rank 0's buffer (the very memory), and its own block 1 from its own
    assert pools[0].own is not None and pools[1].views[0] is pools[0].own
    assert sbs[1]._blocks[0].slots[0].source.data_ptr() == pools[0].own.data_ptr()
    # training: bitwise the unpooled stack; the host link carries block 3 only
    ref = _stack(n=4)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    want = _loss(ref, x)
    for s, sb in zip(sim.stacks, sbs):
        sb.reset_stats()
        got = _loss(s, x)
        got.backward()
        assert_bitwise_equal(got.detach().reshape(1), want.detach().reshape(1))
        st = sb.stats()
        assert st["h2d_bytes"] == 2 * block and st["source_bytes"] == 3 * 2 * block
    # teardown (collective): sources dropped, buffers released; the host copies serve again
    _in_threads(lambda r: pools[r].remove())
    assert pools[0].own is None and not pools[1].views
    for s, sb in zip(sim.stacks, sbs):
        sb.reset_stats()
        _loss(s, x).backward()
        assert sb.stats()["source_bytes"] == 0 and sb.stats()["h2d_bytes"] == 4 * 2 * block
        sb.remove()


def test_install_forced_ignores_the_rates_only(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulate(monkeypatch, mode=True, rates=(100.0, 100.0))
    assert sim.events[0][-1].startswith("peer pooling: on: 3 of 4") and "forced" in sim.events[0][-1]
    _in_threads(lambda r: sim.pools[r].remove())
    for sb in sim.sbs:
        sb.remove()


def test_plan_is_made_with_the_pool_reserve_taken_off_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer_pool_bytes counts against the budget: the plan gets the VRAM budget minus the reserve (the
    profile and planner are stand-ins recording what they were given)."""
    import importlib.util
    import pathlib

    import tidal_plan
    from tidal_stream import distributed

    gib = 2**30
    seen: dict[str, object] = {}
    monkeypatch.setattr(
        tidal_plan, "profile_hardware", lambda device, **kw: types.SimpleNamespace(vram_budget_bytes=80 * gib)
    )

    def plan(census: object, profile: object, config: tidal_plan.PlanConfig) -> object:
        seen["config"] = config
        return types.SimpleNamespace(explain=lambda: "the plan")

    monkeypatch.setattr(tidal_plan, "plan", plan)
    monkeypatch.setattr(distributed, "_host_available", lambda: 64 * gib)
    events: list[tuple[str, str, dict]] = []
    session = types.SimpleNamespace(
        device=torch.device("cuda", 0), plan=None, record=lambda k, m, **d: events.append((k, m, d))
    )
    ctx = types.SimpleNamespace(local_rank=0, local_world=2)
    opts = types.SimpleNamespace(
        plan=None, blocks=None, vram_budget=None, batch_tokens=None, param_offload="auto"
    )
    spec = importlib.util.spec_from_file_location(
        "tidal_pool_tinygpt", pathlib.Path(__file__).parent / "tinygpt.py"
    )
    tinygpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tinygpt)
    distributed._plan_share(session, tinygpt.make_model(seed=0), opts, ctx, 0, pool_reserve=12 * gib)
    assert seen["config"].vram_budget == 68 * gib
    assert any("12.00 GiB of the 80.00 GiB VRAM budget kept for pooled blocks" in m for _, m, _ in events)
    with pytest.raises(OptionError, match=r"distributed\.peer_pool_bytes"):
        distributed._plan_share(session, tinygpt.make_model(seed=0), opts, ctx, 0, pool_reserve=80 * gib)
