"""placement: the host share on the blocks whose gradients land first; the measured move to the device."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest
import torch

from tidal_stream import session_of, unwrap, wrap
from tidal_stream.placement import device_share, device_state_bytes, overlap_order, promote_to_device
from tidal_testing import max_abs_diff

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("tidal_stream_tinygpt_placement", HERE / "tinygpt.py")
tinygpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tinygpt)
loss_fn, make_model = tinygpt.loss_fn, tinygpt.make_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _split_plan(n_layers: int, host: list[int], streamed: list[int]):
    """A real plan of a TinyGPT stack, its decisions set to the given host/streamed blocks."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    model = tinygpt.TinyGPT(layers=n_layers)
    p = plan(
        census(model, blocks=model.blocks),
        HardwareProfile.synthetic(vram_budget_bytes="2MiB", device_free_bytes="2MiB"),
        PlanConfig(batch_tokens=64, headroom_bytes=0),
    )
    blocks = tuple(
        dataclasses.replace(
            b,
            optimizer="host" if b.index in host else "gpu",
            weights="streamed" if b.index in streamed else "resident",
        )
        for b in p.blocks
    )
    gpu = tuple(i for i in range(n_layers) if i not in host)
    return dataclasses.replace(
        p, blocks=blocks, optimizer=dataclasses.replace(p.optimizer, placement="split", gpu_blocks=gpu)
    )


def test_overlap_order_moves_the_host_share_to_the_last_blocks():
    p = _split_plan(6, host=[0, 1, 2], streamed=[0, 1])
    q, note = overlap_order(p)
    assert note is not None and "0-2 to 3-5" in note
    assert [b.optimizer for b in q.blocks] == ["gpu"] * 3 + ["host"] * 3
    assert [b.weights for b in q.blocks] == ["resident"] * 3 + ["streamed"] * 2 + ["resident"]
    assert q.optimizer.gpu_blocks == (0, 1, 2)
    # same bytes: activations untouched, same counts per kind
    assert [b.activations for b in q.blocks] == [b.activations for b in p.blocks]
    assert q.tiers == p.tiers and q.optimizer.gpu_state_bytes == p.optimizer.gpu_state_bytes
    assert q.notes[-1] == note


def test_overlap_order_leaves_plans_it_cannot_improve():
    done = _split_plan(4, host=[2, 3], streamed=[3])
    assert overlap_order(done) == (done, None)  # already last
    uneven = _split_plan(4, host=[0], streamed=[])
    blocks = list(uneven.blocks)
    blocks[3] = dataclasses.replace(blocks[3], weight_bytes=blocks[3].weight_bytes + 1)
    uneven = dataclasses.replace(uneven, blocks=tuple(blocks))
    assert overlap_order(uneven)[1] is None  # moving would change the bytes on the device
    assert (
        overlap_order(
            dataclasses.replace(uneven, optimizer=dataclasses.replace(uneven.optimizer, placement="host"))
        )[1]
        is None
    )


def _streamed_wrap():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return wrap(model, opt, offload=True, param_offload=True, blocks=model.blocks, attention=None)


def test_device_share_moves_streamed_blocks_whole():
    model, opt = _streamed_wrap()
    ext = session_of(model).extensions[0]
    slots = opt.host_slots()
    block0 = [s for s in slots if ext.streamed_block_of(s.param) == 0]
    assert block0 and all(s.host_weight is not None for s in block0)
    # without the extension streamed weights never move; the non-streamed ones before them do
    chosen, _ = device_share(slots, float("inf"), 4)
    assert all(ext.streamed_block_of(p) is None for p in chosen)
    outside = [s for s in sorted(slots, key=lambda s: s.index) if s.host_weight is None]
    first_block = min(s.index for s in block0)
    before = [s for s in outside if s.index < first_block]
    cost_before = sum(device_state_bytes(s.param, 4) for s in before)
    cost0 = ext.weights.block_nbytes(0) + sum(device_state_bytes(s.param, 4) for s in block0)
    # room for block 0 and its predecessors but not one byte of more: block 0 whole, nothing after it
    chosen, total = device_share(slots, cost_before + cost0, 4, ext)
    assert {id(p) for p in chosen} == {id(s.param) for s in before + block0}
    assert total == cost_before + cost0
    # one byte short of block 0: it is not split, and nothing after it is taken
    chosen, total = device_share(slots, cost_before + cost0 - 1, 4, ext)
    assert {id(p) for p in chosen} == {id(s.param) for s in before} and total == cost_before
    unwrap(model)


@pytest.mark.parametrize("part", [False, True], ids=["whole-block", "one-tensor"])
def test_promoted_streamed_block_trains_like_torch_adamw(part):
    """Block 0 stops streaming and its optimizer (or one tensor's) moves to the device after 2 steps; the
    rest of the block then updates on the host into the device weights; same training."""
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, opt = _streamed_wrap()
    ext = session_of(model).extensions[0]
    for step in range(6):
        if step == 2:
            params = [s.param for s in opt.host_slots() if ext.streamed_block_of(s.param) == 0]
            params = params[:1] if part else params
            n_host = len(opt.host_slots())
            moved, unstreamed = promote_to_device(opt, params, ext)
            assert moved == len(params) and unstreamed == [0]
            assert len(opt.host_slots()) == n_host - moved
            assert ext.weights.streamed == [1] and ext.streamed_block_of(params[0]) is None
            assert all(p.untyped_storage().nbytes() > 0 for p in model.blocks[0].parameters())
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_fn(m, step).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    # block 1 still streams: its weights are read from their host copies
    for p, q in zip(model.parameters(), ref.parameters()):
        host = ext.host_tensor(p) if ext.streamed_block_of(p) is not None else None
        got = host.reshape(q.shape) if host is not None else p
        assert max_abs_diff(got, q) < 1e-6
    unwrap(model)
    assert max(max_abs_diff(p, q) for p, q in zip(model.parameters(), ref.parameters())) < 1e-6


@pytest.mark.gpu
def test_gpu_measured_move_unstreams_host_blocks():
    """Streamed host-optimizer blocks on CUDA: the first step's measurement (room for everything on the
    real device) stops their streaming and moves their optimizer to the device; same training."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    spec = importlib.util.spec_from_file_location(
        "tidal_stream_test_optimizer_ref", HERE / "test_optimizer.py"
    )
    ref_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref_mod)
    model = make_model(device="cuda")
    budget = "500KiB"  # synthetic: forces a split; the real device has room for everything
    p = plan(
        census(model),
        HardwareProfile.synthetic(vram_budget_bytes=budget, device_free_bytes=budget),
        PlanConfig(batch_tokens=64, headroom_bytes=0, param_offload=False),
    )
    host_blocks = [b.index for b in p.blocks if b.optimizer == "host"]
    assert host_blocks
    p = dataclasses.replace(
        p,
        blocks=tuple(
            dataclasses.replace(b, weights="streamed" if b.index in host_blocks else "resident")
            for b in p.blocks
        ),
    )
    model, opt = wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=p, attention=None, blocks=model.blocks
    )
    ext = session_of(model).extensions[0]
    assert ext.weights.streamed == host_blocks
    trainable = [q for q in model.parameters() if q.requires_grad]
    on_host = {id(s.param) for s in opt.host_slots()}
    ref = ref_mod.run_placed_reference(
        "cuda", 10, {i: int(id(q) in on_host) for i, q in enumerate(trainable)}
    )
    for step in range(10):
        loss_fn(model, step, "cuda").backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert not opt.host_slots() and ext.weights.streamed == []
    opt.synchronize()
    assert ref_mod.max_param_diff(ref, model) < 1e-6
    unwrap(model)
