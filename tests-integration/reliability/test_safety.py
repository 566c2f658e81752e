"""Safety: loaders never unpickle unless asked; the arena never hands out memory a copy still uses; the
library makes no network calls."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tidal_arena import ArenaConfig, PinnedArena

pytestmark = pytest.mark.timeout(180)
HERE = Path(__file__).parent


class _Trap:
    """Unpickling this object creates a marker file (as a malicious checkpoint would run code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "pytorch_model.bin.index.json"])
def test_load_model_refuses_pickle_checkpoints(name, tmp_path):
    pytest.importorskip("transformers")
    from tidal_hf import CheckpointError, load_model, tiny_config

    folder = tmp_path / "model"
    folder.mkdir()
    tiny_config("llama").save_pretrained(folder)
    marker = tmp_path / "code-ran"
    if name.endswith(".json"):
        (folder / "pytorch_model-00001-of-00001.bin").write_bytes(pickle.dumps(_Trap(marker)))
        (folder / name).write_text(
            json.dumps({"weight_map": {"lm_head.weight": "pytorch_model-00001-of-00001.bin"}})
        )
    else:
        (folder / name).write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.raises(CheckpointError, match="pickle") as err:
        load_model(str(folder), quantize=None, device="cpu", progress=False)
    assert "allow_pickle" in str(err.value), str(err.value)
    assert not marker.exists(), "the checkpoint was unpickled (its code ran)"


class _LaterEvent:
    """A CPU stand-in for a CUDA event: ``query()`` is True once the simulated copy finished."""

    def __init__(self, clock: list[int], done_at: int) -> None:
        self.clock = clock
        self.done_at = done_at

    def query(self) -> bool:
        return self.clock[0] >= self.done_at


def _fill(t: torch.Tensor, rng: random.Random) -> int:
    t.copy_(
        torch.randint(
            0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(2**31))
        )
    )
    return int(t.to(torch.int64).sum()) ^ int(
        t[: min(64, t.numel())].to(torch.int64).dot(torch.arange(min(64, t.numel())))
    )


def _checksum(t: torch.Tensor) -> int:
    return int(t.to(torch.int64).sum()) ^ int(
        t[: min(64, t.numel())].to(torch.int64).dot(torch.arange(min(64, t.numel())))
    )


def test_arena_stress_never_reuses_memory_in_flight(request):
    """5,000 random alloc/free operations; a third of the frees are guarded by an event that completes
    1-40 ticks later (a copy still reading the block). Every block is filled with random bytes when handed
    out; a guarded block's checksum is verified when its copy completes, and no live or in-flight block may
    overlap a newly handed-out one."""
    rng = random.Random(1234)
    clock = [0]
    live: list[tuple[object, int, int, int]] = []  # (block, start, end, checksum)
    inflight: list[
        tuple[_LaterEvent, torch.Tensor, int, int, int]
    ] = []  # (event, view, checksum, start, end)
    ops = verified = 0
    with PinnedArena(
        ArenaConfig(backend="pageable", slab_bytes=1 << 16, max_pinned_bytes=1 << 20, alignment=64)
    ) as arena:
        for _ in range(5000):
            clock[0] += 1
            ops += 1
            # copies that finished: their memory must still hold what they were reading
            for item in [x for x in inflight if x[0].query()]:
                ev, view, want, _, _ = item
                assert _checksum(view) == want, "memory of an in-flight copy was overwritten"
                inflight.remove(item)
                verified += 1
            if live and (rng.random() < 0.45 or len(live) > 60):
                blk, s, e, want = live.pop(rng.randrange(len(live)))
                t = blk.tensor()
                assert _checksum(t) == want, "a live block was overwritten"
                if rng.random() < 0.33:
                    ev = _LaterEvent(clock, clock[0] + rng.randint(1, 40))
                    inflight.append((ev, t, want, s, e))  # the copy keeps reading t (a view) after free
                    blk.free(after=ev)
                else:
                    blk.free()
                continue
            n = rng.choice([1, 7, 64, 100, 511, 4096, rng.randint(1, 30000)])
            try:
                blk = arena.alloc(n, tag=rng.choice(["a", "b", "c"]))
            except Exception as e:  # the cap may be reached while many copies are in flight
                assert "cannot allocate" in str(e)
                continue
            start = blk.data_ptr
            end = start + blk.nbytes
            for _, s, e, _ in live:
                assert end <= s or start >= e, "a new block overlaps a live block"
            for _, _, _, s, e in inflight:
                assert end <= s or start >= e, "a new block overlaps memory a copy still reads"
            live.append((blk, start, end, _fill(blk.tensor(), rng)))
        for blk, *_ in live:
            blk.free()
        clock[0] += 100
        st = arena.stats()
        assert st.blocks == 0 and st.used_bytes == 0 and st.pending_bytes == 0
    request.node.user_properties.append(("arena_ops", ops))
    request.node.user_properties.append(("arena_inflight_verified", verified))
    assert verified > 300


