"""``census(model)``: find the repeated block stack and count the bytes in and around it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from tidal_plan.act_bytes import ByteRate, estimate_saved_bytes
from tidal_plan.errors import PlanConfigError
from tidal_plan.units import format_bytes

__all__ = ["BlockCensus", "ModelCensus", "census"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockCensus:
    """Bytes and parameters of one block of the stack."""

    index: int
    """Position in the stack."""
    name: str
    """Qualified module name, e.g. ``"model.layers.3"``."""
    trainable_bytes: int
    """Bytes of parameters with ``requires_grad``."""
    frozen_bytes: int
    """Bytes of parameters without ``requires_grad``."""
    buffer_bytes: int
    """Bytes of buffers."""
    trainable_params: int
    """Number of trainable parameters (elements)."""
    frozen_params: int
    """Number of frozen parameters (elements)."""
    activation_bytes_per_token: int
    """Bytes autograd saves for backward in this block, per token: distinct storages of its activations
    (weights and inputs shared by every block excluded), i.e. what ``keep`` holds on the device."""
    quantizable_params: int = 0
    """Frozen elements in 2-D weights (linear layers) that a quantized storage format can hold."""
    quantizable_bytes: int = 0
    """Bytes of those weights in their current dtype."""
    input_bytes_per_token: int = 0
    """Bytes of the block's input per token (what recompute keeps)."""
    matmul_params: int = 0
    """Elements of 2-D weights (used for FLOP counts)."""
    matmul_shapes: tuple[tuple[int, int, bool], ...] = ()
    """``(in_features, out_features, trainable)`` of each 2-D weight, for the per-GEMM roofline; default
    ``()`` (unknown: the cost model then counts ``matmul_params`` at the peak rate)."""
    attention_width: int = 0
    """Query width (heads x head dim) of the block's attention, for its T x T work; 0: none found."""
    forward_kernels: int = 0
    """Device operations one forward of the block runs (views excluded), counted in the activation trace;
    0: unknown."""
    stored_format: str = "exact"
    """Format of linear weights the model already holds quantized (a module with ``fmt``,
    ``in_features`` and ``out_features`` whose weight is not a Parameter, like ``tidal_quant.QuantLinear``);
    the most common by elements, ``"exact"`` when none. Default ``"exact"``."""
    stored_params: int = 0
    """Weight elements of those already-quantized linears (their bytes are in ``buffer_bytes``); default 0."""
    stored_bytes: int = 0
    """Bytes of their stored weights and scales; default 0."""
    activation_bytes_per_position: int = 0
    """Keep bytes per token per position of its sequence (an eager attention's T x T scores, a mask
    converted in the block); default 0."""
    activation_bytes_per_sequence_position: int = 0
    """Keep bytes per position of a sequence, once for the whole batch; default 0."""
    offload_bytes_per_token: int | None = None
    """Bytes per token an offloaded block copies to the host and back: distinct saved views, inputs shared
    by every block included (tidal-stream copies those per block too); default ``None`` =
    ``activation_bytes_per_token``."""
    offload_bytes_per_position: int = 0
    """The part of the offloaded bytes per token that grows with the sequence; default 0."""
    offload_bytes_per_sequence_position: int = 0
    """Offloaded bytes per position of a sequence, once for the batch (rotary tables); default 0."""
    saved_bytes_per_token: int = 0
    """Every saved reference's bytes per token, repeats included (what a plain hook census adds up);
    default 0 (unknown)."""
    saved_bytes_per_position: int = 0
    """The part of ``saved_bytes_per_token`` that grows with the sequence; default 0."""
    saved_bytes_per_sequence_position: int = 0
    """Saved bytes per position of a sequence, once for the batch; default 0."""

    def keep_bytes(self, tokens: int, seq_len: int) -> int:
        """Device bytes the block's saved activations hold for ``tokens`` tokens in sequences of
        ``seq_len``: its ``keep`` cost, and the transient peak of its recomputed backward."""
        return ByteRate(
            self.activation_bytes_per_token,
            self.activation_bytes_per_position,
            self.activation_bytes_per_sequence_position,
        ).at(tokens, seq_len)

    def offload_bytes(self, tokens: int, seq_len: int) -> int:
        """Bytes ``offload`` copies each way over PCIe (and holds in pinned host memory)."""
        if self.offload_bytes_per_token is None:
            return self.keep_bytes(tokens, seq_len)
        return ByteRate(
            self.offload_bytes_per_token,
            self.offload_bytes_per_position,
            self.offload_bytes_per_sequence_position,
        ).at(tokens, seq_len)

    def saved_bytes(self, tokens: int, seq_len: int) -> int:
        """Every saved reference's bytes, repeats included (0 when unknown)."""
        return ByteRate(
            self.saved_bytes_per_token, self.saved_bytes_per_position, self.saved_bytes_per_sequence_position
        ).at(tokens, seq_len)

    def recompute_bytes(self, tokens: int) -> int:
        """Device bytes ``recompute`` holds between forward and backward: the block's input."""
        return tokens * self.input_bytes_per_token

    @property
    def param_bytes(self) -> int:
        """Trainable + frozen parameter bytes."""
        return self.trainable_bytes + self.frozen_bytes


