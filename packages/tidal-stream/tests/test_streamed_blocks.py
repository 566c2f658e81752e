import copy

import pytest
import torch
from torch import nn

from tidal_stream.streamed_blocks import SlotBudgetError, StreamedBlocks, StreamingError
from tidal_testing import assert_bitwise_equal, devices

torch.set_num_threads(1)


class Block(nn.Module):
    """A pre-norm MLP block with dropout, a frozen projection and a buffer used in forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.frozen = nn.Linear(d, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, D]
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + self.drop(h) * self.scale + self.frozen(x)


class Model(nn.Module):
    def __init__(self, d: int = 32, n: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).float().logsumexp(-1).mean()


def make(dtype: torch.dtype, device: str, seed: int = 0):
    torch.manual_seed(seed)
    ref = Model().to(dtype)
    model = copy.deepcopy(ref)
    ref.to(device)
    model.embed.to(device)
    model.head.to(device)
    return ref, model


def run_steps(ref, model, sb, device, steps=5, kept=()):
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_s = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype = next(ref.parameters()).dtype
    for step in range(steps):
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(step)).to(device, dtype)
        torch.manual_seed(100 + step)
        loss_r = ref(x)
        loss_r.backward()
        torch.manual_seed(100 + step)
        loss_s = model(x)
        loss_s.backward()
        assert_bitwise_equal(loss_r.detach().reshape(1), loss_s.detach().reshape(1), f"loss step {step}")
        for (name, pr), ps in zip(ref.named_parameters(), model.parameters()):
            if pr.grad is None:
                assert ps.grad is None, name
                continue
            assert_bitwise_equal(pr.grad, ps.grad, f"grad {name} step {step}")
        assert sb.resident() == tuple(kept)
        opt_r.step()
        opt_r.zero_grad()
        with sb.gathered():
            opt_s.step()
        opt_s.zero_grad()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("hold", [False, True])
def test_training_bit_exact_over_five_steps(device, dtype, k, hold):
    ref, model = make(dtype, device)
    sb = StreamedBlocks(model.layers, device, prefetch_ahead=k, hold_turns=hold)
    run_steps(ref, model, sb, device)
    # the streamed parameters are the very Parameter objects the optimizer holds, now on `device`
    assert all(p.device.type == device for p in model.layers.parameters())
    st = sb.stats()
    # trained blocks are held over the forward-to-backward turn only: their host copies change at step()
    assert st["turn_holds"] == (5 * (k + 1) if hold else 0)
    gathers = 5 * 5  # the optimizer step gathers every block
    assert st["fetches"] == 5 * (2 * 5 - (k + 1 if hold else 0)) + gathers


def test_residency_bound_and_storage_released():
    _, model = make(torch.float32, "cpu")
    events = []
    sb = StreamedBlocks(model.layers, "cpu", prefetch_ahead=1, observer=events.append)
    x = torch.randn(2, 6, 32)
    model(x).backward()
    assert max(len(e.resident) for e in events) == 2
    fetched_fwd = [e.block for e in events if e.kind == "fetch" and e.phase in ("forward", "prefetch")][:5]
    assert fetched_fwd == [0, 1, 2, 3, 4]
    # backward re-fetches in reverse order
    bwd = [e.block for e in events if e.kind == "fetch"][5:]
    assert bwd == [4, 3, 2, 1, 0]
    assert events == list(sb.history)
    assert model.layers[2].up.weight.untyped_storage().nbytes() == 0
    assert model.layers[2].scale.untyped_storage().nbytes() == 0
    st = sb.stats()
    total = sum(sb.block_bytes())
    assert st["h2d_bytes"] == 2 * total
    assert st["resident_peak_blocks"] == 2
    assert st["demand_fetches"] == 2  # block 0 in forward, block 4 in backward; the rest prefetched
    assert st["fetches"] == 10


@pytest.mark.parametrize("k", [0, 2])
def test_residency_never_exceeds_prefetch_plus_one(k):
    _, model = make(torch.float32, "cpu")
    peak = []
    sb = StreamedBlocks(
        model.layers, "cpu", prefetch_ahead=k, observer=lambda e: peak.append(len(e.resident))
    )
    model(torch.randn(1, 3, 32)).backward()
    assert max(peak) == k + 1
    assert sb.stats()["resident_peak_blocks"] == k + 1


def _frozen_pair(seed: int = 0):
    """The model and its copy with frozen blocks (a LoRA base's case): only embed and head train."""
    ref, model = make(torch.float32, "cpu", seed)
    for m in (ref, model):
        m.layers.requires_grad_(False)
    return ref, model


def _held(model, k: int, **options):
    """``StreamedBlocks`` over ``model.layers`` with turn holds (CPU), and the list of resident-block counts
    its observer sees after every residency event."""
    sizes: list[int] = []
    sb = StreamedBlocks(
        model.layers,
        "cpu",
        prefetch_ahead=k,
        hold_turns=True,
        observer=lambda e: sizes.append(len(e.resident)),
        **options,
    )
    return sb, sizes


@pytest.mark.parametrize("k", [0, 1, 2])
def test_turn_holds_keep_one_window_over_each_turn_of_frozen_blocks(k):
    """hold_turns on frozen blocks: losses and gradients bit-identical to the resident model over 5 steps;
    the forward's last window stays for the backward and the backward's last window for the next forward,
    so each step after the first refills 2 x (5 - (k + 1)) blocks, never more than k + 1 at once."""
    ref, model = _frozen_pair()
    sb, sizes = _held(model, k)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt_s = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    w = k + 1
    for step in range(5):
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(step))
        for m, opt in ((ref, opt_r), (model, opt_s)):
            torch.manual_seed(100 + step)
            m(x).backward()
            opt.step()
            opt.zero_grad()
        assert sb.resident() == tuple(range(w))  # the next forward's first blocks
        for m in ("embed", "head"):  # the trained ones (streamed weights have no storage between uses)
            for (name, pr), ps in zip(getattr(ref, m).named_parameters(), getattr(model, m).parameters()):
                assert_bitwise_equal(pr.detach(), ps.detach(), f"{m}.{name} after step {step}")
    st = sb.stats()
    assert st["fetches"] == 5 + 9 * (5 - w)  # the first forward fills every block
    assert st["turn_holds"] == 5 * 2 * w and max(sizes) == w == st["resident_peak_blocks"]
    with torch.no_grad():  # an evaluation forward starts with the held blocks, ends prefetching k of them
        x = torch.randn(2, 6, 32)
        torch.manual_seed(7)  # the blocks' dropout draws the same masks
        loss = model(x)
        torch.manual_seed(7)
        assert_bitwise_equal(loss, ref(x), "eval loss")
    assert sb.resident() == tuple(range(k)) and sb.stats()["fetches"] == st["fetches"] + 5 - w + k


