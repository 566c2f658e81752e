"""``fp8_compute``: int8 / NF4 / NVFP4 weights recast to e4m3 and multiplied on FP8 tensor cores.

CPU: the reference recast (row scales, codes, transposed codes), the fp32 emulation's accuracy, the
options' errors and the CPU fallback. The row-scales kernel runs in the Triton interpreter where triton is
importable; gpu-marked tests check every recast kernel bit for bit on CUDA and that QuantLinear takes the
path.
"""

import importlib.util
import textwrap

import pytest
import torch
from torch.library import opcheck

import tidal_quant as tq
from tidal_quant import fp8_ops, linear_ops, ops
from tidal_quant.api import block_scales
from tidal_testing import assert_bitwise_equal, assert_sqnr, sqnr_db

gpu = pytest.mark.gpu
FORMATS = ["int8", "nf4", "nvfp4"]


def _args(qw):
    """(data, decompressed block scales, global scale) as the ops take them."""
    return ops.as_bytes(qw.data), ops.as_bytes(block_scales(qw)), qw.global_scale


def _recast(qw):
    """(codes [N, K] uint8, [2, N] row scales and their inverses) of the reference recast."""
    data, scales, g = _args(qw)
    return fp8_ops.recast_fp8(data, scales, g, qw.fmt.value, list(qw.shape), qw.block_size)


def _weight(n=512, k=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g)
    w[3] = 0.0  # an all-zero row: scale 0, codes 0
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_scale_bounds_the_row_and_codes_round_once(fmt):
    qw = tq.quantize(_weight(), fmt)
    codes, (rs, inv) = _recast(qw)
    wd = tq.dequantize(qw, torch.float32)  # [N, K]
    row_max = wd.abs().amax(dim=1)
    assert rs[3] == 0 and inv[3] == 1 and not codes[3].any()
    assert torch.equal(inv[rs != 0], 1 / rs[rs != 0])
    # the scale comes from the block scales alone: never below the row's largest weight, and equal to it
    # where a code of largest magnitude exists (NF4 and int8 always have one per non-zero block)
    assert bool((rs * 448 >= row_max * (1 - 1e-6)).all())
    if fmt != "nvfp4":
        torch.testing.assert_close(rs * 448, row_max, rtol=1e-6, atol=0)
    back = codes.view(torch.float8_e4m3fn).float() * rs[:, None]
    normal = (wd / torch.where(rs == 0, 1, rs)[:, None]).abs() >= 2.0**-6  # e4m3 normals: 3 mantissa bits
    rel = ((back - wd).abs() / wd.abs().clamp_min(1e-30))[normal]
    assert float(rel.max()) <= 2.0**-4 * (1 + 1e-6)  # one round to nearest, no more


@pytest.mark.parametrize("fmt", FORMATS)
def test_transposed_recast_is_the_transpose(fmt):
    qw = tq.quantize(_weight(64, 256), fmt)
    codes, rs2 = _recast(qw)
    t = fp8_ops.recast_fp8_t(*_args(qw), rs2, fmt, list(qw.shape), qw.block_size)
    assert torch.equal(t, codes.t())


def test_double_quant_scales_are_decompressed_first():
    w = _weight(64, 256)
    plain, dq = tq.quantize(w, "nf4"), tq.quantize(w, "nf4", double_quant=True)
    c1, _ = _recast(plain)
    c2, rs2 = _recast(dq)
    wd = tq.dequantize(dq, torch.float32)
    torch.testing.assert_close(rs2[0] * 448, wd.abs().amax(dim=1), rtol=1e-6, atol=0)
    assert (c1 != c2).float().mean() < 0.2  # the same codes where the decompressed scales round alike


