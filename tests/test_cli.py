"""The CLI lists every subcommand and rejects unknown ones. Run: pytest tests/test_cli.py"""

import subprocess
import sys

from projected_grpo.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_rejected(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "projected_grpo.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: projected-grpo" in r.stdout
