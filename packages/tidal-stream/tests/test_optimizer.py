"""OffloadAdamW through wrap(): parity with torch.optim.AdamW on CPU (and the GPU machine)."""

from __future__ import annotations

import importlib.util
import pathlib
import threading

import pytest
import torch

from tidal_stream import memory_report, unwrap, wrap
from tidal_testing import devices, max_abs_diff

_spec = importlib.util.spec_from_file_location(
    "tidal_stream_tinygpt", pathlib.Path(__file__).with_name("tinygpt.py")
)
tinygpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tinygpt)
loss_fn, make_model = tinygpt.loss_fn, tinygpt.make_model

# every test here runs on one host thread (the fixture lives in conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": 2e-3},
        {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3},
    ]


def run_reference(device, steps=20, clip=None, accum=1, groups=False, sched=False, autocast=False):
    model = make_model(device=device)
    opt = torch.optim.AdamW(two_groups(model) if groups else model.parameters(), lr=1e-3)
    lr_s = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if sched else None
    for step in range(steps):
        for micro in range(accum):
            loss_fn(model, step * accum + micro, device, autocast).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if lr_s:
            lr_s.step()
    return model


def run_wrapped(device, steps=20, clip=None, accum=1, groups=False, sched=False, autocast=False, **kw):
    model = make_model(device=device)
    opt = torch.optim.AdamW(two_groups(model) if groups else model.parameters(), lr=1e-3)
    model, opt = wrap(
        model, opt, offload=True, max_grad_norm=clip, accumulation_steps=accum, attention=None, **kw
    )
    lr_s = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if sched else None
    for step in range(steps):
        for micro in range(accum):
            loss_fn(model, step * accum + micro, device, autocast).backward()
            opt.step()
            opt.zero_grad()
        if lr_s:
            lr_s.step()
    opt.synchronize()
    return model, opt