# measured on this reference at 512x1024 (weights 0.02·U(0,1)·N(0,1) per row), 64 tokens: the recast
# weight against the dequantized one 30.5-31.7 dB; the products against the dequantized-weight ones
# 28.0-28.7 dB (forward) and 28.1-28.6 dB (input gradient). NF4's own error against the original weight is
# 20.7 dB, 20.4 dB after the recast.
@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_products_track_the_dequantized_weight(fmt):
    qw = tq.quantize(_weight(), fmt)
    codes, rs2 = _recast(qw)
    rs = rs2[0]
    wd = tq.dequantize(qw, torch.float32)
    assert_sqnr(wd, codes.view(torch.float8_e4m3fn).float() * rs[:, None], 29.0, f"{fmt} recast weight")
    x, g = torch.randn(64, 1024), torch.randn(64, 512)
    assert_sqnr(x @ wd.t(), fp8_ops.fp8_linear(x, codes, rs, 0), 26.0, f"{fmt} forward")
    t = fp8_ops.recast_fp8_t(*_args(qw), rs2, fmt, list(qw.shape), qw.block_size)
    assert_sqnr(g @ wd, fp8_ops.fp8_grad_input_t(g, t, rs), 26.0, f"{fmt} input gradient")
    if fmt == "nf4":  # the recast costs NF4 little against its own error
        w = _weight()
        assert sqnr_db(w, wd) - sqnr_db(w, codes.view(torch.float8_e4m3fn).float() * rs[:, None]) < 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_recast_ops(fmt):
    qw = tq.quantize(_weight(32, 64), fmt)
    meta = (fmt, list(qw.shape), qw.block_size)
    opcheck(fp8_ops.recast_fp8, (*_args(qw), *meta))
    _, rs2 = _recast(qw)
    opcheck(fp8_ops.recast_fp8_t, (*_args(qw), rs2, *meta))
    t = fp8_ops.recast_fp8_t(*_args(qw), rs2, *meta)
    opcheck(fp8_ops.fp8_grad_input_t, (torch.randn(6, 32, dtype=torch.bfloat16), t, rs2[0]))
    x = torch.randn(5, 64, requires_grad=True)
    opcheck(linear_ops.linear, (x, *_args(qw), *meta, 0, False, True))


def test_cpu_falls_back_to_the_dequantized_weight():
    lin = torch.nn.Linear(256, 64)
    plain = tq.QuantLinear.from_linear(lin, "nf4")
    fast = tq.QuantLinear.from_linear(lin, "nf4", fp8_compute=True)
    assert "fp8_compute=True" in repr(fast)
    x = torch.randn(3, 256, requires_grad=True)
    y1, y2 = plain(x), fast(x)
    assert torch.equal(y1, y2)  # FP8 tensor cores are CUDA-only: the CPU multiplies the dequantized weight
    (g1,) = torch.autograd.grad(y1.sum(), x)
    (g2,) = torch.autograd.grad(y2.sum(), x)
    assert torch.equal(g1, g2)


def test_fp8_compute_option_errors():
    lin = torch.nn.Linear(64, 32)
    with pytest.raises(ValueError, match=r"fp8_compute.*fmt='fp8'.*fp8_backward"):
        tq.QuantLinear.from_linear(lin, "fp8", fp8_compute=True)
    with pytest.raises(ValueError, match=r"fp8_compute.*True or False"):
        tq.QuantLinear(64, 32, "nf4", fp8_compute="yes")
    with pytest.raises(ValueError, match=r"cfg.*fp8_compute"):
        tq.QuantLinear.from_linear(lin, "nf4", fp8_compute_typo=True)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32))
    tq.quantize_model_(m, "nvfp4", fp8_compute=True)
    assert m[0].fp8_compute


