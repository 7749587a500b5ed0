"""Helpers for the runtime tests: a clean environment, the rank probe, and a real local Slurm.

The Slurm fixture starts munged, slurmctld and slurmd (Debian's slurm-wlm and munge, as root, no
cgroups: proctrack/linuxproc, task/none) on private ports with a private slurm.conf naming this
machine, and stops them at the end. When they cannot start, the tests fail with the daemons' logs:
they are never skipped (`make test` installs the packages when missing: scripts/setup-test-system.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PROBE = HERE / "probe.py"
BIN = Path(sys.executable).parent
ENTRYPOINT = str(BIN / "entrypoint")

# Variables of any launcher: the tests build their own and must not inherit the outer job's.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "PALS_", "FLUX_", "MPI_LOCAL", "TORCHELASTIC_", "MDS_",
                      "PBS_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES",
                   "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests: no GPU ranks even on a GPU machine
    env.update(extra)
    return env


def read_ranks(out_dir: Path, expected: int) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == expected, f"expected {expected} rank reports in {out_dir}, found {[f.name for f in files]}"
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


def assert_two_ranks(out_dir: Path, master: str | None = None) -> list[dict]:
    """Ranks 0 and 1 of world 2 ran, agreed on the master, and all_reduce summed 1 + 2."""
    ranks = read_ranks(out_dir, 2)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["world_size"] for r in ranks} == {2}
    assert {r["master_addr"] for r in ranks} == {master or ranks[0]["master_addr"]}
    assert len({r["master_port"] for r in ranks}) == 1
    assert [r["allreduce_sum"] for r in ranks] == [3.0, 3.0]
    return ranks


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Slurm:
    """A one-node cluster in `root`. `enter` prefixes every daemon and command (Slurm24: another root's Slurm)."""

    name = "mdstest"
    enter: list[str] = []
    # A job's ranks take MASTER_PORT from its job id: clusters running side by side (two pytest-xdist workers) number
    # their jobs from different bases, so their jobs' ports differ.
    first_job_id = 1

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.hostname = socket.gethostname().split(".")[0]

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(SLURM_CONF=str(self.conf), **extra)

    def run(self, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm command (srun, sbatch, scontrol...) against this cluster; `env` extends the cluster's."""
        env = self.env(**kw.pop("env", {}))
        return subprocess.run([*self.enter, *argv], env=env, capture_output=True, text=True, timeout=timeout, **kw)

    def logs(self) -> str:
        text = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "daemons.out"):
            path = self.root / name
            if path.exists():
                text.append(f"--- {name}\n{path.read_text()[-3000:]}")
        return "\n".join(text)

    def _start(self, argv: list[str]) -> None:
        out = open(self.root / "daemons.out", "ab")
        # in the cluster's directory: whatever a daemon leaves in its working directory (a core file) stays there
        self.procs.append(subprocess.Popen([*self.enter, *argv], env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                           cwd=self.root, start_new_session=True))

    def start(self) -> None:
        for tool in ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo"):
            if not self.enter and not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
                pytest.fail(f"{tool} not found: install slurm-wlm and munge (`make test` does, as root)")
        if os.geteuid() != 0:
            pytest.fail("the local Slurm needs root (slurmd runs as root): run the tests as root (CI does)")
        r = self.root
        r.chmod(0o700)
        (r / "state").mkdir()
        (r / "spool").mkdir()
        key = r / "munge.key"
        subprocess.run([*self.enter, "mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        sock = r / "munge.sock"
        self._start(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}", f"--log-file={r}/munged.log",
                     f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed"])
        cpus = max(4, os.cpu_count() or 1)
        self.conf.write_text("\n".join([
            f"ClusterName={self.name}", f"FirstJobId={self.first_job_id}", f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # CPUs below may exceed the real count (oversubscribe)
            "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "KillWait=5", "InactiveLimit=0",
            f"NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP", ""]))
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._start(["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._start(["slurmd", "-D", "-f", str(self.conf)])
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            result = self.run(["sinfo", "-h", "-o", "%T"])
            state = result.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"local Slurm did not come up (node state {state!r}):\n{self.logs()}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


REPO = HERE.parents[1]
SLURM24_ROOT = REPO / ".cache" / "slurm24-root"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the image's PATH, and the root's


def write_oci_conf(cluster: Slurm) -> None:
    """oci.conf beside slurm.conf (Slurm reads it at each step): run the bundle with runc, its state in the cluster's
    directory. %n.%u.%j.%s.%t names one container per node, user, job, step and task."""
    runc = f"runc --root={cluster.root}/runc"
    name = "%n.%u.%j.%s.%t"
    (cluster.root / "oci.conf").write_text("\n".join([
        f'RunTimeQuery="{runc} state {name}"', f'RunTimeKill="{runc} kill -a {name}"',
        f'RunTimeDelete="{runc} delete --force {name}"', f'RunTimeRun="{runc} run {name} -b %b"', ""]))


class Slurm24(Slurm):
    """Slurm 24.11 from a Debian trixie root (scripts/setup-slurm24-root.sh: built once, cached in .cache/), every
    daemon and command entered with scripts/slurm24-enter.sh, with an oci.conf running runc: `srun -n 2
    --container=BUNDLE` runs two tasks in one container step, each with its task variables. `binds` are the host
    directories seen inside (the bundle, the jobs' work directories), at their own paths."""

    name = "mds24"
    first_job_id = 5000

    def __init__(self, root: Path, binds: list[Path]):
        super().__init__(root)
        self.enter = ["bash", str(REPO / "scripts" / "slurm24-enter.sh"), str(SLURM24_ROOT), str(root),
                      *map(str, binds), "--"]

    def env(self, **extra: str) -> dict[str, str]:
        # Slurm hands srun's environment to the container: the image's PATH, nothing of the host's venv
        return {"PATH": IMAGE_PATH, "HOME": "/root", "LANG": "C.UTF-8", "SLURM_CONF": str(self.conf), **extra}

    def start(self) -> None:
        built = subprocess.run(["bash", str(REPO / "scripts" / "setup-slurm24-root.sh"), str(SLURM24_ROOT)],
                               capture_output=True, text=True, timeout=1200)
        if built.returncode != 0:
            pytest.fail(f"the Slurm 24.11 root could not be built (scripts/setup-slurm24-root.sh):\n"
                        f"{built.stdout[-3000:]}{built.stderr[-3000:]}")
        if os.geteuid() != 0:
            pytest.fail("the Slurm 24.11 cluster needs root (pivot_root, slurmd): run the tests as root (CI does)")
        write_oci_conf(self)
        super().start()
