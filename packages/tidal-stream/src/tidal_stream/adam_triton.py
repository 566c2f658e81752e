"""Multi-tensor AdamW on the device in one Triton launch per param group and dtype mix.

One pass per element: reads the gradient (bf16/fp16/fp32), the fp32 master and both moments (fp32 or
bf16); writes the master, the moments (bf16: stochastically rounded) and, when the model keeps 16-bit
weights, the weight rounded to nearest even. Tensors live in separate allocations: each launch gets a
small int64 table of element offsets from one base tensor per operand (one row per tensor) and a cached
table of (row, start) chunks, so one program updates ``CHUNK`` elements of one tensor.

The arithmetic is torch's fused CUDA AdamW (``torch._fused_adamw_``, float opmath with fma) written out
step by step: IEEE division and square root, the same fma's, and bias corrections computed by torch on
the device exactly as the fused kernel computes them (``powf``), so fp32 moments are meant to come out
bit-identical (checked on the GPU machine by ``test_adam_triton.py``).

[Note: stochastic-rounding stream] The 16 random bits per moment element come from Philox4x32-10 keyed
by ``seed`` with counter (quad index low, quad index high, tensor id, step): one Philox call gives 128
bits, the 32 bits of element ``4q + j`` are output ``j`` (low half for ``exp_avg``, high half for
``exp_avg_sq``). The bits depend on no launch parameter, so a step redone after a rollback, or run with
another chunking, rounds identically. :func:`philox_reference` reproduces them with torch ops.

Import this module lazily (``optimizer_device`` does, on CUDA only): it imports Triton when present.
"""

from __future__ import annotations

import math

import torch

from tidal_stream.errors import StreamError

__all__ = ["adamw_reference_", "adamw_triton_", "philox_reference", "triton_available"]

BLOCK = 1024
"""Elements per inner iteration of a program ([BLOCK // 4, 4] tiles); a multiple of 4."""
CHUNK = 32 * BLOCK
"""Elements per program (one tensor each; a multiple of BLOCK); the chunk table has a row per program."""
_COLS = 8  # int64 table columns (the kernel strides rows by 8): master, grad, exp_avg, exp_avg_sq, weight offsets, numel, tensor id, pad

_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: callers check triton_available() and keep torch's path
    triton = None


