"""Each engine's build path, run on the CPU: at every block the build device holds what the model keeps
so far plus at most the one bf16 block being quantized (a replaced block kept alive is the whole bf16
model on the device by the end), and after the build exactly what the model keeps.

Live bytes are counted with ``gc`` over every tensor and storage object, one count per storage.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterable

import pytest
import torch
from engines import common
from engines.common import build_meta_model, decoder_layers, materialize
from engines.scenarios import SCENARIOS, decoder_shape
from torch import nn

MiB = 1 << 20
#: a mid-size Qwen2: 6 blocks of ~6 MiB in bf16, so one leaked block is far above the slack
MID = dataclasses.replace(
    SCENARIOS["smoke"], name="mid", shape=decoder_shape(512, 1536, 6, 8, 2, 1000, 10_000.0, 1e-6, 512, False)
)
#: small allocations besides the model's own tensors (quantization code tables, generator states)
SLACK = MiB // 2


def _storages(objs: Iterable[object], device: str) -> dict[int, int]:
    seen: dict[int, int] = {}
    for o in objs:
        kind = type(o)  # not isinstance: some objects warn when their __class__ is read
        if issubclass(kind, torch.Tensor):
            if o.is_meta or o.device.type != device:
                continue
            st = o.untyped_storage()
        elif issubclass(kind, (torch.UntypedStorage, torch.TypedStorage)):
            st = o.untyped_storage() if issubclass(kind, torch.TypedStorage) else o
            if st.device.type != device:
                continue
        else:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fake storage's data_ptr only warns in some torch versions
            try:
                ptr = st.data_ptr()
            except (RuntimeError, UserWarning):  # fake/functional tensors left by other tests' tracing
                continue
        if st.nbytes():
            seen[ptr] = st.nbytes()
    return seen


def live_bytes(device: str = "cpu", baseline: dict[int, int] | None = None) -> int:
    """Bytes of every live storage on ``device`` not in ``baseline``."""
    now = _storages(gc.get_objects(), device)
    return sum(n for ptr, n in now.items() if baseline is None or ptr not in baseline)


def _owned(module: nn.Module) -> list[torch.Tensor]:
    """The module's tensors, bitsandbytes' quantization state included (it is not a buffer)."""
    out = [*module.parameters(), *module.buffers()]
    for p in module.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            out += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
            qs = getattr(qs, "state2", None)
    return out


def owned_bytes(module: nn.Module, device: str = "cpu") -> int:
    return sum(_storages(_owned(module), device).values())


def bf16_block_bytes() -> int:
    meta = build_meta_model(MID, torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in decoder_layers(meta)[0].parameters())


def _bnb_build(on_block: Callable[[nn.Module], None]) -> nn.Module:
    pytest.importorskip("bitsandbytes")
    from engines import bnb

    return bnb.build_model(MID, torch.device("cpu"), 0, on_block=on_block)


def _tidal_build(fmt: str) -> Callable[[Callable[[nn.Module], None]], nn.Module]:
    def build(on_block: Callable[[nn.Module], None]) -> nn.Module:
        from engines import tidal_engine

        return tidal_engine.build_model(MID, fmt, torch.device("cpu"), 0, on_block=on_block)

    return build


@pytest.mark.parametrize(
    "build",
    [_bnb_build, _tidal_build("nf4"), _tidal_build("int8")],
    ids=["bnb-nf4", "tidal-nf4", "tidal-int8"],
)
def test_build_holds_one_bf16_block_beyond_the_model(build) -> None:
    torch.manual_seed(0)
    gc.collect()
    base = _storages(gc.get_objects(), "cpu")
    one_block = bf16_block_bytes()
    kept: list[int] = []  # bytes each finished block keeps
    excess: list[int] = []

    def on_block(block: nn.Module) -> None:
        kept.append(owned_bytes(block))
        # this block's replaced bf16 weights are still referenced by the build's own map until it moves on
        excess.append(live_bytes(baseline=base) - sum(kept) - one_block)

    model = build(on_block)
    assert len(kept) == MID.shape["num_hidden_layers"]
    assert kept[0] < 0.75 * one_block, "the hook quantized the block (int8 + fp32 LoRA: 0.63 of bf16)"
    assert max(excess) <= SLACK, [round(e / MiB, 2) for e in excess]
    after = live_bytes(baseline=base) - owned_bytes(model)
    assert after <= SLACK, after / MiB


def test_materialize_frees_what_a_hook_leaves_referenced(monkeypatch) -> None:
    notes: list[str] = []
    monkeypatch.setattr(common, "BUILD_NOTES", notes)
    stash: list[nn.Module] = []  # a stray reference: the hook keeps every linear it replaces

    def hook(block: nn.Module) -> None:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                stash.append(child)
                if name == "up_proj":  # replaced by a layer sharing the old weight's storage: kept as is
                    same = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                    same.weight = nn.Parameter(child.weight.data)
                    setattr(parent, name, same)
                else:
                    setattr(parent, name, nn.Identity())

    gc.collect()
    base = _storages(gc.get_objects(), "cpu")
    model = materialize(
        build_meta_model(MID, torch.bfloat16), "device", device=torch.device("cpu"), block_hook=hook
    )
    assert len(notes) == MID.shape["num_hidden_layers"]
    assert "still referenced after the hook" in notes[0] and "Linear < list" in notes[0], notes[0]
    freed = [m for m in stash if m.weight.untyped_storage().nbytes() == 0]
    assert len(freed) == len(stash) - MID.shape["num_hidden_layers"]  # all but the shared up_proj weights
    for block in decoder_layers(model):
        w = block.mlp.up_proj.weight
        assert w.untyped_storage().nbytes() == w.numel() * 2 and 0.015 < w.float().std().item() < 0.025
    assert live_bytes(baseline=base) - owned_bytes(model) <= SLACK


def test_materialize_records_nothing_when_the_hook_leaves_no_reference(monkeypatch) -> None:
    notes: list[str] = []
    monkeypatch.setattr(common, "BUILD_NOTES", notes)
    model = materialize(build_meta_model(MID, torch.bfloat16), "device", device=torch.device("cpu"))
    assert notes == []
    w = decoder_layers(model)[0].mlp.up_proj.weight
    assert w.untyped_storage().nbytes() == w.numel() * 2 and 0.015 < w.float().std().item() < 0.025


@pytest.mark.gpu
def test_tidal_build_on_cuda_peaks_at_one_block_and_leaves_nothing_behind() -> None:
    from engines import tidal_engine

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = tidal_engine.build_model(MID, "nf4", dev, 0)
    peak = torch.cuda.max_memory_allocated(dev) - start
    one_block = bf16_block_bytes()
    # the block being filled (bf16 + fp32 LoRA), its quantized copy and the quantizer's fp32 temporaries;
    # blocks done are on the host (every block kept on the device would be 6 bf16 blocks)
    assert peak <= 3 * one_block, (peak / MiB, one_block / MiB)
    assert torch.cuda.memory_allocated(dev) - start <= SLACK
    assert all(p.device.type == "cpu" for p in model.parameters())
