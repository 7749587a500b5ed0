import ctypes.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import ENTRYPOINT, clean_env

from megatron_ds.runtime import profiles
from megatron_ds.runtime.sbatch import cpu_masks

NVIDIA_H100 = "Model: \t\t NVIDIA H100 80GB HBM3\n"

# (name, files under the fake root {path: content or None for a directory}, env, hostname, expected profile)
DETECT = [
    ("bare machine", {}, {}, "laptop", "generic"),
    ("amd gpu", {"dev/kfd": ""}, {}, "box", "generic-rocm"),
    ("infiniband", {"sys/class/infiniband/mlx5_0": None}, {}, "dgx01", "dgx-ib"),
    ("azure ndv5", {"sys/class/dmi/id/sys_vendor": "Microsoft Corporation\n", "sys/class/infiniband/mlx5_ib0": None,
                    "proc/driver/nvidia/gpus/0000:00:01.0/information": NVIDIA_H100}, {}, "nd-vm", "azure-ndv5"),
    ("azure without IB", {"sys/class/dmi/id/sys_vendor": "Microsoft Corporation\n"}, {}, "vm", "generic"),
    ("aws efa", {"sys/class/dmi/id/sys_vendor": "Amazon EC2\n", "opt/amazon/efa": None}, {}, "ip-10-0-0-1", "aws-efa"),
    ("aws without efa", {"sys/class/dmi/id/sys_vendor": "Amazon EC2\n"}, {}, "ip-10-0-0-1", "generic"),
    ("cray slingshot", {"sys/class/net/hsn0": None, "opt/cray": None}, {}, "nid001234", "cray-slingshot"),
    ("slingshot NIC without Cray stack", {"sys/class/net/hsn0": None}, {}, "node1", "generic"),
    ("polaris compute host", {}, {}, "x3005c0s13b0n0", "polaris"),
    ("polaris beats cray slingshot", {"sys/class/net/hsn0": None, "opt/cray": None}, {}, "x3005c0s13b0n0", "polaris"),
    ("polaris via PBS", {}, {"PBS_O_HOST": "polaris-login-02.hsn.cm.polaris.alcf.anl.gov"}, "x", "polaris"),
    ("lumi", {"dev/kfd": ""}, {"SLURM_CLUSTER_NAME": "lumi"}, "nid005000", "lumi"),
    ("lumi beats plain IB", {"sys/class/infiniband/mlx5_0": None}, {"LUMI_STACK_NAME": "LUMI"}, "uan01", "lumi"),
    ("other slurm cluster", {}, {"SLURM_CLUSTER_NAME": "lumix"}, "nid005000", "generic"),
]


def _fake_root(tmp_path: Path, files: dict) -> str:
    for rel, content in files.items():
        path = tmp_path / rel
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    return str(tmp_path)


@pytest.mark.parametrize("name, files, env, host, expected", DETECT, ids=[d[0] for d in DETECT])
def test_detect(tmp_path, name, files, env, host, expected):
    assert profiles.detect(env, hostname=host, root=_fake_root(tmp_path, files)).name == expected


def test_every_profile_cites_its_source():
    found = profiles.all_profiles({})
    assert {"generic", "dgx-ib", "azure-ndv5", "aws-efa", "polaris", "lumi"} <= set(found)
    for profile in found.values():
        text = Path(profile.path).read_text()
        assert "Source" in text and "http" in text, f"{profile.path} does not cite a public source"
        assert profile.description


def test_lumi_cpu_map_matches_the_documented_masks():
    lumi = profiles.get_profile("lumi", {})
    assert [profiles.format_cpus(c) for c in lumi.cpus_by_local_rank] == [
        "49-55", "57-63", "17-23", "25-31", "1-7", "9-15", "33-39", "41-47"]
    c = "fe"  # LUMI's documented srun --cpu-bind=mask_cpu list for 8 GCDs
    documented = [f"0x{c}000000000000", f"0x{c}00000000000000", f"0x{c}0000", f"0x{c}000000", f"0x{c}", f"0x{c}00",
                  f"0x{c}00000000", f"0x{c}0000000000"]
    assert cpu_masks(lumi.cpus_by_local_rank) == ",".join(documented)


