"""Data parallel on CPU processes (gloo): parity with single-process training, the shared host copy's
memory accounting, a rank failure raising on every rank, checkpoints under DP. Ranks are started as
subprocesses with torchrun's environment variables (``dp_worker.py``)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

from tidal_stream import OptionError, StreamError
from tidal_stream.distributed import DistributedConfig, host_ram_share, local_layout, resolve_distributed
from tidal_testing import assert_bitwise_equal, max_abs_diff, torch_threads

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "dp_worker.py"
_spec = importlib.util.spec_from_file_location("tidal_stream_dp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# Bounds on max |Δp| after 10 fp32 steps (lr 1e-3) against single-process torch.optim.AdamW(fused=True):
# - SAME_SPLIT: the reference computes the gradient as DP does (one backward per rank's rows, summed,
#   divided) — what DP must reproduce up to summation order (measured: 0 for 2 ranks, 1.5e-7 for 3);
# - against a reference taking one backward over the whole global batch the gap is what splitting the
#   batch alone causes (computed, never assumed): Adam normalises each element by its own magnitude, so
#   attention weights whose gradient is partly round-off move by 8e-7 (2 ranks) to 6e-6 (3 ranks);
#   DP must stay within that gap + SAME_SPLIT. The LoRA-like model (lr 1e-2, 5 steps) is held to the
#   same two bounds: its whole-batch gap was 6.5e-7 on one CPU and 9.6e-6 on another (the CPU's own
#   matmul kernels decide the round-off that Adam then normalises).
SAME_SPLIT = 1e-6

# [Note: CUDA AdamW is not the host's] the ranks update on the host with the CPU fused AdamW; a reference
# running torch.optim.AdamW(fused=True) on CUDA uses another kernel with other rounding: nvcc contracts
# ``beta1 * m + (1 - beta1) * g``, ``beta2 * v + (1 - beta2) * g * g`` and the decay of p into FMAs (one
# rounding each) where the CPU kernel rounds its vector products and sums separately, and the two take
# the bias corrections / step size in different precisions. So m, v and p drift apart by ~1 ulp per step,
# and Adam divides m by sqrt(v) element by element: where a gradient is mostly round-off, that ulp is a
# visible change of the update (measured on the GPU machine: 1.43e-6 after 10 steps, over SAME_SPLIT).
# The gap is between the two kernels, not caused by data parallel. The gradients themselves agree bit
# for bit: each rank's backward is the reference's per-half backward, the all-reduce of 2 ranks is one
# (commutative) addition per element and /2 is exact. So on CUDA the parity tests compare with
# ``reference(..., host_adamw=True)`` (backward on the GPU, the update by the CPU fused AdamW on fp32
# copies, as the ranks do) within SAME_SPLIT, and with the CUDA-AdamW reference only within the computed
# gap between the two references + SAME_SPLIT.


@pytest.fixture(autouse=True)
def _one_thread():
    """References computed here run on one thread, as the ranks do (OMP_NUM_THREADS=1)."""
    with torch_threads(1):
        yield


def _free_port() -> int:
    """A port for rank 0's rendezvous store that nothing else is likely to take before rank 0 binds it.

    A port the OS hands out (bind to 0) comes from the ephemeral range, which other launches' ranks also draw
    from for their outgoing connections (gloo pairs, NCCL bootstrap): once on the GPU machine one of them took
    such a port between this probe and rank 0's bind (EADDRINUSE). Ports just below that range are only ever
    taken by explicit binds, so the probe picks one of those at random.
    """
    low = 32768  # Linux's default start of the ephemeral range
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.Random()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: try another
            return port
    with socket.socket() as s:  # nothing free below the range: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    scenario: str,
    world: int,
    tmp: pathlib.Path,
    wait_for: list[int] | None = None,
    limit_s: float = 28.0,
    **cfg: object,
) -> list[dict]:
    """Start ``world`` ranks as torchrun would; wait (at most ``limit_s``) for the ranks in ``wait_for``
    (all by default), kill the rest; return each rank's result (``{"missing": output}`` when it wrote
    none)."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, str(WORKER), scenario, str(tmp), json.dumps(cfg)]
        log = open(tmp / f"log{r}.txt", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + limit_s
    try:
        for r in wait_for if wait_for is not None else range(world):
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[r][0].wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    results = []
    for r in range(world):
        f = tmp / f"result{r}.json"
        text = (tmp / f"log{r}.txt").read_text(errors="replace")[-3000:]
        results.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "missing": text})
    return results


def _ok(results: list[dict]) -> None:
    bad = [r for r in results if "missing" in r]
    assert not bad, bad[0]["missing"]


def _load(tmp: pathlib.Path, world: int) -> list[dict]:
    params = [torch.load(tmp / f"params{r}.pt", weights_only=True) for r in range(world)]
    for r in range(1, world):
        for k in params[0]:
            assert torch.equal(params[r][k], params[0][k]), f"rank {r} differs from rank 0 in {k}"
    return params