@pytest.mark.parametrize("k", [1, 2])
def test_forwards_without_autograd_prefetch_the_next_ones_head(k):
    """A loop of no-grad forwards over frozen blocks (evaluation, decode steps): each forward's last
    blocks prefetch the next one's first k, so only the very first block is fetched on demand; outputs
    bit-identical, never more than k + 1 blocks resident."""
    ref, model = _frozen_pair()
    sb, sizes = _held(model, k)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(step))
            torch.manual_seed(step)
            got = model(x)
            torch.manual_seed(step)
            assert_bitwise_equal(got, ref(x), f"forward {step}")
            assert sb.resident() == tuple(range(k))
    st = sb.stats()
    assert st["demand_fetches"] == 1 and st["fetches"] == 3 * 5 + k
    assert max(sizes) == k + 1 == st["resident_peak_blocks"]
    model(torch.randn(2, 6, 32)).backward()  # a training step after them starts with the same head
    assert sb.stats()["demand_fetches"] == 1


def test_only_empty_blocks_wear_the_read_guard():
    """A block's tensors are plain while filled (its kernels pay no __torch_function__ call) and guarded
    while empty: a read between uses raises a clear error, a read of a held block just works."""
    _, model = _frozen_pair()
    sb, _ = _held(model, 1)
    with torch.no_grad():
        model(torch.randn(2, 6, 32))
    assert sb.resident() == (0,)  # prefetched for the next forward
    held, empty = model.layers[0].up.weight, model.layers[2].up.weight
    assert type(held) is nn.Parameter and type(model.layers[0].scale) is torch.Tensor
    assert held.clone().shape == held.shape
    assert type(empty) is not nn.Parameter and isinstance(empty, nn.Parameter)
    with pytest.raises(StreamingError, match="block 2"):
        empty.clone()
    with sb.gathered(writeback=False):
        assert all(type(p) is nn.Parameter for p in model.layers.parameters())
    assert sb.resident() == () and type(empty) is type(held) is not nn.Parameter  # gathered released all
    sb.remove()
    assert all(type(p) is nn.Parameter for p in model.layers.parameters())
    assert empty.clone().shape == empty.shape


