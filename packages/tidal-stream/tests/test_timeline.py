import json

import pytest
import torch
from torch import nn

from tidal_stream.activations import install_activation_policy
from tidal_stream.streamed_blocks import StreamedBlocks, StreamingError
from tidal_stream.timeline import TimelineRecorder, chrome_trace

torch.set_num_threads(1)


def stack(n=3, d=32):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))


def run(blocks, x):
    for b in blocks:
        x = b(x)
    return x.square().mean()


def test_recorder_spans_bytes_and_png(tmp_path):
    blocks = stack()
    sb = StreamedBlocks(blocks, "cpu")
    acts = install_activation_policy(blocks, ["offload"] * 3, device="cpu", min_offload_bytes=0)
    rec = TimelineRecorder(blocks, "cpu", streamed=sb, activations=acts)
    run(blocks, torch.randn(4, 16, 32, requires_grad=True)).backward()
    spans = rec.spans()
    assert [(b, p) for b, p, _, _ in spans] == [
        (0, "forward"),
        (1, "forward"),
        (2, "forward"),
        (2, "backward"),
        (1, "backward"),
        (0, "backward"),
    ]
    assert all(e >= s for _, _, s, e in spans)
    assert rec.events[-1].h2d_bytes == sb.h2d_bytes == 2 * sum(sb.block_bytes())
    assert rec.events[-1].d2h_bytes == acts.stats()["offloaded_bytes"] > 0
    out = rec.save_png(str(tmp_path / "timeline.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    rec.remove()
    with pytest.raises(StreamingError, match="nothing recorded"):
        TimelineRecorder(blocks, "cpu").save_png(str(tmp_path / "empty.png"))


def test_chrome_trace_has_tidal_ranges(tmp_path):
    blocks = stack(2)
    StreamedBlocks(blocks, "cpu")
    path = chrome_trace(lambda: run(blocks, torch.randn(2, 4, 32)).backward(), str(tmp_path / "trace.json"))
    with open(path) as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert "tidal::stream.fetch[0]" in names and "tidal::stream.fetch[1]" in names
    with pytest.raises(StreamingError, match="steps=0"):
        chrome_trace(lambda: None, str(tmp_path / "t.json"), steps=0)