def _diff(a: dict, b: dict) -> float:
    return max(max_abs_diff(a[k], b[k]) for k in b)


def test_parity_and_checkpoint_2_ranks(tmp_path: pathlib.Path) -> None:
    """10 steps on 2 ranks with a checkpoint after 5: rank 0 saves, a fresh wrap on every rank loads it."""
    res = launch("parity", 2, tmp_path, steps=10, ckpt_at=5)
    _ok(res)
    got = _load(tmp_path, 2)[0]
    same, full = worker.reference(10, split=2), worker.reference(10)
    assert _diff(got, same) < SAME_SPLIT, f"max |Δp| {_diff(got, same):.3g} after 10 steps"
    assert _diff(got, full) < _diff(same, full) + SAME_SPLIT
    # the shards tile the flat parameters exactly once; several buckets were used
    shards = sorted((r["shard_lo"], r["shard_hi"]) for r in res)
    assert shards[0][0] == 0 and shards[-1][1] == res[0]["numel"] and shards[0][1] == shards[1][0]
    assert res[0]["buckets"] > 1
    assert sum(r["early_updates"] for r in res) > 0  # host updates started during backward
    assert any("peer pooling: off (DistributedConfig.peer_pooling=False)" in m for m in res[0]["events"])
    # the DP checkpoint is a full torch.optim.AdamW state dict: it resumes in one process without DP
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    single = worker.reference(5, state=ck, first=5, split=2)
    assert _diff(single, same) < SAME_SPLIT, "the DP checkpoint resumed by torch.optim.AdamW"


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_parity_ranks_clip_and_accumulation(tmp_path: pathlib.Path, world: int) -> None:
    """3 ranks (uneven shards) or 4 (the next machine size), 2 micro-steps each, global-norm clipping:
    against the reference split 2 * world ways."""
    res = launch("parity", world, tmp_path, steps=10, clip=0.5, accum=2)
    _ok(res)
    got = _load(tmp_path, world)[0]
    same, full = worker.reference(10, clip=0.5, split=2 * world), worker.reference(10, clip=0.5)
    assert _diff(got, same) < SAME_SPLIT, f"max |Δp| {_diff(got, same):.3g} after 10 steps"
    assert _diff(got, full) < _diff(same, full) + SAME_SPLIT
    assert all(r["early_updates"] == 0 for r in res)  # clipping: every update waits for the global norm


