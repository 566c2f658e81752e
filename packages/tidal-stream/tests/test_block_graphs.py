"""CUDA graphs of resident blocks (``tidal_stream.block_graphs``).

CPU: which blocks qualify and why the others do not, the call signature, the option. GPU: a LoRA Qwen2
trained with graphs gives the losses and gradients of the same run without them (bit for bit), also with
a second forward before backward, gradient accumulation, zero_grad(set_to_none=False) and a change of
sequence length (that call runs eagerly).
"""

from __future__ import annotations

import copy
import types
import weakref

import pytest
import torch
from torch import nn

from tidal_stream import graph_fit, memory_report, wrap
from tidal_stream.block_graphs import (
    BlockGraphs,
    _BlockGraph,
    _foreign_hooks,
    _signature,
    blocks_within,
    graphable_blocks,
    graphs_reserve_by_block,
)
from tidal_stream.errors import OptionError
from tidal_testing.numerics import assert_bitwise_equal

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


# ----------------------------------------------------------------------------------------------- CPU
def _fake_session(blocks, streamed=(), policies=None, host_params=()):
    ext = types.SimpleNamespace(
        blocks=blocks,
        weights=types.SimpleNamespace(streamed=list(streamed)) if streamed else None,
        activations=types.SimpleNamespace(policies=policies) if policies else None,
    )
    opt = types.SimpleNamespace(host_slots=lambda: [types.SimpleNamespace(param=p) for p in host_params])
    return types.SimpleNamespace(extensions=[ext], model=None), opt


def test_graphable_blocks_names_why_the_others_stay_eager():
    blocks = [nn.Linear(4, 4) for _ in range(7)]
    blocks[5].register_forward_hook(lambda *a: None)  # a user's hook on the block itself runs every call
    child = nn.Sequential(nn.Linear(4, 4))
    child[0].register_forward_pre_hook(lambda *a: None)  # a user's hook inside the block would not
    blocks[4] = child
    blocks[6] = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    session, opt = _fake_session(
        blocks,
        streamed=[0],
        policies=["keep", "recompute", "offload", "keep", "keep", "keep", "recompute"],
        host_params=[blocks[3].weight],
    )
    chosen, others = graphable_blocks(session, opt)
    acts = session.extensions[0].activations
    assert chosen == {1: (blocks[1], acts), 5: (blocks[5], None)}  # a recomputed block carries its handle
    assert others == {
        "their weights stream": [0],
        "their activations are offloaded": [2],
        "their optimizer is on the host": [3],
        "their submodules carry hooks that are not tidal's": [4],
        "they recompute with dropout (the graphs do not replay its random masks)": [6],
    }


def test_foreign_hooks_ignores_the_blocks_own_and_tidals():
    block = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    block.register_forward_pre_hook(lambda *a: None)
    assert _foreign_hooks(block) == []
    block[1].register_forward_hook(lambda *a: None)
    assert _foreign_hooks(block) == ["1._forward_hooks"]


def test_signature_tracks_shapes_grad_and_plain_values_only():
    x = torch.zeros(2, 3)
    spec_leaves = lambda *a, **k: torch.utils._pytree.tree_flatten((a, k))  # noqa: E731
    leaves, spec = spec_leaves(x, mask=None, use_cache=False)
    s1 = _signature(spec, leaves, x.device)
    leaves2, spec2 = spec_leaves(torch.ones(2, 3), mask=None, use_cache=False)
    assert _signature(spec2, leaves2, x.device) == s1  # values do not matter, shapes do
    leaves3, spec3 = spec_leaves(torch.ones(2, 4), mask=None, use_cache=False)
    assert _signature(spec3, leaves3, x.device) != s1
    leaves4, spec4 = spec_leaves(x.requires_grad_(), mask=None, use_cache=False)
    assert _signature(spec4, leaves4, x.device) != s1
    leaves5, spec5 = spec_leaves(x, cache=object())
    assert _signature(spec5, leaves5, x.device) is None  # an object a replay cannot account for


def test_cuda_graphs_option_is_validated():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(OptionError, match="cuda_graphs"):
        wrap(model, None, lr=1e-3, device="cpu", cuda_graphs="yes")
    with pytest.raises(OptionError, match="cuda_graphs"):
        wrap(model, None, lr=1e-3, device="cpu", cuda_graphs=True)