def test_user_values_win_and_reasons_are_given():
    azure = profiles.get_profile("azure-ndv5", {})
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    decided = {s.name: s for s in profiles.apply(azure, env)}
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and not decided["NCCL_SOCKET_IFNAME"].applied
    assert "user" in decided["NCCL_SOCKET_IFNAME"].why
    assert env["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml" and env["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert env["MDS_PROFILE"] == "azure-ndv5"


def test_cuda_ranks_get_growable_allocator_segments_unless_the_user_chose():
    """Every CUDA profile sets PYTORCH_CUDA_ALLOC_CONF (GPT-1.3B's default run at micro batch 16 fits an 80 GB card
    only with it); the launched command sees it, and a user's own allocator settings are kept."""
    cuda = [p for p in profiles.all_profiles({}).values() if p.platform == "cuda"]
    assert len(cuda) >= 5
    assert all(p.env.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True" for p in cuda), \
        [p.name for p in cuda if p.env.get("PYTORCH_CUDA_ALLOC_CONF") != "expandable_segments:True"]
    cmd = [ENTRYPOINT, "launch", "--profile", "generic", "--", "sh", "-c", 'echo "ALLOC=$PYTORCH_CUDA_ALLOC_CONF"']
    env = clean_env()
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    ours = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and "ALLOC=expandable_segments:True" in ours.stdout, ours.stderr
    theirs = subprocess.run(cmd, env=clean_env(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128"), capture_output=True,
                            text=True, timeout=60)
    assert theirs.returncode == 0 and "ALLOC=max_split_size_mb:128" in theirs.stdout, theirs.stderr


def _write_profile(directory: Path, name: str, body: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.ini").write_text("# test profile. Source: http://example.invalid\n" + body)


def test_plugin_found_in_ld_library_path(tmp_path):
    libdir = tmp_path / "lib"
    libdir.mkdir()
    real = ctypes.util.find_library("m")
    source = next(p for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
                              "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu") if (p := Path(d) / real).exists())
    shutil.copy(source, libdir / "libnccl-net-test.so")
    _write_profile(tmp_path / "profiles", "needs-plugin",
                   "[profile]\ndescription = t\n[libraries]\nplugin = libnccl-net-test.so\n")
    profile = profiles.get_profile("needs-plugin", {"MDS_PROFILE_PATH": str(tmp_path / "profiles")})
    [found] = profiles.check_libraries(profile, {"LD_LIBRARY_PATH": str(libdir)})
    assert found.loaded == str(libdir / "libnccl-net-test.so")
    [missing] = profiles.check_libraries(profile, {})
    assert missing.loaded is None and missing.errors


def test_missing_plugin_warns_loudly_or_fails_with_strict(tmp_path):
    _write_profile(tmp_path, "slingshot-test",
                   "[profile]\ndescription = t\n[env]\nNCCL_NET = AWS Libfabric\n"
                   "[libraries]\nlibfabric NCCL plugin = libnccl-net-absent-xyz.so\n")
    env = clean_env(MDS_PROFILE_PATH=str(tmp_path))
    cmd = [ENTRYPOINT, "launch", "--profile", "slingshot-test", "--", "sh", "-c", 'echo "NET=$NCCL_NET"']
    loose = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert loose.returncode == 0 and "NET=AWS Libfabric" in loose.stdout
    assert "WARNING" in loose.stderr and "libnccl-net-absent-xyz.so" in loose.stderr and "TCP" in loose.stderr
    strict = subprocess.run(cmd[:2] + ["--strict"] + cmd[2:], env=env, capture_output=True, text=True, timeout=60)
    assert strict.returncode == 2 and "libnccl-net-absent-xyz.so" in strict.stderr and "NET=" not in strict.stdout


def test_unknown_profile_is_a_usage_error():
    result = subprocess.run([ENTRYPOINT, "env", "--profile", "nope"], env=clean_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "'nope'" in result.stderr and "lumi" in result.stderr


def test_env_command_explains_every_variable():
    env = clean_env(SLURM_CLUSTER_NAME="lumi", NCCL_SOCKET_IFNAME="eth7")
    result = subprocess.run([ENTRYPOINT, "env", "--format", "shell"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = {line.split("=", 1)[0][len("export "):]: line for line in result.stdout.splitlines()
             if line.startswith("export ")}
    assert "set by the user" in lines["NCCL_SOCKET_IFNAME"] and "eth7" in lines["NCCL_SOCKET_IFNAME"]
    assert "profile lumi" in lines["NCCL_NET_GDR_LEVEL"]
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MDS_PROFILE"} <= set(lines)
    assert all("  # " in line for line in lines.values())
    evaluated = subprocess.run(["bash", "-c", result.stdout + "\necho $NCCL_SOCKET_IFNAME $MDS_PROFILE"],
                               capture_output=True, text=True)
    assert evaluated.stdout.strip() == "eth7 lumi"


def test_spawned_ranks_are_bound_to_the_profile_cpu_map(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail("this test needs 2 CPUs (CI has 2)")
    _write_profile(tmp_path / "profiles", "two-cores", "[profile]\ndescription = t\n[affinity]\n"
                   f"cpus = {cpus[0]} {cpus[1]}\n")
    out = tmp_path / "out"
    out.mkdir()
    env = clean_env(MDS_PROFILE_PATH=str(tmp_path / "profiles"))
    script = ("import os, sys; open(sys.argv[1] + '/' + os.environ['RANK'], 'w')"
              ".write(repr(sorted(os.sched_getaffinity(0))))")
    result = subprocess.run([ENTRYPOINT, "launch", "--profile", "two-cores", "--nproc-per-node", "2", "--", "python3",
                             "-c", script, str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (out / "0").read_text() == f"[{cpus[0]}]" and (out / "1").read_text() == f"[{cpus[1]}]"


@pytest.mark.slow
def test_installed_package_finds_the_profiles(tmp_path):
    """A non-editable install (wheel) carries the profiles as data files under <prefix>/share/mds."""
    import sys

    repo = Path(__file__).resolve().parents[2]
    source = tmp_path / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "entrypoint.py"):
        shutil.copy(repo / name, source / name)
    for name in ("megatron_ds", "cuda", "rocm"):
        shutil.copytree(repo / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), "-q"], capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [whl] = (tmp_path / "dist").glob("*.whl")
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                              str(whl)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    probe = ("from megatron_ds.runtime import profiles; ps = profiles.all_profiles(); "
             "import json; print(json.dumps(sorted(ps))); print(ps['lumi'].path)")
    result = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            env=clean_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    names, lumi_path = result.stdout.splitlines()
    assert {"generic", "dgx-ib", "azure-ndv5", "aws-efa", "polaris", "lumi"} <= set(json.loads(names))
    assert lumi_path.startswith(str(venv / "share" / "mds"))


def test_compile_cache_defaults_to_home_and_the_users_value_wins(tmp_path):
    """torch.compile's kernels go where a restarted or resubmitted job finds them: ~/.cache/mds/torch-compile
    (home outlives the job and is shared across a cluster's nodes), unless the user chose TORCHINDUCTOR_CACHE_DIR."""
    from megatron_ds.runtime import profiles

    generic = profiles.get_profile("generic", env={})
    env = {"HOME": str(tmp_path)}
    decided = {s.name: s for s in profiles.apply(generic, env)}
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache" / "mds" / "torch-compile")
    assert decided["TORCHINDUCTOR_CACHE_DIR"].applied and "kept across jobs" in decided["TORCHINDUCTOR_CACHE_DIR"].why
    mine = {"HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": "/shared/cache"}
    decided = {s.name: s for s in profiles.apply(generic, mine)}
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/shared/cache" and not decided["TORCHINDUCTOR_CACHE_DIR"].applied
