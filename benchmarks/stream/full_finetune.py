"""Full fine-tuning of a Qwen2.5-1.5B-shaped model under a 24 GiB budget with ``tidal_stream.wrap``.

Run on the GPU machine (no download: exact shape, random weights)::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 benchmarks/stream/full_finetune.py

Steps:
1. a filler tensor leaves exactly ``--budget`` free on the device (a smaller card, simulated fairly);
2. the model is built on the meta device in bf16 and filled on the device (``normal_(0, 0.02)``);
3. fwd+bwd alone (no optimizer, gradients dropped) is timed: the compute floor of a step;
4. ``wrap(model, AdamW, vram_budget=budget, loss_chunk_tokens=...)`` — the plan splits the optimizer
   between the device and the host and picks streamed / recomputed blocks — and training steps are timed
   after warm-up (the first step also settles the split).

The loss is what a tidal user computes under a tight budget: ``tidal_stream.chunked_cross_entropy`` on
the final hidden states and ``lm_head.weight`` (``--loss-chunk`` tokens per chunk), told to the plan with
``loss_chunk_tokens``, instead of ``model(..., labels=)``, whose full fp32 logits (2048 x 151936 here)
cost about 3.5 GiB at the loss's peak. ``--loss-chunk 0`` uses the Hugging Face loss (the plan then
counts the full logits). Both phases use the same loss.

Prints (and writes as JSON with ``--json``): median step time, the compute floor, the exposed optimizer
time (median step − compute floor), peak VRAM above the filler, and the placement decisions.
Goal on the H200: ≤ 0.30 s per step.

``--profile PATH`` writes a Chrome trace of one more step there and prints its summary: the GPU's kernel
time against the span of its kernels, the longest stretches without a kernel with the host's
``tidal::`` annotations and synchronizations in them, and each annotation's host time per thread.

Then ``--breakdown`` more steps are cut into phases, each bracketed by ``torch.cuda.synchronize()`` (so
they do not overlap each other as in the timed steps): forward (loss included), backward, the ``step()``
call, and the wait for the host updates still running after it (``synchronize()``). The host worker's
own time over the timed steps comes from the optimizer's counters (``host_work()``): the busy time of its
jobs per step, of which the AdamW updates (with the copy back of the new weight), and the intra-op
thread count inside the worker thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared code

from bench_common import add_qwen2_args, random_qwen2, sync, time_calls

GiB = 2**30


def make_batch(args: argparse.Namespace, device: torch.device, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)  # [B, T]


def host_work(opt: object) -> dict[str, Any]:
    """The host optimizer's own counters (``memory_report(model)["host_optimizer"]``), or zeros for an
    optimizer without them (the data-parallel one)."""
    work = getattr(opt, "host_work", None)
    return work() if work is not None else {"worker_busy_s": 0.0, "update_s": 0.0, "updates": 0}


def trace_summary(prof: Any) -> dict[str, Any]:
    """One profiled step: GPU kernel time against the span, the longest GPU idle stretches with the
    host's tidal annotations and synchronizations in them, and each annotation's host time per thread."""
    from trace_intervals import annotation_ms, gpu_idle_gaps, kineto_events, merged, total

    evs = kineto_events(prof)
    kernels = merged(
        (e.start, e.end) for e in evs if e.device and not e.name.startswith(("Memcpy", "Memset"))
    )
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    return {
        "kernel_span_ms": span,
        "kernel_busy_ms": total(kernels) / 1e3,
        "idle_gaps": gpu_idle_gaps(evs, top=10),
        "annotations_ms": {
            k: {str(t): round(v, 2) for t, v in per.items()} for k, per in annotation_ms(evs).items()
        },
    }


def worker_threads(opt: object) -> int | None:
    """``torch.get_num_threads()`` as seen inside the host optimizer's worker thread."""
    worker = getattr(opt, "_worker", None)
    if worker is None:
        return None
    seen: list[int] = []
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.join()
    return seen[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--budget", default="24GiB", help="VRAM budget (filler leaves this free); 'none' for no filler"
    )
    add_qwen2_args(
        ap, dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936, seq=512)
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--offload", default="auto", help="auto | true | false")
    ap.add_argument("--moment-dtype", default="fp32")
    ap.add_argument("--delayed-update", action="store_true")
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="recompute every block in backward (frees VRAM for optimizer state)",
    )
    ap.add_argument(
        "--loss-chunk",
        type=int,
        default=1024,
        help="chunked_cross_entropy chunk_size; 0: the model's own full-logits loss (labels=)",
    )
    ap.add_argument(
        "--breakdown", type=int, default=3, help="steps timed phase by phase after the timed steps"
    )
    ap.add_argument("--threads", type=int, default=0, help="wrap(threads=) for the host; 0: torch's default")
    ap.add_argument("--verbose", action="store_true", help="wrap(verbose=True): print decisions as made")
    ap.add_argument("--profile", default="", help="write a Chrome trace of one step here")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()

    from tidal_plan import compare_prediction, parse_bytes
    from tidal_stream import chunked_cross_entropy, memory_report, session_of, wrap

    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda" means the current device; set_device needs its index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    filler_bytes = 0
    filler = None
    budget = None if args.budget.lower() == "none" else parse_bytes(args.budget)
    if budget is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        filler_bytes = max(0, free - budget)
        filler = torch.empty(filler_bytes, dtype=torch.uint8, device=device)  # leaves `budget` free
        print(
            f"filler {filler_bytes / GiB:.2f} GiB; free now {torch.cuda.mem_get_info(device)[0] / GiB:.2f} GiB"
        )

    model = random_qwen2(args, device, torch.Generator(device=device).manual_seed(0))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.3f} B parameters, {args.layers} layers, batch {args.batch}x{args.seq}")

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        if args.loss_chunk == 0:
            return model(input_ids=ids, labels=ids).loss
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, D]; no logits built here
        # next-token prediction: position t predicts token t + 1
        return chunked_cross_entropy(
            hidden[:, :-1], model.lm_head.weight, ids[:, 1:], chunk_size=args.loss_chunk
        )

    # 1. compute floor: forward + backward with the gradients dropped, no optimizer
    def compute_only() -> None:
        ids = make_batch(args, device, 0)
        loss_of(ids).backward()
        model.zero_grad(set_to_none=True)

    compute_only()
    floor = time_calls(compute_only, device, args.steps)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # wrap starts from a clean allocator, as in a fresh training process

    # 2. wrapped training
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    offload = {"auto": "auto", "true": True, "false": False}[args.offload.lower()]
    wrap_opts = dict(
        offload=offload,
        moment_dtype=args.moment_dtype,
        delayed_update=args.delayed_update,
        batch_tokens=args.batch * args.seq,
    )
    if args.loss_chunk:
        wrap_opts["loss_chunk_tokens"] = args.loss_chunk
    if args.recompute:
        wrap_opts["recompute"] = True
    if budget is not None:
        wrap_opts["vram_budget"] = budget
    if args.threads:
        wrap_opts["threads"] = args.threads
    if args.verbose:
        wrap_opts["verbose"] = True
    t0 = time.perf_counter()
    model, opt = wrap(model, opt, **wrap_opts)
    wrap_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses: list[float] = []

    def train_step() -> None:
        ids = make_batch(args, device, 0)  # one batch, so a falling loss shows the updates land
        loss = loss_of(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    time_calls(train_step, device, args.warmup)
    opt.synchronize()
    before = host_work(opt)
    steps = time_calls(train_step, device, args.steps)
    opt.synchronize()  # why: every timed step's host jobs have run, so the counters hold all of them
    after = host_work(opt)
    host_per_step = {
        "worker_busy_s": (after["worker_busy_s"] - before["worker_busy_s"]) / args.steps,
        "host_update_s": (after["update_s"] - before["update_s"]) / args.steps,
        "host_updates_per_step": (after["updates"] - before["updates"]) / args.steps,
    }
    host_per_step["worker_threads"] = worker_threads(opt)
    host_per_step["main_threads"] = torch.get_num_threads()
    host_per_step["rollback"] = getattr(opt, "rollback", None)  # undo copies cost host bandwidth and VRAM

    phases: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "step_call", "step_wait")}
    for _ in range(args.breakdown):
        ids = make_batch(args, device, 0)
        sync(device)
        t0 = time.perf_counter()
        loss = loss_of(ids)
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.synchronize()  # the host updates still running after step() returned
        sync(device)
        t4 = time.perf_counter()
        opt.zero_grad()
        for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k].append(dt)
        losses.append(loss.detach())
    breakdown = {k: statistics.median(v) for k, v in phases.items() if v}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            train_step()
            opt.synchronize()
        prof.export_chrome_trace(args.profile)
        result_trace = trace_summary(prof)
        print("profiled step: " + json.dumps(result_trace))
    peak = torch.cuda.max_memory_allocated(device) - filler_bytes if device.type == "cuda" else 0
    # what the device really held (allocator caches and fragmentation included): must stay under the budget
    peak_reserved = torch.cuda.max_memory_reserved(device) - filler_bytes if device.type == "cuda" else 0
    losses_f = [float(x) for x in losses]
    assert all(x == x and x < 1e4 for x in losses_f), f"non-finite loss: {losses_f}"
    report = memory_report(model)
    step_med = statistics.median(steps)
    floor_med = statistics.median(floor)
    result = {
        "scenario": f"full{n_params / 1e9:.1f}b",
        "budget_bytes": budget,
        "params": n_params,
        "step_s_median": step_med,
        "step_s_all": steps,
        "compute_floor_s_median": floor_med,
        "exposed_optimizer_s": step_med - floor_med,
        "peak_vram_bytes": peak,
        "peak_reserved_bytes": peak_reserved,
        "wrap_s": wrap_s,
        "losses": losses_f,
        "tiers": report.get("tiers"),
        "pinned_bytes": report.get("pinned_bytes"),
        "placement": [e["message"] for e in report["events"] if e["kind"] in ("placement", "plan")],
        "phases_s_median": breakdown,
        "host_per_step": host_per_step,
        "weight_streaming": report.get("weight_streaming"),
    }
    if args.profile:
        result["profiled_step"] = result_trace
    plan = session_of(model).plan
    if plan is not None:  # the planner's predicted step time beside the measured one
        result["prediction"] = compare_prediction(plan, step_med)
    for line in result["placement"]:
        print(line)
    print(
        f"step {step_med:.3f} s (median of {args.steps}); compute floor {floor_med:.3f} s; exposed optimizer "
        f"{step_med - floor_med:.3f} s; peak VRAM {peak / GiB:.2f} GiB allocated, {peak_reserved / GiB:.2f} GiB "
        f"reserved (filler excluded); wrap {wrap_s:.1f} s; "
        f"losses {losses_f[0]:.3f} -> {losses_f[-1]:.3f}"
    )
    if breakdown:
        print(
            f"phases (median of {args.breakdown}, each synchronized): "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in breakdown.items())
            + f"; sum {sum(breakdown.values()) * 1e3:.1f} ms against the overlapped step {step_med * 1e3:.1f} ms"
        )
    print(
        f"host worker per timed step: busy {host_per_step['worker_busy_s'] * 1e3:.1f} ms, of which AdamW + copy "
        f"back {host_per_step['host_update_s'] * 1e3:.1f} ms over {host_per_step['host_updates_per_step']:.0f} "
        f"tensors; intra-op threads: worker {host_per_step['worker_threads']}, main {host_per_step['main_threads']}; "
        f"rollback {host_per_step['rollback']}"
    )
    ws = report.get("weight_streaming")
    if ws:
        print(
            f"weight streaming: blocks {ws.get('streamed')}, compute waited {ws.get('stall_ms', 0.0):.1f} ms in total, "
            f"{ws.get('demand_fetches', 0)} demand fetches"
        )
    if "prediction" in result:
        print(result["prediction"]["summary"])
    print(f"goal <= 0.30 s per step: {'met' if step_med <= 0.30 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    del filler


if __name__ == "__main__":
    main()
