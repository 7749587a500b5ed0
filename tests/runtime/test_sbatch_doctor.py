"""Generated job scripts are valid shell (bash -n, shellcheck); the doctor reports and enforces flavours."""

import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from runtime_helpers import ENTRYPOINT, clean_env

VARIANTS = [
    ("pyxis", ["--runtime", "pyxis", "--image", "nvcr.io#org/mds:24.05", "--mount", "/data:/data"]),
    ("apptainer", ["--runtime", "apptainer", "--image", "mds.sif", "--account", "proj", "--partition", "gpu"]),
    ("oci", ["--runtime", "oci", "--image", "/shared/mds bundle"]),
    ("none", ["--runtime", "none"]),
    ("lumi", ["--runtime", "apptainer", "--image", "mds-rocm.sif", "--profile", "lumi", "--partition", "standard-g"]),
    ("pbs polaris", ["--scheduler", "pbs", "--runtime", "apptainer", "--image", "mds.sif", "--profile", "polaris",
                     "-A", "MyProject", "-p", "debug"]),
    ("pbs host", ["--scheduler", "pbs", "--runtime", "none"]),
]
TRAIN = ["--", "train", "--num-layers", "2", "--data-path", "0.3 a", "--lr", "6e-4", "--save", "/ckpt dir/x"]


def _generate(tmp_path, name, flags):
    path = tmp_path / (name.replace(" ", "_") + ".sh")
    result = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "2", "--gpus-per-node", "8", *flags, "-o", str(path),
                             *TRAIN], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return path


@pytest.mark.parametrize("name, flags", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_generated_scripts_pass_bash_n_and_shellcheck(tmp_path, name, flags):
    path = _generate(tmp_path, name, flags)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck not found: install it (`make test` does, as root)")
    check = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    text = path.read_text()
    assert "'/ckpt dir/x'" in text and "'0.3 a'" in text  # flags survive quoting


def test_script_contents(tmp_path):
    pyxis = _generate(tmp_path, "pyxis", VARIANTS[0][1]).read_text()
    assert "#SBATCH --ntasks-per-node=8" in pyxis and "#SBATCH --gpus-per-node=8" in pyxis
    for word in ("--container-image=", "--container-mounts=", "--no-container-mount-home", "--kill-on-bad-exit=1"):
        assert word in pyxis
    lumi = _generate(tmp_path, "lumi", VARIANTS[4][1]).read_text()
    assert "--cpu-bind=mask_cpu:" in lumi and "0xfe000000000000,0xfe00000000000000" in lumi
    assert "--rocm" in lumi and '-B "/opt/cray"' in lumi and "export MDS_PROFILE=lumi" in lumi
    pbs = _generate(tmp_path, "pbs", VARIANTS[5][1]).read_text()
    assert "#PBS -l select=2" in pbs and "--ppn" in pbs and "mpiexec" in pbs and "--nv" in pbs


    oci = _generate(tmp_path, "oci", VARIANTS[2][1]).read_text()
    assert "--container='/shared/mds bundle'" in oci and "scripts/oci-bundle IMAGE BUNDLE" in oci
    assert "--container-image" not in oci and "CONTAINER_CMD" not in oci
    assert 'sh -c \'cd "$0" && exec "$@"\' "${WORKDIR}"' in oci  # the ranks start in the submit directory


@pytest.mark.parametrize("flags, names", [
    (["--runtime", "pyxis"], ["--runtime pyxis needs --image"]),
    (["--runtime", "oci"], ["--runtime oci needs --image", "OCI bundle directory", "scripts/oci-bundle"]),
    (["--runtime", "oci", "--image", "b", "--mount", "/data"], ["--mount with --runtime oci", "config.json"]),
], ids=["pyxis without image", "oci without bundle", "oci with --mount"])
def test_sbatch_usage_errors_exit_2(flags, names):
    result = subprocess.run([ENTRYPOINT, "sbatch", "--nodes", "1", "--gpus-per-node", "1", *flags, "--", "train"],
                            env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    for name in names:
        assert name in result.stderr


def _doctor(*flags, **env):
    start = time.monotonic()
    result = subprocess.run([ENTRYPOINT, "doctor", "--json", *flags], env=clean_env(**env), capture_output=True,
                            text=True, timeout=120)
    return result, json.loads(result.stdout), time.monotonic() - start


def test_doctor_cpu_flavour_passes_strict_and_is_fast(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"patches": [{"name": "msamp-fp8", "target": "MS-AMP", "applied": True}]}))
    result, report, elapsed = _doctor("--strict", "--flavour", "cpu", MDS_PATCH_MANIFEST=str(manifest))
    assert result.returncode == 0, report["failures"]
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("python", "torch", "deepspeed", "tokenizers", "tensorboard", "safetensors", "megatron_ds"):
        assert checks[name]["ok"] is True and checks[name]["required"], name
        assert checks[name]["version"]
    assert checks["torch"]["detail"].startswith("CPU matmul ok")
    assert checks["tensorboard"]["detail"] == "SummaryWriter wrote an event file"
    assert checks["safetensors"]["detail"] == "save and load round trip ok"
    assert checks["patch-manifest"]["ok"] is True and report["patch_manifest"]["patches"][0]["name"] == "msamp-fp8"
    assert checks["profile"]["version"] == "generic"
    # Budget: < 10 s on an idle 2-core machine (measured ~6-7 s); the bound here allows a loaded CI runner.
    assert elapsed < 30, f"doctor took {elapsed:.1f} s"