@pytest.mark.gpu
def test_arena_stress_cuda_copies_in_flight():
    """Real copies: a block is copied to the device on a side stream and freed behind the copy's event;
    new blocks are written at once. Every device copy must equal what the block held when it was queued."""
    rng = random.Random(7)
    stream = torch.cuda.Stream()  # why: the copies run beside the writes of the host, as the H2D stream does
    expected, outputs = [], []
    with PinnedArena(ArenaConfig(slab_bytes=1 << 22, max_pinned_bytes=1 << 24)) as arena:
        for _ in range(2000):
            n = rng.choice([512, 4096, 65536, rng.randint(1, 1 << 20)])
            blk = arena.alloc(n)
            t = blk.tensor()
            t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            expected.append(t.clone())
            with torch.cuda.stream(stream):
                outputs.append(t.to("cuda", non_blocking=True))
                ev = torch.cuda.Event()
                ev.record(stream)  # why: the block may be reused only after this copy read it
            blk.free(after=ev)
        torch.cuda.synchronize()
        for want, got in zip(expected, outputs):
            assert torch.equal(want, got.cpu()), "a block was reused while its copy was in flight"


def test_no_network_calls(tmp_path):
    """In a fresh process with every socket constructor raising: import the packages, profile, plan,
    wrap and train a small model with the host optimizer, build a random-weights HF model and its cache."""
    code = textwrap.dedent(
        f"""
        import socket, sys
        def refuse(*a, **k):
            raise RuntimeError("network access attempted")
        class NoSocket(socket.socket):
            def __init__(self, *a, **k):
                refuse()
        socket.socket = NoSocket
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        sys.path.insert(0, {str(HERE)!r})
        import torch
        torch.set_num_threads(1)
        import tidal, tidal_arena, tidal_kv, tidal_plan, tidal_quant, tidal_stream, tidal_hf
        from _common import batches, loss_of, make_model
        m = make_model()
        c = tidal_plan.census(m, example_inputs={{"idx": torch.zeros(1, 8, dtype=torch.long)}})
        p = tidal_plan.plan(c, tidal_plan.HardwareProfile.synthetic(), tidal_plan.PlanConfig(batch_tokens=32))
        m, opt = tidal_stream.wrap(m, torch.optim.AdamW(m.parameters()), offload=True, max_grad_norm=1.0)
        for b in batches(2):
            loss_of(m, b).backward(); opt.step(); opt.zero_grad()
        tidal_stream.unwrap(m)
        tidal_quant.quantize(torch.randn(16, 64), "nf4")
        hf = tidal_hf.load_model(tidal_hf.tiny_config("llama"), random_weights=True, quantize=None, device="cpu", progress=False)
        with torch.no_grad():  # a cache serves generation, which runs without autograd
            out = hf(torch.randint(0, 100, (1, 8)), past_key_values=tidal_hf.TidalCache(hf, 32))
        print("OK", tuple(out.logits.shape))
        """
    )
    env = {"HOME": str(tmp_path), "TIDAL_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    import os

    for k in ("PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV"):
        if k in os.environ:
            env[k] = os.environ[k]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
