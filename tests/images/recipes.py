"""Readers for the image recipes, shared by the image tests: pin files, Dockerfile ARGs, definition files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from megatron_ds.image_flavours import FLAVOURS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {flavour.recipe: flavour.pins for flavour in FLAVOURS.values()}  # recipe -> its pin file
DEFINITIONS = {"apptainer/mds.def": None, "apptainer/lumi.def": "rocm/versions"}
# build arguments that are not versions: our own metadata and switches
NOT_PINS = {"MDS_VERSION", "MDS_SOURCE", "MDS_REVISION", "PATCH_TARGETS", "PIN_CHECK", "IMAGE", "MDS_IMAGE_FLAVOUR"}
STEP_SCRIPTS = sorted((ROOT / "docker" / "steps").glob("*.sh"))
CPU_TEST_IMAGE = "mds:cpu-test"  # the default recipe on the CPU base, built once per session (conftest.cpu_image)
BUILD_TIMEOUT_S = 1500


def make(docker: str, *targets_and_vars: str, timeout: float = BUILD_TIMEOUT_S, cwd: Path = ROOT) -> tuple[int, str]:
    """Run make with the given targets and VAR=value pairs and the docker client; (exit code, its output)."""
    result = subprocess.run(["make", "--no-print-directory", *targets_and_vars, f"DOCKER={docker}"], cwd=cwd,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def read_pins(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines of a pin file; comments and blank lines ignored, anything else is an error."""
    pins: dict[str, str] = {}
    for number, line in enumerate((ROOT / path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(\S+)", line)
        assert match, f"{path}:{number}: not KEY=VALUE (no spaces, no quotes): {line!r}"
        assert match[1] not in pins, f"{path}:{number}: {match[1]} pinned twice"
        pins[match[1]] = match[2]
    return pins


def dockerfile_instructions(path: str | Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = (ROOT / path).read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, f"{path}: ends inside a continued line"
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "") for parts in
            (line.strip().split(None, 1) for line in logical)]


def dockerfile_args(path: str | Path) -> dict[str, str | None]:
    """ARG name -> default (None when declared without one); first declaration with a default wins."""
    args: dict[str, str | None] = {}
    for instruction, rest in dockerfile_instructions(path):
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            if args.get(name) is None:
                args[name] = default if "=" in rest else None
    return args


def definition_sections(path: str | Path) -> dict[str, str]:
    """%section -> body of an Apptainer definition file (the header under the key 'header')."""
    sections, name, body = {}, "header", []
    for line in (ROOT / path).read_text().splitlines():
        match = re.match(r"^%(\w+)\s*$", line)
        if match:
            sections[name] = "\n".join(body).strip("\n")
            name, body = match[1], []
        else:
            body.append(line)
    sections[name] = "\n".join(body).strip("\n")
    return sections


def definition_arguments(path: str | Path) -> dict[str, str]:
    body = definition_sections(path).get("arguments", "")
    return dict(line.strip().split("=", 1) for line in body.splitlines() if line.strip())
