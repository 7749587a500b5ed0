"""A suite leaves out what it cannot run by marker (pytest counts it as deselected), never by a skip: the torch 2.1
suite deselects the tests that compile our layers, and the GPU suite's one-GPU share mode those that cannot share
one GPU over gloo."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TORCH21_SUITE = ("tests/training", "tests/model", "tests/parallel", "tests/images/test_oldest_stack.py",
                 "tests/images/test_patches.py")


def _addopts_markers() -> str:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    return re.fullmatch(r"-m '([^']*)'", addopts)[1]


def test_torch21_target_deselects_the_compile_tests_and_keeps_the_default_deselection():
    out = subprocess.run(["make", "-n", "test-torch21"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    run = next(line for line in out.stdout.splitlines() if " -m pytest " in line)
    markers = re.search(r' -m "([^"]*)"', run)
    assert markers, run
    # a -m on the command line replaces addopts' one: it must keep what addopts leaves out
    assert markers[1] == f"{_addopts_markers()} and not needs_torch_compile", run


def _skips(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("skip", "skipif") and \
                isinstance(node.value, (ast.Name, ast.Attribute)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_the_torch21_suite_holds_no_skips():
    files = [p for entry in TORCH21_SUITE for p in ((ROOT / entry).rglob("test_*.py") if (ROOT / entry).is_dir()
                                                    else [ROOT / entry])]
    assert len(files) > 20
    skips = [hit for path in files for hit in _skips(path)]
    assert not skips, "mark them (needs_torch_compile, ...) instead:\n" + "\n".join(skips)


def test_share_mode_deselects_the_cases_that_cannot_share_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "MDS_GPU_TESTS_SHARE_GPU"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu", "tests/gpu",
               "--collect-only", "-q"]
    every = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    shared = subprocess.run(command, cwd=ROOT, env=dict(env, MDS_GPU_TESTS_SHARE_GPU="1"), capture_output=True,
                            text=True, timeout=300)
    assert every.returncode == 0 and shared.returncode == 0, every.stdout[-2000:] + shared.stdout[-2000:]
    left_out = set(every.stdout.splitlines()) - set(shared.stdout.splitlines())
    left_out = {line.split("::", 1)[1] for line in left_out if "::" in line}
    assert {"test_layout_matches_single_gpu_bf16[pp2-extra2]",
            "test_compile_matches_eager[tp2_sp_compile-extra1-2-nodrop]",
            "test_compile_matches_eager[tp2_sp_compile-extra1-2-dropout]"} <= left_out, left_out
    assert all("pp2" in name or "sp_compile-" in name or "whole_node" in name for name in left_out), left_out
    assert re.search(r"\(10 deselected\)", shared.stdout), shared.stdout[-500:]