@pytest.mark.parametrize("meta_ranks", [(), (1,)], ids=["loaded-everywhere", "meta-on-rank-1"])
def test_shared_host_copy_accounting(tmp_path: pathlib.Path, meta_ranks: tuple[int, ...]) -> None:
    """One copy per node by the kernel's accounting; training as in one process. With rank 1 holding the
    frozen weights as meta placeholders, it trains on the copy rank 0 filled, bit for bit the same."""
    world, page = 2, 4096
    res = launch("shared", world, tmp_path, meta_frozen_ranks=list(meta_ranks))
    _ok(res)
    # the adapters train as in one process on the whole batch (the frozen base read from the shared copy)
    got = _load(tmp_path, world)[0]
    same, full = worker.lora_reference(split=world), worker.lora_reference()
    diff = _diff(got, same)
    assert diff < SAME_SPLIT, f"LoRA-like model: max |Δp| {diff:.3g} after {worker.LORA_STEPS} steps"
    assert _diff(got, full) < _diff(same, full) + SAME_SPLIT
    nbytes = res[0]["shared"]["bytes"]
    assert nbytes >= res[0]["frozen_bytes"] > 2**19  # the frozen base: 512 KiB and its biases
    assert all(r["frozen_same"] for r in res)
    # bytes are counted once per node ...
    assert sum(r["shared"]["counted_bytes"] for r in res) == nbytes
    # ... and the kernel agrees: every rank maps all of it, their proportional shares add up to one copy
    for r in res:
        assert r["shared"]["mapped_rss"] >= nbytes - page
    pss = sum(r["shared"]["mapped_pss"] for r in res)
    assert abs(pss - -(-nbytes // page) * page) <= world * 1024, (pss, nbytes)
    assert not pathlib.Path(res[0]["shared"]["path"]).exists()  # the name is unlinked once mapped
    assert any("host RAM share" in m for m in res[0]["events"])
    assert all(r["frozen_devices"] == ["cpu"] for r in res)  # placeholders became host views
    assert any("placeholders on the meta device filled from it" in m for m in res[1]["events"]) == bool(
        meta_ranks
    )


@pytest.mark.parametrize(("mode", "world"), [pytest.param("crash", 3, marks=pytest.mark.slow), ("stall", 2)])
def test_rank_failure_raises_everywhere(tmp_path: pathlib.Path, mode: str, world: int) -> None:
    """Rank 1 dies (or stalls) at step 2: every other rank raises DistributedError within the timeout."""
    timeout = 3.0
    survivors = [r for r in range(world) if r != 1]
    res = launch("fail", world, tmp_path, wait_for=survivors, mode=mode, timeout=timeout, pg_timeout=timeout)
    for r in (res[i] for i in survivors):
        assert "missing" not in r, r.get("missing")
        assert r["error"] == "DistributedError", r
        assert f"rank {r['rank']} of {world}" in r["message"] and "Fix:" in r["message"]
        assert r["elapsed"] < timeout + 8.0  # raised within the timeout (plus start-up slack), not a hang


def _check_cuda_run(res: list[dict], tmp: pathlib.Path, devices: list[str]) -> None:
    """Parity on CUDA (see [Note: CUDA AdamW is not the host's]) and the memory accounting of each rank."""
    got = _load(tmp, len(res))[0]
    host = worker.reference(10, split=2, device="cuda", host_adamw=True)
    cuda = worker.reference(10, split=2, device="cuda")
    gap = _diff(host, cuda)  # the two AdamW kernels' gap, computed
    assert _diff(got, host) < SAME_SPLIT, (
        f"max |Δp| {_diff(got, host):.3g} against the host-AdamW reference "
        f"({_diff(got, cuda):.3g} against the CUDA-AdamW one; kernel gap {gap:.3g})"
    )
    assert _diff(got, cuda) < gap + SAME_SPLIT
    numel, shard = res[0]["numel"], -(-res[0]["numel"] // 2)
    for r, dev in zip(res, devices):
        # the host holds only this rank's optimizer shard: fp32 master, two moments and the gradient
        assert r["shard_numel"] in (shard, numel - shard)
        assert r["optimizer_host_bytes"] == 4 * 4 * shard <= r["host_bytes"]
        # frozen weights are resident on this rank's GPU, so no host copy of them exists to share
        assert r["frozen_devices"] == [dev] and r["shared_host"] is None
        assert any("no frozen weights in host memory on any rank" in m for m in r["events"])
        assert r["device_weights_bytes"] > 0


@pytest.mark.gpu
def test_parity_2_processes_sharing_one_gpu(tmp_path: pathlib.Path) -> None:
    """Two ranks on cuda:0 (gloo: NCCL refuses two ranks on one GPU), against single-process references."""
    res = launch("parity", 2, tmp_path, limit_s=55.0, steps=10, device="cuda")
    _ok(res)
    assert all(r["backend"] == "gloo" for r in res)
    _check_cuda_run(res, tmp_path, ["cuda:0", "cuda:0"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallel needs two GPUs")
def test_parity_nccl_two_gpus(tmp_path: pathlib.Path) -> None:
    """Two ranks with NCCL, one GPU each: gradients and weights go through NCCL on CUDA tensors. Bound:
    SAME_SPLIT against the host-AdamW reference on one GPU (the all-reduce of 2 ranks is one addition per
    element, commutative, and /2 is exact, so the only freedom left is kernel choice across two identical
    GPUs); the CUDA-AdamW reference within the computed kernel gap + SAME_SPLIT."""
    res = launch("parity", 2, tmp_path, limit_s=55.0, steps=10, backend="nccl", device="cuda")
    _ok(res)
    assert all(r["backend"] == "nccl" for r in res)
    _check_cuda_run(res, tmp_path, ["cuda:0", "cuda:1"])


def test_options_and_layout_functions() -> None:
    assert resolve_distributed(False) is None
    assert resolve_distributed("auto") is None  # no process group in this process
    with pytest.raises(OptionError, match="distributed"):
        resolve_distributed(True)
    with pytest.raises(OptionError, match="distributed"):
        resolve_distributed("yes")  # type: ignore[arg-type]
    for bad in (
        {"bucket_bytes": 0},
        {"timeout": -1.0},
        {"timeout": True},
        {"share_frozen": 1},
        {"shm_dir": ""},
    ):
        with pytest.raises(OptionError, match="distributed"):
            DistributedConfig(**bad)  # type: ignore[arg-type]
    assert DistributedConfig(timeout=None).timeout is None
    gib = 2**30
    assert host_ram_share(100 * gib, 4, 20 * gib) == 40 * gib
    assert host_ram_share(100 * gib, 1) == 100 * gib
    with pytest.raises(ValueError):
        host_ram_share(gib, 0)
    # ranks of two machines, interleaved: local ranks and node numbers come from host names alone
    hosts = ["a", "b", "a", "b", "b"]
    assert [local_layout(hosts, r) for r in range(5)] == [
        (0, 2, 0),
        (0, 3, 1),
        (1, 2, 0),
        (1, 3, 1),
        (2, 3, 1),
    ]
    assert datetime.timedelta(seconds=DistributedConfig().timeout).total_seconds() == 300.0


@pytest.fixture
def one_rank_group(tmp_path: pathlib.Path):
    """A process group of one rank in this process (gloo, file store)."""
    import torch.distributed as dist

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(old)


def test_one_rank_is_bitwise_torch_adamw(one_rank_group: None) -> None:
    """distributed=True on one rank: the same arithmetic as torch.optim.AdamW, bit for bit."""
    from tidal_stream import memory_report, unwrap, wrap

    model = worker.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=worker.LR, weight_decay=worker.WD)
    model, opt = wrap(model, opt, distributed=DistributedConfig(bucket_bytes=4096, timeout=10.0))
    for step in range(5):
        worker.loss_on(model, *worker.global_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    ref = worker.reference(5)
    for k, v in model.state_dict().items():
        assert_bitwise_equal(v, ref[k])
    rep = memory_report(model)["distributed"]
    assert rep["world"] == 1 and rep["shard_numel"] == rep["numel"]
    assert rep["shared_host"]["counted_bytes"] == rep["shared_host"]["bytes"] > 0  # the frozen vector
    sd = opt.state_dict()
    assert (
        set(sd["state"][2]) == {"step", "exp_avg", "exp_avg_sq", "master"}
        and float(sd["state"][2]["step"]) == 5
    )
    unwrap(model)
    with pytest.raises(StreamError, match="closed"):
        opt.step()


def test_one_shared_copy_per_machine_across_two_machines(tmp_path: pathlib.Path) -> None:
    """3 ranks on two simulated machines, interleaved (hosts a, b, a): each machine gets its own copy,
    filled by its local rank 0 (ranks 0 and 1) and counted there once; rank 2 (local rank 1 on machine a)
    holds meta placeholders and trains on its machine's copy: bit for bit as 3 ranks of one machine."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = launch("shared", 3, tmp_path / "one", limit_s=60.0, timeout=45.0)
    res = launch("shared", 3, tmp_path / "two", limit_s=60.0, hosts=["a", "b", "a"], meta_frozen_ranks=[2])
    _ok(one)
    _ok(res)
    two = _load(tmp_path / "two", 3)[0]
    for k, v in _load(tmp_path / "one", 3)[0].items():
        assert_bitwise_equal(two[k], v)
    paths = [r["shared"]["path"] for r in res]
    assert paths[0] == paths[2] != paths[1]  # one mapping per machine
    nbytes = res[0]["shared"]["bytes"]
    assert [r["shared"]["counted_bytes"] for r in res] == [nbytes, nbytes, 0]
    assert [r["shared"]["local_world"] for r in res] == [2, 1, 2]
    assert all(r["frozen_same"] and r["frozen_devices"] == ["cpu"] for r in res)
    assert any("placeholders on the meta device filled from it" in m for m in res[2]["events"])


def test_meta_placeholders_on_local_rank_0_are_refused(tmp_path: pathlib.Path) -> None:
    """Local rank 0 fills the node's copy: frozen weights on the meta device there are a clear error on
    every rank (the layout exchange is collective), not a crash inside the copy."""
    res = launch("shared", 2, tmp_path, meta_frozen_ranks=[0])
    for r in res:
        assert r["error"] == "DistributedError", r
        assert "local rank 0 of node 0 (rank 0) holds" in r["message"] and "Fix:" in r["message"]


def test_a_full_tmpfs_is_refused_up_front(
    one_rank_group: None, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room is checked before the copy starts (the file is sparse, so a full tmpfs would otherwise show as
    SIGBUS on a write): the error gives both sizes and the ways out."""
    import types

    from tidal_stream.distributed import DistributedError, dp_context
    from tidal_stream.shared_host import SharedHostCopy

    model = worker.LoraLike()
    ctx = dp_context(DistributedConfig(timeout=10.0), torch.device("cpu"))
    monkeypatch.setattr("os.statvfs", lambda path: types.SimpleNamespace(f_bavail=16, f_frsize=4096))
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(DistributedError, match=r"has 0.00 GiB free, the copy needs .* Fix: enlarge"):
        SharedHostCopy.share_frozen(model, ctx, str(shm), "t", lambda k, m, **d: None)
    assert not list(shm.iterdir())  # nothing was created


def test_after_first_update_runs_once(one_rank_group: None) -> None:
    """The one-shot callback wrap_distributed() arms for the measured refinement runs after the first
    update only (not after a micro-step of accumulation, not again)."""
    from tidal_stream import unwrap, wrap

    model = worker.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=worker.LR)
    model, opt = wrap(model, opt, distributed=DistributedConfig(timeout=10.0), accumulation_steps=2)
    calls: list[int] = []
    opt._after_first_update = lambda: calls.append(len(calls))
    for step in range(4):
        worker.loss_on(model, *worker.global_batch(step)).backward()
        opt.step()
        assert calls == ([] if step == 0 else [0]), step
        opt.zero_grad()
    unwrap(model)


@pytest.mark.gpu
def test_offloaded_activations_that_fit_are_kept_after_the_first_step(one_rank_group: None) -> None:
    """One rank on CUDA, every block's activations offloaded by request: after the first update the measured
    room (the whole GPU) keeps them on the device; the loss is the same as with offloading (bit-identical
    copies of the same tensors). With the frozen bases streamed by request too, the same room first stops
    streaming them (every block), with the same losses (the same weights, read from the device)."""
    from tidal_stream import memory_report, unwrap, wrap

    losses = {}
    runs = (("offload", True, False), ("keep", False, False), ("streamed", True, True))
    for name, offload, streamed in runs:
        model = worker.PoolNet().cuda()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=worker.LORA_LR)
        model, opt = wrap(
            model,
            opt,
            distributed=DistributedConfig(timeout=30.0, peer_pooling=False),
            blocks="blocks",
            param_offload=streamed,
            recompute=False,
            activation_offload=offload,
        )
        losses[name] = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(256, 256, generator=gen).cuda()  # [256, 256]: saved tensors of 256 KiB, offloaded
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
        report = memory_report(model)
        events = [e["message"] for e in report["events"]]
        if offload:
            line = next(m for m in events if m.startswith("measured first step"))
            assert "blocks 0-3 KEEP their activations on the device" in line, line
            assert ("blocks 0-3 STOP STREAMING" in line) == streamed, line
            if streamed:
                ws = report["weight_streaming"]
                assert ws["streamed_ever"] == [0, 1, 2, 3] and ws["streamed"] == [], ws
        else:
            assert not any(m.startswith("measured first step") for m in events)
        unwrap(model)
    assert losses["offload"] == losses["keep"] == losses["streamed"]


def test_dp_option_errors(one_rank_group: None) -> None:
    from tidal_stream import wrap

    model = worker.make_model()
    for bad in ({"distributed": "yes"}, {"distributed": 1}):
        with pytest.raises(OptionError, match="distributed"):
            wrap(model, None, **bad)
    with pytest.raises(OptionError, match="delayed_update"):
        wrap(model, None, distributed=True, delayed_update=True)
    with pytest.raises(OptionError, match="offload"):
        wrap(model, None, distributed=True, offload=False)
    lora = worker.LoraLike()
    lora.base[0]._parameters["weight"] = torch.nn.Parameter(torch.empty(256, 256, device="meta"), False)
    with pytest.raises(OptionError, match=r"distributed.share_frozen=False is invalid.*meta placeholders"):
        wrap(lora, None, distributed=DistributedConfig(share_frozen=False))


def test_one_rank_bf16_weights_match_offload_adamw(one_rank_group: None) -> None:
    """bf16 weights, fp32 masters: the sharded optimizer on one rank and OffloadAdamW (offload=True) agree
    bit for bit — the same widening, fused host kernel and narrowing."""
    from tidal_stream import unwrap, wrap

    def run(**options: object) -> dict:
        model = worker.make_model().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=worker.LR, weight_decay=worker.WD)
        model, opt = wrap(model, opt, **options)
        for step in range(4):
            worker.loss_on(model, *worker.global_batch(step)).float().backward()
            opt.step()
            opt.zero_grad()
        out = {k: v.detach().clone() for k, v in model.state_dict().items()}
        unwrap(model)
        return out

    dp = run(distributed=DistributedConfig(bucket_bytes=2048, timeout=10.0))
    single = run(distributed=False, offload=True)
    for k, v in single.items():
        assert_bitwise_equal(dp[k], v)


def test_plan_gets_the_host_ram_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the plan is made with this rank's share of the machine's host RAM (no GPU needed: the
    profile and planner are stand-ins that record what they were given)."""
    import types

    import tidal_plan
    from tidal_stream import distributed

    gib = 2**30
    seen: dict[str, object] = {}

    def profile(device: object, **kw: object) -> str:
        seen["profile_host_ram"] = kw["host_ram"]
        return "profile"

    def plan(census: object, profile: object, config: tidal_plan.PlanConfig) -> object:
        seen["config"] = config
        return types.SimpleNamespace(explain=lambda: "the plan")

    monkeypatch.setattr(tidal_plan, "profile_hardware", profile)
    monkeypatch.setattr(tidal_plan, "plan", plan)
    monkeypatch.setattr(distributed, "_host_available", lambda: 65 * gib)
    events: list[tuple[str, str, dict]] = []
    session = types.SimpleNamespace(
        device=torch.device("cuda", 0), plan=None, record=lambda k, m, **d: events.append((k, m, d))
    )
    ctx = types.SimpleNamespace(local_rank=1, local_world=4)
    opts = types.SimpleNamespace(
        plan=None, blocks=None, vram_budget="8GiB", batch_tokens=None, param_offload="auto"
    )
    distributed._plan_share(session, worker.make_model(), opts, ctx, 1 * gib)
    assert seen["profile_host_ram"] == 17 * gib  # the shared GiB once + a quarter of the other 64
    assert seen["config"].host_ram == 17 * gib and seen["config"].offload is True
    assert session.plan is not None and events[0][2]["host_ram_share"] == 17 * gib
    # a full fine-tune: the sharded optimizer cannot update streamed weights, so the plan streams none
    assert seen["config"].param_offload is False
    assert any("trained weights stay on the GPU" in m for _, m, _ in events)


def test_full_fine_tune_that_cannot_stay_resident_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data parallel full fine-tuning under a budget too small for its resident trained weights: refused
    before anything moves, with the numbers and the ways out that apply under data parallel."""
    import types

    import tidal_plan
    from tidal_plan import HardwareProfile, InfeasiblePlan
    from tidal_stream import distributed

    with torch.device("meta"):  # 8 trained blocks of 128 MiB (bf16): shapes only, no memory
        model = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192, bias=False) for _ in range(8))).bfloat16()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 3 * weights // 4  # a quarter of the blocks would have to stream
    profile = HardwareProfile.synthetic(vram_budget_bytes=budget)
    monkeypatch.setattr(tidal_plan, "profile_hardware", lambda device, **kw: profile)
    monkeypatch.setattr(distributed, "_host_available", lambda: 64 * 2**30)
    session = types.SimpleNamespace(device=torch.device("cuda", 0), plan=None, record=lambda k, m, **d: None)
    ctx = types.SimpleNamespace(local_rank=0, local_world=2)
    opts = types.SimpleNamespace(
        plan=None, blocks=None, vram_budget=budget, batch_tokens=None, param_offload="auto"
    )
    with pytest.raises(
        InfeasiblePlan, match=r"Under data parallel a full fine-tune keeps its .* raise vram_budget"
    ):
        distributed._plan_share(session, model, opts, ctx, 0)
    assert session.plan is None


