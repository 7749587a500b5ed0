"""The pinned-vs-found check of docker/steps/record_stack.py: version shapes, and the step run for real."""

import importlib.util
import json
import os
import subprocess
import sys

import torch

from tests.images.recipes import ROOT

SCRIPT = ROOT / "docker" / "steps" / "record_stack.py"
spec = importlib.util.spec_from_file_location("record_stack", SCRIPT)
record_stack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record_stack)


def test_cudnn_integers_become_dotted_versions():
    assert record_stack.cudnn_text(90600) == "9.6.0"  # NGC 24.12's cuDNN as torch reports it
    assert record_stack.cudnn_text(91002) == "9.10.2"
    assert record_stack.cudnn_text(8907) == "8.9.7"
    assert record_stack.cudnn_text(8600) == "8.6.0"


def test_pins_match_on_whole_dotted_parts():
    assert record_stack.same_version("12.6.3", "12.6")  # torch.version.cuda has no patch level
    assert record_stack.same_version("2.6.0a0+df5bbc09d1", "2.6.0a0+df5bbc09d1")
    assert record_stack.same_version("9.6.0", "9.6.0")
    assert record_stack.same_version("2.13.0", "2.13.0+cpu")  # as pip's ==: any local build
    assert not record_stack.same_version("2.6.0a0+df5bbc09d1", "2.6.0a0+0000000000")
    assert not record_stack.same_version("9.6.0", "9.6.1")
    assert not record_stack.same_version("2.1", "2.13.0")  # a text prefix, not a version prefix
    assert not record_stack.same_version("2.23.4", None)


def test_compare_names_what_differs():
    rows, differ = record_stack.compare({"CUDNN_VERSION": "9.6.0", "NCCL_VERSION": "2.23.4", "TE_VERSION": "1.13"},
                                        {"CUDNN_VERSION": "9.6.0", "NCCL_VERSION": "2.21.5", "TE_VERSION": None,
                                         "DEEPSPEED_VERSION": "0.19.8"})
    assert differ == ["NCCL_VERSION", "TE_VERSION"]
    verdicts = {row[0]: row[3] for row in rows}
    assert verdicts == {"CUDNN_VERSION": "ok", "NCCL_VERSION": "DIFFERS", "TE_VERSION": "ABSENT",
                        "DEEPSPEED_VERSION": "found"}


def _run_step(tmp_path, **pins):
    env = {**os.environ, "PYTHON": sys.executable, "MDS_STACK_FILE": str(tmp_path / "stack.json"),
           "MDS_BUILD_NOTES": str(tmp_path / "notes.txt"), "PIN_CHECK": "strict", **pins}
    return subprocess.run(["sh", str(ROOT / "docker/steps/record-stack.sh"), *pins], env=env,
                          capture_output=True, text=True)


def test_the_step_passes_strict_when_the_pins_hold(tmp_path):
    python = "%d.%d" % sys.version_info[:2]
    result = _run_step(tmp_path, PYTHON_VERSION=python, TORCH_VERSION=torch.__version__.split("+")[0])
    assert result.returncode == 0, result.stdout + result.stderr
    stack = json.loads((tmp_path / "stack.json").read_text())
    assert stack["differs"] == [] and stack["found"]["TORCH_VERSION"] == torch.__version__


def test_the_step_fails_strict_and_names_the_difference(tmp_path):
    result = _run_step(tmp_path, PYTHON_VERSION="2.7")
    assert result.returncode == 1
    assert "differ for: PYTHON_VERSION" in result.stdout and "PIN_CHECK=strict" in result.stderr