def test_no_graphs_on_the_cpu():
    """``cuda_graphs="auto"`` is accepted on the CPU and graphs nothing there."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model, opt = wrap(model, None, lr=1e-3, device="cpu", cuda_graphs="auto")
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert "cuda_graphs" not in memory_report(model)
    assert not [e for e in memory_report(model)["events"] if e["kind"] == "graphs"]


def test_a_delegated_recompute_is_checkpointed_by_its_runner():
    """``ActivationHandle.delegate``: the block's hook no longer checkpoints; ``checkpointed`` (what the
    graph dispatcher calls when a recomputed block runs eagerly) does, with the same gradients."""
    from tidal_stream.activations import install_activation_policy

    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
    model = copy.deepcopy(ref)
    h = install_activation_policy(list(model), ["recompute", "recompute"], device="cpu")
    h.delegate(0)
    model[0].forward = _BlockGraph(
        None, 0, model[0], model[0].forward, h
    ).eager  # the dispatcher's eager path
    x = torch.randn(4, 8)
    for m in (ref, model):
        m(x).square().sum().backward()
    for pr, pm in zip(ref.parameters(), model.parameters()):
        assert_bitwise_equal(pr.grad, pm.grad)
    assert h.stats()["recomputed_forwards"] == 2  # block 0 by checkpointed(), block 1 by its hook
    h.delegate(0, False)
    del model[0].forward
    model(x).square().sum().backward()
    assert h.stats()["recomputed_forwards"] == 4  # both by their hooks again


def test_captures_see_stand_ins_that_share_the_parameters_storage():
    """[Note: fresh leaves]: inside ``_fresh_leaves`` every trainable parameter, a shared one in each of
    its places, is one new leaf on the same storage; the gradients reach the stand-ins; afterwards the
    block holds its own parameters again, unchanged and without gradients."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    block[1].weight = block[0].weight  # one parameter in two places
    block[2].weight.requires_grad_(False)  # frozen: no stand-in
    params = [p for p in block.parameters() if p.requires_grad]
    g = _BlockGraph(None, 0, block, block.forward, None)
    before = [p.detach().clone() for p in params]
    with g._fresh_leaves() as stand_ins:
        assert len(stand_ins) == len(params) == 4  # the shared weight once, two biases, the LayerNorm bias
        assert block[0].weight is block[1].weight is stand_ins[0] and stand_ins[0] is not params[0]
        assert all(s.data_ptr() == p.data_ptr() and s.is_leaf for s, p in zip(stand_ins, params))
        assert block[2].weight is not None and not block[2].weight.requires_grad
        out = block(torch.randn(3, 4)).sum()
        grads = torch.autograd.grad(out, stand_ins)
    assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)
    assert [p for p in block.parameters() if p.requires_grad] == params  # the same objects are back
    assert block[0].weight is block[1].weight is params[0]
    assert all(p.grad is None for p in params)
    for b, p in zip(before, params):
        assert_bitwise_equal(b, p.detach())