def test_no_block_stack_means_no_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, a model without a block stack (adapter + head, as in the torchrun job) is not planned: the
    rank records why and goes on; a wrong explicit ``blocks=`` still raises (no GPU needed)."""
    import types

    import tidal_plan
    from tidal_stream import distributed

    monkeypatch.setattr(distributed, "_host_available", lambda: 2**30)
    events: list[tuple[str, str, dict]] = []
    session = types.SimpleNamespace(
        device=torch.device("cuda", 0), plan=None, record=lambda k, m, **d: events.append((k, m, d))
    )
    ctx = types.SimpleNamespace(local_rank=0, local_world=2)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8).requires_grad_(False), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    opts = types.SimpleNamespace(
        plan=None, blocks=None, vram_budget=None, batch_tokens=None, param_offload="auto"
    )
    distributed._plan_share(session, model, opts, ctx, 0)
    assert session.plan is None
    assert events[-1][0] == "plan" and "no block stack" in events[-1][1]
    with pytest.raises(tidal_plan.PlanConfigError, match="blocks"):
        distributed._plan_share(
            session, model, types.SimpleNamespace(**(vars(opts) | {"blocks": "missing"})), ctx, 0
        )


def test_comm_device_follows_the_backend() -> None:
    from tidal_stream.distributed import comm_device_for

    cuda1, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert comm_device_for("nccl", cuda1) == cuda1  # NCCL reduces CUDA tensors only
    assert comm_device_for("gloo", cuda1) == cpu  # ranks sharing one GPU reduce on the host
    assert comm_device_for("gloo", cpu) == cpu
    assert comm_device_for("cpu:gloo,cuda:nccl", cuda1) == cuda1  # torch's default pair: NCCL for CUDA
    assert comm_device_for("cpu:gloo,cuda:nccl", cpu) == cpu
    with pytest.raises(OptionError, match="device"):
        comm_device_for("nccl", cpu)
    with pytest.raises(OptionError, match="backend"):
        comm_device_for("mpi", cpu)


def test_host_adamw_reference_is_the_cpu_reference() -> None:
    """The CUDA parity references run the update on CPU copies; on the CPU that must change nothing."""
    a = worker.reference(3, split=2)
    b = worker.reference(3, split=2, host_adamw=True)
    for k, v in a.items():
        assert_bitwise_equal(b[k], v)


# ------------------------------------------------------------------------------------------ peer pooling
_BLOCK = 256 * 256 * 4 + 1024  # one frozen base (weight + bias), as its owner's buffer holds it (aligned)


def _pool_runs(tmp: pathlib.Path, mode: object, **cfg: object) -> tuple[list[dict], list[dict]]:
    """The pool scenario on 2 ranks without pooling, then with ``mode``; each rank's results."""
    from tidal_stream.peer_pool import PEER_CONTEXT_BYTES

    runs = []
    # the unpooled baseline keeps streaming every block; the pooled run's own refinement stays armed (it
    # must leave the pooled blocks streaming: equal fetch counts check it)
    for name, pooling, keep in (("off", False, True), ("on", mode, False)):
        (tmp / name).mkdir()
        # room for one block per GPU (after the peer's context): blocks 0 and 1 pool, 2 and 3 stay on host
        room = PEER_CONTEXT_BYTES + _BLOCK + 4096
        # 45 s a launch (two ranks' cold CUDA start is ~5-15 s each, in parallel): both launches stay within
        # the GPU suite's 100 s per test, so a slow rank fails here with its log rather than in a timeout
        res = launch(
            "pool",
            2,
            tmp / name,
            limit_s=45.0,
            peer_pooling=pooling,
            peer_pool_bytes=room,
            keep_streaming=keep,
            **cfg,
        )
        _ok(res)
        runs.append(res)
    return runs[0], runs[1]