def run_placed_reference(device, steps, device_from, clip=None):
    """torch's AdamW run where our optimizer runs each parameter's update, with the kernel it runs there.

    ``device_from[i]``: after how many updates trainable parameter ``i``'s state moves to the device (0:
    there from the start; absent: on the host throughout). Host updates: ``torch.optim.AdamW(fused=True)``
    on a CPU fp32 master copied back to the weight (our host path runs that CPU kernel); device updates:
    ``torch.optim.AdamW(fused=True)`` on the device, continuing the moved state (our device path runs the
    fused device kernel). Why not torch's default: on CUDA it is the foreach path, whose rounding differs
    from the fused kernel's in the last bits, and 16 steps of that exceed the 1e-6 bound.
    """
    model = make_model(device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    opts, masters = {}, {}

    def place(i, on_device):
        p = params[i]
        if on_device:
            opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
            if i in masters:  # the host state continues on the device
                opt.state[p] = {k: v.to(p.device) for k, v in opts[i].state[masters.pop(i)].items()}
        else:
            masters[i] = p.detach().cpu().clone()
            opt = torch.optim.AdamW([masters[i]], lr=1e-3, fused=True)
        opts[i] = opt

    for i in range(len(params)):
        place(i, device_from.get(i) == 0)
    for step in range(steps):
        loss_fn(model, step, device).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for i, p in enumerate(params):
            if i in masters:
                masters[i].grad = p.grad.cpu()
                opts[i].step()
                with torch.no_grad():
                    p.copy_(masters[i])
            else:
                opts[i].step()
        model.zero_grad()
        for i, n in device_from.items():
            if n == step + 1:
                place(i, True)
    return model


def max_param_diff(a, b):
    return max(max_abs_diff(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "case",
    [
        {},
        {"clip": 0.5},
        {"accum": 2},
        {"groups": True, "sched": True},
        {"clip": 0.5, "accum": 2, "groups": True, "sched": True},
    ],
    ids=["plain", "clip", "accum", "groups-sched", "all"],
)
def test_parity_fp32(device, case):
    ref = run_reference(device, **case)
    got, opt = run_wrapped(device, **case)
    d = max_param_diff(ref, got)
    assert d < 1e-6, f"max |Δp| = {d}"
    # the masters are fp32 copies in host buffers, distinct from the weights, and equal to them
    for p in got.parameters():
        if p.requires_grad:
            master = opt.state[p]["master"]
            assert master.data_ptr() != p.data_ptr()
            assert max_abs_diff(master, p) == 0.0
    rep = memory_report(got)
    assert rep["d2h_bytes"] > 0 and rep["h2d_bytes"] > 0
    assert rep["tiers"]["device"]["params"] == 0
    unwrap(got)


@pytest.mark.parametrize("offload", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("device", devices())
def test_bf16_autocast_masters(device, offload):
    """bf16 weights + autocast vs torch AdamW on fp32 master weights whose bf16 copy runs the model.

    The reference keeps its masters where ours are (host memory with offload, else the device) and runs
    ``torch.optim.AdamW(fused=True)`` there: the fused kernel our optimizer runs on that side. torch's
    default on CUDA (the foreach path) rounds differently in the last bits, and with bf16 weights a
    last-bit master difference flips a bf16 rounding, changes the next gradients and grows step by step.
    Both runs compute bf16 gradients from bf16 weights and upcast them to fp32 for the update.
    """
    steps = 20
    master_dev = "cpu" if offload else device
    # fp32 masters, bf16 start (built on the CPU, as make_model does, then moved)
    master_model = make_model(dtype=torch.bfloat16).float().to(master_dev)
    run_model = make_model(device=device, dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(master_model.parameters(), lr=1e-3, fused=True)
    wrapped = make_model(device=device, dtype=torch.bfloat16)
    wrapped, opt = wrap(wrapped, None, lr=1e-3, offload=offload, attention=None)
    for step in range(steps):
        with torch.no_grad():
            for p, q in zip(run_model.parameters(), master_model.parameters()):
                p.copy_(q)
        loss_fn(run_model, step, device, autocast=True).backward()
        for p, q in zip(run_model.parameters(), master_model.parameters()):
            if q.requires_grad:
                q.grad = p.grad.float().to(master_dev)
        ref_opt.step()
        ref_opt.zero_grad()
        run_model.zero_grad()
        loss_fn(wrapped, step, device, autocast=True).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    d = max(
        max_abs_diff(opt.state[p]["master"], q)
        for p, q in zip(wrapped.parameters(), master_model.parameters())
        if q.requires_grad
    )
    assert d < 1e-6, f"max |Δmaster| = {d}"
    # the bf16 weights are the masters rounded
    for p in wrapped.parameters():
        if p.requires_grad:
            assert torch.equal(p, opt.state[p]["master"].to(p.device, torch.bfloat16))


@pytest.mark.parametrize("device", devices())
def test_delayed_update_is_one_step_stale(device):
    """delayed_update: the forward of step t sees weights updated through step t-2 (replayed with torch AdamW)."""
    steps = 6
    model, _ = run_wrapped(device, steps=steps, delayed_update=True)
    # replay: a torch AdamW whose gradient at step t is taken at the weights of the delayed schedule
    ref = make_model(device=device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    stale = make_model(device=device)  # the weights the forward of step t sees
    for step in range(steps):
        loss_fn(stale, step, device).backward()
        for p, q in zip(ref.parameters(), stale.parameters()):
            if p.requires_grad:
                p.grad = q.grad.clone()
        stale.zero_grad()
        with torch.no_grad():  # forward of step t+1 sees the weights before update t
            for p, q in zip(stale.parameters(), ref.parameters()):
                p.copy_(q)
        ref_opt.step()
        ref_opt.zero_grad()
    d = max_param_diff(ref, model)
    assert d < 1e-6, f"max |Δp| = {d}"


@pytest.mark.parametrize("device", devices())
def test_bf16_moments_stochastic_rounding(device):
    """bf16 moments track the fp32 run closely (not bit-exactly) and stay bf16 in the state."""
    ref = run_reference(device, steps=10)
    got, opt = run_wrapped(device, steps=10, moment_dtype="bf16")
    st = next(iter(opt.state.values()))
    assert st["exp_avg"].dtype == torch.bfloat16
    d = max_param_diff(ref, got)
    assert 0 < d < 1e-3, f"max |Δp| = {d}"


@pytest.mark.parametrize("device", devices())
def test_split_placement_matches(device):
    """Part of the state on the device (fused device AdamW), the rest on the host: same result."""
    ref = run_placed_reference(device, 20, {i: 4 for i in range(5)}, clip=1.0)  # moved after 4 updates
    model = make_model(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = wrap(model, opt, offload=True, max_grad_norm=1.0, attention=None)
    first = [p for p in model.parameters() if p.requires_grad][:5]
    for step in range(20):
        loss_fn(model, step, device).backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            assert opt.move_to_device(first) == 5
    opt.synchronize()
    assert opt.memory_tiers()["device"]["params"] == sum(p.numel() for p in first)
    assert max_param_diff(ref, model) < 1e-6


def test_auto_on_cpu_is_fused_and_logged():
    model, opt = wrap(make_model(), None, lr=1e-3)
    ref = run_reference("cpu", steps=3)
    for step in range(3):
        loss_fn(model, step).backward()
        opt.step()
        opt.zero_grad()
    assert max_param_diff(ref, model) < 1e-6
    events = memory_report(model)["events"]
    assert any(e["kind"] == "placement" and "fused" in e["message"] for e in events)


@pytest.mark.parametrize("device", devices())
def test_parity_with_streamed_weights(device):
    """Every block streamed (part 2): updates land in the host copies the refills read; same training."""
    from tidal_stream import session_of

    ref = run_reference(device, steps=5, clip=1.0)
    model = make_model(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = wrap(
        model, opt, offload=True, max_grad_norm=1.0, param_offload=True, blocks=model.blocks, attention=None
    )
    for step in range(5):
        loss_fn(model, step, device).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    ext = session_of(model).extensions[0]
    n_streamed = 0
    for p, q in zip(model.parameters(), ref.parameters()):
        host = ext.host_tensor(p)
        n_streamed += host is not None
        got = host.reshape(q.shape) if host is not None else p
        assert max_abs_diff(got, q) < 1e-6
    assert n_streamed == sum(1 for _ in model.blocks.parameters())
    unwrap(model)


@pytest.mark.gpu
def test_gpu_split_then_measured_move_matches():
    """A planned split on CUDA; the first step's measured peak moves the rest to the device; same result."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan
    from tidal_stream import memory_report

    model = make_model(device="cuda")
    c = census(model)
    budget = "500KiB"  # synthetic: forces a split; the real device has room for everything
    p = plan(
        c,
        HardwareProfile.synthetic(vram_budget_bytes=budget, device_free_bytes=budget),
        PlanConfig(batch_tokens=64, headroom_bytes=0, param_offload=False),
    )
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=p, attention=None)
    assert opt.host_slots()
    trainable = [q for q in model.parameters() if q.requires_grad]
    on_host = {id(s.param) for s in opt.host_slots()}
    # the plan's device share from the start; the host share moves after the first update (asserted below)
    ref = run_placed_reference("cuda", 10, {i: int(id(q) in on_host) for i, q in enumerate(trainable)})
    for step in range(10):
        loss_fn(model, step, "cuda").backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert not opt.host_slots()  # measured: everything fits, plain fused AdamW on the device
    msgs = [e["message"] for e in memory_report(model)["events"] if e["kind"] == "placement"]
    assert any("measured first step" in m for m in msgs), msgs
    assert max_param_diff(ref, model) < 1e-6


def test_offload_adamw_without_wrap():
    """OffloadAdamW used directly: its own session, guards installed by hand, parity with torch AdamW."""
    from tidal_stream import OffloadAdamW

    ref = run_reference("cpu", steps=5)
    model = make_model()
    opt = OffloadAdamW(model.parameters(), lr=1e-3)
    opt.install_read_guards(model)
    for step in range(5):
        loss_fn(model, step).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert max_param_diff(ref, model) < 1e-6
    assert opt.session.optimizer is opt and opt.session.d2h_bytes > 0
    opt.close()


def test_weight_read_outside_its_module_is_guarded():
    """A loss reading ``head.weight`` directly (as chunked losses do): detected, then waited for."""

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"emb": torch.nn.Embedding(64, 32), "head": torch.nn.Linear(32, 64)})

    def loss_of(m, step):
        idx, tgt = tinygpt.batch(step)
        h = m["emb"](idx)  # [B, T, D]
        logits = h @ m["head"].weight.T + m["head"].bias  # head's forward never runs
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tgt.reshape(-1))

    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = wrap(model, None, lr=1e-2, offload=True, attention=None)
    for step in range(6):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert {id(s.param) for s in opt._unguarded.values()} == {id(p) for p in model["head"].parameters()}
    assert max_param_diff(ref, model) < 1e-6


def test_accumulation_steps_can_grow_between_steps():
    """As the HF Trainer does: wrapped without accumulation, then 2 micro-steps per update."""
    ref = run_reference("cpu", steps=4, accum=2)
    model = make_model()
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), offload=True)
    opt.accumulation_steps = 2
    for step in range(4):
        for micro in range(2):
            loss_fn(model, step * 2 + micro).backward()
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    assert max_param_diff(ref, model) < 1e-6
    with pytest.raises(ValueError, match="accumulation_steps"):
        opt.accumulation_steps = 0


def _opt_state(opt) -> dict:
    sd = opt.state_dict()
    return {(i, k): v.clone() for i, st in sd["state"].items() for k, v in st.items() if torch.is_tensor(v)}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _Injected(ValueError):
    """The failure injected into a host update."""


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_failed_host_update_rolls_back_and_raises_original(clip, moment_dtype, monkeypatch):
    """A host update failing part-way through a step: its own exception type surfaces (no hang), weights and
    state equal those before the step, and retrying gives the run that never failed, bit for bit."""
    import tidal_stream.optimizer as optmod
    from tidal_stream import OffloadAdamW

    def build():
        model = make_model()
        opt = OffloadAdamW(
            model.parameters(), lr=1e-2, max_grad_norm=clip, moment_dtype=moment_dtype, rollback=True
        )
        opt.install_read_guards(model)
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            loss_fn(model, step).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    clean, clean_opt = build()
    train(clean, clean_opt, range(4))
    model, opt = build()
    train(model, opt, range(2))
    before_w = {n: p.detach().clone() for n, p in model.named_parameters()}
    before_s = _opt_state(opt)
    real, calls = optmod.adam_update, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise _Injected("injected host update failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(optmod, "adam_update", failing)
    with pytest.raises(_Injected):
        loss_fn(model, 2).backward()
        opt.step()
        opt.synchronize()
    monkeypatch.setattr(optmod, "adam_update", real)
    assert calls[0] == 3  # two updates had run before the failure: they are the ones undone
    opt.zero_grad()
    opt.synchronize()
    assert all(torch.equal(before_w[n], p) for n, p in model.named_parameters())
    _assert_same(before_s, _opt_state(opt))
    train(model, opt, range(2, 4))  # the next forward does not wait forever; retry, then go on
    _assert_same(_opt_state(clean_opt), _opt_state(opt))
    opt.close()
    clean_opt.close()


def test_rollback_off_keeps_partial_updates_and_no_undo_memory(monkeypatch):
    """``rollback=False``: no undo buffers are reserved; a failure still raises and never hangs."""
    import tidal_stream.optimizer as optmod
    from tidal_stream import OffloadAdamW

    model = make_model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, rollback=False)
    opt.install_read_guards(model)
    assert not any(t.startswith("undo") for t in opt.session.host.stats()["bytes_by_tag"])
    real, calls = optmod.adam_update, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise _Injected("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(optmod, "adam_update", failing)
    with pytest.raises(_Injected):
        loss_fn(model, 0).backward()
        opt.step()
        opt.synchronize()
    monkeypatch.setattr(optmod, "adam_update", real)
    opt.zero_grad()
    loss_fn(model, 1).backward()  # no hang: every waiter was released
    opt.step()
    opt.synchronize()
    opt.close()


@pytest.mark.parametrize("accum", [1, 2])
def test_clipped_runs_are_bit_identical_whatever_the_arrival_order(accum):
    """With ``max_grad_norm``, the global norm is summed in parameter order: two runs give bit-identical
    state dicts even when the gradients land in a different order, and the norm is the one
    ``torch.nn.utils.clip_grad_norm_`` computes over the same gradients."""
    from tidal_stream import OffloadAdamW

    def run(reverse):
        model = make_model()
        opt = OffloadAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5, accumulation_steps=accum)
        opt.install_read_guards(model)
        norms = []
        for step in range(4):
            for micro in range(accum):
                loss_fn(model, step * accum + micro).backward()
                if reverse and micro == accum - 1:
                    opt._landed.reverse()  # as if the gradients had arrived in another order
                opt.step()
                opt.zero_grad()
            norms.append(opt.last_grad_norm)
        opt.synchronize()
        state = _opt_state(opt)
        opt.close()
        return state, norms

    a, norms_a = run(False)
    b, norms_b = run(True)
    _assert_same(a, b)
    assert norms_a == norms_b

    # the first step's norm equals clip_grad_norm_'s (parameter order) bit for bit
    ref = make_model()
    for micro in range(accum):
        loss_fn(ref, micro).backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert norms_a[0] == float(total)


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_undo_copy_is_bit_identical_and_restores_a_partial_update(moment_dtype, monkeypatch):
    """``adam_update(undo=...)``: cache-blocked copy + update gives the same bits as without, and a failure
    in a later chunk restores exactly the chunks already updated (the rest was never touched)."""
    import tidal_stream.adam_kernels as ak

    monkeypatch.setattr(ak, "_BLOCK", 1024)
    monkeypatch.setattr(ak, "_CHUNK", 1024)
    hyper = ak.AdamHyper(
        lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False
    )
    g = torch.Generator().manual_seed(0)
    n = 3500  # four blocks, the last one short

    def state():
        p = torch.randn(n, generator=g)
        m = (torch.randn(n, generator=g) * 1e-2).to(moment_dtype)
        v = (torch.rand(n, generator=g) * 1e-3).to(moment_dtype)
        return p, torch.randn(n, generator=g), m, v, torch.tensor(4.0)

    def undo_for(m):
        return ak.UndoCopy(torch.empty(n), torch.empty(n, dtype=m.dtype), torch.empty(n, dtype=m.dtype))

    p, gr, m, v, st = state()
    live = [t.clone() for t in (p, gr, m, v, st)]
    undo = undo_for(m)
    ak.adam_update(*live, hyper, torch.Generator().manual_seed(1), undo=undo)
    ak.adam_update(p, gr, m, v, st, hyper, torch.Generator().manual_seed(1))
    for a, b in zip((p, m, v, st), (live[0], live[2], live[3], live[4])):
        assert torch.equal(a, b)
    assert undo.copied == n

    p, gr, m, v, st = state()
    before = [t.clone() for t in (p, m, v)]
    real, calls = ak._fused, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected kernel failure")
        real(*args, **kwargs)

    monkeypatch.setattr(ak, "_fused", failing)
    undo = undo_for(m)
    undo.master.fill_(float("nan"))  # stale contents past the copied range must never be restored
    with pytest.raises(RuntimeError, match="injected"):
        ak.adam_update(p, gr, m, v, st, hyper, None, undo=undo)
    assert undo.copied == 3072 and not torch.equal(p, before[0])
    undo.restore((p, m, v))
    for a, b in zip((p, m, v), before):
        assert torch.equal(a, b)


_BLOCK_CASES = [
    # (moment dtype, landing dtype or None, accumulate, clip scale, narrow dtype or None, undo)
    (torch.float32, torch.bfloat16, False, False, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, True, False, torch.bfloat16, True),
    (torch.float32, None, False, True, torch.bfloat16, True),
    (torch.float32, torch.float32, True, True, None, False),
    (torch.float32, None, False, False, None, True),
    (torch.bfloat16, torch.bfloat16, False, False, torch.bfloat16, True),
    (torch.bfloat16, torch.float16, True, True, torch.float16, False),
    (torch.bfloat16, None, False, True, None, False),
]


@pytest.mark.parametrize(
    "case", _BLOCK_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c)
)
def test_blocked_host_update_is_bit_identical_to_whole_tensor_passes(case, monkeypatch):
    """``adam_update`` in cache blocks (widen / accumulate / scale into scratch, fused update, narrow)
    gives the bits of the whole-tensor sequence the host path ran before: widen or accumulate into the
    fp32 gradient, scale it, one fused call, narrow the master. Odd block sizes, a short last block."""
    import tidal_stream.adam_kernels as ak

    moment, land_dtype, accumulate, clip, narrow_dtype, with_undo = case
    # bf16 moments go in fixed chunks (their rounding noise depends on them): fold into several
    monkeypatch.setattr(ak, "_CHUNK", 1024)
    hyper = ak.AdamHyper(
        lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False
    )
    n = 3001
    g = torch.Generator().manual_seed(7)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    m = (torch.randn(n, generator=g) * 1e-3).to(moment)
    v = (torch.rand(n, generator=g) * 1e-5).to(moment)
    landing = None if land_dtype is None else (torch.randn(n, generator=g) * 1e-2).to(land_dtype)
    coef = torch.tensor(0.37) if clip else None

    # reference: the whole-tensor passes
    rp, rg, rm, rv, rst = p.clone(), grad.clone(), m.clone(), v.clone(), torch.tensor(2.0)
    if landing is not None:
        rg.add_(landing) if accumulate else rg.copy_(landing)
    if coef is not None:
        rg.mul_(coef)
    ak.adam_update(rp, rg, rm, rv, rst, hyper, torch.Generator().manual_seed(3), block=0)
    rnarrow = None if narrow_dtype is None else rp.to(narrow_dtype)

    for block in (None, 1024, 333, 64, 4096):  # 333: rounded down to 320
        bp, bm, bv, bst = p.clone(), m.clone(), v.clone(), torch.tensor(2.0)
        narrow = None if narrow_dtype is None else torch.full((n,), float("nan"), dtype=narrow_dtype)
        undo = None
        if with_undo:
            undo = ak.UndoCopy(torch.empty(n), torch.empty(n, dtype=moment), torch.empty(n, dtype=moment))
        ak.adam_update(
            bp, grad.clone(), bm, bv, bst, hyper, torch.Generator().manual_seed(3), undo,
            landing=landing, accumulate=accumulate, grad_scale=coef, narrow_to=narrow, block=block,
        )  # fmt: skip
        for got, want in ((bp, rp), (bm, rm), (bv, rv), (bst, rst)):
            assert torch.equal(got, want), f"block={block}"
        if narrow is not None:
            assert torch.equal(narrow, rnarrow)
        if undo is not None:
            assert undo.copied == n and torch.equal(undo.master, p) and torch.equal(undo.exp_avg, m)


def _train_bf16_or_fp32(dtype, steps=6, clip=None, accum=1, **kw):
    model = make_model(dtype=dtype)
    model, opt = wrap(
        model, None, lr=1e-3, offload=True, max_grad_norm=clip, accumulation_steps=accum, attention=None, **kw
    )
    for step in range(steps):
        for micro in range(accum):
            loss_fn(model, step * accum + micro, autocast=dtype != torch.float32).backward()
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    out = _opt_state(opt)
    out.update({("w", i): p.detach().clone() for i, p in enumerate(model.parameters())})
    unwrap(model)
    return out


@pytest.mark.parametrize(
    "case",
    [
        {"dtype": torch.bfloat16},
        {"dtype": torch.bfloat16, "accum": 2, "rollback": True},
        {"dtype": torch.bfloat16, "clip": 0.5, "moment_dtype": "bf16"},
        {"dtype": torch.float32, "accum": 2, "clip": 0.5, "rollback": True},
        {"dtype": torch.float32, "moment_dtype": "bf16", "rollback": True},
    ],
    ids=[
        "bf16",
        "bf16-accum-rollback",
        "bf16-clip-bf16moments",
        "fp32-accum-clip-rollback",
        "fp32-bf16moments",
    ],
)
def test_offload_training_is_bit_identical_whatever_the_block(case, monkeypatch):
    """``OffloadAdamW`` with the host update in small cache blocks (the landed gradient widened or summed
    per block, clipping and the narrow folded in) ends with the same masters, moments, steps and weights
    as with whole-tensor passes."""
    import tidal_stream.adam_kernels as ak

    monkeypatch.setattr(ak, "_BLOCK", 1 << 30)
    whole = _train_bf16_or_fp32(**case)
    monkeypatch.setattr(ak, "_BLOCK", 97)  # many blocks per tensor, a short last one
    blocked = _train_bf16_or_fp32(**case)
    _assert_same(whole, blocked)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_blocked_offload_matches_torch_adamw(clip, monkeypatch):
    """Blocked host updates keep the parity with ``torch.optim.AdamW`` (clipping, accumulation, groups)."""
    import tidal_stream.adam_kernels as ak

    monkeypatch.setattr(ak, "_BLOCK", 61)
    case = {"clip": clip, "accum": 2, "groups": True, "sched": True, "steps": 8}
    ref = run_reference("cpu", **case)
    got, _ = run_wrapped("cpu", rollback=True, **case)
    d = max_param_diff(ref, got)
    assert d < 1e-6, f"max |Δp| = {d}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_buffers_a_device_copy_touches_are_pinned(dtype, monkeypatch):
    """Page-locked host memory is for copies to and from the device: the landing gradient and the outgoing
    weight (for fp32 weights the master itself, and the fp32 gradient the copy lands in). Moments, undo
    copies, and a master or fp32 gradient only the CPU touches stay pageable."""
    from tidal_stream import OffloadAdamW
    from tidal_stream.hostmem import HostMemory

    seen = []
    real = HostMemory.reserve

    def spy(self, requests):
        seen.extend(requests)
        return real(self, requests)

    monkeypatch.setattr(HostMemory, "reserve", spy)
    model = make_model().to(dtype)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, rollback=True)
    pinned = {(r.tag, r.pinned) for r in seen}
    fp32 = dtype == torch.float32
    expected = {("master", fp32), ("exp_avg", False), ("exp_avg_sq", False)}
    expected |= {("undo_master", False), ("undo_exp_avg", False), ("undo_exp_avg_sq", False)}
    # 16-bit weights are lean: the landing buffer is the staging buffer too, and no fp32 gradient is kept
    expected |= {("grad", True)} if fp32 else {("grad_landing", True)}
    assert pinned == expected
    host = opt.session.host.stats()
    # on the CPU nothing is page-locked: every byte is counted pageable, none lost
    assert host["pinned_bytes"] == 0 and host["pageable_bytes"] >= host["host_bytes"]
    opt.close()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_lean_host_buffers_are_bit_identical_and_smaller(clip, moment_dtype, device, monkeypatch):
    """bf16 weights: no fp32 gradient and no staging buffer (the update widens from the landing buffer
    and narrows back into it) gives the bits of the buffered path, and 6 B per parameter less host memory;
    growing accumulation_steps later reserves the fp32 sum and still matches."""
    from tidal_stream import OffloadAdamW

    def run(lean: bool, steps: int = 4, accumulate_from: int | None = None):
        monkeypatch.setattr(OffloadAdamW, "_lean", lambda self, p: lean and p.dtype != torch.float32)
        model = make_model(device=device, dtype=torch.bfloat16)
        opt = OffloadAdamW(model.parameters(), lr=1e-2, max_grad_norm=clip, moment_dtype=moment_dtype)
        opt.install_read_guards(model)
        host = opt.session.host.stats()["host_bytes"]
        for step in range(steps):
            if accumulate_from is not None and step == accumulate_from:
                opt.accumulation_steps = 2
            loss_fn(model, step, device).backward()
            opt.step()
            if (step + 1) % opt.accumulation_steps == 0:  # an update happened
                opt.zero_grad()
        opt.synchronize()
        state = [
            t.clone() for st in opt.state.values() for t in (st["master"], st["exp_avg"], st["exp_avg_sq"])
        ]
        weights = [p.detach().cpu() for p in model.parameters()]
        opt.close()
        return host, state, weights

    host_l, state_l, w_l = run(True)
    host_b, state_b, w_b = run(False)
    n = sum(t.numel() for t in state_l[::3])  # the host-updated parameters (their masters)
    assert host_b - host_l == 6 * n  # the fp32 gradient (4 B) and the staging copy (2 B)
    for a, b in zip(state_l + w_l, state_b + w_b):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    _, state_l, w_l = run(True, steps=6, accumulate_from=2)
    _, state_b, w_b = run(False, steps=6, accumulate_from=2)
    for a, b in zip(state_l + w_l, state_b + w_b):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_plan_counts_the_host_bytes_the_optimizer_reserves(dtype, moment_dtype):
    """tidal-plan's per-parameter host bytes (pinned, pageable) are exactly what OffloadAdamW reserves."""
    import types

    from tidal_plan.param_bytes import host_slot_bytes
    from tidal_stream import OffloadAdamW

    model = make_model().to(dtype)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, moment_dtype=moment_dtype)
    host = opt.session.host.stats()
    n = sum(st["master"].numel() for st in opt.state.values())
    ctx = types.SimpleNamespace(census=types.SimpleNamespace(param_dtype_bytes=dtype.itemsize), master=True)
    pinned, pageable = host_slot_bytes(ctx, moment_dtype)
    assert host["host_bytes"] == (pinned + pageable) * n
    opt.close()


def _held_step(opt, model, step: int, gate: threading.Event) -> None:
    """One step whose host jobs all wait behind ``gate``: every update is still pending at ``step()``."""
    opt._worker.put(gate.wait)
    loss_fn(model, step).backward()
    opt.step()


def test_updates_still_pending_at_step_run_in_parameter_order(monkeypatch):
    """Gradients land in backward's order (last block first); the updates not yet run when ``step()`` is
    called then run in parameter order, so the next forward waits for its first blocks' updates only."""
    from tidal_stream import OffloadAdamW

    def order_of_updates(reorder: bool) -> list[int]:
        model = make_model()
        opt = OffloadAdamW(model.parameters(), lr=1e-2)
        opt.install_read_guards(model)
        if not reorder:
            monkeypatch.setattr(opt._worker, "reorder", lambda: 0)
        ran: list[int] = []
        real = opt._update_now
        monkeypatch.setattr(opt, "_update_now", lambda s, *a, **k: (ran.append(s.index), real(s, *a, **k)))
        gate = threading.Event()
        _held_step(opt, model, 0, gate)
        gate.set()
        opt.synchronize()
        return ran

    landing = order_of_updates(reorder=False)
    assert len(landing) > 2 and landing != sorted(landing)  # backward lands the last blocks first
    assert order_of_updates(reorder=True) == sorted(landing)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_update_order_does_not_change_the_bits(monkeypatch, moment_dtype):
    """bf16 moments round stochastically: each host update seeds its noise from the parameter and its step
    count, so running the updates in parameter order (pending at ``step()``) or in landing order gives the
    same weights and state, bit for bit."""
    from tidal_stream import OffloadAdamW

    def run(reorder: bool) -> tuple[dict, list[torch.Tensor]]:
        model = make_model()
        opt = OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype=moment_dtype)
        opt.install_read_guards(model)
        if not reorder:
            monkeypatch.setattr(opt._worker, "reorder", lambda: 0)
        for step in range(3):
            gate = threading.Event()
            _held_step(opt, model, step, gate)
            gate.set()
            opt.zero_grad()
        opt.synchronize()
        return _opt_state(opt), [p.detach().clone() for p in model.parameters()]

    state_a, weights_a = run(reorder=True)
    state_b, weights_b = run(reorder=False)
    _assert_same(state_a, state_b)
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