# ----------------------------------------------------------------------------------------------- GPU
def _lora_qwen(layers: int = 3, full: bool = False) -> nn.Module:
    """A tiny bf16 Qwen2 on the GPU with LoRA adapters (``full``: no adapters, every weight trained)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    if full:
        return base.cuda()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so every adapter gets a gradient from the first step
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.cuda()


def _run(
    graphs: bool | str,
    lengths: list[int],
    *,
    accumulation: int = 1,
    double_forward: bool = False,
    set_to_none: bool = True,
    recompute: bool = False,
    full: bool = False,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], nn.Module]:
    """Losses and trained gradients per micro-step of a wrapped LoRA Qwen2 (``full``: every weight trained;
    weights and state on the GPU)."""
    model = _lora_qwen(full=full)
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    # one fixed SDPA backend, deterministic in backward: timing could pick a different one per run
    model, opt = wrap(
        model,
        opt,
        offload=False,
        cuda_graphs=graphs,
        accumulation_steps=accumulation,
        attention="math",
        recompute=recompute,
    )
    losses, grads = [], []
    for step, n in enumerate(lengths):
        ids = torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(step)).cuda()
        if double_forward:  # a second forward before the first's backward (as DPO's chosen/rejected)
            other = model(input_ids=ids.flip(1), labels=ids.flip(1)).loss
        loss = model(input_ids=ids, labels=ids).loss
        if double_forward:
            loss = loss + 0.5 * other
        loss.backward()
        losses.append(loss.detach().float().reshape(1))
        grads.append([p.grad.detach().float().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    torch.cuda.synchronize()
    return losses, grads, model


def _graph_events(model: nn.Module) -> list[str]:
    return [e["message"] for e in memory_report(model)["events"] if e["kind"] == "graphs"]


def _same(a, b) -> None:
    for step, (la, lb) in enumerate(zip(a[0], b[0])):
        assert_bitwise_equal(la, lb, f"loss of step {step}")
    for step, (ga, gb) in enumerate(zip(a[1], b[1])):
        for k, (x, y) in enumerate(zip(ga, gb)):
            assert_bitwise_equal(x, y, f"gradient {k} of step {step}")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(double_forward=True),
        dict(accumulation=2),
        dict(set_to_none=False),
    ],
    ids=["plain", "second-forward-before-backward", "accumulation-2", "zero-grad-not-none"],
)
def test_graphed_steps_match_eager_steps_bit_for_bit(case):
    lengths = [16] * 6
    eager = _run(False, lengths, **case)
    graphed = _run(True, lengths, **case)
    _same(eager, graphed)
    rep = memory_report(graphed[2])["cuda_graphs"]
    print(case, rep)
    assert rep["captured"] == [0, 1, 2] and rep["replays"] > 0, _graph_events(graphed[2])
    assert "cuda_graphs" not in memory_report(eager[2])


@pytest.mark.gpu
@cuda
def test_recomputed_blocks_replay_their_recompute_bit_for_bit():
    """Every block recomputes: the backward graph recomputes from the saved inputs; same numbers as the
    eager checkpointed run, and the handle still counts no recompute of a graphed step."""
    lengths = [16] * 5
    eager = _run(False, lengths, recompute=True)
    graphed = _run(True, lengths, recompute=True)
    _same(eager, graphed)
    rep = memory_report(graphed[2])
    assert rep["cuda_graphs"]["captured"] == [0, 1, 2], _graph_events(graphed[2])
    assert rep["activations"]["policies"] == ["recompute"] * 3
    assert any("they fit" in m for m in _graph_events(graphed[2])), _graph_events(graphed[2])
    # eager: 5 steps x 3 blocks recomputed; graphed: step 1 eager (3), then the warm-up and replays
    assert (
        rep["activations"]["recomputed_forwards"]
        < memory_report(eager[2])["activations"]["recomputed_forwards"]
    )


@pytest.mark.gpu
@cuda
def test_full_fine_tuning_graphs_the_blocks_the_room_holds_bit_for_bit(monkeypatch):
    """Full fine-tuning with room for two blocks' graph buffers (their weights' gradients included): blocks
    0-1 replay graphs, block 2 stays eager, and the losses and every weight's gradient match the eager run."""
    from tidal_stream.block_graphs import graphs_reserve_by_block

    rooms = []

    def two_blocks(session):
        reserve = graphs_reserve_by_block(session, session.optimizer)
        rooms.append(reserve)
        return reserve[0] + reserve[1]

    monkeypatch.setattr(graph_fit, "graphs_room", two_blocks)
    lengths = [16] * 5
    eager = _run(False, lengths, recompute=True, full=True)
    graphed = _run(True, lengths, recompute=True, full=True)
    _same(eager, graphed)
    assert rooms and all(r[0] > 4 * 64 * 16 * 2 for r in rooms)  # the buffers count the weights' gradients
    rep = memory_report(graphed[2])["cuda_graphs"]
    assert rep["captured"] == [0, 1] and rep["replays"] > 0, _graph_events(graphed[2])
    assert any("blocks 2 stay eager: their buffers would exceed" in m for m in _graph_events(graphed[2]))


@pytest.mark.gpu
@cuda
def test_a_new_sequence_length_runs_eagerly_and_matches():
    lengths = [16, 16, 16, 24, 16]
    eager = _run(False, lengths)
    graphed = _run(True, lengths)
    _same(eager, graphed)
    rep = memory_report(graphed[2])["cuda_graphs"]
    assert rep["eager_calls"] >= 3  # the 24-token step's three blocks
    assert rep["replays"] >= 3 * 3  # three 16-token steps after the capture


