"""Triton kernels against the pure-torch reference.

gpu-marked tests run on CUDA. ``test_kernels_in_triton_interpreter`` runs the same kernels on the CPU
through ``TRITON_INTERPRET=1`` wherever triton is importable (it is skipped where it is not).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tidal_quant as tq
from tidal_quant import fp8_ops, ops
from tidal_testing import assert_bitwise_equal, assert_sqnr

gpu = pytest.mark.gpu
BF16_ULP = 2.0**-8  # relative spacing of bf16: the only rounding a dequantize kernel adds


def _weights(device="cuda"):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g) * 0.02
    w[0, :64] = 0.0  # all-zero block
    w[1, :64] = tq.reference.nf4_midpoints().repeat(5)[:64] * 0.5  # exact NF4 midpoints after scaling
    w[1, 0] = 0.5
    w[2, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.0, 3.5, 0.25])  # int8 ties (scale 1)
    w[3, 3], w[3, 4] = 9.0, -9.0  # ±max
    odd = torch.randn(37, 61, generator=g)
    return [w.to(device), w.to(device, torch.bfloat16), odd.to(device)]


_PACK_CASES = [("int8", 64, False), ("int8", 6, False), ("nf4", 64, False), ("nf4", 16, False)]
_PACK_CASES += [("nvfp4", 16, False), ("nf4", 64, True), ("int8", 64, True), ("fp8", None, False)]


@gpu
@pytest.mark.parametrize("fmt,bs,dq", _PACK_CASES)
def test_quantize_pack_bit_exact(fmt, bs, dq):
    for w in _weights():
        if fmt == "nvfp4" and w.shape[1] % 16:
            continue
        gpu_q = tq.quantize(w, fmt, block_size=bs, double_quant=dq)
        cpu_q = tq.quantize(w.cpu(), fmt, block_size=bs, double_quant=dq)
        for name, t in cpu_q.tensors().items():
            assert_bitwise_equal(gpu_q.tensors()[name], t, f"{fmt}/{bs} {name} {tuple(w.shape)} {w.dtype}")


@gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_dequantize_matches_reference(fmt):
    # 256x1024: the 4-bit kernels tile it exactly (unmasked path); 37x61: odd element count (masked)
    for w in _weights()[0:3:2]:
        if fmt == "nvfp4" and w.shape[1] % 16:
            continue
        qw = tq.quantize(w.cpu(), fmt)
        ref32 = tq.dequantize(qw, torch.float32)
        qg = qw.to("cuda")
        what = f"{fmt} {tuple(w.shape)}"
        # fp32 output: one fp32 multiply per element, as the reference → identical
        assert_bitwise_equal(tq.dequantize(qg, torch.float32), ref32, f"{what} fp32")
        # bf16 output: within one bf16 rounding of the fp32 reference
        got = tq.dequantize(qg, torch.bfloat16)
        assert got.shape == w.shape and got.is_contiguous()
        assert bool(((got.float().cpu() - ref32).abs() <= ref32.abs() * BF16_ULP).all()), what


@gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_reused_dequantize_launch_writes_a_new_exact_tensor_each_call(fmt):
    qw = tq.quantize(_weights()[0].cpu(), fmt)
    ref32 = tq.dequantize(qw, torch.float32)
    qg = qw.to("cuda")
    args = (
        ops.as_bytes(qg.data),
        ops.as_bytes(qg.scales),
        qg.global_scale,
        fmt,
        list(qg.shape),
        qg.block_size or 0,
    )
    launch = ops.dequant_launch(*args, torch.float32)
    side = torch.cuda.Stream()
    outs = [launch() for _ in range(3)]
    with torch.cuda.stream(side):  # the current stream is the launch's: ordered after its allocation there
        outs.append(launch())
    side.synchronize()
    for got in outs:
        assert_bitwise_equal(got, ref32, f"{fmt} reused launch")
    assert len({t.data_ptr() for t in outs}) == len(outs)  # each call wrote its own tensor


@gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_quant_linear_gpu_paths(fmt, tokens):
    w = torch.randn(512, 1024, device="cuda") * 0.02
    qw = tq.quantize(w, fmt)
    wd = tq.dequantize(qw, torch.float32)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tq.reset_path_counts()
    y = tq.quant_linear(x, qw)
    counts = tq.path_counts()
    assert sum(counts.values()) == 1 and set(counts) <= {"fused_dequant_matmul", "dequant_matmul"}
    # bf16 inputs and output: ≥ 40 dB against the fp32 product with the same dequantized weight
    assert_sqnr(x.detach().float() @ wd.t(), y.float(), 40.0, f"{fmt} fwd {tokens} tokens {counts}")
    if tokens <= ops.FUSED_MAX_TOKENS:  # run the fused kernel too, whatever the measurement chose
        for cfg in ((16, 64, 64), (16, 32, 128), (16, 32, 128, 4, 3, 4)):  # the last: split-K, 4 ranges
            from tidal_quant import _triton

            fused = _triton.fused_matmul(
                ops._FMT_ID[fmt],
                x.detach(),
                qw.data,
                qw.scales,
                qw.global_scale,
                qw.shape,
                qw.block_size,
                cfg,
            )
            assert_sqnr(x.detach().float() @ wd.t(), fused.float(), 40.0, f"{fmt} fused {cfg}")
    g = torch.randn_like(y)
    y.backward(g)
    assert_sqnr(g.float() @ wd, x.grad.float(), 40.0, f"{fmt} input grad")


def _all_e4m3_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 code (±0 and subnormals included) as ``[4, 64]`` codes and positive row scales."""
    b = torch.arange(256, dtype=torch.uint8)
    b[b == 0x7F], b[b == 0xFF] = 0x80, 0x00  # the two NaN codes → -0 / +0
    scales = torch.tensor([1.0, 3.0e-4, 0.2831, 7.5])  # [4]
    return b.view(torch.float8_e4m3fn).view(4, 64), scales


