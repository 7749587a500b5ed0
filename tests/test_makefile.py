"""The Makefile is the README's interface: `make help` names every target, `make test` sets the system up
itself, and CI runs nothing that `make test` does not (so a fresh machine needs only the two commands)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = "scripts/setup-test-system.sh"


def make(*args: str) -> str:
    result = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def phony_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {name for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for name in line.split()}


def test_help_lists_every_target_once_one_line_each():
    lines = make("help").splitlines()
    listed = [line.split()[1] for line in lines]
    assert all(line.startswith("make ") and len(line.split()) > 2 for line in lines), lines
    assert sorted(listed) == sorted(set(listed)), "a target listed twice"
    assert set(listed) == phony_targets(), f"make help vs .PHONY: {set(listed) ^ phony_targets()}"
    assert {"demo", "test", "test-system", "image", "image-cpu", "sif", "test-torch21", "bench"} <= set(listed)


def test_make_test_sets_the_system_up_before_pytest():
    plan = make("-n", "-W", "pyproject.toml", "test").splitlines()  # -W: plan the venv step too
    setup = next(i for i, line in enumerate(plan) if SETUP_SCRIPT in line)
    pytest_run = next(i for i, line in enumerate(plan) if "-m pytest" in line)
    assert setup < pytest_run


def test_two_workers_count_the_deselected_tests_like_one_process():
    """`make test` runs two pytest-xdist workers: the summary line still says how many tests the markers left out
    (tests/gpu: all of them, on a machine without the -m gpu selection)."""
    import sys

    counts = []
    for workers in ("0", "2"):
        result = subprocess.run([sys.executable, "-m", "pytest", "-n", workers, "--dist", "loadgroup", "-q",
                                 "-p", "no:cacheprovider", "tests/gpu"], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        summary = result.stdout.strip().splitlines()[-1]
        assert result.returncode == 5, result.stdout[-2000:] + result.stderr[-2000:]  # 5: nothing ran
        counts.append(int(re.search(r"(\d+) deselected", summary).group(1)))
    assert counts[0] == counts[1] > 0, counts


def test_ci_runs_only_the_make_targets():
    """No apt-get, no daemon started in CI's script: whatever CI needs, `make test` does on any machine."""
    text = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not any(word in c for c in commands for word in ("apt-get", "dockerd", "MDS_REQUIRE_DOCKER")), commands
    assert [c for c in commands if c.startswith("make ")] == ["make lint TORCH_SPEC=torch==2.13.0",
                                                              "make test TORCH_SPEC=torch==2.13.0", "make test-torch21"]


def test_lint_is_configured_and_run_by_make():
    """`make lint` runs the linter pyproject.toml configures, and the test extra installs it."""
    assert "[tool.ruff]" in (ROOT / "pyproject.toml").read_text() and '"ruff==' in (ROOT / "pyproject.toml").read_text()
    dry = subprocess.run(["make", "-n", "lint"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "ruff check ." in dry.stdout, dry.stdout + dry.stderr


def test_setup_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck not found: install it (`make test` does, as root: apt-get install shellcheck)")
    scripts = (SETUP_SCRIPT, ".ci/run", "scripts/setup-slurm24-root.sh", "scripts/slurm24-enter.sh")
    for script in scripts:
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    check = subprocess.run(["shellcheck", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.slow
def test_system_setup_waits_for_the_package_managers_lock():
    """Another apt at work holds dpkg's lock (an fcntl lock, as apt and dpkg take it: flock(1) takes another kind,
    which apt never sees): the set-up waits for it and then installs, instead of failing at once. The table handed
    in names a command that no package provides beside a package that is installed, so apt-get runs for real and
    installs nothing new."""
    import fcntl
    import os
    import sys
    import time

    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("the set-up's lock test needs root and apt-get (as `make test` does on CI)")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        "fd = os.open('/var/lib/dpkg/lock-frontend', os.O_RDWR | os.O_CREAT, 0o640)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, MDS_APT_LOCK_TIMEOUT="120",
               MDS_SYSTEM_GROUPS_TABLE="shellcheck|mds-command-no-package-has|the lock test")
    setup = None
    try:
        assert holder.stdout.readline().strip() == "held"
        probe = os.open("/var/lib/dpkg/lock-frontend", os.O_RDWR)
        with pytest.raises(OSError):  # the lock is really taken, as apt sees it
            fcntl.lockf(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)
        setup = subprocess.Popen(["bash", SETUP_SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        lines = []
        while not any("+ apt-get install" in line for line in lines):
            line = setup.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        time.sleep(10)  # the install itself (shellcheck is there already) takes a second or two
        assert setup.poll() is None, "".join(lines) + setup.stdout.read()  # still waiting for the lock
    finally:
        holder.kill()
        holder.wait()
    output = "".join(lines) + setup.stdout.read()
    assert setup.wait(timeout=120) == 0 and "WARNING" not in output, output
    assert "Could not get lock /var/lib/dpkg/lock-frontend" in output, output
    assert "shellcheck is already the newest version" in output, output
