"""placement: the host share on the blocks whose gradients land first; the measured move to the device."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import types

import pytest
import torch
from torch import nn

from tidal_plan.stream_schedule import spread_streamed
from tidal_stream import session_of, unwrap, wrap
from tidal_stream.options import WrapOptions
from tidal_stream.placement import (
    device_share,
    device_state_bytes,
    host_updated_blocks,
    keep_activations_after_first_step,
    keep_offloaded_activations,
    keep_recomputed_activations,
    promote_to_device,
    refine_after_first_step,
    unstream_frozen_blocks,
    widen_workspace,
)
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
            ws = ext.report()["weight_streaming"]  # what memory_report() shows: block 0 did stream
            assert ws["streamed"] == [1] and ws["streamed_ever"] == [0, 1]
            assert [(c["stopped"], c["started"]) for c in ws["changes"]] == [([0], [])]
            assert ws["changes"][0]["h2d_bytes_before"] > 0
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


def _lora_like_run(device: str, after_first_step=None, **how) -> tuple:
    """TinyGPT with its block linears frozen (a LoRA-like base) wrapped with ``how``, four AdamW steps;
    ``after_first_step(session, opt)`` runs after the first. Forward and backward both run under the math
    SDPA backend: a recomputed block must run the same kernels in backward as in forward.

    Returns:
        The losses, the weight-streaming report, the activation policies, the decision log, the plan.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tidal_stream.kept_activations import activations_of

    model = make_model(device=device)
    for name, q in model.blocks.named_parameters():
        q.requires_grad_("norm" in name)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    model, opt = wrap(model, opt, blocks=model.blocks, attention=None, **how)
    session = session_of(model)
    assert activations_of(session).stats()["policies"] == ["recompute"] * 2
    losses = []
    for step in range(4):
        with sdpa_kernel(SDPBackend.MATH):
            loss = loss_fn(model, step, device)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0 and after_first_step is not None:
            after_first_step(session, opt)
    opt.synchronize()
    report = session.report()
    policies = activations_of(session).stats()["policies"]
    unwrap(model)
    events = [e["message"] for e in report["events"]]
    return losses, report["weight_streaming"], policies, events, session.plan


def _check_switched_run(refined: tuple, given: tuple) -> None:
    """The refined run stopped streaming both blocks and keeps both blocks' activations; the run under the
    same plan given switched nothing; their losses match."""
    losses, streamed, policies, events, plan = refined
    line = next(m for m in events if m.startswith("measured first step"))
    assert "blocks 0-1 STOP STREAMING" in line and "blocks 0-1 KEEP their activations" in line, line
    assert policies == ["keep"] * 2 and streamed["streamed_ever"] == [0, 1] and streamed["streamed"] == []
    assert plan.streamed_blocks and all(b.activations == "recompute" for b in plan.blocks)
    given_losses, given_streamed, given_policies, _, _ = given
    assert given_policies == ["recompute"] * 2 and given_streamed["changes"] == []
    assert max(abs(a - b) for a, b in zip(losses, given_losses)) < 1e-6, (losses, given_losses)