def triton_available() -> bool:
    """True when Triton imported (the kernel needs it, and a CUDA device to run compiled)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _sr_bf16(x, noise):
        # fp32 -> bf16 with stochastic rounding: add 16 uniform bits below bf16's last mantissa bit, truncate;
        # inf keeps its bits, NaN becomes the canonical quiet NaN
        bits = x.to(tl.int32, bitcast=True)
        hi = (bits + noise.to(tl.int32)) >> 16
        finite = (bits & 0x7F800000) != 0x7F800000
        hi = tl.where(finite, hi, bits >> 16)
        hi = tl.where(x != x, 0x7FC0, hi)
        return (hi & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _rne_bf16(x):
        # fp32 -> bf16 rounded to nearest even, in integer ops (the interpreter's cast truncates)
        bits = x.to(tl.int32, bitcast=True)
        hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        hi = tl.where(x != x, 0x7FC0, hi)
        return (hi & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _block(
        master_ptr, grad_ptr, m_ptr, v_ptr, w_ptr,
        offs, mask, r, coef, lr, beta1, beta2, eps, lr_wd, step_size, bc2s,
        MASKED: tl.constexpr, BF16_MOMENTS: tl.constexpr, WEIGHT: tl.constexpr, HAS_COEF: tl.constexpr,
        HAS_WD: tl.constexpr,
    ):  # fmt: skip
        if MASKED:
            p = tl.load(master_ptr + offs, mask=mask, other=0.0)
            g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            p = tl.load(master_ptr + offs)
            g = tl.load(grad_ptr + offs).to(tl.float32)
            m = tl.load(m_ptr + offs).to(tl.float32)
            v = tl.load(v_ptr + offs).to(tl.float32)
        if HAS_COEF:
            g = g * coef  # clip coefficient, applied as the fp32 gradient copy's multiply
        if HAS_WD:
            p = tl.fma(-lr_wd, p, p)  # decoupled weight decay: p -= (lr * wd) * p, contracted
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        gg = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
        denom = tl.div_rn(tl.sqrt_rn(v), bc2s) + eps
        p = p - tl.div_rn(step_size * m, denom)
        if BF16_MOMENTS:
            m_out = _sr_bf16(m, r & 0xFFFF)
            v_out = _sr_bf16(v, r >> 16)
        else:
            m_out = m
            v_out = v
        if MASKED:
            tl.store(master_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m_out, mask=mask)
            tl.store(v_ptr + offs, v_out, mask=mask)
        else:
            tl.store(master_ptr + offs, p)
            tl.store(m_ptr + offs, m_out)
            tl.store(v_ptr + offs, v_out)
        if WEIGHT:
            if w_ptr.dtype.element_ty == tl.bfloat16:
                w = _rne_bf16(p)
            else:
                w = p.to(w_ptr.dtype.element_ty)
            if MASKED:
                tl.store(w_ptr + offs, w, mask=mask)
            else:
                tl.store(w_ptr + offs, w)

    @triton.jit
    def adamw_kernel(
        table_ptr, chunks_ptr, scal_ptr, coef_ptr,
        master_base, grad_base, m_base, v_base, w_base,
        lr, beta1, beta2, eps, weight_decay, seed,
        VEC_P: tl.constexpr, VEC_G: tl.constexpr, VEC_M: tl.constexpr, VEC_W: tl.constexpr,
        BF16_MOMENTS: tl.constexpr, WEIGHT: tl.constexpr, HAS_COEF: tl.constexpr, HAS_WD: tl.constexpr,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        row = tl.load(chunks_ptr + 2 * pid)
        start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), CHUNK)
        tab = table_ptr + row * 8  # _COLS
        # element offsets from each operand's base tensor; the host checked their alignment (VEC_*)
        master_ptr = master_base + tl.multiple_of(tl.load(tab + 0), VEC_P)
        grad_ptr = grad_base + tl.multiple_of(tl.load(tab + 1), VEC_G)
        m_ptr = m_base + tl.multiple_of(tl.load(tab + 2), VEC_M)
        v_ptr = v_base + tl.multiple_of(tl.load(tab + 3), VEC_M)
        w_ptr = w_base + tl.multiple_of(tl.load(tab + 4), VEC_W)
        n = tl.load(tab + 5)
        tid = tl.load(tab + 6)
        step = tl.load(scal_ptr + row * 3)  # fp32 step count (already incremented)
        bc1 = tl.load(scal_ptr + row * 3 + 1)  # 1 - beta1 ** step, as the fused kernel computes it
        bc2s = tl.load(scal_ptr + row * 3 + 2)  # sqrt(1 - beta2 ** step)
        step_size = tl.div_rn(lr, bc1)
        lr_wd = lr * weight_decay
        coef = 1.0
        if HAS_COEF:
            coef = tl.load(coef_ptr)
        step_u = step.to(tl.uint32)
        tid_u = tid.to(tl.uint32)
        # [Q, 4] tiles: row q of the tile is one Philox counter, its 4 outputs feed the 4 columns
        q = tl.arange(0, BLOCK // 4)
        j = tl.arange(0, 4)
        for i in range(0, CHUNK, BLOCK):
            base = start + i
            if base < n:
                offs = base + q[:, None] * 4 + j[None, :]  # [Q, 4] element offsets in the tensor
                quad = (base // 4 + q).to(tl.uint64)  # [Q] Philox counter words 0-1
                r = tl.zeros((BLOCK // 4, 4), dtype=tl.uint32)
                if BF16_MOMENTS:
                    c0 = (quad & 0xFFFFFFFF).to(tl.uint32)
                    c1 = (quad >> 32).to(tl.uint32)
                    c2 = tl.zeros_like(c0) + tid_u
                    c3 = tl.zeros_like(c0) + step_u
                    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
                    r = tl.where(
                        j[None, :] == 0,
                        r0[:, None],
                        tl.where(
                            j[None, :] == 1, r1[:, None], tl.where(j[None, :] == 2, r2[:, None], r3[:, None])
                        ),
                    )
                if base + BLOCK <= n:
                    _block(
                        master_ptr, grad_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, r, coef,
                        lr, beta1, beta2, eps, lr_wd, step_size, bc2s, False, BF16_MOMENTS, WEIGHT, HAS_COEF, HAS_WD,
                    )  # fmt: skip
                else:
                    _block(
                        master_ptr, grad_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, r, coef,
                        lr, beta1, beta2, eps, lr_wd, step_size, bc2s, True, BF16_MOMENTS, WEIGHT, HAS_COEF, HAS_WD,
                    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- host side
_chunk_cache: dict[tuple[torch.device, int, tuple[int, ...]], torch.Tensor] = {}


def _chunks(device: torch.device, numels: tuple[int, ...]) -> torch.Tensor:
    """[C, 2] int64 (row, start) per program on ``device``; cached per tensor-size list."""
    key = (device, CHUNK, numels)
    t = _chunk_cache.get(key)
    if t is None:
        rows = [(r, s) for r, n in enumerate(numels) for s in range(0, n, CHUNK)]
        t = torch.tensor(rows, dtype=torch.int64).to(device)
        if len(_chunk_cache) > 64:
            _chunk_cache.clear()  # bounded: sizes repeat step after step
        _chunk_cache[key] = t
    return t


def _offsets(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int], int]:
    """Base tensor, element offsets of each tensor from it, and the largest vector width (elements per 16
    bytes, or fewer) that every offset and the base's address allow."""
    base = tensors[0]
    size = base.element_size()
    vec = 16 // size
    offs = []
    for t in tensors:
        d = t.data_ptr() - base.data_ptr()
        assert d % size == 0, "tensors of one dtype are element-aligned"
        offs.append(d // size)
    while vec > 1 and (base.data_ptr() % (vec * size) or any(o % vec for o in offs)):
        vec //= 2
    return base, offs, vec


def _check(lists: dict[str, list[torch.Tensor]], weights: list[torch.Tensor] | None) -> None:
    masters = lists["masters"]
    for name, ts in lists.items():
        if len(ts) != len(masters):
            raise StreamError(f"adamw_triton_: {name} has {len(ts)} tensors, masters {len(masters)}")
        dtypes = {t.dtype for t in ts}
        if len(dtypes) != 1 or any(not t.is_contiguous() for t in ts):
            raise StreamError(
                f"adamw_triton_: {name} must be contiguous tensors of one dtype; got {sorted(map(str, dtypes))}. "
                "Fix: split the call by dtype."
            )
    if masters[0].dtype != torch.float32:
        raise StreamError(f"adamw_triton_: masters are {masters[0].dtype}; accepted: torch.float32")
    if lists["exp_avgs"][0].dtype not in (torch.float32, torch.bfloat16):
        raise StreamError(
            f"adamw_triton_: moments are {lists['exp_avgs'][0].dtype}; accepted: torch.float32, torch.bfloat16"
        )
    if lists["exp_avgs"][0].dtype != lists["exp_avg_sqs"][0].dtype:
        raise StreamError("adamw_triton_: exp_avg and exp_avg_sq must share a dtype")
    for name in ("grads", "exp_avgs", "exp_avg_sqs") + (("weights",) if weights is not None else ()):
        for m, t in zip(masters, lists[name]):
            if t.numel() != m.numel():
                raise StreamError(
                    f"adamw_triton_: a {name} tensor has {t.numel()} elements, its master {m.numel()}"
                )


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float) -> torch.Tensor:
    """[T, 3] fp32 (step, 1 - beta1**step, sqrt(1 - beta2**step)) on the steps' device, in float as the
    fused CUDA kernel computes them (``powf`` of the fp32 betas, IEEE ``sqrtf``)."""
    s = torch.stack([t.reshape(()) for t in steps]).float()  # [T]
    # a Python-float base: filled on the device (no host copy, no sync), cast to fp32, then powf(base, step)
    bc1 = 1 - torch.pow(beta1, s)
    bc2 = 1 - torch.pow(beta2, s)
    return torch.stack([s, bc1, torch.sqrt(bc2)], dim=1).contiguous()