def _check_pool(off: list[dict], on: list[dict], tmp: pathlib.Path, decision: str) -> None:
    """Bit-identical training with and without pooling; the host link carries only unpooled blocks."""
    for r, (a, b) in enumerate(zip(off, on)):
        assert a["losses"] == b["losses"], (r, a["losses"], b["losses"])  # the same bytes reach the GPU
        pa = torch.load(tmp / "off" / f"params{r}.pt", weights_only=True)
        pb = torch.load(tmp / "on" / f"params{r}.pt", weights_only=True)
        for k in pa:
            assert_bitwise_equal(pb[k], pa[k])
        assert a["block_fetches"] == b["block_fetches"] and a["source_bytes"] == 0
        assert a["block_bytes"] == [256 * 256 * 4 + 256 * 4] * 4
        # the same refills; those of the pooled blocks 0 and 1 come from a GPU, not over the host link
        assert b["h2d_bytes"] + b["source_bytes"] == a["h2d_bytes"] > 0
        refilled = [n * f for n, f in zip(b["block_bytes"], b["block_fetches"])]
        assert b["source_bytes"] == sum(refilled[:2]) and b["h2d_bytes"] == sum(refilled[2:])
        pp = b["peer_pooling"]
        assert pp["on"] and pp["pooled_blocks"] == [0, 1] and pp["owned_blocks"] == [r]
        assert pp["owned_bytes"] == _BLOCK
        assert any(decision in m for m in b["events"]), [m for m in b["events"] if "peer pooling" in m]
        assert any("peer pooling: off (DistributedConfig.peer_pooling=False)" in m for m in a["events"])


