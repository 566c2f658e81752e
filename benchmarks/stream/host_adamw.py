"""Host AdamW path of ``OffloadAdamW``, piece by piece: where the host update's time goes.

    python3 benchmarks/stream/host_adamw.py                  # the GPU machine (pinned buffers)
    python3 benchmarks/stream/host_adamw.py --smoke          # tiny sizes on the CPU (checks the script)

``--params`` elements split into tensors of ``--tensor`` elements (default: a Qwen2.5-1.5B MLP matrix,
1536 x 8960), laid out as ``OffloadAdamW`` lays out a host slot of a bf16 weight: fp32 master, two
moments, fp32 gradient, bf16 landing buffer (the gradient as copied from the device) and bf16 staging
buffer (the new weight going back). Timed over all tensors, median of ``--repeat``:

- ``widen``: landing (bf16) -> fp32 gradient;
- ``adamw``: ``torch._fused_adamw_`` on master, gradient and moments (one call per tensor);
- ``narrow``: fp32 master -> bf16 staging;
- ``journal``: copying master and moments into undo buffers (what ``rollback=True`` adds per update);
- ``path``: widen + adamw + narrow per tensor, as the worker runs it, on the main thread and on a
  worker thread (``path_worker``: the thread count torch uses there is printed);
- ``path_chunked``: the same three operations in one pass of cache blocks of ``--chunk`` elements, as
  ``tidal_stream.adam_kernels.adam_update(landing=, narrow_to=)`` runs them (the widened gradient in a
  small reused scratch; bit-identical results, checked first: AdamW is elementwise);
- ``path_undo`` / ``path_chunked_undo``: the same with ``rollback=True``'s undo copy (a separate pass
  over master and moments before the update / folded into each block);
- ``path_clip`` / ``path_chunked_clip``: from the widened fp32 gradient (clipping widens it on landing,
  for the norm): scale by the clip coefficient, update, narrow (three passes / one blocked pass);
- ``path_pooled``: ``path`` in blocks of ``--chunk`` spread over ``--pool`` threads that each run a
  whole block on one core (:class:`BlockPool`), not in thread-team fork/joins per op;
- ``--sweep``: ``path_chunked`` again at each listed block size;
- ``--hog N``: N busy processes spin during the timings (as the training thread and the driver's
  threads load the host's cores during backward): blocked passes fork/join the intra-op threads more
  often, and a fork/join waits for its slowest, possibly preempted, thread;
- ``bf16_moments``: ``tidal_stream.adam_kernels.adam_update`` with bf16 moments (stochastic rounding),
  widening the landed gradient and narrowing the new weight as ``path`` does, on ``--bf16-params``
  elements (rate extrapolated; median of ``--repeat`` after one warm-up call); ``bf16_moments_share``
  is ``path`` / ``bf16_moments``, the figure tidal-plan's ``HOST_BF16_MOMENTS_RATE_SHARE`` holds.

Each is reported in ms and G params/s, with the host memory traffic it implies in GB/s.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(p) for p in (Path(__file__).resolve().parents[2] / "packages").glob("*/src")]

from tidal_stream.adam_kernels import AdamHyper, UndoCopy, adam_update, default_block  # noqa: E402

CLIP = torch.tensor(0.5)  # a clip coefficient (0-d, as the optimizer computes it)
HYPER = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False)
# host bytes moved per parameter by each piece (reads + writes)
BYTES = {
    "widen": 2 + 4,
    "adamw": 28,
    "narrow": 4 + 2,
    "journal": 24,
    "path": 40,
    "path_chunked": 28,
    "path_undo": 64,
    "path_chunked_undo": 40,
    "path_clip": 42,
    "path_chunked_clip": 30,
    "path_pooled": 28,
}


def _buf(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, pin_memory=pin)


def make_slots(total: int, per: int, pin: bool, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Host slots of ``per`` elements covering ``total``: random master/gradient, moments from a few steps."""
    g = torch.Generator().manual_seed(seed)
    slots = []
    left = total
    while left > 0:
        n = min(per, left)
        left -= n
        s = {k: _buf(n, torch.float32, pin) for k in ("master", "m", "v", "grad", "u_master", "u_m", "u_v")}
        s["landing"] = _buf(n, torch.bfloat16, pin)
        s["staging"] = _buf(n, torch.bfloat16, pin)
        s["master"].normal_(0, 0.02, generator=g)
        s["landing"].copy_(torch.randn(n, generator=g) * 1e-3)
        s["grad"].copy_(s["landing"])  # the widened gradient (what ``path_clip`` starts from)
        s["m"].copy_(torch.randn(n, generator=g) * 1e-4)
        s["v"].copy_(torch.rand(n, generator=g) * 1e-8)
        s["step"] = torch.tensor(3.0)
        slots.append(s)
    return slots