def test_frozen_blocks_stop_streaming_and_recomputed_blocks_keep_by_a_simulated_measurement(monkeypatch):
    """On the CPU, the refinement run by hand after the first step over a plan that streams and recomputes
    every block, the device's memory simulated (1 GiB used of 140 GiB): the frozen blocks stop streaming,
    the recomputed blocks keep their activations, and training matches the same plan left as it is."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    model = make_model()
    for name, q in model.blocks.named_parameters():
        q.requires_grad_("norm" in name)
    p = plan(
        census(model, blocks=model.blocks),
        HardwareProfile.synthetic(vram_budget_bytes="100GiB", host_ram_bytes=100 * 10**9),
        PlanConfig(param_offload=True, recompute=True, activation_offload=False),
    )
    given = _lora_like_run("cpu", plan=p)
    used = {
        "max_memory_allocated": GiB,
        "memory_allocated": GiB,
        "max_memory_reserved": GiB,
        "memory_reserved": GiB,
    }
    for name, value in used.items():
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 140 * GiB))
    refined = _lora_like_run(
        "cpu", lambda session, opt: refine_after_first_step(session, opt, 0, None), plan=p
    )
    _check_switched_run(refined, given)


@pytest.mark.gpu
def test_gpu_frozen_blocks_stop_streaming_and_recomputed_blocks_keep_after_the_first_step():
    """On CUDA, every block streamed and recomputed by request, planned for the default 4,096 tokens while
    the batch is 64: after the first update the measured room (the whole device) stops streaming the frozen
    blocks and keeps every recomputed block's activations. The losses match the same run under its plan
    given (``plan=``: nothing switches)."""
    refined = _lora_like_run("cuda", param_offload=True, recompute=True, activation_offload=False)
    _check_switched_run(refined, _lora_like_run("cuda", plan=refined[4]))


@pytest.mark.gpu
def test_gpu_given_plan_keeps_streaming_after_the_measured_move():
    """A given plan with streamed host-optimizer blocks on CUDA: the first step's measurement (room for
    everything on the real device) moves the optimizer of what does not stream to the device, the
    streamed blocks keep streaming as the plan says; same training. (Blocks stopping streaming under a
    plan made by wrap() are covered on the CPU: test_promoted_streamed_block_trains_like_torch_adamw and
    the simulated refinements above.)"""
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
    streamed = {id(s.param) for s in opt.host_slots() if ext.streamed_block_of(s.param) is not None}
    # device share from the start (0); the host share that does not stream moves after the first update
    # (1); streamed parameters update on the host throughout (absent), as asserted after step 0 below
    device_from = {i: int(id(q) in on_host) for i, q in enumerate(trainable) if id(q) not in streamed}
    ref = ref_mod.run_placed_reference("cuda", 10, device_from)
    for step in range(10):
        loss_fn(model, step, "cuda").backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert ext.weights.streamed == host_blocks
            assert all(ext.streamed_block_of(s.param) is not None for s in opt.host_slots())
    opt.synchronize()
    ws = session_of(model).report()["weight_streaming"]
    assert ws["streamed_ever"] == host_blocks and ws["changes"] == []
    # streamed weights are read from their host copies while wrapped (the device tensors are streamed in)
    for p, q in zip(model.parameters(), ref.parameters()):
        host = ext.host_tensor(p) if ext.streamed_block_of(p) is not None else None
        assert max_abs_diff(host.reshape(q.shape) if host is not None else p, q) < 1e-6
    unwrap(model)
    assert ref_mod.max_param_diff(ref, model) < 1e-6


# ------------------------------------------------------------------ the measured refinement, CUDA simulated
GiB, MiB = 2**30, 2**20


class _Streaming:
    """The weight-streaming extension as the refinement sees it: block of a tensor, block bytes, unstream."""

    def __init__(self, block_of: dict[int, int], nbytes: int) -> None:
        self._block_of, self._nbytes = block_of, nbytes
        self.weights = self
        self.streamed = sorted(set(block_of.values()))
        self.blocks = [None] * 48  # the stack: the lora14b_* sessions' 48 blocks

    def block_nbytes(self, i: int) -> int:
        return self._nbytes

    def streamed_block_of(self, t: torch.Tensor) -> int | None:
        b = self._block_of.get(id(t))
        return b if b in self.streamed else None

    def unstream(self, indices: list[int]) -> int:
        self.streamed = [i for i in self.streamed if i not in indices]
        return self._nbytes * len(indices)


class _Opt:
    """The parts of OffloadAdamW the refinement uses, over meta parameters (no memory)."""

    moment_dtype = torch.float32

    def __init__(self, host: list[torch.Tensor], streamed: set[int], device: list[torch.Tensor]) -> None:
        self._slots = {
            id(p): types.SimpleNamespace(
                param=p, index=i, host_weight=object() if id(p) in streamed else None
            )
            for i, p in enumerate(host)
        }
        self._gpu = {id(p): (p, {}) for p in device}

    def synchronize(self) -> None:
        pass

    def host_slots(self) -> list:
        return list(self._slots.values())

    def move_to_device(self, params: list[torch.Tensor]) -> int:
        for p in params:
            del self._slots[id(p)]
            self._gpu[id(p)] = (p, {})
        return len(params)


class _Session:
    def __init__(self, extensions: list) -> None:
        self.device = torch.device("cuda", 0)
        self.extensions = extensions
        self.events: list[tuple[str, str, dict]] = []
        self.plan = None
        # no CUDA graphs: the refinement reserves nothing for them and predicts the eager step
        self.options = WrapOptions(cuda_graphs=False)

    def record(self, kind: str, message: str, **data) -> None:
        self.events.append((kind, message, data))


def _qwen15b_block() -> list[torch.Tensor]:
    """One Qwen2.5-1.5B decoder layer's parameters, bf16 on the meta device (46.8 M, 89.3 MiB)."""
    d, f, kv = 1536, 8960, 256
    shapes = [(d, d), (d,), (kv, d), (kv,), (kv, d), (kv,), (d, d), (f, d), (f, d), (d, f), (d,), (d,)]
    return [nn.Parameter(torch.empty(s, dtype=torch.bfloat16, device="meta")) for s in shapes]