def test_pool_scenario_on_cpu_is_off_with_reason(tmp_path: pathlib.Path) -> None:
    """peer_pooling='auto' on CPU ranks: off, with the reason logged; the blocks stream from the host."""
    res = launch("pool", 2, tmp_path, peer_pooling="auto", device="cpu")
    _ok(res)
    _load(tmp_path, 2)  # both ranks hold the same weights
    for r in res:
        assert any("peer pooling: off (training on cpu: needs CUDA)" in m for m in r["events"])
        assert r["source_bytes"] == 0 and r["h2d_bytes"] > 0 and r["peer_pooling"] == {"on": False}


@pytest.mark.gpu
def test_peer_pool_2_processes_sharing_one_gpu(tmp_path: pathlib.Path) -> None:
    """Two ranks on cuda:0 (gloo): the CUDA IPC mechanics on one GPU — each rank reads the other's pooled
    block out of the other process's memory; same-GPU copies beat the host link, so 'auto' turns it on."""
    off, on = _pool_runs(tmp_path, "auto")
    _check_pool(off, on, tmp_path, "peer pooling: on: 2 of 4 frozen streamed blocks pooled")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="peer pooling across GPUs needs two GPUs")
def test_peer_pool_nccl_two_gpus(tmp_path: pathlib.Path) -> None:
    """Two ranks with NCCL, one GPU each: block 1 reaches GPU 0 from GPU 1 (and block 0 GPU 1 from GPU 0)
    by peer copies. Needs peer access and a peer copy >= 2x the host link ('auto')."""
    off, on = _pool_runs(tmp_path, "auto", backend="nccl")
    _check_pool(off, on, tmp_path, "peer pooling: on: 2 of 4 frozen streamed blocks pooled")
    line = next(m for m in on[0]["events"] if "peer pooling: on" in m)
    print(line)  # the measured rates, for the record (pytest -s)


