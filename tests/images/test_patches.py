"""patches/apply: series headers pinned to cuda/versions, real application to a real git tree (a small
upstream made here), idempotence, loud failure, and the manifest doctor reads."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .recipes import ROOT, read_pins

APPLY = ROOT / "patches" / "apply"


def load_apply():
    loader = importlib.machinery.SourceFileLoader("mds_patches_apply", str(APPLY))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def upstream(tmp_path):
    """A tiny upstream project at a commit, and a series against it (written as a real `git diff`)."""
    src = tmp_path / "upstream"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "device.py").write_text("def fp8_ok(name):\n    return 'h100' in name.lower()\n")
    (src / "pkg" / "other.py").write_text("VALUE = 1\n")
    git(src, "init", "-q")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "v1")
    commit = git(src, "rev-parse", "HEAD")
    (src / "pkg" / "device.py").write_text("def fp8_ok(capability):\n    return capability >= (8, 9)\n")
    diff1 = git(src, "diff")
    git(src, "checkout", "-q", "--", ".")
    (src / "pkg" / "other.py").write_text("VALUE = 2\n")
    diff2 = git(src, "diff")
    git(src, "checkout", "-q", "--", ".")

    patches = tmp_path / "patches"
    series_dir = patches / "demo"
    series_dir.mkdir(parents=True)
    header = f"Target: demo (https://example.invalid/demo)\nRef: v1 ({commit})\n"
    (series_dir / "0001-capability.patch").write_text(
        header + "Fixes: fp8_ok decides by name\nWhy: names lie\n---\n" + diff1 + "\n")
    (series_dir / "0002-value.patch").write_text(header + "Fixes: VALUE is 1\nWhy: it must be 2\n---\n" + diff2 + "\n")
    (series_dir / "series").write_text(
        f"# target: demo\n# upstream: https://example.invalid/demo\n# ref: v1\n# commit: {commit}\n"
        "0001-capability.patch\n0002-value.patch\n")
    return src, patches, commit


def run_apply(patches, *args, env=None):
    """The tool as a command, on a copy of the given patches directory (it resolves series next to itself)."""
    tool = patches / "apply"
    if not tool.exists():
        tool.write_text(APPLY.read_text())
    return subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))


def test_applies_in_order_then_second_run_changes_nothing(upstream, tmp_path):
    src, patches, commit = upstream
    manifest = tmp_path / "opt" / "patch-manifest.json"
    first = run_apply(patches, "demo", "--source", str(src), "--manifest", str(manifest))
    assert first.returncode == 0, first.stderr
    assert "0001-capability.patch: applied" in first.stdout and "0002-value.patch: applied" in first.stdout
    assert "capability >= (8, 9)" in (src / "pkg" / "device.py").read_text()
    assert (src / "pkg" / "other.py").read_text() == "VALUE = 2\n"
    before = {p: p.read_bytes() for p in src.rglob("*.py")}

    second = run_apply(patches, "demo", "--source", str(src), "--manifest", str(manifest))
    assert second.returncode == 0, second.stderr
    assert "nothing to do: every patch is already applied" in second.stdout
    assert {p: p.read_bytes() for p in src.rglob("*.py")} == before

    data = json.loads(manifest.read_text())
    assert [p["name"] for p in data["patches"]] == ["0001-capability.patch", "0002-value.patch"]
    for entry in data["patches"]:
        assert entry["target"] == "demo" and entry["ref"] == "v1" and entry["commit"] == commit
        assert entry["sha256"] == hashlib.sha256((patches / "demo" / entry["name"]).read_bytes()).hexdigest()
    assert data["patches"][0]["fixes"] == "fp8_ok decides by name"


def test_fails_loudly_naming_the_patch_that_does_not_apply(upstream):
    src, patches, _ = upstream
    (src / "pkg" / "other.py").write_text("VALUE = 3  # upstream moved on\n")
    result = run_apply(patches, "demo", "--source", str(src), "--manifest", str(src / "m.json"))
    assert result.returncode == 1
    assert "0002-value.patch does not apply" in result.stderr and "pkg/other.py" in result.stderr


def test_refuses_a_checkout_at_another_commit(upstream):
    src, patches, commit = upstream
    (src / "pkg" / "other.py").write_text("VALUE = 5\n")
    git(src, "commit", "-q", "-am", "v2")
    result = run_apply(patches, "demo", "--source", str(src), "--check")
    assert result.returncode == 1
    assert f"the series is pinned to v1 ({commit})" in result.stderr


def test_check_only_changes_nothing(upstream):
    src, patches, _ = upstream
    result = run_apply(patches, "demo", "--source", str(src), "--check")
    assert result.returncode == 0, result.stderr
    assert "applies cleanly (--check: not applied)" in result.stdout
    assert "'h100'" in (src / "pkg" / "device.py").read_text()


def test_patch_without_reason_is_rejected(upstream):
    src, patches, _ = upstream
    patch = patches / "demo" / "0002-value.patch"
    patch.write_text(patch.read_text().replace("Why: it must be 2\n", ""))
    result = run_apply(patches, "demo", "--source", str(src), "--check")
    assert result.returncode == 1 and "lacks a 'Why:' line" in result.stderr


def test_a_git_repository_around_the_source_is_not_used(upstream, tmp_path):
    """A non-git source inside some other checkout (a venv in a repo): paths must still be patched."""
    src, patches, _ = upstream
    outer = tmp_path / "outer"
    inner = outer / "site-packages"
    inner.mkdir(parents=True)
    git(outer, "init", "-q")
    (inner / "pkg").mkdir()
    for name in ("device.py", "other.py"):
        (inner / "pkg" / name).write_text((src / "pkg" / name).read_text())
    result = run_apply(patches, "demo", "--source", str(inner), "--manifest", str(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    assert "not a git checkout: cannot verify" in result.stdout
    assert (inner / "pkg" / "other.py").read_text() == "VALUE = 2\n"


def test_no_target_writes_an_empty_manifest(tmp_path):
    manifest = tmp_path / "patch-manifest.json"
    result = subprocess.run([sys.executable, str(APPLY), "--manifest", str(manifest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(manifest.read_text()) == {"schema": 1, "patches": []}


def test_repository_series_are_well_formed_and_pinned():
    apply = load_apply()
    series = sorted(p.parent.name for p in (ROOT / "patches").glob("*/series"))
    assert "msamp" in series
    for target in series:
        header, paths = apply.read_series(target)  # raises on any malformed header or patch
        assert paths, f"patches/{target}: empty series"
    pins = read_pins("cuda/versions")
    header, _ = apply.read_series("msamp")
    assert (header["upstream"], header["ref"], header["commit"]) == \
        (pins["MSAMP_REPO"], pins["MSAMP_REF"], pins["MSAMP_COMMIT"])
    header, _ = apply.read_series("deepspeed")
    for pin_file in ("cuda/versions", "rocm/versions"):
        version = read_pins(pin_file)["DEEPSPEED_VERSION"]
        assert (header["ref"], header["commit"]) == (version, f"pypi:deepspeed=={version}"), pin_file


def test_deepspeed_series_is_applied_to_the_installed_release():
    """The pinned DeepSpeed is the one in this environment, patched by `make setup` as the images patch theirs:
    every patch of the series is found applied (that the series applies to the pristine release is checked by
    tests/images/test_deepspeed_patches.py, which reverses and reapplies it)."""
    import deepspeed

    apply = load_apply()
    header, _ = apply.read_series("deepspeed")
    assert deepspeed.__version__ == header["ref"], \
        f"DeepSpeed {deepspeed.__version__} installed here, the series is pinned to {header['ref']}: run make setup"
    result = subprocess.run([sys.executable, str(APPLY), "deepspeed", "--installed", "deepspeed", "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"deepspeed {header['ref']} is installed" in result.stdout
    assert result.stdout.count("already applied") == len(apply.read_series("deepspeed")[1]), result.stdout


def test_repository_patches_hold_no_upstream_files():
    """Our patches are diffs: no patch creates a whole upstream file (new files would be copies)."""
    for patch in (ROOT / "patches").glob("*/*.patch"):
        assert "new file mode" not in patch.read_text(), f"{patch}: adds a whole file"


@pytest.mark.upstream_src
def test_msamp_series_applies_to_pinned_upstream():
    """`git apply --check` of patches/msamp against MS-AMP v0.4.0 (MDS_MSAMP_SRC=/path/to/MS-AMP at 51f34acd...).
    CI has no GitHub access, so this runs only when asked: `pytest -m upstream_src tests/images`."""
    source = os.environ.get("MDS_MSAMP_SRC")
    assert source, "set MDS_MSAMP_SRC to a checkout of Azure/MS-AMP at v0.4.0 (51f34acd...)"
    result = subprocess.run([sys.executable, str(APPLY), "msamp", "--source", source, "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applies cleanly" in result.stdout or "already applied" in result.stdout
    assert Path(source, "msamp/common/utils/device.py").exists()
