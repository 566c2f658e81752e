"""``tidal env``: versions, GPU facts and the to-do list."""

from __future__ import annotations

import importlib.metadata as md
import json

import torch

from tidal.cli import main
from tidal.env import EnvReport, _missing, collect, render


def test_env_json_reports_real_versions(capsys):
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["packages"]["torch"] == torch.__version__
    assert data["tidal"]["tidal"].startswith("0.1.0")
    for dist in ("tidal-arena", "tidal-quant", "tidal-plan", "tidal-stream", "tidal-kv", "tidal-hf"):
        assert data["tidal"][dist] is not None, dist
    assert data["cuda_available"] == torch.cuda.is_available()
    assert data["torch_cuda"] == torch.version.cuda
    assert data["packages"]["transformers"] == md.version("transformers")


def test_env_table_mentions_every_package(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for word in ("tidal-stream", "torch", "triton", "cupy", "transformers", "CUDA (torch build)"):
        assert word in text


def test_env_does_not_import_triton_or_cupy():
    import sys

    before = {m for m in ("triton", "cupy") if m in sys.modules}
    collect()
    assert {m for m in ("triton", "cupy") if m in sys.modules} == before


def _report(**kw) -> EnvReport:
    base = dict(
        python="3.11",
        platform="Linux x86_64",
        tidal={"tidal": "0.1.0", "tidal-hf": None, "tidal-testing": None},
        packages={"torch": "2.11", "triton": None, "cupy": None, "transformers": None},
        torch_cuda="13.0",
        cuda_available=True,
        gpus=[{"index": 0, "name": "G", "capability": "9.0", "memory_gib": 80.0, "fp8_tensor_cores": True,
               "fp4_tensor_cores": False}],
    )  # fmt: skip
    base.update(kw)
    return EnvReport(**base)


def test_missing_list_gives_the_install_command_for_each_gap():
    todo = "\n".join(_missing(_report()))
    assert 'pip install "tidal[hf]"' in todo  # tidal-hf and transformers
    assert 'pip install "tidal[cuda13]"' in todo  # CuPy for torch's CUDA 13 build
    assert "triton" in todo
    assert "tidal-testing" not in todo  # dev-only: not a gap


def test_missing_list_without_gpu_says_so():
    todo = _missing(_report(cuda_available=False, torch_cuda=None, gpus=[]))
    assert any("GPU: none visible" in t and "CPU-only build" in t for t in todo)
    assert not any("cupy" in t for t in todo)  # CuPy only matters with a GPU


def test_render_shows_gpu_capability():
    text = render(_report())
    assert "compute capability 9.0" in text and "FP8 tensor cores" in text