def test_trained_blocks_are_not_prefetched_across_forwards():
    """Blocks that require grad may be rewritten by an optimizer between forwards: never held over."""
    _, model = make(torch.float32, "cpu")
    sb, _ = _held(model, 1)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(2, 6, 32))
    assert sb.resident() == () and sb.stats()["demand_fetches"] == 2


def test_a_forward_without_its_backward_gives_up_its_holds_at_the_next_forward():
    ref, model = _frozen_pair()
    sb, sizes = _held(model, 1)
    x = torch.randn(2, 6, 32)
    model(x)  # builds a graph that is never backpropagated: its last window stays
    assert sb.resident() == (3, 4)
    torch.manual_seed(0)
    loss = model(x)
    assert sb.resident() == (3, 4)  # this forward's own holds
    loss.backward()
    torch.manual_seed(0)
    ref(x).backward()
    assert_bitwise_equal(model.embed.weight.grad, ref.embed.weight.grad, "embed grad")
    assert max(sizes) == 2 and sb.resident() == (0, 1)


def test_in_flight_cap_counts_the_blocks_ahead_of_the_running_one():
    """max_inflight_bytes of one block with prefetch 2: one block fetched ahead, two resident at most."""
    _, model = _frozen_pair()
    block = sum(
        t.numel() * t.element_size() for t in (*model.layers[0].parameters(), *model.layers[0].buffers())
    )
    sb, sizes = _held(model, 2, max_inflight_bytes=block)
    assert max(sb.block_bytes()) == block
    model(torch.randn(2, 6, 32)).backward()
    assert max(sizes) == 2 and sb.resident() == (0, 1)
    assert sb.stats()["fetches"] == 5 + 3  # the last two blocks stayed for the backward


def test_inference_matches_and_remove_restores():
    ref, model = make(torch.float32, "cpu")
    sb = StreamedBlocks(model.layers, "cpu")
    x = torch.randn(3, 4, 32)
    with torch.no_grad():
        ref.eval(), model.eval()
        assert_bitwise_equal(ref(x).reshape(1), model(x).reshape(1), "eval output")
    assert sb.resident() == ()
    sb.remove()
    assert model.layers[0].up.weight.untyped_storage().nbytes() > 0
    with torch.no_grad():
        assert_bitwise_equal(ref(x).reshape(1), model(x).reshape(1), "after remove")


def test_host_tensor_updates_next_fetch():
    _, model = make(torch.float32, "cpu")
    sb = StreamedBlocks(model.layers, "cpu")
    w = model.layers[1].up.weight
    host = sb.host_tensor(w)
    assert host.shape == w.shape and host.abs().sum() > 0
    host.mul_(2.0)
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(m.up.weight.detach().clone()))
    with torch.no_grad():
        model(torch.randn(1, 2, 32))
    assert_bitwise_equal(seen[0], host, "refilled weight")
    with pytest.raises(StreamingError, match="not a parameter or buffer"):
        sb.host_tensor(model.head.weight)


def test_slot_budget_error_names_option_and_need():
    _, model = make(torch.float32, "cpu")
    need = sum(p.numel() * 4 for p in model.layers[0].parameters()) + 32 * 4
    with pytest.raises(SlotBudgetError, match=rf"slot_bytes=1000.*at least {need}"):
        StreamedBlocks(model.layers, "cpu", slot_bytes=1000)
    StreamedBlocks(model.layers, "cpu", slot_bytes=need)  # exactly enough is fine


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_prefetch_ahead(bad):
    _, model = make(torch.float32, "cpu")
    with pytest.raises(StreamingError, match="prefetch_ahead"):
        StreamedBlocks(model.layers, "cpu", prefetch_ahead=bad)