@pytest.mark.gpu
@cuda
def test_auto_releases_the_graphs_and_their_memory_at_a_new_sequence_length():
    """``cuda_graphs="auto"`` (the default): the 24-token step releases the graphs; that step and the later
    ones run eagerly with the numbers of the run without graphs, and the graphs' memory is handed back."""
    lengths = [16, 16, 16, 24, 16]
    eager = _run(False, lengths)
    graphed = _run("auto", lengths)
    _same(eager, graphed)
    rep = memory_report(graphed[2])["cuda_graphs"]
    assert rep["released"] is not None and "(2, 24, 64)" in rep["released"], _graph_events(graphed[2])
    # three blocks replayed in step 2 (the capture's own call) and in step 3
    assert rep["captured"] == [] and rep["replays"] == 6
    assert any("memory was handed back" in m for m in _graph_events(graphed[2])), _graph_events(graphed[2])


@pytest.mark.gpu
@cuda
def test_graphs_that_leave_too_little_room_go_after_the_capture_step(monkeypatch):
    """The step that captured is measured as over the budget (less than half the headroom left): the graphs
    go with their memory and the next steps run eagerly, with the numbers of the run without graphs."""
    real, calls = graph_fit.measured_room, []

    def over(dev, foreign, budget):
        peak, used, room, headroom = real(dev, foreign, budget)
        calls.append(used)
        # the peak before the graphs as measured, the capture step's over
        return peak, used, room if len(calls) == 1 else -headroom, headroom

    monkeypatch.setattr(graph_fit, "measured_room", over)
    lengths = [16] * 5
    eager = _run(False, lengths, recompute=True)
    graphed = _run("auto", lengths, recompute=True)
    _same(eager, graphed)
    rep = memory_report(graphed[2])["cuda_graphs"]
    events = _graph_events(graphed[2])
    assert rep["released"].startswith("released: the step that captured them peaked"), events
    assert rep["replays"] == 3  # the capture step's three blocks only
    assert any("memory was handed back" in m for m in events), events
    assert len(calls) == 2  # at the install, after the capture step


