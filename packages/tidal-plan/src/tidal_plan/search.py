"""The planner's search over placements: greedy upgrades by the cost model, then the cheapest activation
mode per block. Used by :func:`tidal_plan.plan`."""

from __future__ import annotations

from dataclasses import dataclass

from tidal_plan.census import ModelCensus
from tidal_plan.cost import Context, Evaluation, State, evaluate
from tidal_plan.stream_schedule import frozen_blocks, spread_streamed

__all__: list[str] = []

# A step that improves by less than this share is not worth more VRAM under prefer="memory".
MEMORY_PREFER_MIN_GAIN = 0.02


@dataclass
class Fixed:
    """User-forced decisions per block (None = the planner decides)."""

    resident: list[bool | None]
    act_allowed: list[list[str]]  # activation modes allowed per block, in ACT_ORDER
    opt_gpu: bool | None


ACT_ORDER = ("offload", "recompute", "keep")


def minimal(n: int, fmt: str, moment: str, fx: Fixed, act_floor: str) -> State:
    """Every block streamed, every update on the host, activations at ``act_floor`` where allowed."""
    floor = ACT_ORDER.index(act_floor)
    act = [
        next((a for a in allowed if ACT_ORDER.index(a) >= floor), allowed[-1]) for allowed in fx.act_allowed
    ]
    resident = [r if r is not None else False for r in fx.resident]
    return State(
        fmt=fmt,
        moment=moment,
        resident=resident,
        act=act,
        opt_gpu=[bool(fx.opt_gpu) and r for r in resident],
        outside_opt_gpu=fx.opt_gpu if fx.opt_gpu is not None else False,
    )


def maximal(n: int, fmt: str, moment: str, fx: Fixed) -> State:
    """Every block resident unless forced to stream, updates on the GPU where the block is resident."""
    resident = [r if r is not None else True for r in fx.resident]
    return State(
        fmt=fmt,
        moment=moment,
        resident=resident,
        act=[allowed[-1] for allowed in fx.act_allowed],
        opt_gpu=[(fx.opt_gpu if fx.opt_gpu is not None else True) and r for r in resident],
        outside_opt_gpu=fx.opt_gpu if fx.opt_gpu is not None else True,
    )


def _moves(s: State, fx: Fixed, census: ModelCensus) -> list[State]:
    """The next upgrade of each kind: one more resident block (the first streamed one), one more
    GPU-updated block (the first host-updated resident one), or both at once (residency alone may not
    pay for itself where residency and the GPU update together do), the outside parameters' update on the
    GPU, and an activation mode one step towards keep.

    [Note: overlap order] backward lands the gradients of the last blocks first, so a host update hides
    behind the rest of backward and the next forward up to its block only when the block is late in the
    stack: the GPU's share of the optimizer grows from the first block up, leaving the host the last
    blocks, and residency grows from the first block up too, leaving the streamed blocks last, inside the
    host share. A block's optimizer moves to the GPU only with its weights resident: a streamed block's
    trainable parameters update on the host (see the planner's [Note: streamed blocks update on the host]).
    """
    n = len(s.resident)
    out = []
    first_streamed = next((i for i in range(n) if not s.resident[i] and fx.resident[i] is None), None)
    if first_streamed is not None:
        t = s.copy()
        t.resident[first_streamed] = True
        out.append(t)
    if fx.opt_gpu is None:

        def first_host(st: State) -> int | None:
            return next(
                (
                    i
                    for i in range(n)
                    if st.resident[i] and not st.opt_gpu[i] and census.blocks[i].trainable_params
                ),
                None,
            )

        i = first_host(s)
        if i is not None:
            t = s.copy()
            t.opt_gpu[i] = True
            out.append(t)
        if first_streamed is not None:
            t = out[0].copy()
            i = first_host(t)
            if i is not None:
                t.opt_gpu[i] = True
                out.append(t)
        if not s.outside_opt_gpu:
            t = s.copy()
            t.outside_opt_gpu = True
            out.append(t)
    # Activations: raise the lowest mode first (offload -> recompute everywhere before any keep).
    upgradable = [i for i in range(n) if s.act[i] != fx.act_allowed[i][-1]]
    if upgradable:
        i = min(upgradable, key=lambda j: (ACT_ORDER.index(s.act[j]), j))
        allowed = fx.act_allowed[i]
        t = s.copy()
        t.act[i] = allowed[allowed.index(s.act[i]) + 1]
        out.append(t)
    return out