def test_shared_parameter_across_blocks_rejected():
    _, model = make(torch.float32, "cpu")
    model.layers[1].up = model.layers[0].up
    with pytest.raises(StreamingError, match="shared by blocks 0 and 1"):
        StreamedBlocks(model.layers, "cpu")


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("hold", [False, True])
def test_cuda_vram_peak_bound(k, train, hold):
    """peak(streamed) <= 1.1 x ((k + 1) blocks + the activations measured with every block resident)."""
    device = "cuda"
    torch.manual_seed(0)
    d, n = 1024, 8
    model = Model(d, n).to(torch.bfloat16)
    model.layers.requires_grad_(False)  # frozen base: no weight gradients, backward still re-fetches
    ref = copy.deepcopy(model).to(device)
    model.embed.to(device)
    model.head.to(device)
    x = torch.randn(4, 256, d, device=device, dtype=torch.bfloat16, requires_grad=train)

    def step(m):
        def run():
            if train:
                m(x).backward()
            else:
                with torch.no_grad():
                    m(x)

        return run

    weights = sum(t.numel() * t.element_size() for t in (*ref.layers.parameters(), *ref.layers.buffers()))
    activations = _peak(step(ref))  # the resident run: its peak above the base is activations only
    sb = StreamedBlocks(model.layers, device, prefetch_ahead=k, hold_turns=hold)
    block = max(sb.block_bytes())
    peak = _peak(step(model))
    bound = 1.10 * ((k + 1) * block + activations)
    print(
        f"k={k} train={train}: streamed peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB "
        f"(block {block / 2**20:.1f} MiB, activations {activations / 2**20:.1f} MiB, all weights "
        f"{weights / 2**20:.1f} MiB), stats {sb.stats()}"
    )
    assert peak <= bound
    assert sb.stats()["resident_peak_blocks"] == k + 1


def test_host_copies_in_an_arena():
    from tidal_arena import ArenaConfig, PinnedArena

    ref, model = make(torch.float32, "cpu")
    arena = PinnedArena(ArenaConfig(backend="pageable", slab_bytes=1 << 20))
    sb = StreamedBlocks(model.layers, "cpu", arena=arena)
    used = arena.stats().used_bytes
    assert used >= sum(sb.block_bytes())
    run_steps(ref, model, sb, "cpu", steps=2)
    sb.remove()
    assert arena.stats().used_bytes == 0
    arena.close()


def test_reading_a_streamed_weight_between_uses_raises_a_clear_error():
    """Between uses a streamed tensor's storage is empty: a read names it and the fix instead of crashing
    (it read freed memory); forward/backward still work, and remove() gives plain tensors back."""
    ref, model = make(torch.float32, "cpu")
    sb = StreamedBlocks(model.layers, "cpu", prefetch_ahead=1)
    w, scale = model.layers[2].up.weight, model.layers[2].scale
    assert isinstance(w, nn.Parameter) and w.shape == (64, 32) and w.grad is None  # metadata reads work
    for read in (lambda: w.clone(), lambda: w.sum(), lambda: repr(w), lambda: w * 2, lambda: scale + 1,
                 lambda: copy.deepcopy(w), lambda: torch.save(w, __import__("io").BytesIO())):  # fmt: skip
        with pytest.raises(StreamingError, match=r"block 2 Linear\.weight|block 2 Block\.scale") as e:
            read()
        assert "model.state_dict()" in str(e.value) and "unwrap(model)" in str(e.value)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))  # [B, T, D]
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss = model(x)
    loss.backward()
    torch.manual_seed(1)
    assert_bitwise_equal(loss, ref(x))
    assert w.grad is not None and w.grad.abs().sum() > 0  # gradients of streamed weights are plain tensors
    sb.remove()
    assert type(w) is nn.Parameter and type(model.layers[2].scale) is torch.Tensor
    assert_bitwise_equal(w.clone(), ref.layers[2].up.weight)
    assert_bitwise_equal(copy.deepcopy(model).layers[2].scale, ref.layers[2].scale)


def test_adopt_host_reads_frozen_tensors_in_place():
    """``adopt_host``: frozen tensors it accepts are their own host copies (no private copy); the others
    (trainable ones, buffers it refuses) are copied; training stays bit-exact; remove() refills them all."""
    ref, model = make(torch.float32, "cpu")
    frozen = [layer.frozen.weight for layer in model.layers]
    before = {id(p): (p.data, p.data_ptr()) for p in frozen}
    asked = []

    def adopt(t: torch.Tensor) -> bool:
        asked.append(t.requires_grad)
        return any(t.data_ptr() == ptr for _, ptr in before.values())

    sb = StreamedBlocks(model.layers, "cpu", prefetch_ahead=1, adopt_host=adopt)
    assert asked and not any(asked)  # asked about frozen tensors only
    for p in frozen:
        host = sb.host_tensor(p)
        assert host.data_ptr() == before[id(p)][1]  # the very memory the weight was in
        assert p.untyped_storage().nbytes() == 0  # the parameter streams as usual
    others = [s for b in model.layers for s in (b.up.weight, b.scale)]
    assert all(sb.host_tensor(t).data_ptr() != t.data_ptr() for t in others)
    assert sb.stats()["adopted_host_bytes"] == sum(p.numel() * p.element_size() for p in frozen)
    run_steps(ref, model, sb, "cpu")
    for p in frozen:  # read, never written
        assert_bitwise_equal(before[id(p)][0], sb.host_tensor(p))
    sb.remove()
    for p, (host, ptr) in zip(frozen, before.values()):
        assert p.data_ptr() != ptr  # a device (here: private) copy again, the adopted memory unreferenced
        assert_bitwise_equal(p.detach(), host)


