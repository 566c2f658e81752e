"""Does the H2D traffic of TidalCache's page gathers itself slow a host-bound 4k x 1 decode step?

```bash
python3 benchmarks/kv/dma_share.py 40   # the GPU machine, ~25 s; the argument is the timed rounds
```

Engines in one process, stepped in rotating rounds as ``interleaved.py`` does (8B shape, 4k context, batch 1):

- ``dynamic``: DynamicCache;
- ``dynamic+big``: the same, plus one H2D copy per step of the bytes TidalCache gathers (one launch);
- ``dynamic+layercopy``: the same, plus one copy of one offloaded layer's pages from a pre-hook of every odd
  layer (TidalCache's bytes and copy launches, without its events, tails or bookkeeping);
- ``tidal``: TidalCache, half the layers offloaded;
- ``tidal-nocopy``: the same cache whose page gathers copy nothing (its K/V are wrong: timing only);
- ``tidal-resident``: TidalCache, every layer resident.

If the link's traffic slowed the host, ``dynamic+big`` would step slower than ``dynamic`` and ``tidal``
slower than ``tidal-nocopy``.
"""

import statistics
import sys

sys.path[:0] = ["benchmarks/kv", "benchmarks"]
import engines  # noqa: E402, F401 - puts packages/*/src on the path
import torch  # noqa: E402
from decode import model_config  # noqa: E402
from decode_worker import build_model, fill, make_cache, sdpa_backends, step  # noqa: E402
from interleaved import rounds, split  # noqa: E402

ctx, steps, warm = 4096, int(sys.argv[1]) if len(sys.argv) > 1 else 40, 3
model = build_model(model_config(False), "cuda", torch.bfloat16)
layers = model.model.layers
per_layer = 2 * 8 * 128 * 2 * ((ctx - 64) // 256 * 256)  # K+V bytes of one layer's full pages, batch 1
host = [torch.empty(per_layer, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
big_host = torch.empty(16 * per_layer, dtype=torch.uint8, pin_memory=True)
dev = [torch.empty(per_layer, dtype=torch.uint8, device="cuda") for _ in range(2)]
big_dev = torch.empty(16 * per_layer, dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()  # why: the extra copies run beside the decode step, as TidalCache's gathers do
state = {"hook": False}


def pre_hook(mod, args):
    i = mod.self_attn.layer_idx
    if state["hook"] and i % 2 == 1:
        with torch.cuda.stream(side):  # why: see `side`
            dev[(i // 2) % 2].copy_(host[i // 2], non_blocking=True)


for layer in layers:
    layer.register_forward_pre_hook(pre_hook)

names = ["dynamic", "dynamic+big", "dynamic+layercopy", "tidal", "tidal-nocopy", "tidal-resident"]
base = {"dynamic+big": "dynamic", "dynamic+layercopy": "dynamic", "tidal-nocopy": "tidal"}
caches = {n: make_cache(base.get(n, n), model, ctx + 1, 256, 2) for n in names}
toks = {}
with torch.no_grad(), sdpa_backends("no-cudnn"):
    for n, c in caches.items():
        fill(c, model, 1, ctx - warm - steps - 1, seed=1)
        toks[n] = torch.randint(1, model.config.vocab_size, (1, 1), device="cuda")
    for s in caches["tidal-nocopy"].paged._slots:
        orig = s.gather_runs
        memo = {}

        def no_copies(*a, _orig=orig, _memo=memo):
            runs = _orig(*a)
            if id(runs) not in _memo:
                _memo[id(runs)] = (runs, [r._replace(copies=()) for r in runs])
            return _memo[id(runs)][1]

        s.gather_runs = no_copies

    def stepper(n):
        def one():
            if n == "dynamic+big":
                with torch.cuda.stream(side):  # why: see `side`
                    big_dev.copy_(big_host, non_blocking=True)
            state["hook"] = n == "dynamic+layercopy"
            toks[n] = step(model, caches[n], toks[n])
            state["hook"] = False

        return one

    st = {n: stepper(n) for n in names}
    rounds(st, warm, torch.cuda.synchronize)
    clock = rounds(st, steps, torch.cuda.synchronize)
d = statistics.median(clock.wall["dynamic"])
for n in names:
    m = statistics.median(clock.wall[n])
    sp = split(clock, n)
    print(
        f"{n:18s} {1e3 * m:6.2f} ms  x dynamic {d / m:.3f}  issue {sp['issue_ms']:.2f} wait {sp['wait_ms']:.2f}",
        flush=True,
    )
print("tidal stats", caches["tidal"].stats)