@dataclass(frozen=True)
class ModelCensus:
    """What a model holds: its block stack, per-block bytes, everything outside, tied parameters."""

    stack_name: str
    """Qualified name of the block stack (``""`` when the model itself is the stack)."""
    block_type: str
    """Class name of the blocks."""
    blocks: tuple[BlockCensus, ...]
    """One entry per block, in order."""
    outside_trainable_bytes: int
    """Trainable parameter bytes outside the stack (embeddings, head, final norm)."""
    outside_frozen_bytes: int
    """Frozen parameter bytes outside the stack."""
    outside_buffer_bytes: int
    """Buffer bytes outside the stack."""
    outside_trainable_params: int
    """Trainable elements outside the stack."""
    outside_frozen_params: int
    """Frozen elements outside the stack."""
    outside_quantizable_params: int
    """Frozen elements outside the stack in linear weights (e.g. an untied LM head)."""
    outside_quantizable_bytes: int
    """Bytes of those weights in their current dtype."""
    outside_matmul_params: int
    """Elements of outside linear weights (the LM head) used for FLOP counts."""
    outside_activation_bytes_per_token: int
    """Activation bytes per token outside the stack (embedding output, final norm)."""
    tied: tuple[tuple[str, ...], ...]
    """Groups of qualified names that share one parameter (counted once)."""
    outside_matmul_shapes: tuple[tuple[int, int, bool], ...] = ()
    """``(in_features, out_features, trainable)`` of each outside 2-D weight (the LM head); default ``()``."""
    param_to_block: dict[str, int | None] = field(default_factory=dict)
    """Every parameter's qualified name (tied aliases too) -> block index, or None outside the stack."""
    param_dtype_bytes: int = 2
    """Element size of the (most common) trainable parameter dtype, or of all parameters if none trains."""
    compute_dtype_bytes: int | None = None
    """Element size of the most common parameter dtype of all (frozen ones too): the dtype most matmuls
    run in. It differs from ``param_dtype_bytes`` under LoRA, whose fp32 adapters (PEFT's default) train
    on a bf16 base. Default None: ``param_dtype_bytes``."""
    activation_source: str = "meta-trace"
    """How activation bytes were found: ``"meta-trace"``, ``"measured"``, ``"override"`` or ``"heuristic"``."""
    notes: tuple[str, ...] = ()
    """Anything estimated rather than traced, one line each."""
    outside_activation_bytes_per_position: int = 0
    """Outside activation bytes per token per position of its sequence; default 0."""
    outside_activation_bytes_per_sequence_position: int = 0
    """Outside activation bytes per position of a sequence, once for the batch (rotary tables every block
    saves); default 0."""

    def outside_activation_bytes(self, tokens: int, seq_len: int) -> int:
        """Device bytes of activations outside the stack, with the inputs every block shares and saves
        (one copy per forward), for ``tokens`` tokens in sequences of ``seq_len``."""
        return ByteRate(
            self.outside_activation_bytes_per_token,
            self.outside_activation_bytes_per_position,
            self.outside_activation_bytes_per_sequence_position,
        ).at(tokens, seq_len)

    @property
    def matmul_dtype_bytes(self) -> int:
        """Element size the bulk of the matmuls run in (``compute_dtype_bytes``, else ``param_dtype_bytes``)."""
        return self.compute_dtype_bytes or self.param_dtype_bytes

    @property
    def trainable_bytes(self) -> int:
        """All trainable parameter bytes."""
        return sum(b.trainable_bytes for b in self.blocks) + self.outside_trainable_bytes

    @property
    def frozen_bytes(self) -> int:
        """All frozen parameter bytes."""
        return sum(b.frozen_bytes for b in self.blocks) + self.outside_frozen_bytes

    @property
    def trainable_params(self) -> int:
        """All trainable elements."""
        return sum(b.trainable_params for b in self.blocks) + self.outside_trainable_params

    @property
    def frozen_params(self) -> int:
        """All frozen elements."""
        return sum(b.frozen_params for b in self.blocks) + self.outside_frozen_params

    @property
    def total_params(self) -> int:
        """All elements, tied parameters once."""
        return self.trainable_params + self.frozen_params

    @property
    def total_bytes(self) -> int:
        """All parameter and buffer bytes, tied parameters once."""
        return (
            self.trainable_bytes
            + self.frozen_bytes
            + sum(b.buffer_bytes for b in self.blocks)
            + self.outside_buffer_bytes
        )

    def summary(self) -> str:
        """One line: stack, blocks, parameters, bytes."""
        return (
            f"{len(self.blocks)} x {self.block_type} at '{self.stack_name}': "
            f"{self.total_params / 1e9:.2f} B params ({self.trainable_params / 1e6:.1f} M trainable), "
            f"{format_bytes(self.total_bytes)}; activations "
            f"{format_bytes(self.blocks[0].activation_bytes_per_token)}/token/block ({self.activation_source})"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        d["tied"] = [list(t) for t in self.tied]
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelCensus:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["blocks"] = tuple(
            BlockCensus(**{**b, "matmul_shapes": _shapes(b.get("matmul_shapes", ()))}) for b in d["blocks"]
        )
        d["outside_matmul_shapes"] = _shapes(d.get("outside_matmul_shapes", ()))
        d["tied"] = tuple(tuple(t) for t in d["tied"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def _shapes(rows: Any) -> tuple[tuple[int, int, bool], ...]:
    """``matmul_shapes`` read back from JSON lists."""
    return tuple((int(i), int(o), bool(t)) for i, o, t in rows)


def _find_stack(model: nn.Module, blocks: nn.Module | str | None) -> tuple[str, nn.Module]:
    if isinstance(blocks, str):
        try:
            mod = model.get_submodule(blocks)
        except AttributeError as e:
            raise PlanConfigError(
                "blocks", blocks, "a dotted name of a ModuleList/Sequential inside the model", str(e)
            ) from None
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 1:
            raise PlanConfigError("blocks", blocks, "a non-empty nn.ModuleList or nn.Sequential")
        return blocks, mod
    if blocks is not None:
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) < 1:
            raise PlanConfigError(
                "blocks", type(blocks).__name__, "a non-empty nn.ModuleList or nn.Sequential"
            )
        for name, mod in model.named_modules():
            if mod is blocks:
                return name, mod
        raise PlanConfigError("blocks", type(blocks).__name__, "a module list that is part of the model")
    best: tuple[int, int, str, nn.Module] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        types = {type(c) for c in mod}
        if len(types) != 1:
            continue
        numel = sum(p.numel() for p in mod.parameters())
        if numel == 0:
            continue
        cand = (numel, len(mod), name, mod)
        if best is None or cand[:2] > best[:2]:
            best = cand
    if best is None:
        raise PlanConfigError(
            "blocks",
            None,
            "a model with a ModuleList/Sequential of >= 2 same-type children holding parameters",
            "pass blocks= (the module list, or its dotted name like 'model.layers')",
        )
    return best[2], best[3]


def _linear_weight_ids(module: nn.Module) -> tuple[set[int], set[int]]:
    """ids of 2-D weights usable as matmul operands, and of embedding weights (lookups, not matmuls)."""
    mats, embeds = set(), set()
    for m in module.modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2:
            continue
        (embeds if isinstance(m, nn.Embedding) else mats).add(id(w))
    return mats, embeds


# Names of attention projections: query alone (its width is the query width), or q, k and v fused in one
# linear of three equal parts (GPT-2's c_attn, a plain ``qkv``).
_QUERY_NAMES = ("q_proj", "query", "wq")
_FUSED_QKV_NAMES = ("qkv", "qkv_proj", "c_attn", "wqkv", "Wqkv")


def _out_features(m: nn.Module) -> int:
    """A linear's output features; for a wrapper (an adapter around a projection, a stored linear) the
    widest ``out_features`` inside it; 0 if none."""
    width = getattr(m, "out_features", None)
    if isinstance(width, int):
        return width
    return max(
        (x.out_features for x in m.modules() if isinstance(getattr(x, "out_features", None), int)), default=0
    )


def _attention_width(block: nn.Module) -> int:
    """Query width of the block's attention: a ``q_proj``/``query``/``wq`` projection's output features,
    a third of a fused ``qkv``/``c_attn`` projection's (wrapped ones included), else an
    ``nn.MultiheadAttention``'s embedding size; 0 if none."""
    for name, m in block.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            return int(m.embed_dim)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _QUERY_NAMES or leaf in _FUSED_QKV_NAMES:
            width = _out_features(m) // (3 if leaf in _FUSED_QKV_NAMES else 1)
            if width:
                return width
    return 0


STORED_FORMATS = ("int8", "nf4", "fp8", "nvfp4")


def _stored_linears(module: nn.Module) -> tuple[str, int, int, tuple[tuple[int, int, bool], ...]]:
    """Linears under ``module`` that hold their weight already quantized (duck-typed: ``fmt`` names a
    storage format, ``in_features``/``out_features`` are ints, ``weight`` is no Parameter): the most
    common format by elements (``"exact"`` if none), their elements, bytes (buffers), and GEMM shapes."""
    per_fmt: dict[str, int] = {}
    n_bytes, shapes = 0, []
    for m in module.modules():
        fmt = str(getattr(getattr(m, "fmt", None), "value", getattr(m, "fmt", None)))
        k, n = getattr(m, "in_features", None), getattr(m, "out_features", None)
        if fmt not in STORED_FORMATS or not isinstance(k, int) or not isinstance(n, int):
            continue
        if isinstance(getattr(m, "weight", None), nn.Parameter):
            continue
        per_fmt[fmt] = per_fmt.get(fmt, 0) + k * n
        n_bytes += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
        shapes.append((k, n, False))
    if not per_fmt:
        return "exact", 0, 0, ()
    return max(per_fmt, key=lambda f: per_fmt[f]), sum(per_fmt.values()), n_bytes, tuple(shapes)


def _count(params: list[nn.Parameter], mats: set[int]) -> tuple[dict[str, int], tuple]:
    c = dict(trainable_bytes=0, frozen_bytes=0, trainable_params=0, frozen_params=0)
    c.update(quantizable_params=0, quantizable_bytes=0, matmul_params=0)
    shapes: list[tuple[int, int, bool]] = []
    for p in params:
        nb = p.numel() * p.element_size()
        kind = "trainable" if p.requires_grad else "frozen"
        c[f"{kind}_bytes"] += nb
        c[f"{kind}_params"] += p.numel()
        if id(p) in mats:
            c["matmul_params"] += p.numel()
            shapes.append((int(p.shape[1]), int(p.shape[0]), bool(p.requires_grad)))  # weight [out, in]
            if not p.requires_grad:
                c["quantizable_params"] += p.numel()
                c["quantizable_bytes"] += nb
    return c, tuple(shapes)


def _common_element_size(params: Iterable[nn.Parameter]) -> int:
    """Element size holding the most elements among ``params`` (2 when there are none)."""
    elements: dict[int, int] = {}
    for p in params:
        elements[p.element_size()] = elements.get(p.element_size(), 0) + p.numel()
    return max(elements, key=lambda k: elements[k]) if elements else 2


def census(
    model: nn.Module,
    blocks: nn.Module | str | None = None,
    *,
    activation_bytes_per_token: int | None = None,
    seq_len: int = 32,
    example_inputs: dict[str, Any] | None = None,
    activation_trace: Literal["meta", "device"] = "meta",
) -> ModelCensus:
    """Count what a model holds, block by block. Works on the meta device.

    Args:
        model: The model (on any device, the meta device included).
        blocks: The block stack: a ``ModuleList``/``Sequential`` of the model or its dotted name; by default
            the largest list of >= 2 same-type children.
        activation_bytes_per_token: Override the per-block activation bytes per token.
        seq_len: Sequence length of the trace that finds activation bytes (short, so attention's
            T x T terms stay small next to the per-token ones).
        example_inputs: Keyword inputs for one forward of the model (default: ``input_ids`` of
            ``[1, seq_len]`` zeros on the model's device, plus ``[1, 2 * seq_len]`` and ``[2, seq_len]``
            to separate per-token, T x T and per-position bytes).
        activation_trace: ``"meta"`` (default): trace one block per kind with meta stand-ins for its
            weights (no memory, no arithmetic; cached per block class, shapes, dtypes and attention
            implementation); ``"device"``: run it on the model's own device with real weights.

    Returns:
        The census. Saved-activation bytes (keep / offload / every saved reference, see
        :mod:`tidal_plan.act_bytes`) come from forwards of one block of each kind under
        ``saved_tensors_hooks``, else from a per-linear formula (logged and recorded in ``notes``).
    """
    if not isinstance(model, nn.Module):
        raise PlanConfigError("model", type(model).__name__, "a torch.nn.Module")
    if activation_bytes_per_token is not None and (
        isinstance(activation_bytes_per_token, bool)
        or not isinstance(activation_bytes_per_token, int)
        or activation_bytes_per_token < 0
    ):
        raise PlanConfigError("activation_bytes_per_token", activation_bytes_per_token, "a non-negative int")
    stack_name, stack = _find_stack(model, blocks)
    prefix = f"{stack_name}." if stack_name else ""

    # Parameter identity -> every name it has (tied aliases), in model order.
    names_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        param_of[id(p)] = p
    tied = tuple(tuple(n) for n in names_of.values() if len(n) > 1)

    block_of_id: dict[int, int] = {}
    per_block_params: list[list[nn.Parameter]] = []
    for i, blk in enumerate(stack):
        own = []
        for p in blk.parameters():
            if id(p) not in block_of_id:
                block_of_id[id(p)] = i
                own.append(p)
        per_block_params.append(own)
    param_to_block = {n: block_of_id.get(pid) for pid, ns in names_of.items() for n in ns}
    outside = [param_of[pid] for pid in names_of if pid not in block_of_id]
    mats, _ = _linear_weight_ids(model)

    in_stack_buffers = {id(b) for b in stack.buffers()}
    outside_buf = sum(b.numel() * b.element_size() for b in model.buffers() if id(b) not in in_stack_buffers)

    if activation_trace not in ("meta", "device"):
        raise PlanConfigError("activation_trace", activation_trace, "'meta' or 'device'")
    saved, notes = estimate_saved_bytes(
        model,
        stack,
        seq_len=seq_len,
        example_inputs=example_inputs,
        override=activation_bytes_per_token,
        trace=activation_trace,
    )
    sources = {s.source for s in saved}
    source = next(s for s in ("heuristic", "override", "measured", "meta-trace") if s in sources)
    block_list = []
    for i, blk in enumerate(stack):
        c, shapes = _count(per_block_params[i], mats)
        stored_fmt, stored_params, stored_bytes, stored_shapes = _stored_linears(blk)
        c["matmul_params"] += stored_params
        buf = sum(b.numel() * b.element_size() for b in blk.buffers())
        block_list.append(
            BlockCensus(
                index=i,
                name=f"{prefix}{i}",
                buffer_bytes=buf,
                activation_bytes_per_token=saved[i].keep.per_token,
                activation_bytes_per_position=saved[i].keep.per_position,
                activation_bytes_per_sequence_position=saved[i].keep.per_sequence_position,
                offload_bytes_per_token=saved[i].offload.per_token,
                offload_bytes_per_position=saved[i].offload.per_position,
                offload_bytes_per_sequence_position=saved[i].offload.per_sequence_position,
                saved_bytes_per_token=saved[i].saved.per_token,
                saved_bytes_per_position=saved[i].saved.per_position,
                saved_bytes_per_sequence_position=saved[i].saved.per_sequence_position,
                input_bytes_per_token=saved[i].input,
                matmul_shapes=shapes + stored_shapes,
                stored_format=stored_fmt,
                stored_params=stored_params,
                stored_bytes=stored_bytes,
                attention_width=_attention_width(blk),
                forward_kernels=saved[i].kernels,
                **c,
            )
        )
    oc, outside_shapes = _count(outside, mats)
    trainable = [p for p in param_of.values() if p.requires_grad] or list(param_of.values())
    dtype_bytes = _common_element_size(trainable)
    result = ModelCensus(
        stack_name=stack_name,
        block_type=type(stack[0]).__name__,
        blocks=tuple(block_list),
        outside_trainable_bytes=oc["trainable_bytes"],
        outside_frozen_bytes=oc["frozen_bytes"],
        outside_buffer_bytes=outside_buf,
        outside_trainable_params=oc["trainable_params"],
        outside_frozen_params=oc["frozen_params"],
        outside_quantizable_params=oc["quantizable_params"],
        outside_quantizable_bytes=oc["quantizable_bytes"],
        outside_matmul_params=oc["matmul_params"],
        # the embedding output and the final norm's input, plus what every block saves of its shared inputs
        # (rotary tables, a mask): one copy for the whole forward
        outside_activation_bytes_per_token=2 * saved[0].input + saved[0].shared.per_token,
        outside_activation_bytes_per_position=saved[0].shared.per_position,
        outside_activation_bytes_per_sequence_position=saved[0].shared.per_sequence_position,
        outside_matmul_shapes=outside_shapes,
        tied=tied,
        param_to_block=param_to_block,
        param_dtype_bytes=dtype_bytes,
        compute_dtype_bytes=_common_element_size(param_of.values()),
        activation_source=source,
        notes=tuple(notes),
    )
    logger.info("census: %s", result.summary())
    return result