def _fused(s: dict[str, torch.Tensor], lo: int = 0, hi: int | None = None, grad: Any = None) -> None:
    sl = slice(lo, hi)
    torch._fused_adamw_(
        [s["master"][sl]],
        [s["grad"][sl] if grad is None else grad],
        [s["m"][sl]],
        [s["v"][sl]],
        [],
        [s["step"]],
        lr=HYPER.lr,
        beta1=HYPER.beta1,
        beta2=HYPER.beta2,
        weight_decay=HYPER.weight_decay,
        eps=HYPER.eps,
        amsgrad=False,
        maximize=False,
    )


def widen(slots: list[dict]) -> None:
    for s in slots:
        s["grad"].copy_(s["landing"])


def adamw(slots: list[dict]) -> None:
    for s in slots:
        _fused(s)


def narrow(slots: list[dict]) -> None:
    for s in slots:
        s["staging"].copy_(s["master"])


def journal(slots: list[dict]) -> None:
    for s in slots:
        s["u_master"].copy_(s["master"])
        s["u_m"].copy_(s["m"])
        s["u_v"].copy_(s["v"])


def path(slots: list[dict]) -> None:
    for s in slots:
        s["grad"].copy_(s["landing"])
        _fused(s)
        s["staging"].copy_(s["master"])


def path_undo(slots: list[dict]) -> None:
    for s in slots:
        s["grad"].copy_(s["landing"])
        for k in ("master", "m", "v"):
            s["u_" + k].copy_(s[k])
        _fused(s)
        s["staging"].copy_(s["master"])


def path_clip(slots: list[dict]) -> None:
    for s in slots:
        s["grad"].mul_(CLIP)
        _fused(s)
        s["staging"].copy_(s["master"])


def _lib(s: dict[str, torch.Tensor], chunk: int, undo: bool = False, clip: bool = False) -> None:
    """One slot through ``adam_update`` at the step ``_fused`` uses (it increments the count first)."""
    u = UndoCopy(s["u_master"], s["u_m"], s["u_v"]) if undo else None
    s["step"].sub_(1)
    adam_update(
        s["master"], s["grad"], s["m"], s["v"], s["step"], HYPER, None, u,
        landing=None if clip else s["landing"], grad_scale=CLIP if clip else None,
        narrow_to=s["staging"], block=chunk or None,
    )  # fmt: skip


def path_chunked(slots: list[dict], chunk: int) -> None:
    for s in slots:
        _lib(s, chunk)


def path_chunked_undo(slots: list[dict], chunk: int) -> None:
    for s in slots:
        _lib(s, chunk, undo=True)


def path_chunked_clip(slots: list[dict], chunk: int) -> None:
    for s in slots:
        _lib(s, chunk, clip=True)