class _HostSyncBlock(nn.Module):
    """A block whose forward reads a value on the host: it runs eagerly, but it cannot be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() < 0:  # never true; .item() synchronizes, which a capture refuses
            x = -x
        return torch.tanh(self.lin(x))


class _HostSyncStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_HostSyncBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.gpu
@cuda
def test_a_failed_capture_leaves_the_session_eager_and_the_rng_usable():
    """[Note: failed capture]: a capture that fails (a host sync in the block) leaves every block eager,
    logs why, gives the same numbers as a run without graphs, and leaves the CUDA generator usable (a
    failed capture used to leave it in its capture state: random ops then raised)."""

    def train(graphs: bool) -> tuple[list[torch.Tensor], nn.Module]:
        torch.manual_seed(0)
        model = _HostSyncStack().cuda()
        model, opt = wrap(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), offload=False, cuda_graphs=graphs
        )
        losses = []
        for step in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).cuda()
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().reshape(1))
        return losses, model

    eager_losses, _ = train(False)
    losses, model = train(True)
    for step, (a, b) in enumerate(zip(eager_losses, losses)):
        assert_bitwise_equal(a, b, f"loss of step {step}")
    rep = memory_report(model)["cuda_graphs"]
    assert rep["captured"] == [] and rep["replays"] == 0
    assert any("capture failed" in m for m in _graph_events(model)), _graph_events(model)
    torch.randn(16, device="cuda").normal_()  # the generator left its capture state
    torch.cuda.synchronize()


def _pretend_captured(session, blocks, x):
    """BlockGraphs over ``blocks`` with every block marked as captured for calls like ``block(x)`` (the CPU
    cannot capture; the dispatcher's decisions before a replay are what these tests look at)."""
    bg = BlockGraphs(session, {i: (b, None) for i, b in enumerate(blocks)})
    for g in bg.graphs.values():
        leaves, spec = torch.utils._pytree.tree_flatten(((x,), {}))
        g.signature = (*_signature(spec, leaves, x.device), g.block.training)
        g.ptrs = g._ptrs()
        g.fwd = g.bwd = object()
        g.static_in, g.static_out = [x.clone()], [x.clone()]
    return bg


def _cpu_session(mode):
    events = []
    opts = types.SimpleNamespace(vram_budget_bytes=None, cuda_graphs=mode)
    record = lambda kind, message, **_: events.append(message)  # noqa: E731
    return types.SimpleNamespace(device=torch.device("cpu"), options=opts, record=record), events


def test_auto_releases_the_graphs_at_the_first_change_of_input_shape():
    """``cuda_graphs="auto"``: a call with another shape than the capture runs eagerly and releases the graphs
    of every block (each dropped at its own next call); the log names both shapes."""
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    session, events = _cpu_session("auto")
    bg = _pretend_captured(session, blocks, torch.randn(2, 4))
    y = torch.randn(3, 4)
    assert_bitwise_equal(blocks[0](y), torch.nn.functional.linear(y, blocks[0].weight, blocks[0].bias))
    g0, g1 = bg.graphs[0], bg.graphs[1]
    assert g0.fwd is None and g0.static_out == []  # dropped at once: no replay of it awaits a backward
    assert g1.fwd is not None and g1.failed is not None  # dropped at its next call
    assert any("shape (3, 4)" in m and "shape (2, 4)" in m for m in events), events
    blocks[1](torch.randn(2, 4))  # the captured shape, but released: eager, and its graphs go
    assert g1.fwd is None
    rep = bg.report()["cuda_graphs"]
    assert rep["captured"] == [] and rep["released"].startswith("released: block 0")
    assert rep["eager_calls"] == 2 and rep["replays"] == 0


def test_true_keeps_the_graphs_for_the_captured_shape():
    """``cuda_graphs=True``: another shape runs eagerly and the graphs stay for the captured one."""
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    session, events = _cpu_session(True)
    bg = _pretend_captured(session, blocks, torch.randn(2, 4))
    blocks[0](torch.randn(3, 4))
    assert all(g.fwd is not None and g.failed is None for g in bg.graphs.values())
    assert bg.report()["cuda_graphs"]["released"] is None and not events


def test_a_moved_weight_releases_the_graphs_under_auto():
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    session, events = _cpu_session("auto")
    bg = _pretend_captured(session, blocks, torch.randn(2, 4))
    blocks[0].weight.data = blocks[0].weight.data.clone()  # new storage: the graph's addresses are stale
    blocks[0](torch.randn(2, 4))
    assert bg.graphs[0].fwd is None and "weights moved" in bg.released
    assert any("weights moved" in m for m in events), events


def test_a_busy_block_called_with_another_shape_releases_after_its_backward():
    """A second forward of another length before the first's backward (chosen and rejected of DPO):
    released at once, but the graph whose replay awaits its backward is kept until that backward ran."""
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    session, _ = _cpu_session("auto")
    bg = _pretend_captured(session, blocks, torch.randn(2, 4))
    g0 = bg.graphs[0]
    node = nn.Identity()  # stands for the replay's autograd node (alive: its backward is pending)
    g0.pending = weakref.ref(node)
    blocks[0](torch.randn(3, 4))  # eager: released, but its graphs stay for the pending backward
    assert bg.released is not None and g0.fwd is not None
    del node  # the backward ran (its graph is gone)
    blocks[0](torch.randn(2, 4))
    assert g0.fwd is None and bg.report()["cuda_graphs"]["eager_calls"] == 2


def _reserve_session(inputs, blocks, streamed=(1,)):
    acts = types.SimpleNamespace(policies=["keep"] * len(blocks), stats=lambda: {"block_input_bytes": inputs})
    ext = types.SimpleNamespace(
        blocks=blocks, weights=types.SimpleNamespace(streamed=list(streamed)), activations=acts
    )
    opts = types.SimpleNamespace(cuda_graphs="auto")
    return types.SimpleNamespace(extensions=[ext], options=opts, device=torch.device("cuda", 0)), ext


def test_graphs_reserve_four_input_sized_buffers_per_resident_block():
    blocks = [nn.Linear(4, 4).requires_grad_(False) for _ in range(4)]  # frozen: no gradient buffers
    session, ext = _reserve_session([100, 200, 300, 400], blocks)
    assert graphs_reserve_by_block(session) == {
        0: 4 * 100,
        2: 4 * 300,
        3: 4 * 400,
    }  # block 1 streams: never graphed
    session.options.cuda_graphs = False
    assert graphs_reserve_by_block(session) == {}
    session.options.cuda_graphs, session.device = "auto", torch.device("cpu")
    assert graphs_reserve_by_block(session) == {}
    session.device, ext.activations = torch.device("cuda", 0), None
    assert graphs_reserve_by_block(session) == {}  # no input measured


def test_graphs_reserve_the_trained_weights_gradients_of_the_blocks_that_will_be_graphed():
    """Full fine-tuning: a graphed block's backward graph writes its weights' gradients into the graphs'
    pool (on the GPU machine full1.5b's capture step added 2.2 GiB where 0.47 GiB had been reserved and
    ran out of memory); a block whose optimizer stays on the host is not graphed, so nothing is reserved."""
    blocks = [nn.Linear(8, 8) for _ in range(4)]  # trained: 8*8+8 fp32 parameters each
    grads = (8 * 8 + 8) * 4
    session, _ = _reserve_session([100, 200, 300, 400], blocks)
    assert graphs_reserve_by_block(session) == {0: 4 * 100 + grads, 2: 4 * 300 + grads, 3: 4 * 400 + grads}
    host = types.SimpleNamespace(param=blocks[3].weight)  # block 3's optimizer stays on the host
    opt = types.SimpleNamespace(host_slots=lambda: [host])
    assert graphs_reserve_by_block(session, opt) == {0: 4 * 100 + grads, 2: 4 * 300 + grads}


def _refined_session(blocks, inputs, room):
    """A session over trained ``blocks`` (none streams) whose measured refinement left ``room`` bytes for
    the graphs' buffers (None: no refinement ran)."""
    from tidal_stream.session import Decision

    session, _ = _reserve_session(inputs, blocks, streamed=())
    session.events = []
    if room is not None:
        session.events.append(Decision("placement", "measured first step", {"graphs_reserve_bytes": room}))
    session.record = lambda kind, message, **d: session.events.append(Decision(kind, message, d))
    session.model = None
    return session


def test_blocks_within_takes_the_first_blocks_that_fit():
    reserve = {4: 10, 1: 30, 2: 30, 7: 5}
    assert blocks_within(reserve, 75) == [1, 2, 4, 7]
    assert blocks_within(reserve, 70) == [
        1,
        2,
        4,
    ]  # stack order: block 7 would fit, but follows one that did not
    assert blocks_within(reserve, 29) == []
    assert blocks_within({}, 100) == []


@pytest.mark.parametrize(
    ("room_blocks", "graphed"),
    [
        (None, [0, 1, 2, 3]),  # no refinement ran: nothing measured bounds them
        (4.5, [0, 1, 2, 3]),
        (2.5, [0, 1]),  # full1.5b at 24 GiB: the optimizer took most of the room
        (0, []),
    ],
)
def test_graphs_go_on_as_many_blocks_as_the_refinement_left_room_for(monkeypatch, room_blocks, graphed):
    """After the refinement, graphs go on the graphable blocks whose buffers fit the room it left them
    (before, full fine-tuning's graphs went on every block or, when they did not all fit, on none)."""
    blocks = [nn.Linear(8, 8) for _ in range(4)]
    per_block = 4 * 100 + (8 * 8 + 8) * 4  # four input-sized buffers and the block's gradients
    room = None if room_blocks is None else int(room_blocks * per_block)
    session = _refined_session(blocks, [100] * 4, room)
    opt = types.SimpleNamespace(host_slots=lambda: [], _after_first_update=None)
    made = []
    monkeypatch.setattr(
        graph_fit, "BlockGraphs", lambda s, chosen, foreign: made.append(sorted(chosen)) or object()
    )
    monkeypatch.setattr(graph_fit, "foreign_device_bytes", lambda *a: 0)
    monkeypatch.setattr(graph_fit, "_over", lambda *a: (False, 0, 0))
    session.extensions[0].activations.policies = ["recompute"] * 4
    graph_fit.with_block_graphs(session, opt, None)()
    assert made == ([graphed] if graphed else [])
    message = session.events[-1].message
    if graphed != [0, 1, 2, 3]:
        left = [i for i in range(4) if i not in graphed]
        assert (
            f"blocks {'-'.join(map(str, (left[0], left[-1])))} stay eager: their buffers would exceed"
            in message
        )
    if not graphed:
        assert message.startswith("no block is graphed")


def _capture_check(monkeypatch, room, captured=True, was_over=False, refined=None, retry=True):
    """``check_capture_step`` over pretended graphs with ``measured_room`` giving ``room`` (headroom 100);
    ``refined``: the data of the measured refinement's placement event (None: no refinement ran)."""
    from tidal_stream.session import Decision

    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    session, events = _cpu_session("auto")
    session.extensions = []
    session.events = [Decision("placement", "measured first step", refined)] if refined else []
    bg = _pretend_captured(session, blocks, torch.randn(2, 4))
    session.extensions.append(bg)
    if not captured:
        bg.graphs[1].fwd = None
    monkeypatch.setattr(graph_fit, "measured_room", lambda dev, foreign, budget: (900, 1000, room, 100))
    opt = types.SimpleNamespace(_after_first_update=None)
    graph_fit.check_capture_step(session, opt, bg, was_over, retry)
    return bg, blocks, events, opt


def test_released_graphs_come_back_once_on_the_blocks_their_measured_cost_fits(monkeypatch):
    """The refinement left 100 bytes of room before the graphs (half the headroom: 50); the step that
    captured both blocks left -300, so they cost 400 where 150 was allowed, 4x their estimate of 50 each.
    With the margin, 0.8 x 150 / 400 of their estimate (30 bytes) fits no block; a cost of 160 (room -60)
    fits one (0.8 x 150 / 160 x 100 = 75 bytes): block 0 is graphed again, checked once more without a retry."""
    monkeypatch.setattr(graph_fit, "graphs_reserve_by_block", lambda s, o: {0: 50, 1: 50})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: None)
    installed = []
    monkeypatch.setattr(
        graph_fit, "install_block_graphs", lambda s, o, room: installed.append(room) or "again"
    )
    refined = dict(room=300, device_bytes=200, activations_kept_bytes=0, graphs_reserve_bytes=100)
    bg, _, events, opt = _capture_check(monkeypatch, room=-300, refined=refined)
    assert bg.released is not None and not installed and "every block runs eagerly" in events[-1], events
    bg, _, events, opt = _capture_check(monkeypatch, room=-60, refined=refined)
    assert installed == [50] and bg.released is not None
    assert "(1.6x their estimated buffers)" in events[-1] and "blocks 0 are graphed again" in events[-1], (
        events
    )
    checks = []
    monkeypatch.setattr(graph_fit, "check_capture_step", lambda *a, **k: checks.append((a[2], k)))
    opt._after_first_update()
    assert checks == [("again", {"retry": False})]
    installed.clear()
    _capture_check(monkeypatch, room=-60, refined=refined, retry=False)  # the second check: no third try
    assert not installed