def test_doctor_strict_fails_on_the_wrong_platform_and_a_broken_manifest(tmp_path):
    import torch

    build = "rocm" if getattr(torch.version, "hip", None) else ("cuda" if torch.version.cuda else "cpu")
    flavour, missing = ("rocm", {"rocm", "rccl"}) if build == "cuda" else ("cuda", {"cuda", "nccl"})
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{not json")
    # Stand-ins for installed GPU packages: one broken (bad symbol), one that needs a GPU driver to import.
    fakes = tmp_path / "site"
    fakes.mkdir()
    (fakes / "apex.py").write_text('raise ImportError("apex_C.so: undefined symbol: _ZN3c10")\n')
    (fakes / "flash_attn.py").write_text('raise OSError("libcuda.so.1: cannot open shared object file")\n')
    # and a stack without tensorboard (--tensorboard-dir would fail): required, so strict names it
    (fakes / "tensorboard.py").write_text('raise ModuleNotFoundError("No module named tensorboard", '
                                           'name="tensorboard")\n')
    result, report, _ = _doctor("--strict", "--flavour", flavour, MDS_PATCH_MANIFEST=str(manifest),
                                PYTHONPATH=str(fakes))
    assert result.returncode == 1
    assert missing | {"patch-manifest", "apex", "tensorboard"} <= set(report["failures"])
    assert not {"torch", "deepspeed", "tokenizers"} & set(report["failures"])
    checks = {c["name"]: c for c in report["checks"]}
    if not report["gpus"]:
        assert checks["flash_attn"]["state"] == "unverified" and "flash_attn" not in report["failures"]
    assert checks["apex"]["state"] == "BROKEN" and "undefined symbol" in checks["apex"]["detail"]


OCI_BUNDLE = Path(__file__).resolve().parents[2] / "scripts" / "oci-bundle"


def _oci_bundle_module():
    loader = importlib.machinery.SourceFileLoader("oci_bundle", str(OCI_BUNDLE))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("oci_bundle", loader))
    loader.exec_module(module)
    return module


def test_oci_bundle_config_shares_the_hosts_network_and_binds_each_dir(tmp_path):
    """scripts/oci-bundle's config.json (the bundle `--runtime oci` runs): ranks on the host's network and host name,
    the devices of the host, each DIR at its own path; a DIR that does not exist exits 2 naming it."""
    script, module = OCI_BUNDLE, _oci_bundle_module()
    spec = module.config(["PATH=/usr/bin"], "/workspace", ["/shared/data", "/shared/ckpt"])
    assert {n["type"] for n in spec["linux"]["namespaces"]} == {"pid", "ipc", "mount"}  # no network, no uts
    assert "hostname" not in spec and spec["process"]["terminal"] is False
    assert spec["process"]["env"] == ["PATH=/usr/bin"] and spec["process"]["cwd"] == "/workspace"
    binds = {m["destination"]: m for m in spec["mounts"] if m["type"] == "bind"}
    for path in ("/shared/data", "/shared/ckpt", "/etc/hosts", "/etc/resolv.conf", "/dev"):
        assert binds[path]["source"] == path, path
    assert "rw" in binds["/shared/data"]["options"] and "ro" in binds["/etc/hosts"]["options"]
    missing = subprocess.run([str(script), "mds:latest", str(tmp_path / "b"), str(tmp_path / "nowhere")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and f"{tmp_path / 'nowhere'} is not a directory" in missing.stderr


def test_oci_bundle_makes_every_mount_point_inside_the_rootfs(tmp_path):
    """The mount points are made before any task runs (two tasks' runc would race to make them), each where the
    container sees it: an absolute link in the image (Debian's /var/run -> /run) leads within the rootfs, never
    to the host's directory of that name."""
    module = _oci_bundle_module()
    rootfs, host = tmp_path / "rootfs", tmp_path / "host"
    (rootfs / "run").mkdir(parents=True)
    (rootfs / "var").mkdir()
    (rootfs / "var" / "run").symlink_to("/run")
    (rootfs / "etc").mkdir()
    (rootfs / "shared").symlink_to(str(host))  # absolute, naming a host path: inside the image it is rootfs/<that>
    data = tmp_path / "data"
    data.mkdir()
    module.make_mount_points(rootfs, module.config([], "/", [str(data), str(host / "ckpt")]))
    assert (rootfs / "run" / "slurm").is_dir() and not (rootfs / "var" / "slurm").exists()
    assert (rootfs / "etc" / "hosts").is_file() and (rootfs / "etc" / "resolv.conf").is_file()
    for path in ("proc", "sys", "dev", "dev/shm", "tmp", "var/tmp", str(data).lstrip("/")):
        assert module.inside(rootfs, "/" + path).is_dir(), path
    assert not host.exists(), "a link in the image was followed on the host"
    assert (rootfs / str(host).lstrip("/") / "ckpt").is_dir()