@gpu
def test_fp8_dequantize_every_code_bit_exact():
    d, s = _all_e4m3_codes()
    ref = tq.reference.dequantize_fp8(d, s, torch.float32)
    assert int((ref.view(torch.int32) == torch.iinfo(torch.int32).min).sum()) == 2  # -0.0 is covered
    got = ops.dequantize(d.cuda(), s.cuda(), None, "fp8", (4, 64), 0, torch.float32)
    assert_bitwise_equal(got, ref, "fp8 every code (sign of zero included)")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [5000, 13824, 20000])
def test_fp8_row_quantization_bit_exact(dtype, width):
    from tidal_quant import _triton, _triton_fp8

    x = (torch.randn(64, width) * 3).to("cuda", dtype)
    x[5] = 0.0
    c = torch.rand(width, device="cuda")
    one_tile = (min(16384, _triton._pow2(width)), 8)  # the row in registers (two passes at 20000)
    for cs in (None, c):
        rq, rs = tq.reference.quantize_rows_fp8(x.float().cpu() if cs is None else x.float().cpu() * cs.cpu())
        for config in (None, (1024, 4), one_tile):  # the default, and both kernel paths whatever it is
            q, s = _triton_fp8.quantize_rows_fp8(x, cs, config=config)
            assert_bitwise_equal(s, rs, f"row scales, config {config}")
            assert_bitwise_equal(q, rq, f"e4m3 codes, config {config}")


