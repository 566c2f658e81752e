"""CUDA graphs of resident blocks: one replay per block forward and one per backward.

At a few hundred tokens per step the GPU finishes a block's kernels faster than Python can launch them:
a LoRA block of a 14B model is some 300 launches forward and backward, and on the GPU machine the kernels
of a 512-token step of a resident NF4 base took a fifth of its time (433 of 2,178 ms over three
profiled steps). A CUDA graph records those launches
once and replays them with one call.

Which blocks (:func:`graphable_blocks`): after the first step's refinement, blocks whose weights stay on
the device, whose activations are kept or recomputed (not offloaded), whose trainable parameters are
updated on the device (no host copy in flight), with no hooks on their submodules other than tidal's own;
a recomputed block also draws no random numbers (its recompute would not replay dropout's masks).

How: such a block's ``forward`` is replaced by :class:`_Dispatch`. Its first eligible call captures the
block for exactly those inputs: a forward graph and a backward graph (``torch.autograd.grad`` of the
outputs, retained so the saved activations stay in the graphs' memory pool), after two warm-up passes on
a side stream. A recomputed block is captured through a non-reentrant checkpoint: its forward graph
saves only the inputs and its backward graph recomputes. Every later eligible call copies its inputs into
the static ones and replays. The outputs are copies, so nothing a caller holds is overwritten by the next
replay.

On by default (``wrap(..., cuda_graphs="auto")``; False turns it off). Installed after the measured
refinement, which leaves room for the graphs' buffers, and released when the step that captured them
left too little memory under the budget (:mod:`tidal_stream.graph_fit`). The capture records the
parameters' gradients through stand-in leaves (:meth:`_BlockGraph._fresh_leaves`): through the parameters
themselves, the backward capture failed whenever the training loop still held the previous step's loss
(see [Note: fresh leaves]). A capture that fails for another reason leaves the session eager (see
[Note: failed capture]).

A call runs the original forward instead (eagerly; checkpointed by the activation handle when the block
recomputes) when: grad mode is off or it runs inside a backward (a recompute), autocast or saved-tensor
hooks are active, its shapes, dtypes, strides, ``requires_grad``, non-tensor arguments or training mode
differ from the captured call, the block's weights moved, the block's last replay still waits for its
backward (a second forward before backward: the graph's saved activations are in use), the budget has no
room for another capture, or a capture failed (logged; from then on no block of the session is captured).
Under ``"auto"`` the first call with other inputs than the capture's (another sequence length) or with
moved weights releases every block's graphs and their memory (:meth:`BlockGraphs.release`); ``True`` keeps
them for the captured shape.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from tidal_stream.kept_activations import block_ranges
from tidal_stream.streamed_blocks import StreamingError

__all__ = [
    "BlockGraphs",
    "blocks_within",
    "graphable_blocks",
    "graphs_reserve_by_block",
]

_WARMUP = 2  # eager passes before capture: lazy initialisations (cuBLAS handles, kernel choices) happen there
_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)
_TENSOR = object()  # a tensor leaf's place in a captured call's arguments
_MIN_CAPTURE_BYTES = 256 * 2**20  # what the first capture is expected to add at least (margin before it)


def _foreign_hooks(block: nn.Module) -> list[str]:
    """Hooks on ``block``'s submodules that are not tidal's own (they would run once, at capture)."""
    out = []
    for name, m in block.named_modules():
        if m is block:
            continue  # the block's own hooks run around the dispatcher on every call
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            for fn in getattr(m, kind).values():
                if not getattr(fn, "__module__", "").startswith("tidal_stream."):
                    out.append(f"{name}.{kind}")
    return out


class _Replay(torch.autograd.Function):
    """One replay of a block's forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, graph: _BlockGraph, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.graph, ctx.generation = graph, graph.replay_forward(inputs, ctx)
        outs = tuple(o.clone() for o in graph.static_out)  # the caller's own copies
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, graph.out_diff) if not d))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.graph.replay_backward(ctx.generation, grads))


