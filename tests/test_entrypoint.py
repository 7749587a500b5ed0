import subprocess
import sys

import entrypoint


def test_help_lists_only_registered_commands(capsys):
    assert entrypoint.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in entrypoint.COMMANDS:
        assert name in out


def test_unknown_command_is_usage_error(capsys):
    assert entrypoint.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_console_script_installed():
    bindir = sys.executable.rsplit("/", 1)[0]
    result = subprocess.run([f"{bindir}/entrypoint", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("mds ")