def _worth(ctx: Context, ev: Evaluation, et: Evaluation, prefer: str) -> float | None:
    """Objective saved by moving from ``ev`` to ``et``, or None when ``et`` does not fit or, under
    ``prefer="memory"``, saves too little for the VRAM it adds. A move may not take host RAM past what is
    usable (offloaded activations would otherwise buy speed with RAM the machine lacks); from a start
    already past it, moves that do not add host bytes stay allowed."""
    if et.vram_total > ctx.budget or et.host_total > max(ctx.host_usable, ev.host_total):
        return None
    gain = ev.objective - et.objective
    if gain <= 0:
        return None
    if (
        prefer == "memory"
        and et.vram_total > ev.vram_total
        and gain < MEMORY_PREFER_MIN_GAIN * ev.prediction.step_s
    ):
        return None
    return gain


def _greedy(ctx: Context, s: State, ev: Evaluation, fx: Fixed, prefer: str) -> tuple[State, Evaluation]:
    """Take the upgrade that saves the most objective per VRAM byte, while it fits."""
    while True:
        best: tuple[float, State, Evaluation] | None = None
        for t in _moves(s, fx, ctx.census):
            et = evaluate(ctx, t)
            gain = _worth(ctx, ev, et, prefer)
            if gain is None:
                continue
            score = gain / max(1, et.vram_total - ev.vram_total)
            if best is None or score > best[0]:
                best = (score, t, et)
        if best is None:
            return s, ev
        _, s, ev = best


def _activation_modes(
    ctx: Context, s: State, ev: Evaluation, fx: Fixed, prefer: str
) -> tuple[State, Evaluation, bool]:
    """Per block, the allowed activation mode (keep / recompute / offload) with the lowest objective.

    The greedy search only raises modes one step at a time; this compares all three directly, so
    offloading (whose copies compete with streamed weights and gradients on the link, in the phase where
    they must run) is weighed against recomputing (an extra forward of the block) and keeping (VRAM).
    Blocks alike in shape and placement are interchangeable but for their position, so only the first
    and the last of each run of them is tried; a change is kept when it lowers the objective and fits.
    """
    changed = True
    rounds = 0
    while changed and rounds <= 2 * len(s.act):
        changed, rounds = False, rounds + 1
        for members in _alike(ctx, s, fx, with_act=True):
            for i in dict.fromkeys((members[0], members[-1])):
                for mode in fx.act_allowed[i]:
                    if mode == s.act[i]:
                        continue
                    t = s.copy()
                    t.act[i] = mode
                    et = evaluate(ctx, t)
                    if _worth(ctx, ev, et, prefer) is not None:
                        s, ev, changed = t, et, True
                        break
                if changed:
                    break
            if changed:
                break
    return s, ev, rounds > 1


def _alike(ctx: Context, s: State, fx: Fixed, *, with_act: bool) -> list[list[int]]:
    """Runs of consecutive blocks alike in activation size, placement and allowed activation modes (and
    in activation mode when ``with_act``)."""
    runs: list[tuple[tuple, list[int]]] = []
    for i, b in enumerate(ctx.census.blocks):
        key = (s.resident[i], s.opt_gpu[i], tuple(fx.act_allowed[i]), b.activation_bytes_per_token)
        key += (s.act[i],) if with_act else ()
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append((key, [i]))
    return [members for _, members in runs]


# Activation modes along a run of alike blocks, first block first: an early block's offload copy hides
# behind the forward of every block after it, and its way back behind their backward.
_ACT_LAYOUT = ("offload", "keep", "recompute")


def _tidy_activations(ctx: Context, s: State, ev: Evaluation, fx: Fixed) -> tuple[State, Evaluation]:
    """The same modes laid out in ``_ACT_LAYOUT`` order within each run of alike blocks, when that fits
    and predicts no worse (the table then reads in a few lines)."""
    t = s.copy()
    for members in _alike(ctx, s, fx, with_act=False):
        modes = sorted((s.act[i] for i in members), key=_ACT_LAYOUT.index)
        for i, mode in zip(members, modes, strict=True):
            t.act[i] = mode
    if t.act == s.act:
        return s, ev
    et = evaluate(ctx, t)
    if et.vram_total <= ctx.budget and et.objective <= ev.objective * (1 + 1e-9):
        return t, et
    return s, ev


