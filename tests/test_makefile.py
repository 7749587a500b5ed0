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
    for script in (SETUP_SCRIPT, ".ci/run"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    check = subprocess.run(["shellcheck", SETUP_SCRIPT, ".ci/run"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
