"""Every Transformer Engine name and keyword argument megatron_ds uses (fp8_te.TE_API) exists in the sources of
the TE version the NGC image pins (cuda/versions TE_VERSION), read statically: TE does not install on a CPU.

The pure-Python wheel comes from the package index into .cache/fp8-sources (as `make oldest-stack-sources`
fetches DeepSpeed 0.13.1); MDS_TE_SRC=<dir containing transformer_engine/> uses a checkout instead.

The MS-AMP image has its own, older TE (cuda/versions MSAMP_TE_REF, v1.1), and the TE engine runs there too: the
upstream_src tests check the same names against a checkout of that tag (MDS_MSAMP_TE_SRC=<NVIDIA/TransformerEngine
at v1.1>; CI cannot fetch it): `pytest -m upstream_src tests/precision`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from fp8_sources import SourceTree, accepted_names, takes_any_keyword

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


# ------------------------------------------------------------------ the MS-AMP image's TE (upstream_src)

def msamp_te_ref() -> str:
    for line in (ROOT / "cuda" / "versions").read_text().splitlines():
        if line.startswith("MSAMP_TE_REF="):
            return line.split("=", 1)[1].strip()
    raise AssertionError("cuda/versions has no MSAMP_TE_REF")


@pytest.fixture(scope="module")
def msamp_te_source() -> SourceTree:
    ref = msamp_te_ref()
    source = os.environ.get("MDS_MSAMP_TE_SRC")
    assert source, f"set MDS_MSAMP_TE_SRC to a checkout of NVIDIA/TransformerEngine at {ref} (the MS-AMP image's TE)"
    root = Path(source)
    version = (root / "VERSION").read_text().strip() if (root / "VERSION").is_file() else "?"
    assert version.startswith(ref.lstrip("v") + "."), f"{root} is TE {version}, not {ref}"
    return SourceTree(root)


@pytest.mark.upstream_src
def test_every_te_name_and_keyword_we_use_exists_in_the_msamp_images_te(msamp_te_source):
    ref = msamp_te_ref()
    for module, attributes in TE_API.items():
        # TE 1.1: transformer_engine/common/recipe.py (a module); later: a package
        assert msamp_te_source.module_file(module), f"{module} does not exist in TE {ref}"
        public = msamp_te_source.exported(module)
        for attribute, keywords in attributes.items():
            assert attribute in public, f"{module}.{attribute} is not exported by TE {ref}"
            node = msamp_te_source.find(f"{module}:{attribute}")
            assert node is not None, f"{module}.{attribute}: no definition found in TE {ref}"
            missing = set(keywords) - accepted_names(node)
            assert not missing or takes_any_keyword(node), (f"{module}.{attribute} does not take "
                                                            f"{sorted(missing)} in TE {ref}")


@pytest.mark.upstream_src
def test_msamp_images_te_keeps_fp8_state_in_extra_state_and_uses_our_weight(msamp_te_source):
    """What fp8_te.py relies on beyond names, in TE 1.1: the FP8 scales and amax history are the module's extra
    state (a pickled BytesIO there, a uint8 tensor in later versions: shards.py leaves it out of exports), and
    te.Linear's forward reads ``self.weight`` when no parameters_split is given (so the Parameter we assign is
    the one multiplied)."""
    import ast

    base = msamp_te_source.find("transformer_engine.pytorch.module.base:TransformerEngineBaseModule")
    get_extra = next(n for n in base.body if isinstance(n, ast.FunctionDef) and n.name == "get_extra_state")
    text = ast.unparse(get_extra)
    assert "amax_history_fwd" in text and "scale_fwd" in text and "BytesIO" in text
    forward = msamp_te_source.find("transformer_engine.pytorch.module.linear:Linear.forward")
    assert "self.weight if self.parameters_split is None" in ast.unparse(forward)
