"""NF4 over activation rows (``tidal_quant.rows``), and ``nf4_decode_rows_into``: NF4 dequantized straight
into strided rows (a token range of a K/V buffer).

The reference path runs everywhere; the Triton kernel runs on CUDA (gpu-marked) and, wherever triton is
importable, in its interpreter on the CPU.
"""

import importlib.util
import textwrap

import pytest
import torch

import tidal_quant as tq
from tidal_quant import QuantError, ops
from tidal_quant import reference as ref
from tidal_testing import assert_bitwise_equal

gpu = pytest.mark.gpu


def _token_range(device: str, dtype: torch.dtype, tokens: int = 48, start: int = 16, d: int = 128):
    """A ``[2, B, H, cap, D]`` buffer filled with a sentinel, its ``[2, B, H, tokens, D]`` token range at
    ``start``, and NF4 codes of values for that range (packed in the range's row order)."""
    buf = torch.full((2, 2, 3, 96, d), 7.0, dtype=dtype, device=device)
    dst = buf[:, :, :, start : start + tokens]
    x = torch.randn(dst.shape, generator=torch.Generator().manual_seed(3)) * 0.1
    data, scales = ref.quantize_nf4(x.reshape(-1, d), 64)
    return buf, dst, data.to(device), scales.to(device)


def _expected(buf, data, scales, start, tokens):
    d = buf.shape[-1]
    want = buf.clone()
    rows = ref.dequantize_nf4(data.cpu(), scales.cpu(), (data.numel() * 2 // d, d), 64, buf.dtype)
    want[:, :, :, start : start + tokens] = rows.view(*buf.shape[:3], tokens, d).to(buf.device)
    return want


def test_rows_are_the_bytes_quantize_makes_of_a_weight():
    x = torch.randn(2, 3, 40, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    data, scales = tq.nf4_encode_rows(x, 32)
    assert data.shape == (2, 3, 40, 64) and scales.shape == (2, 3, 40, 4)
    qw = tq.quantize(x.reshape(-1, 128), "nf4", block_size=32)
    # the absmax in the rows' dtype (half fp32's bytes) holds the same values: each is one of x's
    assert scales.dtype == torch.bfloat16 and torch.equal(scales.float().reshape(-1), qw.scales)
    assert torch.equal(data.reshape(-1), qw.data)
    back = tq.nf4_decode_rows(data, scales, 32, torch.bfloat16)
    assert torch.equal(back, tq.dequantize(qw, torch.bfloat16).view(x.shape))


def test_reference_path_fills_only_the_token_range():
    buf, dst, data, scales = _token_range("cpu", torch.bfloat16)
    launch = tq.nf4_decode_rows_into(dst, data, scales, 64)
    launch()
    assert_bitwise_equal(buf, _expected(buf, data, scales, 16, 48), "token range")
    buf.fill_(0)
    launch()  # reusable: writes the same values again
    assert_bitwise_equal(buf[:, :, :, 16:64], _expected(buf, data, scales, 16, 48)[:, :, :, 16:64], "again")
    assert buf[:, :, :, :16].abs().sum() == 0 and buf[:, :, :, 64:].abs().sum() == 0


@pytest.mark.parametrize(
    "case, match",
    [
        ("fmt", "fmt"),
        ("transposed", "contiguous"),
        ("gappy", "collapse"),
        ("d", "multiple"),
        ("dtype", "bf16"),
        ("bytes", "uint8"),
        ("scales", "scales"),
    ],
)
def test_bad_layouts_are_refused_by_name(case, match):
    buf, dst, data, scales = _token_range("cpu", torch.bfloat16)
    args = {"data": data, "scales": scales, "fmt": "nf4", "block_size": 64, "dst": dst}
    if case == "fmt":  # the op under the public nf4_decode_rows_into
        args["fmt"] = "int8"
    elif case == "transposed":
        args["dst"] = dst.transpose(-1, -2)
    elif case == "gappy":  # every other head: the leading dims no longer collapse to one stride
        args["dst"] = buf[:, :, ::2, 16:64]
    elif case == "d":
        args["block_size"] = 96
    elif case == "dtype":
        args["dst"] = dst.to(torch.int32)
    elif case == "scales":
        args["scales"] = scales.to(torch.float64)
    else:
        args["data"] = data[:-1]
    with pytest.raises(QuantError, match=match):
        ops.dequant_rows_launch(**args)
    if case != "fmt":
        with pytest.raises(QuantError, match=match):
            tq.nf4_decode_rows_into(args["dst"], args["data"], args["scales"], args["block_size"])


_INTERP_ROWS = textwrap.dedent(
    """
    import torch
    from tidal_quant import _triton as T, reference as R
    # 48 tokens: whole programs; 5: a masked last program; bf16 scales as tidal-kv's pages keep them
    for tokens, start, sdt in ((48, 16, torch.float32), (5, 3, torch.float32), (48, 16, torch.bfloat16)):
        buf = torch.full((2, 2, 3, 96, 128), 7.0)
        dst = buf[:, :, :, start:start + tokens]
        x = torch.randn(dst.shape) * 0.1
        q, s = R.quantize_nf4(x.reshape(-1, 128), 64)
        s = s.to(sdt)
        want = buf.clone()
        want[:, :, :, start:start + tokens] = R.dequantize_nf4(q, s, (q.numel() // 64, 128), 64,
                                                               torch.float32).view(dst.shape)
        T.dequant_rows_launch(T.FMT_NF4, q, s, 64, dst, dst.stride(-3))()
        assert torch.equal(buf, want), (tokens, start)
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rows_kernel_in_triton_interpreter(run_in_triton_interpreter):
    # fp32 out: the interpreter truncates bf16 conversions (bf16 is checked on the GPU)
    run_in_triton_interpreter(_INTERP_ROWS)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, start", [(48, 16), (5, 3)])
@pytest.mark.parametrize("scales_in", ["fp32", "dst dtype"])
def test_rows_kernel_is_bit_exact_on_cuda(dtype, tokens, start, scales_in):
    buf, dst, data, scales = _token_range("cuda", dtype, tokens, start)
    if scales_in == "dst dtype":  # as tidal-kv's NF4 pages keep them
        scales = scales.to(dtype)
    tq.nf4_decode_rows_into(dst, data, scales, 64)()
    assert_bitwise_equal(buf, _expected(buf, data, scales, start, tokens), f"{dtype} rows")