def fit_host(ctx: Context, s: State, ev: Evaluation, fx: Fixed) -> tuple[State, Evaluation]:
    """Trade speed for host RAM until ``s`` fits it, one block at a time (:func:`_host_savers`), taking
    the change that frees the most host bytes per second of objective it adds while the VRAM budget
    holds. Offloading every block's activations is often the fastest start and can need more RAM than
    the machine has (a 14B at 4096 tokens: 42.5 GiB). What VRAM is left is the search's to spend
    afterwards. Returns the last state reached: still over when nothing frees more."""
    while ev.host_total > ctx.host_usable:
        best: tuple[float, State, Evaluation] | None = None
        for t in _host_savers(s, fx, ctx.census):
            et = evaluate(ctx, t)
            freed = ev.host_total - et.host_total
            if freed <= 0 or et.vram_total > ctx.budget:
                continue
            score = freed / max(et.objective - ev.objective, 1e-9)
            if best is None or score > best[0]:
                best = (score, t, et)
        if best is None:
            break
        _, s, ev = best
    return s, ev


def _host_savers(s: State, fx: Fixed, census: ModelCensus) -> list[State]:
    """Single-block changes that free host RAM without spending the VRAM a later one needs: the last
    offloaded block's activations recomputed (kept only where recompute is not allowed; the early
    blocks' copies hide best, [Note: overlap order]); with no offload left, the greedy's upgrades (one
    more resident block takes its weights out of the host's streamed set)."""
    # offloaded blocks the user did not force to offload (activation_offload=True or a share)
    free = [i for i, a in enumerate(s.act) if a == "offload" and len(fx.act_allowed[i]) > 1]
    if not free:
        return _moves(s, fx, census)
    i = free[-1]
    t = s.copy()
    t.act[i] = "recompute" if "recompute" in fx.act_allowed[i] else fx.act_allowed[i][-1]
    return [t]


# Rounds of greedy search + per-block activation choice; each round only lowers the objective.
SEARCH_ROUNDS = 3


def search(ctx: Context, s: State, fx: Fixed, prefer: str) -> tuple[State, Evaluation]:
    """Greedy upgrades, then the cheapest activation mode per block; again while that frees or spends
    VRAM the greedy search can use."""
    ev = evaluate(ctx, s)
    for _ in range(SEARCH_ROUNDS):
        s, ev = _greedy(ctx, s, ev, fx, prefer)
        s, ev, changed = _activation_modes(ctx, s, ev, fx, prefer)
        if not changed:
            break
    s, ev = _tidy_activations(ctx, s, ev, fx)
    return _spread_streamed_blocks(ctx, s, ev, fx)


def _spread_streamed_blocks(ctx: Context, s: State, ev: Evaluation, fx: Fixed) -> tuple[State, Evaluation]:
    """The same number of streamed blocks spread through the stack, when none of them streams a trained
    weight, the user fixed no block's residency, and that fits and predicts no worse.

    The search makes residency grow from the first block up ([Note: overlap order]: the host updates of
    late blocks hide best), which leaves a run of streamed blocks at the end. For frozen blocks (a LoRA
    base) nothing waits on the host, and a run leaves the link alone on the critical path while the
    resident blocks compute; spread, each copy runs beside them (``stream_schedule.spread_streamed``). The
    resident blocks keep their optimizer placement in order; streamed blocks update on the host.
    """
    n = len(s.resident)
    streamed = [i for i in range(n) if not s.resident[i]]
    frozen = frozen_blocks(ctx.census.blocks)
    if not streamed or any(r is not None for r in fx.resident) or not all(frozen[i] for i in streamed):
        return s, ev
    spread = set(spread_streamed(range(n), len(streamed), n))
    t = s.copy()
    resident_opt = iter([s.opt_gpu[i] for i in range(n) if s.resident[i]])
    for i in range(n):
        t.resident[i] = i not in spread
        t.opt_gpu[i] = next(resident_opt) if t.resident[i] else False
    if t.resident == s.resident:
        return s, ev
    et = evaluate(ctx, t)
    fits = et.vram_total <= ctx.budget and et.host_total <= max(ctx.host_usable, ev.host_total)
    if fits and et.objective <= ev.objective * (1 + 1e-9):
        return t, et
    return s, ev