def test_gathered_blocks_have_plain_classes_so_torch_optimizers_take_their_foreach_path():
    """torch's optimizers use foreach only for exactly Tensor/Parameter: inside gathered() the guard steps
    aside (the storage is filled), and on exit it is back with its name."""
    _, model = make(torch.float32, "cpu")
    sb = StreamedBlocks(model.layers, "cpu", prefetch_ahead=1)
    w, scale = model.layers[2].up.weight, model.layers[2].scale
    assert type(w) is not nn.Parameter
    with sb.gathered():
        assert all(type(p) is nn.Parameter for p in model.layers.parameters())
        assert type(scale) is torch.Tensor and w.detach().sum().isfinite()  # readable
    with pytest.raises(StreamingError, match=r"block 2 Linear\.weight"):
        w.sum()


def test_prefetch_looks_past_blocks_kept_resident():
    """Blocks 1 and 2 kept resident, 0, 3 and 4 streamed, one block fetched ahead: block 3 is fetched while
    block 0 is still resident (its forward running), not when block 2 starts; in backward block 0 is
    fetched while block 3 is (its backward running). Training stays bit-exact."""
    ref, model = make(torch.float32, "cpu")
    events = []
    sb = StreamedBlocks(
        model.layers, "cpu", prefetch_ahead=1, keep_resident=[1, 2], observer=lambda e: events.append(e)
    )
    run_steps(ref, model, sb, "cpu", steps=2, kept=(1, 2))  # losses and gradients bit-identical
    fetched = [(e.block, e.phase, e.resident) for e in events if e.kind == "fetch" and e.phase != "gather"]
    assert [(b, p) for b, p, _ in fetched] == 2 * [
        (0, "forward"),  # a forward starts with a refill on demand
        (3, "prefetch"),
        (4, "prefetch"),
        (4, "backward"),  # released after its forward (no turn holds): refilled on demand
        (3, "prefetch"),
        (0, "prefetch"),
    ]
    assert next(res for b, _, res in fetched if b == 3) == (0, 1, 2, 3)  # forward: block 0 still there
    assert next(res for b, p, res in fetched if b == 0 and p == "prefetch") == (0, 1, 2, 3)  # backward
    assert sb.stats()["demand_fetches"] == 2 * 2


def test_host_copies_are_page_locked_block_by_block(monkeypatch):
    """Without an arena on CUDA, each block's exact bytes are page-locked just before its tensors are copied
    in, so a model built in host memory frees its pageable originals block by block instead of holding
    them beside one up-front reservation of every streamed block (the CPU stands in: a pageable arena
    serves the requests)."""
    import tidal_arena
    from tidal_stream._block_adoption import BlockAdoption
    from tidal_stream._host_buffers import HostBuffers

    events: list[tuple[str, object]] = []

    class RecordingArena(tidal_arena.PinnedArena):
        def __init__(self, config):
            super().__init__(tidal_arena.ArenaConfig(backend="pageable"))

        def reserve(self, nbytes):
            events.append(("reserve", nbytes))
            super().reserve(nbytes)

    monkeypatch.setattr(tidal_arena, "PinnedArena", RecordingArena)
    _, model = make(torch.float32, "cpu")
    host = HostBuffers(torch.device("cpu"))
    host.pin = True  # as on CUDA without an arena
    alloc_like = host.alloc_like

    def recorded(t, tag):
        events.append(("copy", tag.split(".")[1]))
        return alloc_like(t, tag)

    host.alloc_like = recorded
    blocks = BlockAdoption(torch.device("cpu"), host, None, True, None).adopt(list(model.layers))
    expected: list[tuple[str, object]] = []
    for i, layer in enumerate(model.layers):
        tensors = [*layer.parameters(), *layer.buffers()]
        expected.append(("reserve", sum(-(-s.nbytes // 512) * 512 for s in blocks[i].slots)))  # arena-aligned
        expected += [("copy", f"block{i}")] * len(tensors)
    assert events == expected
    assert host._own_arena and host.arena.stats().slabs == len(model.layers)
    assert host.arena.stats().fallbacks == 0  # every copy fitted the slab reserved for its block
    host.free_all()
