"""``tidal demo``: train the built-in byte-level GPT on the standard library's source under a VRAM budget.

The pipeline is the one a user would write: build the model, make an AdamW, ``tidal.wrap(model, opt,
vram_budget=..., plan=...)``, then the unchanged ``loss.backward(); opt.step(); opt.zero_grad()`` loop.
The default budget is chosen from tidal-plan's own figures so that the plan has to stream blocks and
keep optimizer state on the host. Without a GPU the same pipeline runs with the CPU standing in for it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from tidal.demo.config import DemoConfig
from tidal.demo.data import ByteBatches, stdlib_bytes
from tidal.demo.lora import add_lora_
from tidal.demo.model import SIZES, TinyGPT
from tidal.demo.stats import DeviceMemory, transfer_totals
from tidal.report import METRICS_FILE

log = logging.getLogger(__name__)

GPU_HEADROOM = 256 << 20  # kept free on a GPU for CUDA workspaces and fragmentation (tidal-plan's floor)
LOSS_PNG = "loss.png"
TIMELINE_PNG = "timeline.png"


@dataclass
class DemoResult:
    """What a demo run measured; ``metrics.json`` holds it together with the per-step records."""

    config: dict[str, Any]
    summary: dict[str, Any]
    plan: str
    steps: list[dict[str, Any]]
    files: dict[str, str]


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class Planner:
    """Plans the demo model on ``device`` against any budget (the machine is profiled once, cached on disk)."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device, batch_tokens: int, profile: Any = None
    ) -> None:
        import tidal

        self._tidal = tidal
        self.profile = tidal.profile_hardware(device) if profile is None else profile
        self.census = tidal.census(model)
        self.batch_tokens = batch_tokens
        self.on_gpu = device.type == "cuda"

    def headroom(self, budget: int) -> int:
        """Device bytes left unplanned: on a GPU tidal-plan's default (5 %, at least 256 MiB: CUDA workspaces,
        fragmentation), never less, however small the budget; 5 % on the CPU stand-in, whose budgets are MiB."""
        return max(GPU_HEADROOM if self.on_gpu else 1, budget // 20)

    def plan(self, budget: int, headroom: int | None = None, **options: Any) -> Any:
        """The plan under ``budget`` bytes (``headroom``: None for :meth:`headroom`; ``options``: more
        ``PlanConfig`` fields).

        Raises:
            InfeasiblePlan: not even a fully streamed run fits (the message has the numbers).
        """
        t = self._tidal
        config = t.PlanConfig(
            vram_budget=budget,
            batch_tokens=self.batch_tokens,
            headroom_bytes=self.headroom(budget) if headroom is None else headroom,
            **options,
        )
        return t.plan(self.census, self.profile, config)

    def least_budget(self, **options: Any) -> int:
        """The smallest budget (with its own headroom) at which a plan with ``options`` exists.

        A bisection over the planner itself: feasibility only grows with the budget (what a budget leaves
        after its headroom never shrinks as it grows), and the planner's refusal of a 1 KiB budget
        without headroom gives the bytes every placement needs besides the headroom, a lower bound.
        """
        try:
            self.plan(1024, headroom=0, **options)
            raise AssertionError("a 1 KiB budget cannot be feasible")  # internal invariant
        except self._tidal.InfeasiblePlan as exc:
            lo = exc.needed_bytes  # infeasible: the headroom comes on top
        hi = 2 * (lo + self.headroom(lo)) + 2
        while not self._fits(hi, options):  # not expected; keeps the bisection's bracket honest
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # lo infeasible, hi feasible
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._fits(mid, options) else (mid, hi)
        return hi

    def _fits(self, budget: int, options: dict[str, Any]) -> bool:
        try:
            self.plan(budget, **options)
        except self._tidal.InfeasiblePlan:
            return False
        return True

    def default_budget(self) -> tuple[int, Any]:
        """A budget under what the run needs, at which the plan streams blocks; and that plan.

        Two budgets from the planner bound it: the least at which any plan fits (every block streamed),
        and the least at which a plan with every block resident fits (``param_offload=False``). Halfway
        between them no all-resident plan fits, so the plan streams, on any machine and at any size.
        """
        low = self.least_budget()
        resident = self.least_budget(param_offload=False)
        budget = low + max(0, resident - low) // 2
        p = self.plan(budget)
        if not p.streamed_blocks:  # streaming saves no VRAM on this model (resident <= low)
            log.warning(
                "tidal demo: no budget makes this model stream (the least budget %d B already fits every "
                "block resident); using it",
                low,
            )
        return budget, p


def plan_options(p: Any, blocks: torch.nn.ModuleList) -> dict[str, Any]:
    """The ``wrap()`` options that carry out a plan's per-block decisions on ``blocks``."""
    n = len(blocks)
    recompute = [b.index for b in p.blocks if b.activations == "recompute"]
    offload = [b.index for b in p.blocks if b.activations == "offload"]
    streamed = list(p.streamed_blocks)
    return {
        "blocks": blocks,
        "param_offload": streamed or False,
        "recompute": recompute or False,
        # activation_offload takes a share of the blocks, not indices
        "activation_offload": (len(offload) / n if len(offload) < n else True) if offload else False,
        "prefetch_depth": p.prefetch_depth,
        "max_inflight_bytes": p.max_inflight_bytes or None,
    }


def run_demo(cfg: DemoConfig, *, echo: TextIO | None = None, progress: bool = True) -> DemoResult:
    """Run the demo end to end and write ``metrics.json``, ``loss.png`` and ``timeline.png`` to ``cfg.out``.

    Args:
        cfg: the settings (``None``/``auto`` fields resolved here for the device found).
        echo: where the plan table, notes and summary are printed (default ``sys.stdout``).
        progress: show the tqdm progress bar (on stderr).

    Returns:
        The measured :class:`DemoResult`.
    """
    import tidal  # the curated API, resolved lazily: a missing package names itself here

    out = echo or sys.stdout
    cfg = cfg.resolve(torch.cuda.is_available())
    assert cfg.steps is not None and cfg.seq_len is not None and cfg.batch_size is not None
    device = torch.device(cfg.device)
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # one spelling ("cuda:0") everywhere
    say = lambda s="": print(s, file=out, flush=True)  # noqa: E731

    if not on_gpu:
        say(
            "note: no GPU in use: the CPU stands in for it. Every mechanism (plan, host optimizer, weight and "
            "activation streaming) runs the same code with synchronous copies; 'VRAM' below is what tidal keeps "
            "on the stand-in device (weights, gradients, optimizer state; activations not counted), and step "
            "times are CPU times."
        )
    # the machine is profiled (or its profile read from the cache) before the model exists, and what the
    # process already holds on the device then is not the demo's: peaks are measured above it
    profile = tidal.profile_hardware(device)
    mem = DeviceMemory(device)
    gcfg = SIZES[cfg.size]
    dtype = torch.bfloat16 if on_gpu else torch.float32  # bf16 matmuls are slow on most CPUs
    text, n_files = stdlib_bytes()
    batches = ByteBatches(text, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = TinyGPT(gcfg).to(device, dtype)  # whole on the device for now: wrap() streams blocks out of it
    mode = "full fine-tune"
    if cfg.quantize != "none":
        tidal.quantize_model_(model.blocks, cfg.quantize)  # on the device: tidal-quant's kernels there
        n_adapters = add_lora_(model.blocks, r=cfg.lora_rank, dtype=dtype)
        mode = f"LoRA r={cfg.lora_rank} on a frozen {cfg.quantize} base ({n_adapters} adapters)"
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(
        f"tidal demo: byte-level GPT '{cfg.size}' ({n_params / 1e6:.2f}M parameters, {n_train / 1e6:.2f}M trained, "
        f"{gcfg.n_layers} blocks, d={gcfg.d_model}), {mode}, {dtype} on {device}"
    )
    say(
        f"data: {len(text) / 2**20:.1f} MiB of Python standard library source ({n_files} files), "
        f"batch {cfg.batch_size}×{cfg.seq_len} bytes"
    )

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
    )
    t_plan = time.perf_counter()
    planner = Planner(model, device, cfg.batch_size * cfg.seq_len, profile=profile)
    if cfg.vram_budget is None:
        budget_bytes, the_plan = planner.default_budget()
        why = "chosen so that blocks must stream"
    else:
        budget_bytes = tidal.parse_bytes(cfg.vram_budget, option="--vram-budget")
        the_plan, why = planner.plan(budget_bytes), "from --vram-budget"
    say(f"budget {_fmt_bytes(budget_bytes)} ({why}); plan:")
    say("")
    say(the_plan.explain())
    say("")
    # the plan and its per-block decisions are passed in, so the CPU stand-in follows the same plan a GPU
    # run would (left to itself, wrap() keeps plain AdamW and resident weights when the "device" is the host);
    # a given plan is followed as printed: after the first step's measurement tidal-stream may move more
    # optimizer state to the GPU, but the plan's streamed blocks keep streaming
    model, optimizer = tidal.wrap(
        model,
        optimizer,
        vram_budget=budget_bytes,
        device=device,
        plan=the_plan,
        batch_tokens=cfg.batch_size * cfg.seq_len,
        # a fixed backend on the GPU: timing every backend ("auto") inside the first step would put its
        # scratch tensors in the peak the budget is checked against; flash runs bf16 causal attention there
        attention="flash" if on_gpu else "auto",
        **plan_options(the_plan, model.blocks),
    )
    setup_s = time.perf_counter() - t_plan
    plan_text = the_plan.explain()
    events = tidal.memory_report(model)["events"]
    for e in events:
        if e["kind"] != "plan":
            say(f"  [{e['kind']}] {e['message']}")
    mem.reset_peak()  # training peaks from here: the model was placed whole before wrap() streamed it out
    steps = _train(model, optimizer, batches, cfg, device, mem, tidal.memory_report, progress)
    report = tidal.memory_report(model)
    for e in report["events"][len(events) :]:  # decisions made while training (the measured refinement)
        say(f"  [{e['kind']}] {e['message']}")
    summary = _summary(steps, cfg, budget_bytes, setup_s, report, on_gpu, n_params, n_train)
    files, skipped = _write_outputs(cfg, steps, summary, plan_text, budget_bytes, report, on_gpu)
    for line in _summary_lines(summary, files, skipped):
        say(line)
    return DemoResult(
        config=_jsonable(asdict(cfg)), summary=summary, plan=plan_text, steps=steps, files=files
    )


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: ByteBatches,
    cfg: DemoConfig,
    device: torch.device,
    mem: DeviceMemory,
    memory_report: Any,
    progress: bool,
) -> list[dict[str, Any]]:
    """The unchanged training loop, timing each step and sampling memory and transfers after it."""
    from tqdm.auto import tqdm

    assert cfg.steps is not None
    records: list[dict[str, Any]] = []
    h2d0, d2h0 = transfer_totals(memory_report(model))
    bar = tqdm(
        range(1, cfg.steps + 1), desc="training", unit="step", disable=not progress, dynamic_ncols=True
    )
    for step in bar:
        x, y = batches.next(device)  # [B, T] each
        mem.reset_peak()
        mem.synchronize()  # why: the step's clock starts when earlier GPU work is done
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())  # waits for the forward; backward and the update are synced below
        optimizer.synchronize()  # the host update of this step has landed: its time belongs to this step
        mem.synchronize()  # why: a step's time includes its queued backward and optimizer work
        dt = time.perf_counter() - t0
        report = memory_report(model)
        h2d, d2h = transfer_totals(report)
        peak, allocated = mem.read(model, report)
        records.append(
            {
                "step": step,
                "loss": loss_value,
                "step_s": dt,
                "tokens": x.numel(),
                "peak_bytes": peak,
                "allocated_bytes": allocated,
                "h2d_bytes": h2d - h2d0,
                "d2h_bytes": d2h - d2h0,
            }
        )
        h2d0, d2h0 = h2d, d2h
        if not math.isfinite(loss_value):
            bar.close()
            raise FloatingPointError(f"demo: loss became {loss_value} at step {step}; lower --lr")
        bar.set_postfix(
            loss=f"{loss_value:.3f}", step=f"{dt * 1e3:.0f}ms", vram=_fmt_bytes(records[-1]["peak_bytes"])
        )
    bar.close()
    return records


