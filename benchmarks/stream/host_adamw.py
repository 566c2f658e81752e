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
- ``path_chunked``: the same three operations cache-blocked, ``--chunk`` elements at a time
  (bit-identical results, checked first: AdamW is elementwise);
- ``bf16_moments``: ``tidal_stream.adam_kernels.adam_update`` with bf16 moments (stochastic rounding),
  on ``--bf16-params`` elements (it is much slower; rate extrapolated).

Each is reported in ms and G params/s, with the host memory traffic it implies in GB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(p) for p in (Path(__file__).resolve().parents[2] / "packages").glob("*/src")]

from tidal_stream.adam_kernels import AdamHyper, adam_update  # noqa: E402

HYPER = AdamHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False)
# host bytes moved per parameter by each piece (reads + writes)
BYTES = {"widen": 2 + 4, "adamw": 28, "narrow": 4 + 2, "journal": 24, "path": 40, "path_chunked": 28}


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
        s["m"].copy_(torch.randn(n, generator=g) * 1e-4)
        s["v"].copy_(torch.rand(n, generator=g) * 1e-8)
        s["step"] = torch.tensor(3.0)
        slots.append(s)
    return slots


def _fused(s: dict[str, torch.Tensor], lo: int = 0, hi: int | None = None) -> None:
    sl = slice(lo, hi)
    torch._fused_adamw_(
        [s["master"][sl]],
        [s["grad"][sl]],
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


def path_chunked(slots: list[dict], chunk: int) -> None:
    for s in slots:
        n = s["master"].numel()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            s["grad"][lo:hi].copy_(s["landing"][lo:hi])
            _fused(s, lo, hi)
            s["staging"][lo:hi].copy_(s["master"][lo:hi])


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


def timed(fn: Any, repeat: int, *args: Any) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_chunked(per: int, chunk: int, pin: bool) -> None:
    """Cache-blocked and whole-tensor paths give bit-identical masters, moments and staging."""
    a, b = make_slots(per, per, pin, seed=1), make_slots(per, per, pin, seed=1)
    path(a)
    path_chunked(b, chunk)
    for k in ("master", "m", "v", "staging"):
        assert torch.equal(a[0][k], b[0][k]), f"chunked path differs in {k}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=468e6)
    ap.add_argument("--tensor", type=int, default=1536 * 8960)
    ap.add_argument("--chunk", type=int, default=1 << 18)
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
    check_chunked(min(args.tensor, total), args.chunk, pin)
    slots = make_slots(total, args.tensor, pin)
    path(slots)  # first touch of every page
    res: dict[str, Any] = {"params": total, "tensor": args.tensor, "pinned": pin}
    res["threads_main"] = torch.get_num_threads()
    for name, fn, extra in (
        ("widen", widen, ()),
        ("adamw", adamw, ()),
        ("narrow", narrow, ()),
        ("journal", journal, ()),
        ("path", path, ()),
        ("path_chunked", path_chunked, (args.chunk,)),
    ):
        res[name] = timed(fn, args.repeat, slots, *extra)
    worker = [in_thread(path, slots) for _ in range(args.repeat)]
    res["path_worker"] = statistics.median(s for s, _ in worker)
    res["threads_worker"] = worker[0][1]
    nb = int(args.bf16_params)
    m = torch.zeros(nb, dtype=torch.bfloat16)
    v = torch.zeros(nb, dtype=torch.bfloat16)
    p = torch.randn(nb) * 0.02
    g = torch.randn(nb) * 1e-3
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    adam_update(p, g, m, v, torch.zeros(()), HYPER, gen)
    res["bf16_moments"] = (time.perf_counter() - t0) * total / nb  # extrapolated to --params
    print(
        f"host AdamW pieces over {total / 1e6:.0f} M params in tensors of {args.tensor / 1e6:.1f} M "
        f"({'pinned' if pin else 'pageable'}); intra-op threads: main {res['threads_main']}, "
        f"worker thread {res['threads_worker']}"
    )
    for k in ("widen", "adamw", "narrow", "journal", "path", "path_worker", "path_chunked", "bf16_moments"):
        gbps = BYTES.get(k.replace("_worker", ""), 0) * total / res[k] / 1e9
        print(
            f"  {k:<13} {res[k] * 1e3:9.1f} ms  {total / res[k] / 1e9:6.2f} G params/s"
            + (f"  {gbps:6.1f} GB/s" if gbps and k != "bf16_moments" else "")
        )
    print("RESULT " + json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
