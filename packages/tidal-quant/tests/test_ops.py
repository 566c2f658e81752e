"""torch.library registrations: opcheck (schema, fake kernels, autograd registration) on the CPU."""

import pytest
import torch
from torch.library import opcheck

import tidal_quant as tq
from tidal_quant import fp8_ops, linear_ops, ops


def _case(fmt):
    w = torch.randn(32, 64)
    qw = tq.quantize(w, fmt)
    return qw


@pytest.mark.parametrize("nf4", [False, True])
def test_opcheck_quantize_blockwise(nf4):
    opcheck(ops.quantize_blockwise, (torch.randn(16, 64), 64, nf4))


def test_opcheck_quantize_nvfp4_codes():
    w = torch.randn(16, 64)
    _, _, eff = tq.reference.nvfp4_scales(w)
    opcheck(ops.quantize_nvfp4_codes, (w, eff))


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_opcheck_dequantize_and_qmatmul(fmt):
    qw = _case(fmt)
    data, scales = ops.as_bytes(qw.data), ops.as_bytes(qw.scales)
    meta = (qw.global_scale, fmt, list(qw.shape), qw.block_size or 0)
    opcheck(ops.dequantize, (data, scales, *meta, torch.bfloat16))
    opcheck(ops.qmatmul, (torch.randn(5, 64, dtype=torch.bfloat16), data, scales, *meta))


@pytest.mark.parametrize("n_out", [0, 3])
def test_opcheck_fp8_linear(n_out):
    qw = _case("fp8")
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    opcheck(fp8_ops.fp8_linear, (x, ops.as_bytes(qw.data), qw.scales, n_out))


def test_torch_compile_traces_quant_linear_fullgraph():
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    tq.quantize_model_(m, "nf4", block_size=32)
    x = torch.randn(4, 64, requires_grad=True)
    eager = m(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, eager) and torch.equal(g, g_eager)


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_opcheck_linear_with_autograd(fmt):
    qw = _case(fmt)
    x = torch.randn(5, 64, dtype=torch.float32, requires_grad=True)
    args = (x, ops.as_bytes(qw.data), ops.as_bytes(qw.scales), qw.global_scale, fmt, list(qw.shape))
    opcheck(linear_ops.linear, (*args, qw.block_size or 0, 0, fmt == "fp8", False))


def test_opcheck_fp8_grad_input():
    qw = _case("fp8")
    opcheck(
        fp8_ops.fp8_grad_input, (torch.randn(6, 32, dtype=torch.bfloat16), ops.as_bytes(qw.data), qw.scales)
    )
