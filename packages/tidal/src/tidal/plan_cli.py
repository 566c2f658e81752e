"""``tidal plan CONFIG --vram-budget 24GiB``: tidal's plan for a model shape, with no weights and no GPU.

The model is built from a transformers config on the meta device (no memory is touched), optionally
with LoRA adapters of the exact shapes PEFT would add, then censused and planned by tidal-plan against
this machine's profile (or, without a GPU, a synthetic H200-class profile with the budget given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.errors import CLIError


def _arch(
    name: str,
    model_type: str,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    *,
    tie: bool,
) -> tuple[str, str, dict[str, Any]]:
    """A ``PRESETS`` entry: display name, transformers model_type and the config values."""
    return name, model_type, dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tie,
    )  # fmt: skip


# Exact architectures of public checkpoints (config values only; no weights are read).
# _arch(name, model_type, hidden, intermediate, layers, heads, kv_heads, vocab, tie=)
PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "1.5b": _arch("Qwen2.5-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 151936, tie=True),
    "7b": _arch("Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 152064, tie=False),
    "8b": _arch("Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128256, tie=False),
    "14b": _arch("Qwen2.5-14B", "qwen2", 5120, 13824, 48, 40, 8, 152064, tie=False),
    "32b": _arch("Qwen2.5-32B", "qwen2", 5120, 27648, 64, 40, 8, 152064, tie=False),
    "72b": _arch("Qwen2.5-72B", "qwen2", 8192, 29568, 80, 64, 8, 152064, tie=False),
    "110b": _arch("Qwen1.5-110B", "qwen2", 8192, 49152, 80, 64, 8, 152064, tie=False),
}
_H200_BYTES = int(139.8 * 2**30)  # the synthetic profile's device memory
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZE = ("auto", "int8", "nf4", "fp8", "nvfp4")


@dataclass(frozen=True)
class PlanRequest:
    """Inputs of ``tidal plan``."""

    config: str
    """A preset name (see ``PRESETS``), a folder with ``config.json``, or a ``config.json`` path."""
    vram_budget: str | int
    """Device memory budget, bytes or e.g. ``"24GiB"``. Required."""
    lora: bool = False
    """Freeze the base and add rank-``lora_rank`` adapters on every projection. Default False (full fine-tune)."""
    lora_rank: int = 16
    """LoRA rank; default 16."""
    quantize: str | None = None
    """Frozen-base storage: None (exact), ``auto``, ``int8``, ``nf4``, ``fp8``, ``nvfp4``. Default None."""
    host_ram: str | int | None = None
    """Host RAM to plan for; None: what this machine has available."""
    batch_size: int = 1
    """Sequences per step; default 1."""
    seq_len: int = 512
    """Tokens per sequence; default 512."""

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise CLIError(
                f"--quantize: got {self.quantize!r}; accepted: {', '.join(QUANTIZE)} (or leave it out: exact)"
            )
        if self.quantize is not None and not self.lora:
            raise CLIError(
                f"--quantize {self.quantize}: quantized storage is for a frozen base, but this is a full fine-tune; "
                "add --lora (or drop --quantize)"
            )
        for name in ("lora_rank", "batch_size", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise CLIError(f"--{name.replace('_', '-')}: got {v!r}; accepted: a positive integer")


def _transformers() -> Any:
    """transformers, or a clear error naming the extra that installs it."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise
        raise CLIError(
            'plan: building a model from a config needs transformers, which is not installed; pip install "tidal[hf]"'
        ) from exc
    return transformers


