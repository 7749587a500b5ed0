import subprocess
import sys

import entrypoint


def test_help_lists_only_registered_commands(capsys):
    assert entrypoint.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in entrypoint.COMMANDS:
        assert name in out


def test_no_command_is_usage_error_on_stderr():
    """`entrypoint` alone is a mistake (exit 2, usage on stderr, nothing on stdout); --help is not."""
    bindir = sys.executable.rsplit("/", 1)[0]
    bare = subprocess.run([f"{bindir}/entrypoint"], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stdout == ""
    assert "no command given" in bare.stderr and "usage: entrypoint <command>" in bare.stderr
    for name in entrypoint.COMMANDS:
        assert name in bare.stderr
    helped = subprocess.run([f"{bindir}/entrypoint", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "usage: entrypoint <command>" in helped.stdout and helped.stderr == ""


def test_unknown_command_is_usage_error(capsys):
    assert entrypoint.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_console_script_installed():
    bindir = sys.executable.rsplit("/", 1)[0]
    result = subprocess.run([f"{bindir}/entrypoint", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("mds ")