def test_a_capture_step_with_half_the_headroom_left_keeps_the_graphs(monkeypatch):
    bg, _, events, _ = _capture_check(monkeypatch, room=-50)
    assert bg.released is None and all(g.fwd is not None for g in bg.graphs.values())
    assert len(events) == 1 and "they fit" in events[0], events


def test_a_capture_step_with_less_than_half_the_headroom_left_releases_the_graphs(monkeypatch):
    bg, blocks, events, _ = _capture_check(monkeypatch, room=-51)
    assert bg.released.startswith("released: the step that captured them peaked"), bg.released
    assert bg.graphs == {} and all("forward" not in b.__dict__ for b in blocks)  # original forwards back
    assert any("every block runs eagerly" in m for m in events), events


def test_the_capture_check_waits_for_every_block_to_be_captured(monkeypatch):
    bg, _, events, opt = _capture_check(monkeypatch, room=-1000, captured=False)
    assert bg.released is None and not events and opt._after_first_update is not None  # re-armed


def test_a_peak_over_before_the_graphs_came_says_nothing_of_theirs(monkeypatch):
    bg, _, events, _ = _capture_check(monkeypatch, room=-1000, was_over=True)
    assert bg.released is None and all(g.fwd is not None for g in bg.graphs.values())
    assert len(events) == 1 and "before the graphs came; they stay" in events[0], events