def load_config(spec: str) -> tuple[str, Any]:
    """A transformers ``PretrainedConfig`` and a display name for a preset, a folder or a config.json.

    Raises:
        CLIError: not a preset and not a readable config.
    """
    transformers = _transformers()
    key = spec.lower()
    if key in PRESETS:
        name, model_type, kwargs = PRESETS[key]
        return f"{name} shape (preset {key})", transformers.AutoConfig.for_model(model_type, **kwargs)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CLIError(
            f"CONFIG: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with config.json nor a "
            "config.json file; give one of those (no weights are needed)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        model_type = data.pop("model_type")
    except (json.JSONDecodeError, KeyError) as exc:
        raise CLIError(f"CONFIG: {path} is not a transformers config.json with a model_type ({exc})") from exc
    try:
        return str(path), transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise CLIError(
            f"CONFIG: {path}: transformers does not know model_type {model_type!r} ({exc})"
        ) from exc


def build_meta_model(config: Any, *, lora: bool, lora_rank: int) -> Any:
    """The causal LM for ``config`` on the meta device in bf16; with ``lora``, a frozen base plus adapters.

    The adapters are parameters of PEFT's shapes (``A: [r, in]``, ``B: [out, r]``) registered on every
    projection named in ``LORA_TARGETS``: the census counts exactly the trainable and frozen bytes a PEFT
    model has, without PEFT's cost of wrapping every layer.
    """
    import torch

    transformers = _transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.bfloat16)
    if not lora:
        return model
    model.requires_grad_(False)
    n = 0
    for name, mod in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(mod, torch.nn.Linear):
            a = torch.empty(lora_rank, mod.in_features, device="meta", dtype=torch.bfloat16)  # [r, in]
            b = torch.empty(mod.out_features, lora_rank, device="meta", dtype=torch.bfloat16)  # [out, r]
            mod.register_parameter("lora_A", torch.nn.Parameter(a))
            mod.register_parameter("lora_B", torch.nn.Parameter(b))
            n += 1
    if n == 0:
        raise CLIError(
            f"--lora: the model has no projections named {', '.join(LORA_TARGETS)}; LoRA targets none"
        )
    return model


def build_profile(budget: int, host_ram: str | int | None) -> tuple[Any, str]:
    """This machine's measured GPU profile, or without a GPU a synthetic H200-class one, at ``budget``."""
    import torch

    import tidal

    if torch.cuda.is_available():
        return tidal.profile_hardware("cuda", vram_budget=budget, host_ram=host_ram), "measured on this GPU"
    overrides: dict[str, Any] = {"vram_budget_bytes": budget}
    if host_ram is not None:
        overrides["host_ram_bytes"] = tidal.parse_bytes(host_ram, option="--host-ram")
    profile = tidal.HardwareProfile.synthetic(**overrides) if budget <= _H200_BYTES else None
    if profile is None:  # a budget beyond the H200's memory: plan for a card that has it
        profile = tidal.HardwareProfile.synthetic(
            device_total_bytes=budget, device_free_bytes=budget, **overrides
        )
    return profile, "synthetic (no GPU here): an H200-class card on PCIe Gen5, with the budget given"


def make_plan(req: PlanRequest) -> tuple[str, Any, Any, Any, str]:
    """(model title, census, profile, plan, profile source) for a request.

    Raises:
        InfeasiblePlan: the shape cannot be trained under the budget (tidal-plan's numbers in the message).
    """
    import tidal

    budget = tidal.parse_bytes(req.vram_budget, option="--vram-budget")
    title, config = load_config(req.config)
    model = build_meta_model(config, lora=req.lora, lora_rank=req.lora_rank)
    cen = tidal.census(model, seq_len=min(req.seq_len, 64))
    profile, source = build_profile(budget, req.host_ram)
    cfg = tidal.PlanConfig(
        vram_budget=budget,
        batch_tokens=req.batch_size * req.seq_len,
        seq_len=req.seq_len,  # attention work and per-sequence activations follow the sequence length
        training="lora" if req.lora else "full",
        quantize=req.quantize,
        bytes_per_weight=tidal.bytes_per_weight if req.quantize is not None else None,
    )
    return title, cen, profile, tidal.plan(cen, profile, cfg), source


def run_plan(req: PlanRequest, *, as_json: bool = False) -> int:
    """Print the plan; returns 0, or 1 when tidal-plan refuses the run (its numbers are printed)."""
    import tidal

    try:
        title, cen, profile, p, source = make_plan(req)
    except tidal.InfeasiblePlan as exc:
        if as_json:
            print(json.dumps({"model": req.config, "feasible": False, "reason": str(exc)}, indent=2))
        else:
            print(f"{req.config}: no plan fits under {req.vram_budget}:\n{exc}")
        return 1
    if as_json:
        payload = {"model": title, "feasible": True, "profile_source": source, "census": cen.to_dict()}
        payload.update(profile=profile.to_dict(), plan=p.to_dict())
        print(json.dumps(payload, indent=2, default=str))
        return 0
    mode = f"LoRA r={req.lora_rank}" if req.lora else "full fine-tune"
    print(f"{title}, {mode}, {req.batch_size}x{req.seq_len} tokens per step")
    print(f"model       {cen.summary()}")
    print(f"profile     {source}")
    print(profile.summary())
    print()
    print(p.explain())
    return 0