def test_streamed_frozen_blocks_read_the_shared_copy(tmp_path: pathlib.Path) -> None:
    """2 CPU ranks streaming frozen blocks: their host copies are the node's shared mapping (one copy per
    node by Pss, no private copy per rank); training is bit-identical to private host copies; unwrap()
    leaves nothing mapped."""
    world, page = 2, 4096
    (tmp_path / "private").mkdir()
    (tmp_path / "shared").mkdir()
    priv = launch("pool", world, tmp_path / "private", device="cpu", share_frozen=False)
    res = launch("pool", world, tmp_path / "shared", device="cpu")
    _ok(priv)
    _ok(res)
    streamed_frozen = 4 * (256 * 256 + 256) * 4  # the four frozen bases, fp32
    for r, (a, b) in enumerate(zip(priv, res)):
        assert a["losses"] == b["losses"], (r, a["losses"], b["losses"])
        pa = torch.load(tmp_path / "private" / f"params{r}.pt", weights_only=True)
        pb = torch.load(tmp_path / "shared" / f"params{r}.pt", weights_only=True)
        for k in pa:
            assert_bitwise_equal(pb[k], pa[k])
        assert a["shared"] is None and a["adopted_host_bytes"] == 0  # the old layout: private copies
        # no private host copy: every streamed frozen byte is read in place from the mapping
        assert b["adopted_host_bytes"] == streamed_frozen and b["host_copies_in_mapping"]
        assert b["h2d_bytes"] == a["h2d_bytes"] > 0  # the same refills, from the mapping
        assert b["shared"]["mapped_rss"] >= streamed_frozen - page  # every rank reads all of it ...
        assert not b["mapped_after_unwrap"]  # ... and unwrap() released it
    nbytes = res[0]["shared"]["bytes"]
    assert nbytes >= streamed_frozen and sum(r["shared"]["counted_bytes"] for r in res) == nbytes
    pss = sum(r["shared"]["mapped_pss"] for r in res)  # ... once per node, by the kernel's accounting
    assert abs(pss - -(-nbytes // page) * page) <= world * 1024, (pss, nbytes)


@pytest.mark.gpu
def test_shared_copy_on_cuda_is_page_locked_and_resident_pages_given_back(tmp_path: pathlib.Path) -> None:
    """2 ranks on cuda:0 (gloo), the model on the host at wrap(), half the blocks streamed: the streamed
    bases are read in place from the node's mapping, page-locked on each rank; the resident half's pages
    are given back to the kernel; training is bit-identical to private host copies."""
    world, page = 2, 4096
    runs = {}
    for name, share in (("private", False), ("shared", True)):
        (tmp_path / name).mkdir()
        cfg = {"device": "cuda:0", "model_device": "cpu", "param_offload": 0.5, "share_frozen": share}
        runs[name] = launch("pool", world, tmp_path / name, limit_s=45.0, **cfg)
        _ok(runs[name])
    base = (256 * 256 + 256) * 4  # one frozen base (weight + bias), fp32
    for r, (a, b) in enumerate(zip(runs["private"], runs["shared"])):
        assert a["losses"] == b["losses"], (r, a["losses"], b["losses"])
        pa = torch.load(tmp_path / "private" / f"params{r}.pt", weights_only=True)
        pb = torch.load(tmp_path / "shared" / f"params{r}.pt", weights_only=True)
        for k in pa:
            assert_bitwise_equal(pb[k], pa[k])
        assert a["shared"] is None and a["adopted_host_bytes"] == 0
        assert b["adopted_host_bytes"] == 2 * base and b["host_copies_in_mapping"] and b["host_copies_pinned"]
        sh = b["shared"]
        assert sh["bytes"] >= 4 * base
        # the two resident bases left the mapping (all but the pages they share with streamed ones)
        assert 2 * base - 2 * page <= sh["released_bytes"] <= 2 * base + 2 * page, sh
        assert 2 * base <= sh["pinned_bytes"] <= sh["bytes"] - sh["released_bytes"], sh
        assert sh["mapped_rss"] <= sh["bytes"] - sh["released_bytes"], sh  # the given-back pages are gone
        assert any("MiB page-locked on this rank" in m for m in b["events"])
    assert sum(r["shared"]["counted_bytes"] for r in runs["shared"]) == sh["bytes"] - sh["released_bytes"]


def test_page_runs_cover_spans_and_leave_the_rest() -> None:
    from tidal_stream.shared_host import _PAGE, page_runs

    p = _PAGE
    used, free = page_runs([(10, 20), (p + 5, 2 * p), (5 * p, 5 * p + 1), (2 * p, 2 * p + 3)], 8 * p - 100)
    assert used == [(0, 3 * p), (5 * p, 6 * p)]  # touching pages merge: one registration each
    assert free == [(3 * p, 5 * p), (6 * p, 8 * p)]
    assert page_runs([], 1) == ([], [(0, p)])
    assert page_runs([(0, 3 * p)], 3 * p) == ([(0, 3 * p)], [])


def test_settle_gives_back_pages_of_tensors_no_longer_read(
    one_rank_group: None, tmp_path: pathlib.Path
) -> None:
    """One rank (CPU): three frozen tensors shared; one moves off the mapping (as a resident weight moves
    to the GPU); settle() gives its pages back (the mapping's Rss falls) and keeps the others intact."""
    from tidal_stream.distributed import DistributedConfig, dp_context
    from tidal_stream.shared_host import _PAGE, SharedHostCopy

    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(3))).requires_grad_(
        False
    )
    for m in model:
        m.weight.data.normal_(generator=gen)
    want = [m.weight.detach().clone() for m in model]
    ctx = dp_context(DistributedConfig(timeout=10.0), torch.device("cpu"))
    events: list[str] = []
    copy = SharedHostCopy.share_frozen(model, ctx, str(tmp_path), "t", lambda k, m, **d: events.append(m))
    assert copy is not None and all(copy.owns(m.weight) for m in model)
    before = copy.smaps()["rss"]
    model[1].weight.data = model[1].weight.data.clone()  # no longer a view of the mapping
    copy.settle([m.weight for m in model], pin=False, record=lambda k, m, **d: events.append(m))
    nbytes = 512 * 512 * 4
    assert nbytes - 2 * _PAGE <= copy.released_bytes <= nbytes
    assert before - copy.smaps()["rss"] >= copy.released_bytes  # the kernel took the pages back
    for m, w in zip(model, want):
        assert_bitwise_equal(m.weight, w)
    assert copy.report()["counted_bytes"] == copy.nbytes - copy.released_bytes
    assert any("given back" in m for m in events)
    copy.release()
