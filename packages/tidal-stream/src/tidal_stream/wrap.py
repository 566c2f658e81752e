"""``wrap()`` / ``unwrap()`` / ``memory_report()``: the one-call entry point of tidal-stream.

[Note: part-2 installer] weight streaming, activation offload, recompute and the attention backend are
installed by ``tidal_stream.weights.install(session, model, options) -> object`` when that module
exists (the returned object may have ``report() -> dict`` and ``remove()``); ``wrap()`` validates their
options here and, while the module is missing, refuses non-default values with NotImplementedError.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from torch import nn

from tidal_stream.distributed import resolve_distributed, wrap_distributed
from tidal_stream.errors import NotWrappedError, option_error
from tidal_stream.graph_fit import with_block_graphs
from tidal_stream.oom import install_forward_note
from tidal_stream.optimizer import OffloadAdamW
from tidal_stream.options import WrapOptions
from tidal_stream.placement import (
    decide_placement,
    foreign_device_bytes,
    has_first_step_refinement,
    refine_after_first_step,
)
from tidal_stream.session import Session
from tidal_stream.sharded_optimizer import ShardedHostAdamW
from tidal_stream.streamed_blocks import StreamingError

__all__ = ["memory_report", "session_of", "unwrap", "wrap"]

log = logging.getLogger(__name__)

_ATTR = "_tidal_session"


def session_of(model: nn.Module) -> Session:
    """The :class:`Session` ``wrap()`` attached to ``model``."""
    s = getattr(model, _ATTR, None)
    if s is None:
        raise NotWrappedError(
            f"{type(model).__name__} is not wrapped; accepted: a model returned by tidal_stream.wrap(). "
            "Fix: call wrap(model, optimizer) first."
        )
    return s


def _device_of(model: nn.Module, opts: WrapOptions) -> torch.device:
    if opts.device is not None:
        dev = torch.device(opts.device)
    else:
        # meta placeholders (frozen weights another rank's shared host copy fills) say nothing of it
        first = next((p for p in model.parameters() if not p.is_meta), None)
        dev = first.device if first is not None else torch.device("cpu")
    if dev.type not in ("cpu", "cuda"):
        raise option_error("device", opts.device, '"cpu" or "cuda[:N]"')
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise option_error(
            "device", opts.device, '"cpu" here: torch sees no CUDA device', 'pass device="cpu".'
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if opts.cuda_graphs is True and dev.type != "cuda":
        raise option_error("cuda_graphs", True, '"auto" or False on a CPU device', "pass cuda_graphs='auto'.")
    return dev


def _hyper_from(optimizer: torch.optim.Optimizer | None, opts: WrapOptions) -> tuple[list[dict], bool]:
    """Param groups (with hyper-parameters) of the given optimizer, and AdamW (True) vs Adam."""
    if optimizer is None:
        return [], True
    if opts.lr is not None:
        raise option_error("lr", opts.lr, "lr only when no optimizer is given", "set lr on your optimizer.")
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise option_error(
            "optimizer",
            type(optimizer).__name__,
            "torch.optim.AdamW, torch.optim.Adam or None",
            "build a torch.optim.AdamW over the model's parameters (or pass None and lr=).",
        )
    for g in optimizer.param_groups:
        if g.get("amsgrad"):
            raise option_error(
                "optimizer.amsgrad", True, "False", "amsgrad is not supported by OffloadAdamW."
            )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.param_groups[0].get("decoupled_weight_decay", False)
    )
    groups = []
    for g in optimizer.param_groups:
        keep = ("params", "lr", "betas", "eps", "weight_decay", "maximize")
        groups.append({k: v for k, v in g.items() if k in keep})
        groups[-1]["params"] = list(g["params"])
    return groups, decoupled


def _setup_training(
    session: Session, model: nn.Module, optimizer: torch.optim.Optimizer | None, opts: WrapOptions
) -> tuple[list[dict], bool, list[nn.Parameter]]:
    """Apply ``opts.threads``; return the param groups, AdamW (True) vs Adam, and the trainable parameters
    (each once, in group order). Raises when nothing is trainable."""
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
        session.record("threads", f"host threads set to {opts.threads} (torch.set_num_threads)")
    groups, decoupled = _hyper_from(optimizer, opts)
    if not groups:
        groups = [{"params": list(model.parameters())}]  # as torch.optim.AdamW(model.parameters())
    trainable = list({id(p): p for g in groups for p in g["params"] if p.requires_grad}.values())
    if not trainable:
        raise option_error(
            "model",
            f"{type(model).__name__} with no trainable parameters",
            "a module with at least one parameter that requires grad",
            "set requires_grad=True on the parameters to train (or add adapters) before wrap().",
        )
    return groups, decoupled, trainable


def _part2(session: Session, model: nn.Module, opts: WrapOptions) -> None:
    """Hand the part-2 options to their installer, or refuse non-default ones while it is missing."""
    try:
        mod = importlib.import_module("tidal_stream.weights")
    except ImportError:
        mod = None
    install = getattr(mod, "install", None)
    if install is None:
        bad = opts.part2_non_default()
        if bad:
            raise NotImplementedError(
                f"wrap(): option {bad[0]}={getattr(opts, bad[0])!r} needs weight/activation streaming, which "
                "this build of tidal-stream does not provide yet. Fix: leave it at its default."
            )
        return
    ext = install(session, model, opts)
    if ext is not None:
        session.extensions.append(ext)


def _move_resident(session: Session, model: nn.Module) -> None:
    """Move weights still elsewhere (a host-resident model) to the device; streamed ones stay on the host."""
    dev = session.device
    moved = 0
    with torch.no_grad():
        for mod in model.modules():
            for t in list(mod._parameters.values()):
                if t is not None and t.device != dev and t.untyped_storage().nbytes() > 0:
                    t.data = t.data.to(dev)  # the Parameter object stays; hooks and optimizer keep it
                    moved += t.numel() * t.element_size()
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device != dev:
                    mod._buffers[name] = b.to(dev)
                    moved += b.numel() * b.element_size()
    if moved:
        session.record("weights", f"moved {moved / 2**20:.1f} MiB of resident weights to {dev}", bytes=moved)


def _install(
    session: Session,
    model: nn.Module,
    opt: OffloadAdamW,
    optimizer: torch.optim.Optimizer | None,
    opts: WrapOptions,
) -> None:
    """After the optimizer read the weights: streaming, resident weights to the device, device state, guards."""
    _part2(session, model, opts)
    for ext in session.extensions:
        if hasattr(ext, "host_tensor") and hasattr(ext, "set_before_fetch"):
            n = opt.attach_streaming(ext)
            if n:
                session.record("optimizer", f"{n} streamed weights are updated in their host copies")
    _move_resident(session, model)
    opt.allocate_device_state()
    if optimizer is not None:
        migrated = [p for p, st in optimizer.state.items() if st]
        for p in migrated:
            opt._import_state(p, optimizer.state[p])
        if migrated:
            session.record("migrate", f"{type(optimizer).__name__} state of {len(migrated)} tensors migrated")
    session.handles += opt.install_read_guards(model)
    # a model state_dict must see the updated weights, not ones still in flight
    session.handles.append(model.register_state_dict_pre_hook(lambda *a, **k: opt.synchronize()))
    session.handles += _streamed_state_dict_hooks(session, model)
    session.handles.append(install_forward_note(session, model))  # OOM in forward: note + log (oom.py)


def _streamed(session: Session, model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, tensor, host copy)`` of the model's parameters and buffers whose device storage is empty
    now (streamed, between uses)."""
    out = []
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    for ext in session.extensions:
        if not hasattr(ext, "host_tensor"):
            continue
        for name, t in named:
            if t.numel() > 0 and t.untyped_storage().nbytes() == 0:
                host = ext.host_tensor(t)
                if host is not None:
                    out.append((name, t, host))
    return out


