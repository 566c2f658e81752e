"""The README's examples run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# what each block prints (the generate block: 12 prompt + 15 cached tokens of layer 1 fill 3 pages of 8)
EXPECTED = [
    "trained; last log",
    "QuantLinear layers: 14",
    "dpo loss",
    "same tokens as DynamicCache: True | host pages written: 3",
]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"{README}#block{index}", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert EXPECTED[index] in out