def adamw_triton_(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    tensor_ids: list[int],
    seed: int = 0,
    weights: list[torch.Tensor] | None = None,
    clip_coef: torch.Tensor | None = None,
    maximize: bool = False,
) -> None:
    """One AdamW step over many tensors of one device in one launch; ``steps`` are incremented first.

    Args:
        masters: fp32 master weights, updated in place.
        grads: gradients (fp32, bf16 or fp16, one dtype), read only.
        exp_avgs: first moments (fp32 or bf16), updated in place; bf16 is stochastically rounded.
        exp_avg_sqs: second moments, same dtype as ``exp_avgs``.
        steps: 0-d fp32 step counters on the device, one per tensor (incremented here, as torch does).
        lr: learning rate.
        beta1: first-moment decay.
        beta2: second-moment decay.
        eps: denominator epsilon.
        weight_decay: decoupled weight decay.
        tensor_ids: a stable id per tensor (its position in the optimizer): part of the rounding key.
        seed: the rounding stream's key.
        weights: the 16-bit weights the model computes with, written from the new masters rounded to
            nearest even; None when the masters are the weights.
        clip_coef: 0-d fp32 device tensor multiplying every gradient (gradient clipping), or None.
        maximize: only False is supported.
    """
    if maximize:
        raise StreamError(
            "adamw_triton_: maximize=True is not supported; accepted: False. Fix: use torch's fused AdamW path."
        )
    if not masters:
        return
    lists = dict(masters=masters, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if weights is not None:
        lists["weights"] = weights
    _check(lists, weights)
    if len(steps) != len(masters) or len(tensor_ids) != len(masters):
        raise StreamError("adamw_triton_: steps and tensor_ids need one entry per master")
    hyper = (lr, beta1, beta2, eps, weight_decay)
    torch._foreach_add_(steps, 1)
    try:
        _launch(masters, grads, exp_avgs, exp_avg_sqs, steps, weights, tensor_ids, clip_coef, seed, hyper)
    except Exception as e:
        # raised before the kernel ran (compilation, arguments): nothing was written; undo the count
        torch._foreach_sub_(steps, 1)
        e.tidal_wrote = False  # type: ignore[attr-defined]
        raise


def _launch(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    weights: list[torch.Tensor] | None,
    tensor_ids: list[int],
    clip_coef: torch.Tensor | None,
    seed: int,
    hyper: tuple[float, float, float, float, float],
) -> None:
    """Build the tables and launch :func:`adamw_triton_`'s kernel (steps already incremented)."""
    lr, beta1, beta2, eps, weight_decay = hyper
    dev = masters[0].device
    scal = bias_corrections(steps, beta1, beta2)  # [T, 3]
    bases, cols, vecs = [], [], []
    for ts in (masters, grads, exp_avgs, exp_avg_sqs, weights if weights is not None else masters):
        b, o, v = _offsets(ts)
        bases.append(b)
        cols.append(o)
        vecs.append(v)
    numels = tuple(m.numel() for m in masters)
    rows = [[*c, n, tid, 0] for *c, n, tid in zip(*cols, numels, tensor_ids)]
    table = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)  # [T, 8]
    chunks = _chunks(dev, numels)  # [C, 2]
    coef = (
        clip_coef.to(dev, torch.float32, non_blocking=True).reshape(1) if clip_coef is not None else scal
    )  # scal: unused
    adamw_kernel[(chunks.shape[0],)](
        table, chunks, scal, coef, *bases,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(seed),
        VEC_P=vecs[0], VEC_G=vecs[1], VEC_M=min(vecs[2], vecs[3]), VEC_W=vecs[4],
        BF16_MOMENTS=exp_avgs[0].dtype == torch.bfloat16, WEIGHT=weights is not None,
        HAS_COEF=clip_coef is not None, HAS_WD=weight_decay != 0, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=4,
        enable_fp_fusion=False,  # only the explicit fma's: the fused kernel's rounding, op for op
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- reference
def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [N] int64 holding uint32 values: the 64-bit product's high and low 32 bits (int64 wraps, masked back)
    prod = b * a
    return (prod >> 32) & _U32, prod & _U32


def philox_reference(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor):
    """Philox4x32-10 as ``tl.philox`` computes it, on int64 tensors holding uint32 counter words.

    Returns the four [N] int64 outputs (values in [0, 2**32)).
    """
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1, c2, c3 = (c.to(torch.int64) & _U32 for c in (c0, c1, c2, c3))
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _U32, (k1 + _PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def rounding_bits(
    seed: int, tensor_id: int, step: int, numel: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[numel] int64: the 32 random bits of each element of one tensor at one step (see
    [Note: stochastic-rounding stream]); low 16 round ``exp_avg``, high 16 ``exp_avg_sq``."""
    quads = math.ceil(numel / 4)
    q = torch.arange(quads, dtype=torch.int64, device=device)
    full = lambda v: torch.full_like(q, v)  # noqa: E731
    out = torch.stack(philox_reference(seed, q & _U32, q >> 32, full(tensor_id), full(step)), dim=1)  # [Q, 4]
    return out.reshape(-1)[:numel]


def _fma(a: torch.Tensor | float, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # fp32 fma via fp64: the product is exact there; one fp64 rounding then one to fp32 (double rounding
    # differs from a true fma only when the fp64 sum lands exactly on an fp32 midpoint)
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    return (a64 * b.double() + c.double()).float()


def _sr_reference(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32).to(torch.int64)
    hi = torch.where(torch.isfinite(x), (bits + noise) >> 16, bits >> 16)
    hi = torch.where(torch.isnan(x), 0x7FC0, hi)
    return (hi & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def adamw_reference_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    tensor_id: int,
    seed: int = 0,
    weight: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
) -> None:
    """:func:`adamw_triton_` on one tensor in torch ops, same operation order and rounding bits (tests)."""
    step.add_(1)
    s, bc1, bc2s = bias_corrections([step], beta1, beta2)[0].tolist()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    lr32, b1, b2 = f32(lr), f32(beta1), f32(beta2)
    p = master.reshape(-1)
    g = grad.reshape(-1).float()
    if clip_coef is not None:
        g = g * clip_coef.float().cpu().to(g.device)
    m, v = exp_avg.reshape(-1).float(), exp_avg_sq.reshape(-1).float()
    if weight_decay != 0:
        p = _fma(-(lr32 * f32(weight_decay)), p, p)
    m = _fma(b1, m, _fma(-b1, g, g))
    gg = g * g
    v = _fma(b2, v, _fma(-b2, gg, gg))
    # divisors as full tensors: CUDA turns division by a CPU scalar into a reciprocal multiply
    step_size = lr32.to(p.device) / torch.full((), bc1, device=p.device)
    denom = torch.sqrt(v) / torch.full_like(v, bc2s) + f32(eps)
    p = p - step_size * m / denom
    master.copy_(p.view(master.shape))
    if exp_avg.dtype == torch.bfloat16:
        bits = rounding_bits(seed, tensor_id, int(s), p.numel(), p.device)
        m_out, v_out = _sr_reference(m, bits & 0xFFFF), _sr_reference(v, bits >> 16)
    else:
        m_out, v_out = m, v
    exp_avg.copy_(m_out.view(exp_avg.shape))
    exp_avg_sq.copy_(v_out.view(exp_avg_sq.shape))
    if weight is not None:
        weight.copy_(master)  # round to nearest even