def _streamed_state_dict_hooks(session: Session, model: nn.Module) -> list[Any]:
    """[Note: streamed tensors outside forward] a streamed weight's device storage is empty between uses
    (reading it directly, e.g. ``p.clone()``, raises: see ``_empty_guard``; ``unwrap()`` first). The model's
    ``state_dict()`` — what checkpointing reads — gets those entries from their host copies instead (a
    CPU copy, current: pending host updates are written first); ``load_state_dict()`` into a wrapped
    model with streamed weights is refused with the fix."""

    def save(module: nn.Module, destination: dict, prefix: str, local_metadata: Any) -> None:
        for name, t, host in _streamed(session, model):
            key = prefix + name
            if key in destination:
                destination[key] = host.detach().reshape(t.shape).clone()  # CPU, [same shape]

    def load(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        names = [name for name, _, _ in _streamed(session, model) if prefix + name in state_dict]
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise StreamingError(
                f"load_state_dict(): {type(model).__name__} is wrapped and {len(names)} of the weights given "
                f"stream ({shown}): their device storage is empty between uses and the host optimizer keeps "
                "their fp32 masters; accepted: a state dict without streamed weights. Fix: load the state dict "
                "before wrap(), or unwrap(model), load it, and wrap again."
            )

    return [model.register_state_dict_post_hook(save), model.register_load_state_dict_pre_hook(load)]


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **options: Any
) -> tuple[nn.Module, OffloadAdamW | ShardedHostAdamW]:
    """Train ``model`` with optimizer state and gradients in host memory; the loop stays unchanged.

    Args:
        model: the module to train (its weights stay on the device).
        optimizer: a ``torch.optim.AdamW`` / ``Adam`` (hyper-parameters, param groups and state are
            migrated) or None (an AdamW over the trainable parameters with ``lr=``).
        **options: see :class:`tidal_stream.options.WrapOptions` (unknown names raise ValueError).

    Returns:
        ``(model, optimizer)``: the same model (hooks installed) and an :class:`OffloadAdamW` — or, data
        parallel (``distributed``), a :class:`~tidal_stream.sharded_optimizer.ShardedHostAdamW`.

    Reading weights between steps: ``model.state_dict()`` works (streamed weights come from their host
    copies, as CPU tensors); a streamed parameter's own tensor has no device storage outside its block's
    forward and backward: reading it directly (``p.clone()``, ``copy.deepcopy(model)``) raises
    ``StreamingError`` naming it (``unwrap(model)`` first). ``load_state_dict()`` into a model whose weights
    stream is refused the same way.
    """
    if not isinstance(model, nn.Module):
        raise option_error("model", type(model).__name__, "a torch.nn.Module", "pass the model to train.")
    opts = WrapOptions.from_kwargs(options)
    if getattr(model, _ATTR, None) is not None:
        raise option_error("model", type(model).__name__, "a model not wrapped yet", "call unwrap() first.")
    device = _device_of(model, opts)
    dp = resolve_distributed(opts.distributed)
    if dp is not None and opts.cuda_graphs is True:
        raise option_error(
            "cuda_graphs", True, "False or 'auto' under data parallel (block graphs are single-GPU for now)"
        )
    if dp is not None:  # data parallel: every rank of the process group wraps collectively
        return wrap_distributed(model, optimizer, opts, device, dp)
    session = Session(model, opts, device)
    groups, decoupled, trainable = _setup_training(session, model, optimizer, opts)
    try:
        place = decide_placement(session, model, opts, trainable)
    except BaseException:
        session.close()  # a refused plan: nothing is installed yet, the model is as it was given
        raise
    moment = place.moment_dtype
    defaults = {"lr": opts.lr if opts.lr is not None else 1e-3}
    opt = OffloadAdamW(
        groups,
        **defaults,
        decoupled_weight_decay=decoupled,
        session=session,
        gpu_params=place.gpu_params,
        accumulation_steps=opts.accumulation_steps,
        max_grad_norm=opts.max_grad_norm,
        moment_dtype=moment,
        delayed_update=opts.delayed_update,
        seed=opts.seed,
        defer_device_state=True,
        rollback=opts.rollback,
    )
    session.optimizer = opt
    try:
        _install(session, model, opt, optimizer, opts)
    except BaseException:
        opt.close()
        session.close()
        raise
    if place.refine and has_first_step_refinement(session, opt):
        torch.cuda.synchronize(device)
        foreign = foreign_device_bytes(opt, model, device)
        # the refinement reads the first step's peak of RESERVED bytes: cached blocks freed by streaming
        # the weights out (and by earlier work) would count as this model's use
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        budget = opts.vram_budget_bytes
        keep = place.keep_streamed
        opt._after_first_update = lambda: refine_after_first_step(session, opt, foreign, budget, keep)
    opt._after_first_update = with_block_graphs(session, opt, opt._after_first_update)
    setattr(model, _ATTR, session)
    session.record(
        "wrap",
        f"wrapped {type(model).__name__}: {sum(p.numel() for p in trainable) / 1e6:.2f} M trainable parameters "
        f"on {device}, moments {moment}, accumulation {opts.accumulation_steps}, "
        f"clip {opts.max_grad_norm}, delayed_update {opts.delayed_update}",
    )
    return model, opt


def unwrap(model: nn.Module) -> nn.Module:
    """Finish pending updates, remove every hook and release host memory; returns the plain model."""
    session = session_of(model)
    if session.optimizer is not None:
        session.optimizer.close()
    for ext in session.extensions:
        if hasattr(ext, "remove"):
            ext.remove()
    session.close()
    delattr(model, _ATTR)
    return model


def memory_report(model: nn.Module) -> dict[str, Any]:
    """Bytes per tier, pinned bytes, H2D/D2H volumes and the decision log (``"events"``)."""
    return session_of(model).report()
