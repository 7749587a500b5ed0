"""Transformer Engine for a GPU machine that lacks it, carried in parts that each fit one call's 64 MiB.

    python bench/te_carry.py fetch                    # here: TE's wheels into .te/, the core wheel cut in parts
    cp .te/p1/* /tmp/te/  ...                         # there: one call per part (carry .te/pN), back to back
    bash bench/device.sh te STAGE...                  # there: carry the last part(s); the `te` stage installs

The core wheel (transformer-engine-cu13, 276 MB) is split into parts of PART_BYTES; the last part holds the small
wheels, the torch extension's sdist (built there against the machine's torch, ~110 s on 16 cores, unless a wheel
built earlier is given with --torch-wheel) and manifest.json (the parts, the core wheel's sha256, the version).
`install` joins the parts found in /tmp/te, checks the sha256, unpacks every wheel into one folder (SITE: the
wheels share the transformer_engine package) and leaves a copy of a freshly built extension wheel in $OUT, to be
carried next time. Nothing of TE is committed: .te/ is git-ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERSION = "2.20.2"
CORE = "transformer-engine-cu13"
SMALL_WHEELS = (f"transformer-engine=={VERSION}", "pybind11==3.1.0")  # pydantic and its needs come in .whl/
TORCH_SDIST = f"transformer-engine-torch=={VERSION}"
PART_BYTES = 50_000_000
DEST = REPO / ".te"
PARTS_THERE = Path(os.environ.get("MDS_TE_PARTS", "/tmp/te"))  # where the parts were copied, there
SITE = Path(os.environ.get("MDS_TE_SITE", "/tmp/te/site"))  # the unpacked wheels, there (device.sh's PYTHONPATH)
WHEEL_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_17_x86_64"]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(dest: Path, *requirements: str, binary: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    subprocess.run(cmd + (WHEEL_TARGET if binary else []) + list(requirements), check=True)


def fetch(a: argparse.Namespace) -> int:
    """Here: the wheels, the core cut in parts, the last part with the rest and the manifest."""
    download = a.dest / "download"
    shutil.rmtree(a.dest, ignore_errors=True)
    download.mkdir(parents=True)
    pip_download(download, f"{CORE}=={VERSION}", *SMALL_WHEELS)
    pip_download(download, TORCH_SDIST, binary=False)
    core = next(download.glob("transformer_engine_cu13-*.whl"))
    data = core.read_bytes()
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    last = a.dest / f"p{len(parts) + 1}"
    last.mkdir()
    for i, chunk in enumerate(parts, 1):
        (a.dest / f"p{i}").mkdir()
        (a.dest / f"p{i}" / f"core.part{i}").write_bytes(chunk)
    for small in download.iterdir():
        if small != core:
            shutil.move(str(small), last / small.name)
    if a.torch_wheel:
        shutil.copy2(a.torch_wheel, last / a.torch_wheel.name)
    manifest = {"version": VERSION, "core": core.name, "sha256": hashlib.sha256(data).hexdigest(),
                "parts": [f"core.part{i}" for i in range(1, len(parts) + 1)]}
    (last / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(download)
    for folder in sorted(a.dest.iterdir()):
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{size / 2**20:7.1f} MiB  {folder.relative_to(REPO)}")
    print(f"then, there: {len(parts)} calls copying .te/pN/* to {PARTS_THERE}, and `bench/device.sh te ...` "
          f"carrying {last.relative_to(REPO)}")
    return 0


def last_part(dest: Path) -> Path:
    found = sorted(dest.glob("p*/manifest.json"))
    if not found:
        raise SystemExit(f"te_carry: no manifest.json under {dest}/p*: carry the last part made by `fetch`")
    return found[-1].parent


def join_core(manifest: dict, dest: Path) -> Path:
    """The core wheel from its parts in PARTS_THERE (or carried in this call under ``dest``), its sha256 checked."""
    core = PARTS_THERE / manifest["core"]
    if core.exists() and sha256(core) == manifest["sha256"]:
        return core
    with core.open("wb") as out:
        for name in manifest["parts"]:
            part = next((p for p in [PARTS_THERE / name, *dest.glob(f"p*/{name}")] if p.exists()), None)
            if part is None:
                raise SystemExit(f"te_carry: {name} is missing from {PARTS_THERE}: copy each .te/pN/* there first "
                                 "(one call per part, back to back: the machine keeps /tmp while warm)")
            out.write(part.read_bytes())
    if sha256(core) != manifest["sha256"]:
        raise SystemExit(f"te_carry: {core} does not match its sha256: a part was cut short; copy the parts again")
    return core


def build_torch_extension(folder: Path, built: Path) -> Path:
    """transformer_engine_torch against this machine's torch (Hopper only, every core)."""
    sdist = next(folder.glob("transformer_engine_torch-*.tar.gz"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
               NVTE_FRAMEWORK="pytorch", NVTE_PYTORCH_FORCE_BUILD="TRUE", NVTE_CUDA_ARCHS="90",
               MAX_JOBS=str(os.cpu_count() or 8))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "-w", str(built), str(sdist)], env=env, check=True)
    return next(built.glob("transformer_engine_torch-*.whl"))


def install(a: argparse.Namespace) -> int:
    """There: join, check, unpack; build the torch extension unless a built wheel came along."""
    folder = last_part(a.dest)
    manifest = json.loads((folder / "manifest.json").read_text())
    SITE.mkdir(parents=True, exist_ok=True)
    ready = SITE / ".mds_te_ready"
    if not (ready.exists() and ready.read_text() == manifest["sha256"]):
        with zipfile.ZipFile(join_core(manifest, a.dest)) as whl:
            whl.extractall(SITE)
        for small in folder.glob("*.whl"):
            if not small.name.startswith("transformer_engine_torch-"):
                with zipfile.ZipFile(small) as whl:
                    whl.extractall(SITE)
        extension = next(folder.glob("transformer_engine_torch-*.whl"), None)
        if extension is None:
            extension = build_torch_extension(folder, PARTS_THERE / "built")
            if os.environ.get("OUT"):
                shutil.copy2(extension, Path(os.environ["OUT"]) / extension.name)
        with zipfile.ZipFile(extension) as whl:
            whl.extractall(SITE)
        ready.write_text(manifest["sha256"])
    probe = "import transformer_engine, transformer_engine.pytorch; print(transformer_engine.__version__)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"te_carry: Transformer Engine does not import from {SITE} (above)")
    print(f"transformer_engine {out.stdout.strip()} ready in {SITE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="te_carry.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="here: download and cut")
    f.add_argument("--dest", type=Path, default=DEST)
    f.add_argument("--torch-wheel", type=Path, help="a transformer_engine_torch wheel built there earlier")
    i = sub.add_parser("install", help="there: join, check, unpack, build")
    i.add_argument("--dest", type=Path, default=DEST)
    a = p.parse_args(argv)
    return fetch(a) if a.command == "fetch" else install(a)


if __name__ == "__main__":
    sys.exit(main())
