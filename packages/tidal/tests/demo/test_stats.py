"""What the demo counts: bytes moved (from the memory report) and memory on the CPU stand-in."""

from __future__ import annotations

import torch
from torch import nn

from tidal.demo.stats import DeviceMemory, resident_bytes, transfer_totals


def test_transfer_totals_adds_every_mechanism():
    report = {
        "h2d_bytes": 100,
        "d2h_bytes": 40,
        "weight_streaming": {"h2d_bytes": 1000, "resident_peak_bytes": 7},
        "activations": {"offloaded_bytes": 5},
        "host": {"host_bytes": 123456},  # not a transfer
    }
    assert transfer_totals(report) == (1105, 45)
    assert transfer_totals({}) == (0, 0)


def test_resident_bytes_counts_storage_once_and_skips_emptied_tensors():
    lin = nn.Linear(8, 4)  # weight 32 floats, bias 4 floats
    tied = nn.Module()
    tied.a, tied.b = lin, lin  # the same parameters twice: counted once
    lin.weight.grad = torch.ones_like(lin.weight)
    assert resident_bytes(tied, {}, torch.device("cpu")) == (32 + 4 + 32) * 4
    lin.bias.data.untyped_storage().resize_(0)  # a streamed tensor between uses holds no storage
    lin.weight.grad = None
    assert resident_bytes(tied, {"tiers": {"device": {"bytes": 10}}}, torch.device("cpu")) == 32 * 4 + 10


def test_cpu_peak_adds_the_streaming_window():
    lin = nn.Linear(8, 4)
    mem = DeviceMemory(torch.device("cpu"))
    peak, now = mem.read(lin, {"weight_streaming": {"resident_peak_bytes": 1000}})
    assert now == 36 * 4 and peak == now + 1000