class _BlockGraph:
    """The captured forward and backward of one block at one input signature."""

    def __init__(
        self, owner: BlockGraphs, index: int, block: nn.Module, forward: Callable[..., Any], recompute: Any
    ) -> None:
        self.owner, self.index, self.block, self.forward = owner, index, block, forward
        # the activation handle when the block recomputes: its graphs recompute in backward, and an eager
        # call is checkpointed by the handle as before
        self.recompute = recompute
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.tensors = [*block.parameters(), *block.buffers()]  # their addresses are baked into the graphs
        # each trainable parameter's places in the block's modules (one parameter may sit in several)
        self.places = [
            (m, n, p)
            for m in block.modules()
            for n, p in m._parameters.items()
            if p is not None and p.requires_grad
        ]
        self.failed: str | None = None
        self.fwd: torch.cuda.CUDAGraph | None = None
        self.generation = 0
        self.pending: weakref.ref | None = None  # the autograd node of a replay whose backward has not run

    # ------------------------------------------------------------------------------------------ capture
    def capture(self, spec: Any, leaves: list[Any], signature: tuple[Any, ...]) -> None:
        """Warm up, then record the forward and backward graphs for inputs like ``leaves``."""
        dev = self.owner.device
        self.signature, self.spec = signature, spec
        # plain values as given, tensors as placeholders (the call's own tensors are not kept alive)
        self.leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self.ptrs = self._ptrs()
        self.static_in = [
            t.detach().clone().requires_grad_(t.requires_grad) for t in leaves if isinstance(t, torch.Tensor)
        ]
        with self._fresh_leaves() as stand_ins:
            diff_in = [t for t in self.static_in if t.requires_grad] + stand_ins
            compute = torch.cuda.current_stream(dev)
            side = self.owner.stream
            side.wait_stream(compute)  # why: the warm-up reads inputs the compute stream just wrote
            with torch.cuda.stream(side):
                for _ in range(_WARMUP):
                    outs = [o for o in tree_flatten(self._run())[0] if isinstance(o, torch.Tensor)]
                    diff = [o for o in outs if o.requires_grad]
                    torch.autograd.grad(diff, diff_in, [torch.zeros_like(o) for o in diff], allow_unused=True)
                    del outs, diff
            compute.wait_stream(side)  # why: the capture below must follow the warm-up's kernels
            pool = self.owner.pool
            fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                out = self._run()
            out_leaves, self.out_spec = tree_flatten(out)
            self.out_other = [None if isinstance(o, torch.Tensor) else o for o in out_leaves]
            self.static_out = [o for o in out_leaves if isinstance(o, torch.Tensor)]
            self.out_diff = [o.requires_grad for o in self.static_out]
            diff_out = [o for o in self.static_out if o.requires_grad]
            self.static_grad_out = [torch.empty_like(o) for o in diff_out]
            bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                # retain_graph: the saved activations stay referenced, so no later capture reuses their memory
                grads = torch.autograd.grad(
                    diff_out, diff_in, self.static_grad_out, retain_graph=True, allow_unused=True
                )
            self.static_grad_in = list(grads)
        self.in_diff = [t.requires_grad for t in self.static_in]
        self.fwd, self.bwd = fwd, bwd

    @contextlib.contextmanager
    def _fresh_leaves(self) -> Iterator[list[torch.Tensor]]:
        """For the warm-ups and captures, the block's trainable parameters are stand-ins: new leaves that share
        their storage (so the graphs read and update the same memory).

        [Note: fresh leaves] Autograd orders a gradient after the stream of its AccumulateGrad node, which is
        the stream current when the node was made. A parameter's node lives as long as any graph reaching it
        does: the previous step's loss, still held by the training loop, keeps it, made on the default
        stream. Capturing a backward into that node made the legacy stream wait on the capturing one, which
        CUDA refuses (cudaErrorStreamCaptureImplicit; the first capture of every test process failed so on
        the GPU machine). A stand-in's node is made during the warm-up, on the side stream.
        """
        stand_in = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in self.params}
        for m, n, p in self.places:
            m._parameters[n] = stand_in[id(p)]
        try:
            yield [stand_in[id(p)] for p in self.params]
        finally:
            for m, n, p in self.places:
                m._parameters[n] = p

    def _run(self) -> Any:
        it = iter(self.static_in)
        leaves = [next(it) if x is _TENSOR else x for x in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        if self.recompute is None:
            return self.forward(*args, **kwargs)
        # saves only the inputs; the backward graph recomputes the rest (no RNG use: see graphable_blocks)
        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The block's own forward, under its recompute policy when it has one and autograd records."""
        if self.recompute is None or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return self.forward(*args, **kwargs)
        return self.recompute.checkpointed(self.index, self.forward, args, kwargs)

    def _ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def drop(self) -> None:
        """Let go of the graphs and every tensor of theirs (their memory returns to the pool)."""
        self.fwd = self.bwd = None
        self.static_in, self.static_out, self.static_grad_out, self.static_grad_in = [], [], [], []
        self.returned, self.pending = [], None

    # ------------------------------------------------------------------------------------------- replay
    def busy(self) -> bool:
        """The last replay's backward has not run and its autograd graph is alive."""
        return self.pending is not None and self.pending() is not None

    def matches(self, signature: tuple[Any, ...]) -> bool:
        return signature == self.signature and self._ptrs() == self.ptrs

    def replay_forward(self, inputs: tuple[torch.Tensor, ...], node: Any) -> int:
        for static, t in zip(self.static_in, inputs):
            static.copy_(t)
        self.fwd.replay()
        self.generation += 1
        self.pending = weakref.ref(node)
        self.owner.replays += 1
        return self.generation

    def replay_backward(self, generation: int, grads: tuple[torch.Tensor | None, ...]) -> list[Any]:
        if generation != self.generation:
            raise StreamingError(
                f"block {self.index}: a backward through an older forward of this block after a newer one "
                "replayed its CUDA graph (e.g. retain_graph=True across steps); accepted: one backward per "
                "forward before the next forward. Fix: wrap(..., cuda_graphs=False)."
            )
        diff_grads = [g for g, d in zip(grads, self.out_diff) if d]
        for static, g in zip(self.static_grad_out, diff_grads):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        self.bwd.replay()
        self.pending = None
        it = iter(self.static_grad_in)
        out = [next(it) if d else None for d in self.in_diff]
        out += [next(it) for _ in self.params]
        # [Note: gradients are copied out] a later-captured block's graph may use this graph's output
        # memory as scratch (replays run in another order than captures). Holding a reference to what is
        # returned makes autograd copy each parameter gradient into .grad instead of adopting the static
        # buffer, at once; the input gradient is copied by the previous block before its own replay.
        self.returned = [None if g is None else g.detach() for g in out]
        return self.returned


class _Dispatch:
    """The block's ``forward``: replay when the call is eligible (see the module docstring), else eager."""

    def __init__(self, graph: _BlockGraph) -> None:
        self.graph = graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        g = self.graph
        dev = g.owner.device
        if g.failed is not None and g.fwd is not None:
            g.owner.drop(g)  # released earlier, while this block's last replay still awaited its backward
        if (
            g.failed is not None
            or not torch.is_grad_enabled()
            or torch._C._current_graph_task_id() != -1
            or torch.is_autocast_enabled(dev.type)
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ):
            g.owner.eager_calls += 1
            return g.eager(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        signature = _signature(spec, leaves, dev)
        if signature is not None:
            signature += (g.block.training,)  # train and eval differ in what dropout does
        changed = signature is not None and g.fwd is not None and not g.matches(signature)
        if changed and g.owner.release_on_change:
            g.owner.release(g, signature)  # also while busy: its graphs go once that backward has run
        if signature is None or changed or g.busy():
            g.owner.eager_calls += 1
            return g.eager(*args, **kwargs)
        if g.fwd is None and not g.owner.try_capture(g, spec, leaves, signature):
            return g.eager(*args, **kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        outs = iter(_Replay.apply(g, *tensors, *g.params))
        return tree_unflatten([next(outs) if o is None else o for o in g.out_other], g.out_spec)


def _shape(signature: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape of the first tensor of a call's signature (what a log line names)."""
    return next((tuple(x[0]) for x in signature[1:] if isinstance(x, tuple) and len(x) == 4), None)


def _signature(spec: Any, leaves: list[Any], device: torch.device) -> tuple[Any, ...] | None:
    """What a capture depends on; None when a leaf is neither a tensor on ``device`` nor a plain value."""
    sig: list[Any] = [spec]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.device != device:
                return None
            sig.append((x.shape, x.dtype, x.stride(), x.requires_grad))
        elif isinstance(x, _SIMPLE):
            sig.append(x)
        else:
            return None  # e.g. a KV cache object: its state is not an input a graph can replay
    return tuple(sig)


class BlockGraphs:
    """CUDA graphs installed on some blocks of a wrapped model; ``remove()`` restores their forwards."""

    def __init__(self, session: Any, blocks: dict[int, tuple[nn.Module, Any]], foreign: int = 0) -> None:
        self.session = session
        self.device = session.device
        self.pool: Any = None  # made at the first capture: one pool, the blocks' graphs share its memory
        # one side stream for every warm-up and capture: its cached temporaries serve the next block's
        self.stream: torch.cuda.Stream | None = None
        # "auto" lets the graphs go at the first change of input shape (see release); True keeps them
        self.release_on_change = session.options.cuda_graphs == "auto"
        self.released: str | None = None
        self.graphs = {i: _BlockGraph(self, i, b, b.forward, acts) for i, (b, acts) in blocks.items()}
        self.replays = 0
        self.eager_calls = 0
        self._growth = 0  # reserved bytes the last capture added (what the next one is expected to need)
        self._grown = 0  # reserved bytes all captures added (the pool, and what their warm-ups cached)
        self.budget = session.options.vram_budget_bytes
        self.foreign = foreign  # device bytes allocated that are not this model's (a filler, other models)
        for g in self.graphs.values():
            # an instance attribute: nn.Module's __call__ runs it, with the block's own hooks around it
            g.block.forward = _Dispatch(g)
            if g.recompute is not None:
                g.recompute.delegate(g.index)  # its pre-hook no longer checkpoints: the dispatcher decides

    def try_capture(self, g: _BlockGraph, spec: Any, leaves: list[Any], signature: tuple[Any, ...]) -> bool:
        """Capture ``g`` when the budget has room for it; else, or on failure, leave the block eager."""
        dev = self.device
        need = int(1.5 * max(self._growth, _MIN_CAPTURE_BYTES))  # the last capture's growth, with margin
        free = (
            torch.cuda.mem_get_info(dev)[0]
            + torch.cuda.memory_reserved(dev)
            - torch.cuda.memory_allocated(dev)
        )
        ours = torch.cuda.memory_reserved(dev) - self.foreign
        if need > free or (self.budget is not None and ours + need > self.budget):
            g.failed = f"no room: {need / 2**20:.0f} MiB more would exceed the budget"
            self._finish_if_done(signature)
            return False
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
        before = torch.cuda.memory_reserved(dev)
        caller_stream = torch.cuda.current_stream(dev)
        try:
            g.capture(spec, leaves, signature)
        except Exception as e:  # a kernel that syncs, allocates from the host or is not capturable
            # why: torch.cuda.graph leaves its capture stream current when ending the capture raises, and the
            # caller's later kernels would run there, unordered with its own stream's work
            torch.cuda.set_stream(caller_stream)
            g.fwd = None
            self._give_up(f"capture failed: {type(e).__name__}: {str(e).splitlines()[0]}")
        else:
            self._growth = torch.cuda.memory_reserved(dev) - before
            self._grown += self._growth
        self._finish_if_done(signature)
        return g.failed is None

    def _give_up(self, why: str) -> None:
        """A capture failed: every block not captured yet stays eager, and torch's CUDA RNG leaves capture.

        [Note: failed capture] torch's CUDA generator enters its capture state when a capture begins and
        leaves it when one ends well; after a failed capture, random ops on the device raise "Offset
        increment outside graph capture" (seen on the GPU machine). A trivial capture that ends well takes
        it out of that state (torch's generator leaves it at every good capture end; the GPU test of a
        failed capture draws random numbers afterwards); no further block is captured in this session.
        """
        for g in self.graphs.values():
            if g.fwd is None and g.failed is None:
                g.failed = why
        dev = self.device
        with contextlib.suppress(Exception):  # the capture's own error is what gets recorded
            torch.cuda.synchronize(dev)  # why: the failed capture's stream work ends before another capture
        reset = torch.cuda.CUDAGraph()
        try:
            # a fresh stream: the failed capture's stream may still be marked as capturing
            with torch.cuda.graph(reset, stream=torch.cuda.Stream(dev)):
                torch.zeros(1, device=dev).add_(1)
        except Exception as e:
            self.session.record("graphs", f"resetting the CUDA RNG after a failed capture failed too: {e!r}")

    def _finish_if_done(self, signature: tuple[Any, ...]) -> None:
        """After the last capture: hand back what the warm-ups cached on the side stream, record the outcome."""
        if not all(g.fwd is not None or g.failed is not None for g in self.graphs.values()):
            return
        torch.cuda.empty_cache()
        reserved = (
            torch.cuda.memory_reserved(self.device) - self.foreign
        )  # this model's, the graphs' pool in it
        captured = [i for i, g in self.graphs.items() if g.fwd is not None]
        failed: dict[str, list[int]] = {}
        for i, g in self.graphs.items():
            if g.failed is not None:
                failed.setdefault(g.failed, []).append(i)
        shape = _shape(signature)
        self.session.record(
            "graphs",
            f"captured CUDA graphs of blocks {block_ranges(captured) or 'none'} at input shape {shape}: each "
            f"forward and backward of them is one replay from now on; the captures added {self._grown / 2**30:.2f} "
            f"GiB of reserved memory (warm-ups' cache included), {reserved / 2**30:.2f} GiB reserved in all after "
            "handing back the cache"
            + "".join(f"; blocks {block_ranges(ix)} stay eager ({why})" for why, ix in failed.items()),
            captured=captured,
            failed={why: ix for why, ix in failed.items()},
            capture_growth_bytes=self._grown,
            reserved_bytes=reserved,
        )

    def release(self, g: _BlockGraph, signature: tuple[Any, ...]) -> None:
        """``cuda_graphs="auto"``: block ``g`` was called with other inputs than it was captured for (another
        sequence length, or its weights moved), so every block runs eagerly from now on and the graphs go.

        The pool holds the captured step's activations; an eager step beside it would need its own as well,
        over a budget that counted one set. Each block's graphs are dropped at its next call, since a replay
        whose backward has not run still needs them; the memory is handed back when the last goes.
        """
        why = f"released: block {g.index}'s weights moved since its capture"
        if signature != g.signature:
            why = (
                f"released: block {g.index} was called with other inputs (shape {_shape(signature)}) than it "
                f"was captured for (shape {_shape(g.signature)})"
            )
        self.released = why
        for other in self.graphs.values():
            if other.failed is None:
                other.failed = why
        self.session.record(
            "graphs",
            f"CUDA graphs {why}: every block runs eagerly from now on (cuda_graphs='auto' graphs one input "
            "shape; pad the batches to one length, or pass cuda_graphs=True to keep the graphs for the first "
            "shape at the cost of their memory)",
        )
        self.drop(g)

    def drop(self, g: _BlockGraph) -> None:
        """Drop ``g``'s graphs unless its last replay awaits its backward; after the last, empty the cache."""
        if g.busy():
            return
        g.drop()
        if self.pool is not None and all(x.fwd is None for x in self.graphs.values()):
            self.pool = None
            before = torch.cuda.memory_reserved(self.device)
            torch.cuda.empty_cache()  # the pool's blocks are free now: hand them back to the device
            freed = (before - torch.cuda.memory_reserved(self.device)) / 2**20
            self.session.record("graphs", f"the CUDA graphs' memory was handed back ({freed:.0f} MiB)")

    def report(self) -> dict[str, Any]:
        return {
            "cuda_graphs": {
                "blocks": sorted(self.graphs),
                "captured": sorted(i for i, g in self.graphs.items() if g.fwd is not None),
                "replays": self.replays,
                "eager_calls": self.eager_calls,
                "released": self.released,
            }
        }

    def close(self, why: str) -> None:
        """Every block runs eagerly for good: the graphs go with their memory (a replay that still awaits
        its backward keeps its own until then), the original forwards come back."""
        self.released = why
        for g in self.graphs.values():
            g.failed = g.failed or why
            self.drop(g)
        self.remove()

    def remove(self) -> None:
        """Restore the original forwards and drop the graphs (their memory pool goes with them)."""
        for g in self.graphs.values():
            g.block.__dict__.pop("forward", None)
            if g.recompute is not None:
                g.recompute.delegate(g.index, False)
        self.graphs.clear()


def _draws_random(block: nn.Module) -> bool:
    """Dropout with p > 0 in ``block`` (a module's, or an attention's ``attention_dropout``)."""
    for m in block.modules():
        p = m.p if isinstance(m, nn.modules.dropout._DropoutNd) else getattr(m, "attention_dropout", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            return True
    return False


def _stack_extension(session: Any) -> Any:
    """The extension over the block stack (weight streaming, activations, attention), or None."""
    return next((e for e in session.extensions if hasattr(e, "blocks") and hasattr(e, "activations")), None)


def graphs_reserve_by_block(session: Any, opt: Any | None = None) -> dict[int, int]:
    """Device bytes each block's CUDA graphs will add to a step, by block index, to leave out of the
    measured refinement's room (see [Note: graphs' memory] in :mod:`tidal_stream.graph_fit`). Each captured
    block keeps in the graphs' pool four buffers the size of its input (static input and output, output
    gradient, input gradient) and the gradients of its trainable parameters, which its backward graph
    writes before they are added to ``.grad`` (full fine-tuning: the block's weights again).

    Counted for the blocks :func:`graphable_blocks` will graph given ``opt``'s placement (without ``opt``:
    every block that does not stream its weights), inputs as measured in the first step; empty when no
    graph will be installed (``cuda_graphs=False``, not CUDA) or no input was measured (no block offloads
    or recomputes)."""
    if session.options.cuda_graphs is False or session.device.type != "cuda":
        return {}
    ext = _stack_extension(session)
    if ext is None or ext.activations is None:
        return {}
    streamed = set(ext.weights.streamed) if ext.weights is not None else set()
    graphed = set(graphable_blocks(session, opt)[0]) if opt is not None else None
    inputs = ext.activations.stats()["block_input_bytes"]
    reserve = {}
    for i, n in enumerate(inputs):
        if i in streamed or (graphed is not None and i not in graphed):
            continue
        grads = sum(p.numel() * p.element_size() for p in ext.blocks[i].parameters() if p.requires_grad)
        reserve[i] = 4 * n + grads
    return reserve


def blocks_within(reserve: dict[int, int], room: int) -> list[int]:
    """The blocks of ``reserve`` (bytes by block index) to graph within ``room`` bytes: in stack order, as
    many as fit. Every graphed block saves the same kind of launches, so the first ones are as good as any;
    a partial set keeps the launches saved where all of full fine-tuning's graphs would not fit."""
    chosen, used = [], 0
    for i in sorted(reserve):
        if used + reserve[i] > room:
            break
        chosen.append(i)
        used += reserve[i]
    return chosen


def graphable_blocks(session: Any, opt: Any) -> tuple[dict[int, nn.Module], dict[str, list[int]]]:
    """The blocks to graph now (see the module docstring), and the others by the reason they are not."""
    ext = _stack_extension(session)
    if ext is not None:
        blocks = ext.blocks
        streamed = set(ext.weights.streamed) if ext.weights is not None else set()
        policies = ext.activations.policies if ext.activations is not None else ["keep"] * len(blocks)
    else:  # nothing streams, offloads, recomputes or routes attention: the stack is found here
        from tidal_stream.weights import find_blocks  # the optional part-2 module (wrap._part2)

        try:
            blocks = find_blocks(session.model)
        except StreamingError:
            return {}, {}
        streamed, policies = set(), ["keep"] * len(blocks)
    host = {id(s.param) for s in opt.host_slots()}
    chosen: dict[int, tuple[nn.Module, Any]] = {}
    others: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        if i in streamed:
            reason = "their weights stream"
        elif policies[i] == "offload":
            reason = "their activations are offloaded"
        elif policies[i] == "recompute" and _draws_random(b):
            reason = "they recompute with dropout (the graphs do not replay its random masks)"
        elif any(id(p) in host for p in b.parameters()):
            reason = "their optimizer is on the host"
        elif _foreign_hooks(b):
            reason = "their submodules carry hooks that are not tidal's"
        else:
            chosen[i] = (b, ext.activations if policies[i] == "recompute" else None)
            continue
        others.setdefault(reason, []).append(i)
    return chosen, others
