"""plan -> stream -> quant: a planner-made plan handed to ``wrap()``, with exact and quantized frozen bases.

Each scenario trains two copies of one small byte-level GPT on the same batches: the reference with
``torch.optim.AdamW(fused=True)`` on host copies and no tidal, the other through
``tidal.wrap(..., plan=tidal.plan(...))`` under a budget at which the plan streams blocks. The plan puts every
update on the host (``offload=True``), so both sides run the same AdamW kernel (see ``_reference.py``);
losses and final weights must agree to fp32 round-off.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _reference import ATTENTION, HostAdamW, reference_attention

import tidal
from tidal.demo.data import ByteBatches, stdlib_bytes
from tidal.demo.lora import add_lora_
from tidal.demo.model import GPTConfig, TinyGPT
from tidal.demo.run import plan_options
from tidal_testing import devices, max_abs_diff

CFG = GPTConfig(d_model=48, n_layers=4, n_heads=4, max_seq_len=64)
STEPS = 5
BATCH, SEQ = 2, 32


def _batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Windows of real text (the standard library's source), the same for every call."""
    text, _ = stdlib_bytes(max_bytes=100_000)
    data = ByteBatches(text, SEQ, BATCH, seed=1)
    return [data.next(torch.device(device)) for _ in range(STEPS)]


def _streaming_plan(model: torch.nn.Module, device: str):
    """The planner's plan at a budget where only streaming fits, every update on the host, with the
    device's measured profile.

    Two bounds from the planner itself: ``low``, the least any placement needs (every block streamed),
    and ``resident``, the least a placement with every block resident needs (``param_offload=False``).
    A budget between them admits no all-resident plan, so whatever the planner picks streams, on any
    device and whatever its measured rates. Fractions of the gap, not of the budget: on the GPU the
    256 MiB headroom dwarfs this model, and 2 % of the budget is already more than all of its blocks.
    """
    profile = tidal.profile_hardware(device)
    cen = tidal.census(model)
    headroom = 256 << 20 if device == "cuda" else 4096

    def at(budget: int, **options):
        cfg = tidal.PlanConfig(
            vram_budget=budget, batch_tokens=BATCH * SEQ, headroom_bytes=headroom, offload=True, **options
        )
        return tidal.plan(cen, profile, cfg)

    def least(**options) -> int:
        try:
            at(headroom + 1024, **options)
        except tidal.InfeasiblePlan as exc:
            return exc.needed_bytes
        raise AssertionError("1 KiB above the headroom cannot fit")

    low, resident = least(), least(param_offload=False)
    assert low < resident, (low, resident)  # streaming must save VRAM on this model, or nothing here streams
    for share in (0.5, 0.25, 0.0):
        p = at(low + int(share * (resident - low)))
        assert p.optimizer.placement == "host", p.explain()
        if p.streamed_blocks:
            return p
    raise AssertionError(f"no budget in [{low}, {resident}) bytes streams a block")


def _model() -> TinyGPT:
    """The small GPT with its attention-input biases frozen.

    The key bias gets a gradient that is zero in exact arithmetic (softmax ignores a shift shared by
    every key), so what it receives is rounding noise, and Adam scales noise up to steps of ~lr * g / eps.
    Any rounding difference between the two runs (a kernel, an order of summation) would make that noise
    differ, and those biases by far more than the bound checked here.
    """
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    for blk in model.blocks:
        blk.qkv.bias.requires_grad_(False)
    return model


def _wrap(model: torch.nn.Module, opt: torch.optim.Optimizer, p, device: str):
    """``wrap()`` carrying out the plan block by block (what ``tidal demo`` does).

    ``offload=True`` is the plan's own placement (every update on the host); passed explicitly it also
    keeps the updates there after the first step (with ``"auto"``, wrap moves what fits to the GPU).
    """
    return tidal.wrap(
        model,
        opt,
        vram_budget=p.vram_budget_bytes,
        device=device,
        plan=p,
        batch_tokens=BATCH * SEQ,
        offload=True,
        attention=ATTENTION,
        **plan_options(p, model.blocks),
    )


def _check_streamed(report: dict, p) -> None:
    """The planned blocks were really streamed, every step, and gradients really left the device."""
    ws = report["weight_streaming"]
    assert ws["streamed"] == list(p.streamed_blocks)
    streamed = list(p.streamed_blocks)
    assert all(ws["block_fetches"][i] > 0 for i in streamed)
    assert ws["h2d_bytes"] == sum(ws["block_bytes"][i] * ws["block_fetches"][i] for i in streamed)
    # each step uses each streamed block in forward and in backward: refilled, or kept over a turn
    assert sum(ws["block_fetches"][i] for i in streamed) + ws["turn_holds"] >= 2 * STEPS * len(streamed)
    assert report["d2h_bytes"] > 0


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if hasattr(opt, "synchronize"):
        opt.synchronize()  # the last host update has landed in the weights
    return losses


def _train_both(reference: torch.nn.Module, device: str, lr: float):
    """Train ``reference`` with the host AdamW and a copy of it through ``wrap()`` under the streaming plan.

    The copy's memory report is checked against the plan (``_check_streamed``). Returns the wrapped copy,
    its optimizer (kept alive for the caller's checks), the reference's losses and the copy's losses.
    """
    model = copy.deepcopy(reference)
    trainable = [q for q in reference.parameters() if q.requires_grad]
    with reference_attention():
        ref_losses = _train(reference, HostAdamW(trainable, lr=lr), _batches(device))

    p = _streaming_plan(model, device)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr)
    model, opt = _wrap(model, opt, p, device)
    losses = _train(model, opt, _batches(device))
    _check_streamed(tidal.memory_report(model), p)
    return model, opt, ref_losses, losses


def _compare(reference: torch.nn.Module, wrapped: torch.nn.Module, ref_losses, losses) -> None:
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (ref_losses, losses)
    ref = dict(reference.named_parameters())
    for name, p in tidal.unwrap(wrapped).named_parameters():
        assert max_abs_diff(ref[name], p) < 1e-6, name


@pytest.mark.parametrize("device", devices())
def test_planned_full_fine_tune_matches_torch_adamw(device):
    reference = _model().to(device)
    model, _opt, ref_losses, losses = _train_both(reference, device, lr=1e-3)
    _compare(reference, model, ref_losses, losses)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_base_with_lora_under_a_plan_matches_torch_adamw(device, fmt):
    base = _model()
    tidal.quantize_model_(base.blocks, fmt)  # frozen QuantLinear: packed bytes + scales are buffers
    add_lora_(base.blocks, r=4)
    reference = base.to(device)
    model, _opt, ref_losses, losses = _train_both(reference, device, lr=1e-2)
    assert ref_losses[-1] < ref_losses[0]  # the adapters learn on a quantized base
    _compare(reference, model, ref_losses, losses)
    frozen = {n: b for n, b in reference.named_buffers()}
    for n, b in model.named_buffers():
        assert torch.equal(frozen[n], b), f"quantized buffer {n} changed"