def _summary(
    steps: list[dict[str, Any]],
    cfg: DemoConfig,
    budget: int,
    setup_s: float,
    report: dict[str, Any],
    on_gpu: bool,
    n_params: int,
    n_train: int,
) -> dict[str, Any]:
    settled = steps[len(steps) // 4 :] or steps  # leave out warm-up and the plan's first adaptations
    median_s = statistics.median(s["step_s"] for s in settled)
    first = statistics.mean(s["loss"] for s in steps[: max(1, len(steps) // 10)])
    last = statistics.mean(s["loss"] for s in steps[-max(1, len(steps) // 10) :])
    peak = max(s["peak_bytes"] for s in steps)
    return {
        "device": cfg.device,
        "cpu_stand_in": not on_gpu,
        "size": cfg.size,
        "parameters": n_params,
        "trained_parameters": n_train,
        "quantize": cfg.quantize,
        "steps": len(steps),
        "tokens_per_step": steps[0]["tokens"],
        "loss_first": first,
        "loss_last": last,
        "median_step_s": median_s,
        "tokens_per_s": steps[0]["tokens"] / median_s,
        "setup_s": setup_s,
        "vram_budget_bytes": budget,
        "peak_vram_bytes": peak,
        "peak_under_budget": peak <= budget,
        "h2d_bytes": sum(s["h2d_bytes"] for s in steps),
        "d2h_bytes": sum(s["d2h_bytes"] for s in steps),
        "events": len(report.get("events", ())),
        # blocks streamed at the end, and every block that streamed at some time
        "streamed_blocks": list(report.get("weight_streaming", {}).get("streamed", [])),
        "streamed_blocks_ever": list(report.get("weight_streaming", {}).get("streamed_ever", [])),
    }


def _summary_lines(s: dict[str, Any], files: dict[str, str], skipped: list[str]) -> list[str]:
    where = "VRAM" if not s["cpu_stand_in"] else "stand-in device memory"
    verdict = "under" if s["peak_under_budget"] else "OVER"
    return [
        "",
        "summary",
        f"  loss            {s['loss_first']:.3f} -> {s['loss_last']:.3f} over {s['steps']} steps",
        f"  peak {where:<10} {_fmt_bytes(s['peak_vram_bytes'])} of a {_fmt_bytes(s['vram_budget_bytes'])} budget "
        f"({verdict} budget)",
        f"  over PCIe       {_fmt_bytes(s['h2d_bytes'])} host->device, {_fmt_bytes(s['d2h_bytes'])} device->host"
        + (" (copies the CPU stand-in would make)" if s["cpu_stand_in"] else ""),
        f"  speed           {s['tokens_per_s']:,.0f} tokens/s (median step {s['median_step_s'] * 1e3:.0f} ms)",
        f"  wrote           {', '.join(files.values())}",
        *(f"  skipped         {why}" for why in skipped),
    ]


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _write_outputs(
    cfg: DemoConfig,
    steps: list[dict[str, Any]],
    summary: dict[str, Any],
    plan_text: str,
    budget: int,
    report: dict[str, Any],
    on_gpu: bool,
) -> tuple[dict[str, str], list[str]]:
    from tidal.demo.plots import plot_loss, plot_timeline

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"tidal demo: '{cfg.size}' on {cfg.device}, {cfg.quantize if cfg.quantize != 'none' else 'full'} fine-tune"
    files: dict[str, str] = {}
    skipped: list[str] = []
    if importlib.util.find_spec("matplotlib") is None:
        # the run's numbers are worth keeping without the pictures: say so, record it, write the JSON
        skipped.append("loss.png and timeline.png: matplotlib is not installed (pip install matplotlib)")
        log.warning("tidal demo: %s", skipped[-1])
    else:
        files["loss"] = str(plot_loss(steps, out / LOSS_PNG, title))
        label = "GPU" if on_gpu else "stand-in device (no activations)"
        files["timeline"] = str(plot_timeline(steps, out / TIMELINE_PNG, budget, label))
    files.update(
        {
            "metrics": str(out / METRICS_FILE),
        }
    )
    payload = {
        "config": _jsonable(asdict(cfg)),
        "summary": summary,
        "plan": plan_text,
        "memory_report": _jsonable({k: v for k, v in report.items() if k != "plan"}),
        "files": files,
        "skipped": skipped,
        "steps": steps,
    }
    (out / METRICS_FILE).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return files, skipped