class BlockPool:
    """Threads that each run whole blocks (widen, update, narrow) with one intra-op thread, taking blocks
    from a shared queue: no fork/join of a thread team per op, and a preempted thread delays only the
    block it holds while the others take the rest (a candidate design for the host update)."""

    def __init__(self, n: int) -> None:
        self.jobs: queue.SimpleQueue[tuple[dict, int, int, Any] | None] = queue.SimpleQueue()
        started = threading.Barrier(n + 1)
        self.threads = [threading.Thread(target=self._run, args=(started,), daemon=True) for _ in range(n)]
        keep = torch.get_num_threads()
        for t in self.threads:
            t.start()
        started.wait()
        torch.set_num_threads(keep)  # set_num_threads(1) in the pool also set the default of new threads

    def _run(self, started: threading.Barrier) -> None:
        torch.set_num_threads(1)  # this thread's ops run on it alone
        scratch = torch.empty(0)
        started.wait()
        while (job := self.jobs.get()) is not None:
            s, lo, hi, done = job
            if scratch.numel() < hi - lo:
                scratch = torch.empty(hi - lo)
            g = scratch[: hi - lo]  # [b] the widened gradient block
            g.copy_(s["landing"][lo:hi])
            _fused(s, lo, hi, grad=g)
            s["staging"][lo:hi].copy_(s["master"][lo:hi])
            done()

    def update(self, s: dict[str, torch.Tensor], block: int) -> None:
        """Update one slot in blocks spread over the pool; returns when every block is done."""
        n = s["master"].numel()
        left, finished, lock = [-(-n // block)], threading.Event(), threading.Lock()

        def done() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        for lo in range(0, n, block):
            self.jobs.put((s, lo, min(n, lo + block), done))
        finished.wait()

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)


def path_pooled(slots: list[dict], chunk: int, pool: BlockPool) -> None:
    for s in slots:
        pool.update(s, chunk)


def in_thread(fn: Any, *args: Any) -> tuple[float, int]:
    """Run ``fn(*args)`` on a new thread; its seconds and the intra-op thread count seen there."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["threads"] = torch.get_num_threads()
        t0 = time.perf_counter()
        fn(*args)
        out["s"] = time.perf_counter() - t0

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["s"], out["threads"]


def timed_rounds(cases: list[tuple[str, Any, tuple]], repeat: int, slots: list[dict]) -> dict[str, float]:
    """Median seconds of each case; the cases take turns in every round (drifting load hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(repeat):
        for name, fn, extra in cases:
            t0 = time.perf_counter()
            fn(slots, *extra)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def check_chunked(per: int, chunk: int, pin: bool, pool: BlockPool) -> None:
    """Cache-blocked and whole-tensor paths give bit-identical masters, moments, staging and undo copies."""
    for whole, blocked in (
        (path, path_chunked),
        (path_undo, path_chunked_undo),
        (path_clip, path_chunked_clip),
        (path, path_pooled),
    ):
        a, b = make_slots(per, per, pin, seed=1), make_slots(per, per, pin, seed=1)
        whole(a)
        blocked(b, chunk, *((pool,) if blocked is path_pooled else ()))
        keys = ("master", "m", "v", "staging") + (("u_master", "u_m", "u_v") if whole is path_undo else ())
        for k in keys:
            assert torch.equal(a[0][k], b[0][k]), f"{blocked.__name__} differs in {k}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=468e6)
    ap.add_argument("--tensor", type=int, default=1536 * 8960)
    ap.add_argument("--chunk", type=int, default=1 << 18, help="block elements of the path_chunked* cases")
    ap.add_argument("--sweep", default="", help="comma-separated block sizes to time path_chunked at")
    ap.add_argument("--hog", type=int, default=0, help="busy processes spinning during the timings")
    ap.add_argument("--pool", type=int, default=0, help="path_pooled's threads; 0: the intra-op thread count")
    ap.add_argument("--bf16-params", type=float, default=20e6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0: torch's default")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.tensor, args.chunk, args.bf16_params, args.repeat = 3e5, 100_000, 4096, 5e4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    pin = torch.cuda.is_available()
    total = int(args.params)
    pool = BlockPool(args.pool or torch.get_num_threads())
    check_chunked(min(args.tensor, total), args.chunk, pin, pool)
    slots = make_slots(total, args.tensor, pin)
    path(slots)  # first touch of every page
    res: dict[str, Any] = {"params": total, "tensor": args.tensor, "pinned": pin}
    res["threads_main"] = torch.get_num_threads()
    res["block"] = args.chunk
    res["default_block"] = default_block(torch.empty(1))  # what adam_update uses now (0: whole tensor)
    sweep = [int(c) for c in args.sweep.split(",") if c]
    cases = [
        ("widen", widen, ()),
        ("adamw", adamw, ()),
        ("narrow", narrow, ()),
        ("journal", journal, ()),
        ("path", path, ()),
        ("path_chunked", path_chunked, (args.chunk,)),
        ("path_undo", path_undo, ()),
        ("path_chunked_undo", path_chunked_undo, (args.chunk,)),
        ("path_clip", path_clip, ()),
        ("path_chunked_clip", path_chunked_clip, (args.chunk,)),
        ("path_pooled", path_pooled, (args.chunk, pool)),
    ] + [(f"path_chunked@{c}", path_chunked, (c,)) for c in sweep]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        res.update(timed_rounds(cases, args.repeat, slots))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    res["hog"] = args.hog
    pool.close()
    worker = [in_thread(path, slots) for _ in range(args.repeat)]
    res["path_worker"] = statistics.median(s for s, _ in worker)
    res["threads_worker"] = worker[0][1]
    nb = int(args.bf16_params)
    m = torch.zeros(nb, dtype=torch.bfloat16)
    v = torch.zeros(nb, dtype=torch.bfloat16)
    p = torch.randn(nb) * 0.02
    landing = (torch.randn(nb) * 1e-3).bfloat16()  # [nb] the gradient as copied from the device
    staging = torch.empty(nb, dtype=torch.bfloat16)  # [nb] the new weight going back
    gen = torch.Generator().manual_seed(0)

    def bf16_step() -> None:  # as "path" does per slot: widen, update, narrow (no fp32 gradient buffer)
        adam_update(p, None, m, v, torch.zeros(()), HYPER, gen, landing=landing, narrow_to=staging)

    bf16_step()  # warm-up: the noise table and the scratch buffers are made once per process
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        bf16_step()
        times.append(time.perf_counter() - t0)
    res["bf16_moments"] = statistics.median(times) * total / nb  # extrapolated to --params
    res["bf16_moments_share"] = res["path"] / res["bf16_moments"]  # tidal-plan's HOST_BF16_MOMENTS_RATE_SHARE
    print(
        f"host AdamW pieces over {total / 1e6:.0f} M params in tensors of {args.tensor / 1e6:.1f} M "
        f"({'pinned' if pin else 'pageable'}); intra-op threads: main {res['threads_main']}, "
        f"worker thread {res['threads_worker']}; busy processes: {args.hog}; block {res['block']} "
        f"(adam_update's default now: {res['default_block'] or 'whole tensor'})"
    )
    names = [n for n, _, _ in cases[:5]] + ["path_worker"] + [n for n, _, _ in cases[5:]] + ["bf16_moments"]
    for k in names:
        gbps = BYTES.get(k.replace("_worker", "").split("@")[0], 0) * total / res[k] / 1e9
        print(
            f"  {k:<24} {res[k] * 1e3:9.1f} ms  {total / res[k] / 1e9:6.2f} G params/s"
            + (f"  {gbps:6.1f} GB/s" if gbps and k != "bf16_moments" else "")
        )
    for whole, blocked in (
        ("path", "path_chunked"),
        ("path", "path_pooled"),
        ("path_undo", "path_chunked_undo"),
        ("path_clip", "path_chunked_clip"),
    ):
        res[f"speedup_{blocked}"] = res[whole] / res[blocked]
        print(f"  {blocked} / {whole}: {res[whole] / res[blocked]:.2f}x faster")
    print("RESULT " + json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
