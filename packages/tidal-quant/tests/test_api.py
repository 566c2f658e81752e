"""quantize / dequantize: layouts, bytes per weight, double quantization, and bad input."""

import pytest
import torch

import tidal_quant as tq
from tidal_quant.formats import QuantizedWeight


def test_public_surface():
    for name in ("QuantFormat", "quantize", "dequantize", "quant_linear", "QuantLinear", "quantize_model_"):
        assert name in tq.__all__
    assert [f.value for f in tq.QuantFormat] == ["int8", "nf4", "fp8", "nvfp4"]
    assert tq.QuantFormat("nf4") is tq.QuantFormat.NF4 and tq.QuantFormat.NF4 == "nf4"
    assert issubclass(tq.QuantError, ValueError)


@pytest.mark.parametrize(
    "fmt,dq", [(f, False) for f in tq.QuantFormat] + [(tq.QuantFormat.INT8, True), (tq.QuantFormat.NF4, True)]
)
def test_layout_matches_quantize_and_bytes_per_weight(fmt, dq):
    w = torch.randn(48, 256)
    qw = tq.quantize(w, fmt, double_quant=dq)
    assert isinstance(qw, QuantizedWeight) and qw.fmt is fmt and qw.shape == (48, 256)
    layout = tq.storage_layout(fmt, (48, 256), double_quant=dq)
    assert {k: (tuple(t.shape), t.dtype) for k, t in qw.tensors().items()} == layout
    bpw = tq.bytes_per_weight(fmt, double_quant=dq)
    extra = 48 * 4 if fmt is tq.QuantFormat.FP8 else (8 if dq else 0)  # fp8 row scales; dq offset/scales2
    assert qw.nbytes() <= bpw * w.numel() + extra + 4


def test_bytes_per_weight_values():
    assert tq.bytes_per_weight("int8") == 1 + 4 / 64
    assert tq.bytes_per_weight("nf4") == 0.5 + 4 / 64
    assert tq.bytes_per_weight("nf4", 128) == 0.5 + 4 / 128
    assert tq.bytes_per_weight("nf4", double_quant=True) == pytest.approx(0.5 + (1 + 4 / 256) / 64)
    assert tq.bytes_per_weight("fp8") == 1.0
    assert tq.bytes_per_weight("nvfp4") == 0.5 + 1 / 16


def test_double_quant_close_to_plain():
    w = torch.randn(64, 512) * 0.02
    a = tq.dequantize(tq.quantize(w, "nf4"), torch.float32)
    b = tq.dequantize(tq.quantize(w, "nf4", double_quant=True), torch.float32)
    qa, qb = tq.quantize(w, "nf4"), tq.quantize(w, "nf4", double_quant=True)
    assert torch.equal(qa.data, qb.data)  # codes come from exact absmax either way (as bitsandbytes)
    assert (a - b).abs().max() <= 0.01 * w.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_dtypes(dtype):
    w = torch.randn(8, 64)
    qw = tq.quantize(w, "int8")
    d = tq.dequantize(qw, dtype)
    assert d.dtype == dtype and torch.equal(d, tq.dequantize(qw, torch.float32).to(dtype))


def _raises(match, fn, *a, **k):
    with pytest.raises(tq.QuantError, match=match) as e:
        fn(*a, **k)
    return str(e.value)


def test_bad_inputs_name_the_argument():
    w = torch.randn(8, 64)
    msg = _raises("fmt", tq.quantize, w, "int4")
    assert "'int4'" in msg and "nf4" in msg  # given and accepted
    _raises("fmt", tq.quantize, w, 4)
    _raises(r"tensor\.shape.*2-D", tq.quantize, torch.randn(64), "nf4")
    _raises(r"tensor\.shape.*2-D", tq.quantize, torch.randn(2, 8, 64), "nf4")
    _raises(r"tensor\.dtype", tq.quantize, torch.randint(0, 3, (8, 64)), "int8")
    _raises(r"tensor\.dtype", tq.quantize, w.double(), "int8")
    _raises(r"tensor\.device", tq.quantize, torch.empty(8, 64, device="meta"), "int8")
    _raises("tensor:", tq.quantize, [[1.0]], "int8")
    bad = w.clone()
    bad[3, 3] = float("nan")
    _raises("NaN/inf", tq.quantize, bad, "nf4")
    bad[3, 3] = float("inf")
    _raises("NaN/inf", tq.quantize, bad, "fp8")
    _raises("block_size.*even", tq.quantize, w, "int8", block_size=7)
    _raises("block_size.*even", tq.quantize, w, "int8", block_size=0)
    _raises("block_size.*power of two", tq.quantize, w, "nf4", block_size=48)
    _raises("block_size", tq.quantize, w, "nf4", block_size=64.0)
    _raises("block_size.*16", tq.quantize, w, "nvfp4", block_size=32)
    _raises("block_size.*fp8", tq.quantize, w, "fp8", block_size=64)
    _raises("double_quant", tq.quantize, w, "fp8", double_quant=True)
    _raises("double_quant", tq.quantize, w, "nf4", double_quant=1)
    _raises(r"tensor\.shape.*16", tq.quantize, torch.randn(8, 24), "nvfp4")
    _raises("qw", tq.dequantize, w)
    _raises("dtype", tq.dequantize, tq.quantize(w, "int8"), torch.int32)
    _raises("fmt", tq.bytes_per_weight, "fp4")


def test_odd_shapes_are_handled_bitsandbytes_style():
    w = torch.randn(7, 9)  # 63 elements: blocks straddle rows, last byte half padding
    qw = tq.quantize(w, "nf4", block_size=16)
    assert qw.data.numel() == 32 and qw.scales.numel() == 4
    assert tq.dequantize(qw, torch.float32).shape == (7, 9)
    assert tq.quantize(w, "int8", block_size=4).data.shape == (7, 9)


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, tidal_quant; bad = {'triton', 'bitsandbytes'} & set(sys.modules); assert not bad, bad"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="a weight on a GPU that is not the current one needs two"
)
@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_cuda_kernels_run_on_the_weights_gpu_when_another_one_is_current(fmt):
    """Triton launches on the current device: a weight on cuda:1 with cuda:0 current must still quantize,
    dequantize and multiply on cuda:1, to the same results as on cuda:0."""
    assert torch.cuda.current_device() == 0
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    results = {}
    for dev in ("cuda:0", "cuda:1"):
        qw = tq.quantize(w.to(dev), fmt)
        y = tq.quant_linear(x.to(dev), qw)
        assert y.device == torch.device(dev)
        results[dev] = (tq.dequantize(qw, torch.bfloat16).cpu(), y.cpu())
    assert torch.cuda.current_device() == 0
    for a, b in zip(results["cuda:0"], results["cuda:1"], strict=True):
        assert torch.equal(a, b)
