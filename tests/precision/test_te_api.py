"""Every Transformer Engine name and keyword argument megatron_ds uses (fp8_te.TE_API) exists in the sources of
the TE version the NGC image pins (cuda/versions TE_VERSION), read statically: TE does not install on a CPU.

The pure-Python wheel comes from the package index into .cache/fp8-sources (as `make oldest-stack-sources`
fetches DeepSpeed 0.13.1); MDS_TE_SRC=<dir containing transformer_engine/> uses a checkout instead.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_ds.precision.fp8_te import TE_API

ROOT = Path(__file__).resolve().parents[2]


def pinned_te_version() -> str:
    for line in (ROOT / "cuda" / "versions").read_text().splitlines():
        if line.startswith("TE_VERSION="):
            version = line.split("=", 1)[1].strip()
            return version if version.count(".") >= 2 else version + ".0"
    raise AssertionError("cuda/versions has no TE_VERSION")


@pytest.fixture(scope="module")
def te_source() -> Path:
    if os.environ.get("MDS_TE_SRC"):
        return Path(os.environ["MDS_TE_SRC"])
    version = pinned_te_version()
    dest = ROOT / ".cache" / "fp8-sources" / f"transformer_engine-{version}"
    if not (dest / "transformer_engine" / "pytorch" / "__init__.py").is_file():
        wheels = dest.parent / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        fetch = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                                f"transformer-engine=={version}", "-d", str(wheels)],
                               capture_output=True, text=True, timeout=300)
        found = sorted(wheels.glob(f"transformer_engine-{version}-*.whl"))
        if not found:
            pytest.fail(f"Transformer Engine {version}'s source is not at hand and could not be fetched "
                        f"(pip download transformer-engine=={version}): {fetch.stderr[-500:]}")
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(dest, [n for n in wheel.namelist() if n.startswith("transformer_engine/")])
    return dest


def definitions(package: Path) -> dict[str, ast.AST]:
    """Every top-level class and function defined in the package's modules (not its subpackages' __init__)."""
    found: dict[str, ast.AST] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.setdefault(node.name, node)
    return found


def accepted_names(node: ast.AST) -> set[str]:
    """A function's parameters; a class's __init__ parameters, annotated fields (dataclass) and members (enum)."""
    if isinstance(node, ast.FunctionDef):
        a = node.args
        return {arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs}
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            names |= accepted_names(item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return names


def exported(init: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
    return names


def test_every_te_name_and_keyword_we_use_exists_in_the_pinned_version(te_source):
    assert TE_API, "fp8_te.TE_API lists what megatron_ds uses"
    for module, attributes in TE_API.items():
        package = te_source / Path(*module.split("."))
        init = package / "__init__.py"
        assert init.is_file(), f"{module} is not a package in {te_source}"
        public = exported(init)
        defined = definitions(package)
        for attribute, keywords in attributes.items():
            assert attribute in public, f"{module}.{attribute} is not exported by TE {pinned_te_version()}"
            assert attribute in defined, f"{module}.{attribute}: no definition found"
            missing = set(keywords) - accepted_names(defined[attribute])
            assert not missing, f"{module}.{attribute} does not take {sorted(missing)} in TE {pinned_te_version()}"
