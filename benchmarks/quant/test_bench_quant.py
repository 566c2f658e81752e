"""Micro benchmarks of tidal-quant on CUDA (pytest-benchmark; skipped without CUDA).

- NF4 dequantize → bf16 at Qwen2.5-14B layer shapes; ``extra_info`` has GB/s and the fraction of the
  device-to-device copy bandwidth (goal ≥ 0.70);
- ``QuantLinear`` forward + input gradient at 5120→13824, 13824→5120, 5120→5120 with 512 and 2048
  tokens for nf4 / fp8 / int8 / nvfp4, bf16 ``nn.Linear`` and bitsandbytes ``Linear4bit`` (when
  importable). Ratios to bf16 are in ``table.py``'s output.

Run: ``pytest -p tidal_testing.plugin benchmarks/quant --benchmark-only``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qbench

import tidal_quant as tq

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def copy_bw() -> float:
    return qbench.copy_gbps()


@pytest.mark.parametrize(
    "name,in_f,out_f", qbench.QWEN14B_LAYERS, ids=[n for n, _, _ in qbench.QWEN14B_LAYERS]
)
def test_nf4_dequantize(synced_benchmark, benchmark, copy_bw, name, in_f, out_f):
    qw = qbench.nf4_weight(in_f, out_f)
    synced_benchmark(tq.dequantize, qw, torch.bfloat16)
    gbps = qbench.dequant_bytes(qw) / (benchmark.stats.stats.median * 1e3) / 1e6
    benchmark.extra_info.update(
        {"gbps": round(gbps, 1), "copy_gbps": round(copy_bw, 1), "fraction_of_copy": round(gbps / copy_bw, 3)}
    )


KINDS = ["bf16", *qbench.FORMATS, "bnb-nf4"]


@pytest.mark.parametrize("tokens", qbench.TOKENS)
@pytest.mark.parametrize(
    "in_f,out_f", qbench.LINEAR_SHAPES, ids=[f"{i}to{o}" for i, o in qbench.LINEAR_SHAPES]
)
@pytest.mark.parametrize("kind", KINDS)
def test_linear_fwd_input_grad(synced_benchmark, benchmark, kind, in_f, out_f, tokens):
    if kind == "bnb-nf4" and not qbench.bnb_available():
        pytest.skip("bitsandbytes not importable")
    torch.manual_seed(0)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    layer = qbench.make_layer(kind, in_f, out_f, weight)
    if kind != "bf16":
        db = qbench.check_layer(kind, layer, qbench.make_layer("bf16", in_f, out_f, weight), x.detach())
        benchmark.extra_info["sqnr_db"] = round(db, 1)
    synced_benchmark(qbench.fwd_bwd(layer, x, g))