def _full15b_at_24gib(monkeypatch, peak_reserved: int, peak_alloc: int = int(20.55 * GiB)):
    """full1.5b at a 24 GiB budget on the GPU machine after the first step: 28 blocks, the last 10 streamed
    with their optimizer on the host, the rest on the device (fp32 moments); a filler leaves 24 GiB free;
    the first step peaked at ``peak_alloc`` (20.55 GiB) allocated, ``peak_reserved`` reserved."""
    blocks = [_qwen15b_block() for _ in range(28)]
    vocab, d = 151936, 1536
    outside = [nn.Parameter(torch.empty(vocab, d, dtype=torch.bfloat16, device="meta")) for _ in range(2)]
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0])
    assert abs(block_bytes / MiB - 89.3) < 0.05
    n_all = sum(p.numel() for b in blocks for p in b) + sum(p.numel() for p in outside) + d
    assert abs(n_all / 1e9 - 1.777) < 0.001
    host = [p for b in blocks[18:] for p in b]
    block_of = {id(p): 18 + k // 12 for k, p in enumerate(host)}
    streaming = _Streaming(block_of, block_bytes)
    opt = _Opt(host, set(block_of), [*outside, *(p for b in blocks[:18] for p in b)])
    foreign = int(115.29 * GiB)  # the filler
    total = foreign + 24 * GiB  # the device as the filler leaves it: exactly the budget free
    resident = peak_alloc - 2 * GiB  # weights and device state between steps (not read by the rule)
    cuda = {
        "synchronize": lambda *a: None,
        "max_memory_allocated": lambda *a: foreign + peak_alloc,
        "memory_allocated": lambda *a: foreign + resident,
        "max_memory_reserved": lambda *a: foreign + peak_reserved,
        "memory_reserved": lambda *a: foreign + peak_reserved,
        "mem_get_info": lambda *a: (total - foreign - peak_reserved, total),
    }
    for name, fn in cuda.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return _Session([streaming]), opt, streaming, foreign, block_bytes


def _block_cost(block_bytes: int) -> int:
    return block_bytes + sum(device_state_bytes(p, 4) for p in _qwen15b_block())  # 14 B/param + weights


def test_refinement_of_full15b_at_24gib_leaves_the_headroom(monkeypatch):
    """The case that ran out of memory on the GPU machine. The old rule (5 % of the budget, allocated peak)
    found 24 x 0.95 - 20.55 = 2.25 GiB of room and promoted 3 blocks (3 x 714 MiB = 2.09 GiB): 22.64 GiB
    allocated, and the allocator's fragmentation took the rest of the 24 GiB. Now the room is what the
    device held (reserved) under the budget less 10 % (2.4 GiB): 1.05 GiB, one block."""
    session, opt, streaming, foreign, block_bytes = _full15b_at_24gib(monkeypatch, int(20.55 * GiB))
    cost = _block_cost(block_bytes)
    assert 713 * MiB < cost < 715 * MiB
    refine_after_first_step(session, opt, foreign, 24 * GiB)
    kind, msg, data = session.events[-1]
    assert kind == "placement" and msg.startswith("measured first step")
    assert data["unstreamed"] == [18] and streaming.streamed == list(range(19, 28))
    assert data["device_bytes"] == cost  # the largest tensor on the device already sets the workspace
    assert "blocks 18 STOP STREAMING" in msg and "blocks 19-27 keep streaming" in msg
    # the next steps' peak, fragmentation as measured, leaves the headroom free
    assert 20.55 * GiB + data["device_bytes"] <= 24 * GiB * 0.9
    assert len(opt.host_slots()) == 9 * 12


def test_refinement_counts_fragmentation_as_used(monkeypatch):
    """The same step with 1.35 GiB of fragmentation (21.9 GiB reserved at the peak): no room, nothing moves,
    every block keeps streaming, and the log says so."""
    session, opt, streaming, foreign, _ = _full15b_at_24gib(monkeypatch, int(21.9 * GiB))
    refine_after_first_step(session, opt, foreign, 24 * GiB)
    _, msg, data = session.events[-1]
    assert (
        data["unstreamed"] == [] and data["device_bytes"] == 0 and streaming.streamed == list(range(18, 28))
    )
    assert "moved the optimizer of 0 tensors" in msg and "21.90 GiB reserved" in msg


def test_refinement_of_a_given_plan_keeps_its_streamed_blocks(monkeypatch):
    """plan= given: even with room for everything the streamed blocks keep streaming."""
    session, opt, streaming, foreign, _ = _full15b_at_24gib(monkeypatch, 4 * GiB, 4 * GiB)
    refine_after_first_step(session, opt, foreign, 24 * GiB, keep_streamed=True)
    _, msg, data = session.events[-1]
    assert data["unstreamed"] == [] and streaming.streamed == list(range(18, 28))
    assert "(plan given: streamed blocks are kept)" in msg
    # the same measurement for a plan made by wrap(): blocks stop streaming while they fit
    session, opt, streaming, foreign, _ = _full15b_at_24gib(monkeypatch, 4 * GiB, 4 * GiB)
    refine_after_first_step(session, opt, foreign, 24 * GiB)
    assert session.events[-1][2]["unstreamed"] == list(range(18, 28)) and not opt.host_slots()


def test_widen_workspace_grows_with_the_largest_moved_tensor():
    """Moving a tensor larger than the widening batch grows the update's workspace: that counts as room."""
    big = nn.Parameter(torch.empty(1024, 1024, 128, dtype=torch.bfloat16, device="meta"))  # 512 MiB fp32
    small = nn.Parameter(torch.empty(1024, dtype=torch.bfloat16, device="meta"))
    assert widen_workspace([small]) == 4096 and widen_workspace([small, big]) == 512 * MiB
    slots = [types.SimpleNamespace(param=big, index=0, host_weight=None)]
    need = device_state_bytes(big, 4) + 512 * MiB - 4096
    assert device_share(slots, need - 1, 4, None, [small]) == ([], 0)
    assert device_share(slots, need, 4, None, [small]) == ([big], need)


# ------------------------------------------------------------------ decide_placement on a simulated CUDA device
def test_given_plan_on_cuda_keeps_streamed_blocks_and_says_so():
    from tidal_stream.options import WrapOptions
    from tidal_stream.placement import decide_placement

    p = _split_plan(4, host=[2, 3], streamed=[3])
    model = tinygpt.TinyGPT(layers=4)
    session = _Session([])
    opts = WrapOptions.from_kwargs({"plan": p, "blocks": model.blocks})
    trainable = [t for t in model.parameters() if t.requires_grad]
    place = decide_placement(session, model, opts, trainable)
    assert place.refine and place.keep_streamed
    msgs = [m for _, m, _ in session.events]
    assert any(
        "plan given (plan=): followed as given; its streamed blocks 3 keep streaming" in m for m in msgs
    )


class _NoStack(nn.Module):
    """One Linear, a LoRA-like adapter and a head: no block stack."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.adapter = nn.Sequential(nn.Linear(64, 4, bias=False), nn.Tanh())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) + self.adapter(x).sum(-1, keepdim=True))


@pytest.mark.parametrize(("budget", "on_device"), [("1MiB", True), ("64KiB", False), (None, True)])
def test_no_block_stack_on_cuda_has_no_plan_and_places_by_size(monkeypatch, budget, on_device):
    from tidal_stream.options import WrapOptions
    from tidal_stream.placement import decide_placement

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (4 * MiB, 80 * GiB))
    model = _NoStack()
    session = _Session([])
    opts = WrapOptions.from_kwargs({} if budget is None else {"vram_budget": budget})
    trainable = list(model.parameters())
    place = decide_placement(session, model, opts, trainable)
    assert session.plan is None
    assert len(place.gpu_params) == (len(trainable) if on_device else 0)
    assert place.refine is (not on_device)  # on the host: the first step's measurement moves what fits
    msgs = [m for _, m, _ in session.events]
    assert msgs[0].startswith("no plan: _NoStack has no block stack")
    assert ("optimizer on the device" in msgs[1]) is on_device, msgs


def test_no_block_stack_with_wrong_blocks_still_raises():
    from tidal_plan import PlanConfigError
    from tidal_stream.options import WrapOptions
    from tidal_stream.placement import decide_placement

    model = _NoStack()
    opts = WrapOptions.from_kwargs({"blocks": "head"})
    with pytest.raises((PlanConfigError, ValueError)):
        decide_placement(_Session([]), model, opts, list(model.parameters()))


class _Acts:
    """An activation-policy handle after one step: its policies (every block offloaded unless given), the
    measured offloaded bytes and inputs of each block."""

    def __init__(
        self, block_bytes: list[int], policies: list[str] | None = None, input_bytes: int = 0
    ) -> None:
        self.policies = list(policies) if policies else ["offload"] * len(block_bytes)
        self.block_bytes = block_bytes
        self.input_bytes = [input_bytes] * len(block_bytes)

    def stats(self) -> dict:
        return {
            "policies": list(self.policies),
            "block_offloaded_bytes": list(self.block_bytes),
            "block_input_bytes": list(self.input_bytes),
        }

    def set_policy(self, i: int, policy: str) -> None:
        self.policies[i] = policy


def _lora14b_at_24gib(monkeypatch, acts: _Acts):
    """lora14b NF4 on the GPU machine: the plan (sized for 4,096 tokens) offloaded all 48 blocks' activations,
    the real batch is 512 tokens (160 MiB per block); every optimizer state is on the device already and the
    first step peaked at 13.4 GiB reserved of a 23.7 GiB budget."""
    foreign = int(115.29 * GiB)
    total = foreign + 24 * GiB
    peak = int(13.4 * GiB)
    cuda = {
        "synchronize": lambda *a: None,
        "max_memory_allocated": lambda *a: foreign + int(12.2 * GiB),
        "memory_allocated": lambda *a: foreign + 11 * GiB,
        "max_memory_reserved": lambda *a: foreign + peak,
        "memory_reserved": lambda *a: foreign + peak,
        "mem_get_info": lambda *a: (total - foreign - peak, total),
    }
    for name, fn in cuda.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    opt = _Opt([], set(), [nn.Parameter(torch.empty(16, device="meta"))])
    return _Session([types.SimpleNamespace(activations=acts)]), opt, foreign


def test_refinement_keeps_offloaded_activations_that_fit_last_blocks_first(monkeypatch):
    """Room left after the first step (23.7 - 2.37 headroom - 13.4 GiB: 7.93 GiB) holds 40 blocks of 200 MiB:
    the last 40 keep their activations, the first 8 still offload; the log names them."""
    acts = _Acts([200 * MiB] * 48)
    session, opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    budget = int(23.7 * GiB)
    refine_after_first_step(session, opt, foreign, budget)
    _, msg, data = session.events[-1]
    room = budget - int(0.1 * budget) - int(13.4 * GiB)
    fits = room // (200 * MiB)
    assert fits == 40
    assert data["activations_kept"] == list(range(48 - fits, 48))
    assert data["activations_kept_bytes"] == fits * 200 * MiB <= room
    assert acts.policies == ["offload"] * (48 - fits) + ["keep"] * fits
    assert f"blocks {48 - fits}-47 KEEP their activations on the device" in msg


def test_refinement_leaves_activations_of_a_given_plan_and_without_room(monkeypatch):
    acts = _Acts([160 * MiB] * 48)
    session, opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    refine_after_first_step(session, opt, foreign, int(23.7 * GiB), keep_streamed=True)
    assert acts.policies == ["offload"] * 48 and session.events[-1][2]["activations_kept"] == []
    assert "KEEP" not in session.events[-1][1]
    assert keep_offloaded_activations(session, 0) == ([], 0)
    # recompute and keep blocks, and blocks that measured nothing, are left as they are
    acts.policies[47], acts.policies[46], acts.block_bytes[45] = "recompute", "keep", 0
    assert keep_offloaded_activations(session, 10 * GiB) == (list(range(45)), 45 * 160 * MiB)
    assert acts.policies[45:] == ["offload", "keep", "recompute"]


def test_data_parallel_keeps_offloaded_activations_that_fit(monkeypatch):
    """Under data parallel (the optimizer sharded on the host, nothing to promote) the first step's measured
    room goes to activations alone: the same 7.93 GiB, the same last 40 blocks, logged."""
    acts = _Acts([200 * MiB] * 48)
    session, _opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    budget = int(23.7 * GiB)
    keep_activations_after_first_step(session, foreign, budget)
    kind, msg, data = session.events[-1]
    assert kind == "placement" and data["activations_kept"] == list(range(8, 48))
    assert acts.policies == ["offload"] * 8 + ["keep"] * 40
    assert "room 7.93 GiB after 2.37 GiB headroom" in msg and "blocks 8-47 KEEP" in msg
    # no room (a peak at the budget): nothing changes and the log says so
    acts2 = _Acts([200 * MiB] * 4)
    session2, _, foreign2 = _lora14b_at_24gib(monkeypatch, acts2)
    keep_activations_after_first_step(session2, foreign2, int(14 * GiB))
    assert (
        acts2.policies == ["offload"] * 4
        and "every offloaded or recomputed block stays so" in session2.events[-1][1]
    )


# lora14b NF4 as the 4,096-token plan of a 24 GiB budget has it: blocks 0-13 offload, 14 keeps, 15-47 recompute;
# the real batch is 512 tokens of hidden 5120 in bf16 (5 MiB of block input)
_LORA14B_POLICIES = ["offload"] * 14 + ["keep"] + ["recompute"] * 33
_INPUT_512 = 512 * 5120 * 2


def _census(n: int, keep_per_token: int, input_per_token: int = 5120 * 2):
    """Per-block bytes per token as tidal_plan's census has them: kept activations and the main input."""
    block = types.SimpleNamespace(
        activation_bytes_per_token=keep_per_token, input_bytes_per_token=input_per_token
    )
    return types.SimpleNamespace(blocks=[block] * n)


def test_refinement_keeps_recomputed_activations_by_estimate_after_offloaded_ones(monkeypatch):
    """Room (7.93 GiB) goes first to the 14 offloaded blocks (200 MiB measured each), then to recomputed
    blocks, last first, at their input (5 MiB) times the census' kept-to-input ratio (40: 200 MiB each)."""
    acts = _Acts([200 * MiB] * 14 + [0] * 34, _LORA14B_POLICIES, _INPUT_512)
    session, opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    session.census = _census(48, 40 * 5120 * 2)
    budget = int(23.7 * GiB)
    refine_after_first_step(session, opt, foreign, budget)
    _, msg, data = session.events[-1]
    room = budget - int(0.1 * budget) - int(13.4 * GiB)
    recomputed = (room - 14 * 200 * MiB) // (200 * MiB)
    assert recomputed == 26
    assert data["activations_kept"] == list(range(14)) + list(range(48 - recomputed, 48))
    assert data["activations_kept_bytes"] == (14 + recomputed) * 200 * MiB <= room
    assert acts.policies == ["keep"] * 15 + ["recompute"] * (33 - recomputed) + ["keep"] * recomputed
    assert f"blocks 0-13, {48 - recomputed}-47 KEEP their activations" in msg and "estimated" in msg


def test_recomputed_activations_need_a_census_of_the_same_stack_and_a_measured_input():
    acts = _Acts([0] * 4, ["recompute"] * 4, _INPUT_512)
    session = _Session([types.SimpleNamespace(activations=acts)])
    assert keep_recomputed_activations(session, 10 * GiB) == ([], 0)  # no census (a plan given without one)
    session.census = _census(3, 40 * 5120 * 2)
    assert keep_recomputed_activations(session, 10 * GiB) == ([], 0)  # another stack's census
    session.census = _census(4, 40 * 5120 * 2)
    acts.input_bytes[3] = 0  # block 3 never ran in grad mode
    assert keep_recomputed_activations(session, 10 * GiB) == ([0, 1, 2], 3 * 200 * MiB)
    assert acts.policies == ["keep"] * 3 + ["recompute"]
    assert keep_recomputed_activations(session, 0) == ([], 0)


def _frozen_streaming(first: int = 9, extra: dict[int, int] | None = None) -> _Streaming:
    """LoRA exact's streaming: blocks ``first``-47 stream frozen bases of 530.5 MiB (``extra``: more tensor
    ids and their blocks)."""
    frozen = {i: nn.Parameter(torch.empty(1, device="meta"), requires_grad=False) for i in range(first, 48)}
    block_of = {id(t): i for i, t in frozen.items()} | (extra or {})
    streaming = _Streaming(block_of, int(530.5 * MiB))
    streaming.frozen = frozen  # the tensors live as long as the stub (ids stay unique)
    return streaming


def _lora14b_streaming_frozen(monkeypatch) -> tuple:
    """:func:`_lora14b_at_24gib` with offloaded activations of 50 MiB per block and blocks 9-47 streaming
    frozen bases. Returns the session, optimizer, foreign bytes, streaming stub and activation stub."""
    streaming = _frozen_streaming()
    acts = _Acts([50 * MiB] * 48)
    session, opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    session.extensions.append(streaming)
    return session, opt, foreign, streaming, acts


def test_frozen_streamed_blocks_stop_streaming_so_the_rest_spread_while_they_fit():
    """LoRA exact: blocks 9-47 stream frozen bases of 530.5 MiB; a block whose streamed weight the host
    optimizer updates (block 10) stays streaming. 3 GiB of room hold five blocks; the 33 other movable
    ones keep streaming, spread from block 9 to the end of the stack, so the five that stop are evenly
    spaced gaps: 18, 25, 31, 38, 44."""
    trained = nn.Parameter(torch.empty(1, device="meta"))
    streaming = _frozen_streaming(extra={id(trained): 10})
    opt = _Opt([trained], {id(trained)}, [])
    updated = host_updated_blocks(opt, streaming)
    assert updated == {10} and host_updated_blocks(opt, None) == frozenset()
    blocks, nbytes = unstream_frozen_blocks(streaming, 3 * GiB, updated)
    assert blocks == [18, 25, 31, 38, 44] and nbytes == 5 * int(530.5 * MiB)
    assert streaming.streamed == [i for i in range(9, 48) if i not in blocks]
    assert unstream_frozen_blocks(streaming, 0, updated) == ([], 0)
    assert unstream_frozen_blocks(None, 3 * GiB) == ([], 0)


def test_streamed_blocks_keep_away_from_blocks_that_offload_activations():
    """Blocks 19-47 stream 268 MiB each (FP8 at 2,048 tokens) and 19-27 offload their activations: the
    room stops 22 from streaming, and the 7 left spread over the blocks whose activations stay, where the
    link is free; with more to keep than those blocks, the spread covers every streamed block again."""
    streaming = _Streaming({i: i for i in range(19, 48)}, 268 * MiB)
    busy = frozenset(range(19, 28))
    blocks, _ = unstream_frozen_blocks(streaming, 22 * 268 * MiB, busy=busy)
    assert len(blocks) == 22 and streaming.streamed == [29, 32, 35, 37, 40, 43, 46]
    streaming = _Streaming({i: i for i in range(19, 48)}, 268 * MiB)
    blocks, _ = unstream_frozen_blocks(streaming, 3 * 268 * MiB, busy=busy)
    assert streaming.streamed == spread_streamed(range(19, 48), 26, 48)


# blocks 9-47 streaming, room for 15: those that stop so the other 24 spread from block 9 to the end
SPREAD_OUT = [10, 12, 15, 18, 20, 23, 25, 28, 31, 33, 36, 38, 41, 44, 46]


def test_refinement_stops_streaming_frozen_blocks_before_keeping_activations(monkeypatch):
    """The 7.93 GiB of room go to frozen blocks first (15 of 530.5 MiB, chosen so the 24 that keep streaming
    spread from block 9 to the end), the rest to offloaded activations; a given plan (keep_streamed)
    leaves its streamed blocks and activations alone."""
    for given in (False, True):
        session, opt, foreign, streaming, _acts = _lora14b_streaming_frozen(monkeypatch)
        budget = int(23.7 * GiB)
        refine_after_first_step(session, opt, foreign, budget, keep_streamed=given)
        _, msg, data = session.events[-1]
        if given:
            assert streaming.streamed == list(range(9, 48)) and data["activations_kept"] == []
            continue
        room = budget - int(0.1 * budget) - int(13.4 * GiB)
        n = room // int(530.5 * MiB)
        assert n == 15 and data["unstreamed"] == SPREAD_OUT
        assert streaming.streamed == [i for i in range(9, 48) if i not in SPREAD_OUT]
        assert "blocks 10, 12, 15, 18, 20, 23, 25, 28, 31, 33, 36, 38, 41, 44, 46 STOP STREAMING" in msg
        left = room - n * int(530.5 * MiB)
        assert data["activations_kept"] == list(range(48 - left // (50 * MiB), 48))


def test_data_parallel_stops_streaming_frozen_blocks_before_keeping_activations(monkeypatch):
    """Under data parallel every streamed weight is frozen: the measured room (7.93 GiB) stops streaming 15
    blocks of 530.5 MiB (the rest spread from block 9 to the end), and the rest keeps the last offloaded blocks' activations; with a
    peer pool (unstream=False) every block keeps streaming and the room goes to activations alone."""
    for unstream in (True, False):
        session, _opt, foreign, streaming, _acts = _lora14b_streaming_frozen(monkeypatch)
        keep_activations_after_first_step(session, foreign, int(23.7 * GiB), unstream)
        _, msg, data = session.events[-1]
        room = int(23.7 * GiB) - int(0.1 * 23.7 * GiB) - int(13.4 * GiB)
        if not unstream:
            assert streaming.streamed == list(range(9, 48)) and data["unstreamed"] == []
            assert len(data["activations_kept"]) == 48 and "STOP STREAMING" not in msg
            continue
        assert data["unstreamed"] == SPREAD_OUT
        assert streaming.streamed == [i for i in range(9, 48) if i not in SPREAD_OUT]
        assert "10, 12, 15, 18, 20, 23, 25, 28, 31, 33, 36, 38, 41, 44, 46 STOP STREAMING (7.77 GiB" in msg
        left = room - 15 * int(530.5 * MiB)
        assert data["activations_kept"] == list(range(48 - left // (50 * MiB), 48))


# ------------------------------------------------------------------ the cost model on the refined placement
def _predicting_session(monkeypatch, h2d_gbps: float) -> tuple:
    """TinyGPT's 4 frozen blocks streaming (2 GiB each, as the streaming stub counts them) and recomputing
    (1.5 GiB of activations each, estimated from the measured input), the 7.93 GiB room of
    :func:`_lora14b_at_24gib`, and the plan, census, profile and options of a plan made by wrap() on a
    machine whose host link moves ``h2d_gbps``. Returns the session, optimizer, foreign bytes, streaming
    and activation stubs."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    model = tinygpt.TinyGPT(layers=4)
    model.blocks.requires_grad_(False)  # a frozen base: nothing in the blocks trains
    c = census(model, blocks=model.blocks)
    ratio = c.blocks[0].activation_bytes_per_token / c.blocks[0].input_bytes_per_token
    acts = _Acts([0] * 4, ["recompute"] * 4, int(1.5 * GiB / ratio))
    session, opt, foreign = _lora14b_at_24gib(monkeypatch, acts)
    block_of = {id(t): i for i, b in enumerate(model.blocks) for t in b.parameters()}
    streaming = _Streaming(block_of, 2 * GiB)
    session.extensions.append(streaming)
    link = {"h2d_gbps": h2d_gbps, "d2h_gbps": h2d_gbps, "bidir_gbps": 2 * h2d_gbps}
    session.profile = HardwareProfile.synthetic(**link)
    session.plan_config = PlanConfig(vram_budget="8GiB")
    session.plan = plan(c, session.profile, session.plan_config)
    session.census, session.model = c, model
    return session, opt, foreign, streaming, acts


@pytest.mark.parametrize("data_parallel", [False, True])
def test_refinement_reports_the_cost_model_at_the_measured_tokens(monkeypatch, data_parallel):
    """The room (7.93 GiB) stops streaming 3 blocks of 2 GiB, the last block keeps its 1.5 GiB of
    activations; the log adds the cost model's step of that placement at the measured tokens. The one
    block still streaming fits the window: turn holds keep it over both turns of every step, so it never
    crosses the link again: alone, the link's speed does not change the predicted step; under data
    parallel the host updates the trained weights outside the stack, whose copies a slow link delays."""
    steps = []
    for gbps in (1e6, 1e-8):
        session, opt, foreign, streaming, acts = _predicting_session(monkeypatch, gbps)
        if data_parallel:
            keep_activations_after_first_step(session, foreign, int(23.7 * GiB))
        else:
            refine_after_first_step(session, opt, foreign, int(23.7 * GiB))
        _, msg, data = session.events[-1]
        assert streaming.streamed == [3] and data["unstreamed"] == [0, 1, 2]
        assert acts.policies == ["recompute"] * 3 + ["keep"] and data["activations_kept"] == [3]
        tokens = int(1.5 * GiB / (session.census.blocks[0].activation_bytes_per_token))
        assert f"the cost model predicts {data['predicted_step_s'] * 1e3:.0f} ms per step" in msg
        assert f"at the measured {tokens} tokens" in msg
        steps.append(data["predicted_step_s"])
    assert 0 < steps[0] < steps[1] if data_parallel else 0 < steps[0] == steps[1]
    # without the plan's options (a plan given as plan=) there is nothing to predict with
    session, opt, foreign, *_ = _predicting_session(monkeypatch, 50.0)
    session.plan_config = None
    refine_after_first_step(session, opt, foreign, int(23.7 * GiB))
    assert session.events[-1][2]["predicted_step_s"] is None and "cost model" not in session.events[-1][1]


def test_measured_tokens_come_from_the_input_bytes(monkeypatch):
    from tidal_stream.refined_prediction import measured_tokens

    session, *_ = _predicting_session(monkeypatch, h2d_gbps=50.0)
    per = session.census.blocks[0].input_bytes_per_token
    session.extensions[0].activations.input_bytes = [0, 512 * per, 0, 0]
    assert measured_tokens(session) == 512
    session.census = None
    assert measured_tokens(session) == 0


def test_host_ram_goes_to_the_profile_and_a_host_refusal_names_the_models_own_bytes(monkeypatch):
    """``host_ram`` is the plan's host RAM (its config's, in place of the profile's measurement); a plan refused for host RAM while the
    model's weights sit in host memory (a GPU run) gets a note with their bytes and the host_ram that
    counts them; not for another resource, on the CPU, or when host_ram was given."""
    import tidal_plan
    from tidal_plan import HardwareProfile, InfeasiblePlan
    from tidal_stream.placement import _make_plan, model_host_bytes, note_model_host_bytes

    model = tinygpt.TinyGPT(layers=2)
    held = model_host_bytes(model)
    assert held == sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    profile = HardwareProfile.synthetic(vram_budget_bytes="1GiB", host_ram_bytes=8 * GiB)
    monkeypatch.setattr(tidal_plan, "profile_hardware", lambda *a, **k: profile)
    opts = WrapOptions(vram_budget="1GiB", host_ram="200GiB", blocks=model.blocks)
    _, p, measured, config = _make_plan(model, opts, torch.device("cuda", 0))
    assert config.host_ram == "200GiB" and measured.host_ram_bytes == 8 * GiB
    assert p.host_ram_bytes > 8 * GiB  # the plan's usable host RAM follows host_ram

    cuda, no_host_ram = torch.device("cuda", 0), WrapOptions(vram_budget="1GiB")

    def refused(resource: str) -> InfeasiblePlan:
        return InfeasiblePlan(resource, 10 * GiB, 3 * GiB, f"not enough {resource}")

    e = refused("host_ram")
    note_model_host_bytes(e, model, no_host_ram, cuda)
    (note,) = e.__notes__
    assert f"hold {held / 2**30:.2f} GiB of host memory" in note
    assert f"host_ram='{(3 * GiB + held) // 2**30}GiB'" in note
    for err, o, dev in ((refused("vram"), no_host_ram, cuda), (refused("host_ram"), opts, cuda)):
        note_model_host_bytes(err, model, o, dev)
        assert not getattr(err, "__notes__", None)
    e = refused("host_ram")
    note_model_host_bytes(e, model, no_host_ram, torch.device("cpu"))
    assert not getattr(e, "__notes__", None)
