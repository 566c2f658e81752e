"""wrap(): options, state_dict compatibility, resume in a fresh process, memory on the GPU machine."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from tidal_stream import OffloadAdamW, StreamError, memory_report, unwrap, wrap
from tidal_testing import assert_bitwise_equal, devices, max_abs_diff

HERE = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("tidal_stream_tinygpt", HERE / "tinygpt.py")
tinygpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tinygpt)
loss_fn, make_model = tinygpt.loss_fn, tinygpt.make_model

# every test here runs on one host thread (the fixture lives in conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"vram_bugdet": "24GiB"}, "vram_budget"),
        ({"vram_budget": "24 parsecs"}, "24GiB"),
        ({"vram_budget": -1}, "positive"),
        ({"moment_dtype": "fp8"}, "bf16"),
        ({"offload": "always"}, "auto"),
        ({"accumulation_steps": 0}, ">= 1"),
        ({"max_grad_norm": -1.0}, "positive"),
        ({"threads": 0}, "positive"),
        ({"delayed_update": "yes"}, "True or False"),
        ({"param_offload": 1.5}, "fraction"),
        ({"recompute": ["a"]}, "block indices"),
        ({"attention": "fastest"}, "flash"),
        ({"prefetch_depth": -2}, ">= 0"),
        ({"device": "tpu:banana"}, "cuda"),
        ({"device": "meta"}, "cuda"),
        ({"plan": "fast"}, "tidal_plan.Plan"),
        ({"batch_tokens": 0}, ">= 1"),
        ({"host_ram": "plenty"}, "24GiB"),
        ({"host_ram": -1}, "positive"),
        ({"loss_chunk_tokens": 0}, ">= 1"),
        ({"lr": float("inf")}, "finite"),
    ],
)
def test_bad_options(options, needle):
    with pytest.raises(ValueError, match=needle) as info:
        wrap(make_model(), None, **options)
    assert repr(next(iter(options.values())))[:10] in str(info.value)


@pytest.mark.parametrize("model", [None, 3, [torch.nn.Linear(2, 2)]])
def test_non_module_is_refused(model):
    with pytest.raises(ValueError, match="model"):
        wrap(model)


def test_model_without_trainable_parameters_is_refused():
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    for m in (torch.nn.Module(), frozen):
        with pytest.raises(ValueError, match="trainable param"):
            wrap(m, None, offload=True)


def test_lr_with_optimizer_is_refused():
    m = make_model()
    with pytest.raises(ValueError, match="lr"):
        wrap(m, torch.optim.AdamW(m.parameters()), lr=1e-3)


def test_other_optimizer_is_refused():
    m = make_model()
    with pytest.raises(ValueError, match="AdamW"):
        wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_part2_option_without_installer():
    """Part-2 options validate; a non-default value needs the part-2 installer (or is accepted by it)."""
    try:
        import tidal_stream.weights as w

        has_installer = hasattr(w, "install")
    except ImportError:
        has_installer = False
    if has_installer:
        pytest.skip("the part-2 installer is present; its own tests cover param_offload")
    with pytest.raises(NotImplementedError, match="param_offload"):
        wrap(make_model(), None, param_offload=True)


def test_threads_reach_the_host_optimizers_worker_thread():
    """``threads=`` is the intra-op thread count the host updates run with, on the worker thread that runs
    them (a thread started after ``torch.set_num_threads`` takes the process-wide count)."""
    import threading

    fresh: list[int] = []  # what a new thread gets by default (torch's default: the physical cores)
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    asked = fresh[0] + 1  # differs from the default whatever the machine
    m, opt = wrap(make_model(), offload=True, lr=1e-3, threads=asked)
    seen: list[int] = []
    opt._worker.submit(lambda: seen.append(torch.get_num_threads()))
    opt._worker.join()
    assert seen == [asked] and torch.get_num_threads() == asked
    assert any(e["kind"] == "threads" for e in memory_report(m)["events"])
    unwrap(m)


def test_adam_with_l2_and_migrated_state():
    """torch.optim.Adam (L2 weight decay) with 3 steps of existing state, continued by OffloadAdamW."""
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.05)
    m = make_model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.05)
    for step in range(6):
        loss_fn(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 3:
            m, opt = wrap(m, opt, offload=True)
            assert isinstance(opt, OffloadAdamW)
        loss_fn(m, step).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert max(max_abs_diff(p, q) for p, q in zip(ref.parameters(), m.parameters())) < 1e-6
    assert any(e["kind"] == "migrate" for e in memory_report(m)["events"])


def test_state_dict_moves_to_torch_adamw_and_back():
    m, opt = wrap(make_model(), None, lr=1e-3, offload=True)
    for step in range(3):
        loss_fn(m, step).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    key = next(iter(sd["state"]))
    assert set(sd["state"][key]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    plain = make_model()
    plain.load_state_dict(m.state_dict())
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    torch_opt.load_state_dict(sd)
    assert set(torch_opt.state_dict()["param_groups"][0]) == set(sd["param_groups"][0])
    # continue both for 2 steps: same weights
    m2, opt2 = wrap(make_model(), None, lr=1e-3, offload=True)
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(torch_opt.state_dict())
    for step in range(3, 5):
        for model, o in ((plain, torch_opt), (m2, opt2)):
            loss_fn(model, step).backward()
            o.step()
            o.zero_grad()
    opt2.synchronize()
    assert max(max_abs_diff(p, q) for p, q in zip(plain.parameters(), m2.parameters())) < 1e-6
    unwrap(m)
    with pytest.raises(ValueError, match="not wrapped"):
        memory_report(m)


_RESUME = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("tg", sys.argv[1]); tg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tg)
from tidal_stream import wrap
torch.set_num_threads(1)
device, ckpt, out = sys.argv[2], sys.argv[3], sys.argv[4]
model = tg.make_model(device=device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = wrap(model, opt, offload=True, max_grad_norm=1.0, attention=None)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
state = torch.load(ckpt, weights_only=True)
model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); sched.load_state_dict(state["sched"])
for step in range(10, 20):
    tg.loss_fn(model, step, device).backward(); opt.step(); opt.zero_grad(); sched.step()
opt.synchronize()
torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out)
"""


