"""Pieces shared by ``OffloadAdamW`` and ``ShardedHostAdamW``: param-group defaults, option checks and
matching a ``torch.optim.AdamW``-layout state dict's param groups to the optimizer's.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_stream.errors import OptionError, StateDictError, StreamError

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Accepted ``moment_dtype`` names and their dtypes."""

# torch.optim.AdamW's implementation switches, kept in OffloadAdamW's param groups (its state dicts carry them)
_TORCH_SWITCHES = dict(foreach=None, capturable=False, differentiable=False, fused=None)


def adamw_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    *,
    torch_switches: bool,
) -> dict[str, Any]:
    """Param-group defaults in ``torch.optim.AdamW``'s key order (the order state dicts keep).

    ``torch_switches`` adds ``foreach``/``capturable``/``differentiable``/``fused`` before
    ``decoupled_weight_decay``.
    """
    out: dict[str, Any] = dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False
    )
    if torch_switches:
        out.update(_TORCH_SWITCHES)
    out["decoupled_weight_decay"] = decoupled_weight_decay
    return out


def moment_dtype_of(owner: str, moment_dtype: str) -> torch.dtype:
    """The dtype named by ``moment_dtype``; ``owner`` names the optimizer in the error."""
    if moment_dtype not in MOMENT_DTYPES:
        raise StreamError(f"{owner}: moment_dtype={moment_dtype!r}; accepted 'fp32', 'bf16'")
    return MOMENT_DTYPES[moment_dtype]


def check_accumulation_steps(owner: str, n: object) -> None:
    """Raise unless ``n`` is a valid ``accumulation_steps`` (an int >= 1, not a bool)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise OptionError(
            f"{owner}.accumulation_steps={n!r} is invalid; accepted: an int >= 1. "
            "Fix: give the number of micro-steps per update."
        )


def check_contiguous(owner: str, p: torch.Tensor, why: str) -> None:
    """Raise if ``p`` is not contiguous; ``why`` says what needs it."""
    if not p.is_contiguous():
        raise StreamError(
            f"{owner}: parameter {tuple(p.shape)} is not contiguous; {why} contiguous parameters. "
            "Fix: call .contiguous() on it before wrap()."
        )


def match_param_groups(owner: str, state_dict: dict[str, Any], param_groups: list[dict]) -> dict[Any, Any]:
    """Check ``state_dict``'s groups against ``param_groups``, copy their hyper-parameters in, and return
    the checkpoint's parameter keys mapped to this optimizer's parameters."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups) or any(
        len(g["params"]) != len(o["params"]) for g, o in zip(groups, param_groups)
    ):
        raise StateDictError(
            f"{owner}.load_state_dict: param groups differ: checkpoint has "
            f"{[len(g['params']) for g in groups]} parameters per group, this optimizer "
            f"{[len(g['params']) for g in param_groups]}. Fix: build the optimizer over the same "
            "parameters, in the same groups and order, as the one that saved it."
        )
    id_map = {}
    for g, o in zip(groups, param_groups):
        id_map.update(zip(g["params"], o["params"]))
        for k, v in g.items():
            if k != "params":
                o[k] = v
    return id_map


def run_closure(closure: Any) -> Any:
    """``step(closure)``'s loss: the closure's result under grad mode, or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def advance_micro(opt: Any) -> bool:
    """Count one micro-step of ``opt`` (``_micro``, ``accumulation_steps``); True on the last of an update
    (also kept as ``opt._updated_last_step`` for ``zero_grad``)."""
    last = opt._micro == opt.accumulation_steps - 1
    opt._micro = 0 if last else opt._micro + 1
    opt._updated_last_step = last
    return last