@gpu
@pytest.mark.parametrize("outliers,fp8_backward", [(0.0, False), (0.01, False), (0.0, True)])
def test_fp8_quant_linear_runs_on_scaled_mm(monkeypatch, outliers, fp8_backward):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability >= 8.9")
    calls = []
    real = torch._scaled_mm

    def spy(*a, **k):
        calls.append(tuple(a[0].shape))
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    lin = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    q = tq.QuantLinear.from_linear(lin, "fp8", outliers=outliers, fp8_backward=fp8_backward)
    x = torch.randn(4, 64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tq.reset_path_counts()
    y = q(x)
    assert tq.path_counts() == {"fp8_scaled_mm": 1} and calls == [(256, 1024)]
    # against the fp32 emulation of the same arithmetic (per-token e4m3 activations), run on the CPU
    data, scales = ops.as_bytes(q.weight_data).cpu(), q.weight_scales.cpu()
    n_out = tq.linear.n_outlier_channels(outliers, 1024)
    emu = (
        fp8_ops.fp8_linear(x.detach().reshape(-1, 1024).float().cpu(), data, scales, n_out)
        + lin.bias.float().cpu()
    )
    assert_sqnr(emu, y.detach().reshape(-1, 512).float().cpu(), 40.0, "fp8 scaled_mm vs emulation")
    g = torch.randn_like(y)
    y.backward(g)
    gx = x.grad.reshape(-1, 1024).float().cpu()
    if fp8_backward:
        assert calls == [(256, 1024), (256, 512)]  # the input gradient ran on _scaled_mm too
        emu_g = fp8_ops.fp8_grad_input(g.reshape(-1, 512).float().cpu(), data, scales)
        assert_sqnr(emu_g, gx, 40.0, "fp8 grad vs emulation")
    else:
        assert len(calls) == 1
        wd = q.dequantize_weight(torch.float32).cpu()
        assert_sqnr(g.reshape(-1, 512).float().cpu() @ wd, gx, 40.0, "fp8 grad")


_INTERP = textwrap.dedent(
    """
    import torch
    from tidal_quant import _triton as T, _triton_fp8 as F, reference as R
    w = torch.randn(24, 80) * 0.02
    w[0, :64] = 0
    w[2, :64] = R.nf4_midpoints().repeat(5)[:64] * 0.5
    w[2, 0] = 0.5
    for bs in (64, 16):
        q, s = T.quantize_blocks(w, bs, nf4=True)
        rq, rs = R.quantize_nf4(w, bs)
        assert torch.equal(q, rq) and torch.equal(s, rs), ("nf4", bs)
        assert torch.equal(T.dequantize(1, rq, rs, None, w.shape, bs, torch.float32),
                           R.dequantize_nf4(rq, rs, w.shape, bs, torch.float32))
    for bs in (64, 6, 2):
        q, s = T.quantize_blocks(w, bs, nf4=False)
        rq, rs = R.quantize_int8(w, bs)
        assert torch.equal(q, rq) and torch.equal(s, rs), ("int8", bs)
        assert torch.equal(T.dequantize(0, rq, rs, None, w.shape, bs, torch.float32),
                           R.dequantize_int8(rq, rs, bs, torch.float32))
    w2 = torch.randn(64, 256) * 0.02  # 16384 codes: the unmasked int8 tiling (8192 per program)
    for bs in (64, 6):  # one scale per 8-code group / one per code
        rq, rs = R.quantize_int8(w2, bs)
        assert torch.equal(T.dequantize(0, rq, rs, None, w2.shape, bs, torch.float32),
                           R.dequantize_int8(rq, rs, bs, torch.float32)), ("int8 tiled", bs)
    odd = torch.randn(37, 61)  # odd numel: the last byte holds one element
    for bs in (64, 16):
        rq, rs = R.quantize_nf4(odd, bs)
        assert torch.equal(T.dequantize(1, rq, rs, None, odd.shape, bs, torch.float32),
                           R.dequantize_nf4(rq, rs, odd.shape, bs, torch.float32)), ("nf4 odd", bs)
    # 16-bit outputs are written as one 32-bit word per packed byte: check each element's position. The
    # interpreter rounds fp32 -> bf16 by truncation (the GPU by round-to-nearest-even, checked there), so
    # each bf16 must be the fp32 value's top half; fp16 is rounded by numpy, as torch rounds it.
    for shape, bs in (((37, 61), 64), ((64, 256), 64), ((8, 1024), 16)):  # odd numel, tiled, tiled nvfp4-like
        x = torch.randn(shape) * 0.02
        rq, rs = R.quantize_nf4(x, bs)
        r32 = R.dequantize_nf4(rq, rs, shape, bs, torch.float32)
        b = T.dequantize(1, rq, rs, None, shape, bs, torch.bfloat16)
        assert b.shape == shape and torch.equal(b.view(torch.int16), (r32.view(torch.int32) >> 16).to(torch.int16))
        assert torch.equal(T.dequantize(1, rq, rs, None, shape, bs, torch.float16), r32.half()), ("fp16", shape)
    for shape in ((40, 100), (3, 1030)):
        d, s = R.quantize_fp8(torch.randn(shape) * 0.02)
        assert torch.equal(T.dequantize(3, d, s, None, shape, 0, torch.float32),
                           R.dequantize_fp8(d, s, torch.float32)), ("fp8", shape)
        assert torch.equal(F.transpose_bytes(d).view(torch.uint8), d.view(torch.uint8).t().contiguous())
    # every finite e4m3 code, compared as bits: torch.equal calls -0.0 and +0.0 equal, the fp32 bits do not
    b = torch.arange(256, dtype=torch.uint8)
    b[b == 0x7F], b[b == 0xFF] = 0x80, 0x00  # NaN codes → ±0
    d, s = b.view(torch.float8_e4m3fn).view(4, 64), torch.tensor([1.0, 3.0e-4, 0.2831, 7.5])
    ref = R.dequantize_fp8(d, s, torch.float32).view(torch.int32)
    assert int((ref == torch.iinfo(torch.int32).min).sum()) == 2  # two -0.0 outputs
    assert torch.equal(T.dequantize(3, d, s, None, (4, 64), 0, torch.float32).view(torch.int32), ref)
    bsc, g, eff = R.nvfp4_scales(w)
    rq, rbs, rg = R.quantize_nvfp4(w)
    assert torch.equal(T.quantize_nvfp4_codes(w, eff), rq)
    assert torch.equal(T.dequantize(2, rq, rbs.view(torch.uint8), rg, w.shape, 16, torch.float32),
                       R.dequantize_nvfp4(rq, rbs, rg, torch.float32))
    # fused dequant-matmul, every scale-fetch mode (per element / per row / reshaped) and format
    for k, fid, bs in ((256, 0, 64), (256, 0, 16), (192, 0, 6), (256, 1, 64), (256, 1, 16), (256, 2, 16)):
        x = torch.randn(5, k)
        W = torch.randn(40, k) * 0.02
        if fid == 0:
            d, s = R.quantize_int8(W, bs); g = None; ref = R.dequantize_int8(d, s, bs, torch.float32)
        elif fid == 1:
            d, s = R.quantize_nf4(W, bs); g = None; ref = R.dequantize_nf4(d, s, W.shape, bs, torch.float32)
        else:
            d, s, g = R.quantize_nvfp4(W); ref = R.dequantize_nvfp4(d, s, g, torch.float32)
        # (BM, BN, BK[, warps, stages, split-K]): split-K sums fp32 partial products of K ranges
        for cfg in ((16, 32, 64), (16, 16, 128), (16, 32, 32), (16, 32, 32, 4, 1, 2), (16, 16, 16, 4, 1, 4)):
            if (k // cfg[2]) % (cfg[5] if len(cfg) > 5 else 1) == 0 and k % cfg[2] == 0:
                y = T.fused_matmul(fid, x, d, s, g, W.shape, bs, cfg)
                assert (y - x @ ref.T).abs().max() < 1e-5, (fid, bs, cfg)
    # per-row fp8 activation quantization up to the e4m3 cast (the interpreter does not round like
    # the GPU's cvt.rn, so the codes are compared as fp32 here and bit for bit on the GPU)
    for k in (100, 5000):
        x = torch.randn(7, k)
        c = torch.rand(k)
        for cs in (None, c):
            y = torch.empty(7, k)
            sc = torch.empty(7, 1)
            F._rows_fp8_kernel[(7,)](x, sc if cs is None else cs, y, sc, k, k, cs is not None, min(4096, T._pow2(k)))
            xf = x if cs is None else x * cs
            rs = (xf.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
            assert torch.equal(sc, rs) and torch.equal(y, (xf / rs).clamp(-448, 448)), (k, cs is None)
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernels_in_triton_interpreter(run_in_triton_interpreter):
    # fp32 in and out: the interpreter truncates bf16 conversions, so bf16 output is checked on the GPU only
    run_in_triton_interpreter(_INTERP)


_HOPPER_PTX = textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tidal_quant import _triton as T

    def ptx(fn, sig, consts, ints, warps=8):
        # what a launch specializes: 16-byte-aligned pointers, sizes divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
                 if t.startswith("*") or n in ints}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        return k.asm["ptx"], k.metadata.shared

    sig = {"d_ptr": "*u8", "s_ptr": "*fp32", "g_ptr": "*fp32", "tab_ptr": "*fp32", "out_ptr": "*i32",
           "n_bytes": "i32", "nblocks": "i32", "inv_ptr": "*fp32", "K": "i32", "INNER": "i32", "OSTRIDE": "i32",
           "GB": "constexpr", "NG": "constexpr", "NVFP4": "constexpr", "OUT": "constexpr", "EVEN": "constexpr",
           "WIDE": "constexpr", "ROWS": "constexpr"}
    per_program, warps = T.DEQUANT_4BIT_CONFIG
    consts = {"GB": 32, "NG": per_program // 4, "NVFP4": False, "OUT": 0, "EVEN": True, "WIDE": False, "ROWS": False}
    p, shared = ptx(T._dequant_4bit_kernel, sig, consts, {"n_bytes", "nblocks", "K", "INNER", "OSTRIDE"}, warps)
    # nf4 -> bf16 at the default launch config: each thread's 4-byte code groups become 16-byte stores of
    # four output words, rounded to nearest even, with no shared-memory shuffle between the two tiles
    stores = per_program // 4 // (32 * warps)
    assert len(re.findall(r"st\\.global\\.v4\\.b32", p)) == stores and not re.findall(r"st\\.global\\.b", p), "stores"
    assert "cvt.rn.bf16.f32" in p and shared == 0, shared
    sig = {"d_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*bf16", "numel": "i32", "inv_ptr": "*fp32", "K": "i32",
           "BS": "constexpr", "NG": "constexpr", "EVEN": "constexpr", "WIDE": "constexpr", "E4M3": "constexpr"}
    consts = {"BS": 64, "NG": 1024, "EVEN": True, "WIDE": False, "E4M3": False}
    p, shared = ptx(T._dequant_int8_kernel, sig, consts, {"numel", "K"})
    assert len(re.findall(r"st\\.global\\.v4\\.b32", p)) == 4 and shared == 0, shared  # int8 -> bf16 likewise
    # nf4 -> e4m3 pairs (fp8_compute): the same flat layout, 8-byte stores of four 16-bit words, no shuffle
    sig = {"d_ptr": "*u8", "s_ptr": "*fp32", "g_ptr": "*fp32", "tab_ptr": "*fp32", "out_ptr": "*i16",
           "n_bytes": "i32", "nblocks": "i32", "inv_ptr": "*fp32", "K": "i32", "INNER": "i32", "OSTRIDE": "i32",
           "GB": "constexpr", "NG": "constexpr", "NVFP4": "constexpr", "OUT": "constexpr", "EVEN": "constexpr",
           "WIDE": "constexpr", "ROWS": "constexpr"}
    consts = {"GB": 32, "NG": per_program // 4, "NVFP4": False, "OUT": 3, "EVEN": True, "WIDE": False, "ROWS": False}
    p, shared = ptx(T._dequant_4bit_kernel, sig, consts, {"n_bytes", "nblocks", "K", "INNER", "OSTRIDE"}, warps)
    assert "cvt.rn.satfinite.e4m3x2.f32" in p and shared == 0, shared
    assert re.findall(r"st\\.global\\.v2\\.b32", p) and not re.findall(r"st\\.global\\.b(8|16) ", p), "e4m3 stores"
    print("ok")
    """
)


def _hopper_compiler() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    ptxas = os.path.join(
        os.path.dirname(importlib.util.find_spec("triton").origin), "backends/nvidia/bin/ptxas"
    )
    return os.path.exists(ptxas)


@pytest.mark.skipif(not _hopper_compiler(), reason="triton with its bundled CUDA compiler not installed")
def test_dequantize_kernels_vectorize_for_hopper():
    # compiled for sm_90 without a GPU: the memory-bound kernels must keep 16-byte contiguous stores
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "-c", _HOPPER_PTX], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_split_k_fills_the_gpu_with_few_tokens(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(ops._SMS, dev, 132)  # an H100/H200's SM count, without a GPU
    # 1 token, 5120 -> 13824 with 32-wide tiles: 432 tiles; 2 splits reach 4 programs per SM (528)
    assert ops._split_k(dev, 13824, 5120, 16, 1, 32, 128) == 2
    # 5120 -> 5120, 16-wide tiles of 256: 320 tiles → 2 splits; 64-wide tiles: 80 tiles → 8 splits
    assert ops._split_k(dev, 5120, 5120, 16, 16, 16, 256) == 2
    assert ops._split_k(dev, 5120, 5120, 16, 16, 64, 64) == 8
    # splits must divide the K tiles (5120 / 256 = 20 tiles: at most 4) and stop at 16
    assert ops._split_k(dev, 64, 5120, 16, 1, 64, 256) == 4
    assert ops._split_k(dev, 64, 65536, 16, 1, 64, 64) == 16
    assert ops._split_k(dev, 1 << 20, 5120, 16, 1, 32, 128) == 1  # enough tiles already