@pytest.mark.parametrize("device", devices())
def test_resume_in_fresh_process_is_bit_identical(device, tmp_path):
    def run(upto):
        model = make_model(device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = wrap(model, opt, offload=True, max_grad_norm=1.0, attention=None)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        for step in range(upto):
            loss_fn(model, step, device).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return model, opt, sched

    full, _, _ = run(20)
    half, opt, sched = run(10)
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": half.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
    out = tmp_path / "resumed.pt"
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    subprocess.run(
        [sys.executable, str(script), str(HERE / "tinygpt.py"), device, str(ckpt), str(out)],
        check=True,
        timeout=120,
    )
    resumed = torch.load(out, weights_only=True)
    for k, v in full.state_dict().items():
        assert_bitwise_equal(v.cpu(), resumed[k], k)


@pytest.mark.gpu
def test_peak_vram_holds_no_optimizer_state():
    """Peak ≤ weights + activations + gradients of two blocks + 10 % (activations measured unwrapped)."""
    torch.manual_seed(0)
    dim, layers = 1024, 8
    x = torch.randn(512, dim, device="cuda")  # [T, D]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    blocks = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
            for _ in range(layers)
        ]
    ).cuda()
    weights = sum(p.numel() * p.element_size() for p in blocks.parameters())
    two_blocks_grads = 2 * weights // layers
    torch.cuda.reset_peak_memory_stats()
    loss = blocks(x).square().mean()  # saved activations of one forward, unwrapped
    activations = torch.cuda.max_memory_allocated() - base - weights
    del loss
    model, opt = wrap(blocks, None, lr=1e-4, offload=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 1.1 * (weights + activations + two_blocks_grads)
    mib = 2**20
    print(
        f"peak {peak / mib:.1f} MiB <= bound {bound / mib:.1f} MiB = 1.1 x (weights {weights / mib:.1f} + "
        f"activations {activations / mib:.1f} + two blocks' grads {two_blocks_grads / mib:.1f}); "
        f"optimizer state + grads on the host {memory_report(model)['host']['host_bytes'] / mib:.1f} MiB"
    )
    assert peak <= bound
    unwrap(model)


def test_plan_split_is_followed_and_matches():
    """A tidal_plan split (outside-the-stack on the device, blocks on the host) gives the same training."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    model = make_model()
    c = census(model)
    budget = "500KiB"
    p = plan(
        c,
        HardwareProfile.synthetic(vram_budget_bytes=budget, device_free_bytes=budget),
        PlanConfig(batch_tokens=64, headroom_bytes=0, param_offload=False),
    )
    assert p.optimizer.placement == "split"
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=p, max_grad_norm=1.0)
    host = {id(s.param) for s in opt.host_slots()}
    for name, t in model.named_parameters():
        on_host = id(t) in host
        in_gpu_block = c.param_to_block[name] in p.optimizer.gpu_blocks
        outside = c.param_to_block[name] is None
        assert on_host == (not in_gpu_block and not (outside and p.optimizer.outside_on_gpu)), name
    assert host and len(host) < sum(1 for t in model.parameters() if t.requires_grad)
    for step in range(10):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_fn(m, step).backward()
            if o is ref_opt:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert max(max_abs_diff(a, b) for a, b in zip(ref.parameters(), model.parameters())) < 1e-6
    kinds = [e["kind"] for e in memory_report(model)["events"]]
    assert "plan" in kinds and "placement" in kinds
    assert "tidal plan" in memory_report(model)["plan"]


def test_auto_part2_options_follow_the_plan():
    """The plan split the optimizer assuming its recompute choices: "auto" options must install them."""
    from tidal_plan import HardwareProfile, PlanConfig, census, plan

    model = make_model()
    n_blocks = len(model.blocks)
    p = plan(
        census(model),
        HardwareProfile.synthetic(vram_budget_bytes="500KiB", device_free_bytes="500KiB"),
        PlanConfig(batch_tokens=64, headroom_bytes=0, param_offload=False, recompute=[0]),
    )
    planned = [b.activations for b in p.blocks]
    assert planned[0] == "recompute"
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=p)
    events = memory_report(model)["events"]
    followed = [e for e in events if "follow the plan" in e["message"]]
    assert followed and followed[0]["data"]["recompute"] == [
        i for i in range(n_blocks) if planned[i] == "recompute"
    ]
    policy = [e for e in events if e["kind"] == "activations"]
    assert policy and policy[0]["data"]["policies"] == planned
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            with sdpa_kernel(SDPBackend.MATH):  # recompute in backward takes the forward's SDPA path
                loss_fn(m, step).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert max(max_abs_diff(a, b) for a, b in zip(ref.parameters(), model.parameters())) < 1e-6
    unwrap(model)


def test_verbose_prints_decisions_and_report_has_tiers_and_host_work(capsys):
    model, opt = wrap(make_model(), None, lr=1e-3, offload=True, verbose=True)
    loss_fn(model, 0).backward()
    opt.step()
    opt.synchronize()
    printed = capsys.readouterr().out
    assert "tidal [placement]" in printed and "tidal [wrap]" in printed
    rep = memory_report(model)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert rep["tiers"]["host"]["params"] == n
    # master + two moments + fp32 gradient per trainable parameter, all in host buffers
    assert rep["host"]["bytes_by_tag"] == {k: 4 * n for k in ("master", "exp_avg", "exp_avg_sq", "grad")}
    assert rep["d2h_bytes"] == 4 * n and rep["h2d_bytes"] == 4 * n
    assert rep["tiers"]["device"]["weights_bytes"] > 0
    # every trainable tensor updated once on the host, in measured (non-zero) worker seconds
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    work = rep["host_optimizer"]
    assert work["steps"] == 1 and work["updates"] == tensors and work["update_s"] > 0
    assert work["update_s_per_step"] == work["update_s"]
    assert work["steps_done"] == 1 and work["last_step_idle"] == []
    # the total also holds the step's closing marker job, which the per-step figure was taken before
    assert work["worker_busy_s"] >= work["worker_busy_s_per_step"] >= work["update_s_per_step"]
    time.sleep(0.05)  # the worker has nothing to do until the next backward
    loss_fn(model, 1).backward()
    opt.step()
    opt.synchronize()
    work = memory_report(model)["host_optimizer"]
    assert work["steps"] == work["steps_done"] == 2 and work["updates"] == 2 * tensors
    assert work["update_s_per_step"] == pytest.approx(work["update_s"] / 2)
    # the sleep shows as idle time between the two steps; the forward waited for no update (synchronized)
    assert sum(d for _, d in work["last_step_idle"]) >= 0.05 and work["update_wait_s"] == 0.0
    unwrap(model)
    with pytest.raises(StreamError, match="closed by unwrap"):
        opt.step()


def test_device_share_takes_the_earliest_parameters_that_fit():
    from tidal_stream.placement import device_share, device_state_bytes

    _, opt = wrap(make_model(), None, lr=1e-3, offload=True)
    slots = sorted(opt.host_slots(), key=lambda s: s.index)
    costs = [device_state_bytes(s.param, 4) for s in slots]
    assert costs[0] == 12 * slots[0].param.numel()  # fp32: two moments + the gradient, no extra master
    room = sum(costs[:3]) + costs[3] // 2
    chosen, total = device_share(list(reversed(slots)), room, 4)
    assert [id(p) for p in chosen] == [id(s.param) for s in slots[:3]] and total == sum(costs[:3])
    assert opt.move_to_device(chosen) == 3
    assert len(opt.host_slots()) == len(slots) - 3
    assert device_state_bytes(torch.zeros(10, dtype=torch.bfloat16), 2) == 10 * (4 + 2 + 4)


def test_model_state_dict_of_streamed_weights_comes_from_their_host_copies(tmp_path):
    """Checkpointing a wrapped model whose blocks stream: state_dict() (and torch.save of it) gives the
    trained values from the host copies instead of reading emptied device storage; load_state_dict()
    into it is refused with the fix; after unwrap() it loads as usual."""
    from tidal_stream import StreamingError

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model = make_model()
    model, opt = wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), offload=True, param_offload=True,
        blocks=model.blocks, attention=None,
    )  # fmt: skip
    assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())  # streamed now
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_fn(m, step).backward()
            o.step()
            o.zero_grad()
    sd = model.state_dict()  # no opt.synchronize() first: the state_dict does it
    want = ref.state_dict()
    assert sd.keys() == want.keys()
    assert max(max_abs_diff(sd[k], want[k]) for k in want) < 1e-6
    assert any(k.startswith("blocks.0.") for k in sd) and sd["blocks.1.linear1.weight"].abs().sum() > 0
    torch.save(sd, tmp_path / "ckpt.pt")
    back = torch.load(tmp_path / "ckpt.pt")
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    prefixed = torch.nn.ModuleDict({"lm": model}).state_dict()  # a wrapped model inside a bigger one
    assert torch.equal(prefixed["lm.blocks.0.linear1.weight"], sd["blocks.0.linear1.weight"])
    with pytest.raises(StreamingError, match=r"blocks\.0\..*Fix: load the state dict before wrap\(\)"):
        model.load_state_dict(want)
    with pytest.raises(
        StreamingError, match=r"block 0 Linear\.weight: its weights stream.*Fix: read weights with"
    ):
        model.blocks[0].linear1.weight.clone()  # a direct read between uses: a clear error, not a crash
    unwrap(model)
    model.load_state_dict(back)
    assert max(max_abs_diff(p, q) for p, q in zip(model.parameters(), ref.parameters())) < 1e-6


def test_a_refused_plan_closes_the_session_and_leaves_the_model_as_given(monkeypatch):
    """A placement refusal (an InfeasiblePlan from the planner) surfaces from wrap() with the session it
    opened closed; the model is not marked wrapped and wraps again."""
    from tidal_plan import InfeasiblePlan
    from tidal_stream.session import Session

    closed = []
    real_close = Session.close
    monkeypatch.setattr(Session, "close", lambda self: (closed.append(self), real_close(self))[1])

    def refuse(*args, **kwargs):
        raise InfeasiblePlan("host_ram", 10 * 2**30, 2**30, "not enough host_ram")

    # the module (the package's name ``wrap`` is the function)
    monkeypatch.setattr(importlib.import_module("tidal_stream.wrap"), "decide_placement", refuse)
    model = make_model()
    with pytest.raises(InfeasiblePlan, match="host_ram"):
        wrap(model, None, lr=1e-3)
    assert len(closed) == 1
    monkeypatch.undo()
    model, _opt = wrap(model, None, lr=1e-3)  # not marked wrapped by the refused call
    unwrap(model)