_INTERP = textwrap.dedent(
    """
    import torch
    import tidal_quant as tq
    from tidal_quant import _triton_fp8 as R, fp8_ops, ops
    from tidal_quant.api import block_scales
    # the row scales and their inverses bit for bit; the e4m3 codes are written by one PTX instruction per
    # pair (inline assembly, which the interpreter cannot run): the GPU tests check every byte of them
    for fmt, bs, (n, k) in [("nf4", 64, (48, 256)), ("nf4", 32, (32, 512)), ("int8", 64, (48, 256)),
                            ("int8", 6, (16, 96)), ("nvfp4", None, (32, 256))]:
        w = torch.randn(n, k) * torch.rand(n, 1)
        w[3] = 0
        qw = tq.quantize(w, fmt, block_size=bs)
        scales, g = ops.as_bytes(block_scales(qw)), qw.global_scale
        want = fp8_ops.fp8_row_scales(scales, g, fmt, (n, k), qw.block_size)
        assert torch.equal(R.row_scales(fmt, scales, g, (n, k), qw.block_size), want), (fmt, bs)
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_row_scales_kernel_in_triton_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(_INTERP)


# ------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1024, 5120), (256, 13824), (48, 320)])
def test_recast_kernels_bit_exact(fmt, shape):
    from tidal_quant import _triton_fp8

    qw = tq.quantize(_weight(*shape).cuda(), fmt)
    data, scales, g = _args(qw)
    want, want_rs = _recast(qw.to("cpu"))
    for config in (None, (2048, 8)):  # the default and another launch config: the same bytes
        q, rs = _triton_fp8.recast_rows(fmt, data, scales, g, shape, qw.block_size, config)
        assert_bitwise_equal(rs, want_rs, f"{fmt} {shape} row scales {config}")
        assert_bitwise_equal(q.view(torch.uint8), want, f"{fmt} {shape} codes {config}")
    t = _triton_fp8.recast_cols(fmt, data, scales, g, want_rs[1].cuda(), shape, qw.block_size)
    assert_bitwise_equal(t.view(torch.uint8), want.t().contiguous(), f"{fmt} {shape} transposed")


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_compute_runs_on_scaled_mm(monkeypatch, fmt):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability >= 8.9")
    calls = []
    real = torch._scaled_mm

    def spy(*a, **k):
        calls.append((tuple(a[0].shape), tuple(a[1].shape)))
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    lin = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    q = tq.QuantLinear.from_linear(lin, fmt, fp8_compute=True)
    tokens = fp8_ops.FP8_COMPUTE_MIN_TOKENS
    x = torch.randn(4, tokens // 4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tq.reset_path_counts()
    y = q(x)
    assert tq.path_counts() == {"fp8_recast": 1, "fp8_scaled_mm": 1} and calls == [
        ((tokens, 1024), (1024, 512))
    ]
    # against the fp32 emulation of the same arithmetic, on the CPU
    qw_cpu = q.qweight.to("cpu")
    codes, rs2 = _recast(qw_cpu)
    x2 = x.detach().reshape(-1, 1024).float().cpu()
    emu = fp8_ops.fp8_linear(x2, codes, rs2[0], 0) + lin.bias.float().cpu()
    assert_sqnr(emu, y.detach().reshape(-1, 512).float().cpu(), 40.0, f"{fmt} fp8_compute vs emulation")
    g = torch.randn_like(y)
    y.backward(g)
    assert calls[1] == ((tokens, 512), (512, 1024))  # the input gradient ran on _scaled_mm too
    t = fp8_ops.recast_fp8_t(*_args(qw_cpu), rs2, fmt, list(qw_cpu.shape), qw_cpu.block_size)
    emu_g = fp8_ops.fp8_grad_input_t(g.reshape(-1, 512).float().cpu(), t, rs2[0])
    assert_sqnr(emu_g, x.grad.reshape(-1, 1024).float().cpu(), 40.0, f"{fmt} fp8_compute grad vs emulation")


@gpu
def test_few_tokens_keep_the_bf16_path():
    lin = torch.nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    q = tq.QuantLinear.from_linear(lin, "nf4", fp8_compute=True)
    plain = tq.QuantLinear.from_linear(lin, "nf4")
    x = torch.randn(fp8_ops.FP8_COMPUTE_MIN_TOKENS - 1, 1024, device="cuda", dtype=torch.bfloat16)
    tq.reset_path_counts()
    with torch.no_grad():
        y = q(x)
    assert "fp8_recast" not in tq.path_counts() and "fp8_scaled_mm" not in tq.path_counts()
    with torch.no_grad():
        assert torch.equal(y, plain(x))
