"""The ``tidal`` command's shell: help, version, exit statuses, errors without tracebacks."""

from __future__ import annotations

import pytest

import tidal
from tidal.cli import main


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for cmd in ("demo", "env", "plan", "report"):
        assert cmd in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tidal {tidal.__version__}"


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train"])
    assert e.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only tidal's own errors are printed as one line; anything else is a bug and propagates."""
    from tidal import cli

    def boom(_args):
        raise KeyError("internal")

    monkeypatch.setitem(cli.COMMANDS, "env", boom)
    with pytest.raises(KeyError, match="internal"):
        main(["env"])
