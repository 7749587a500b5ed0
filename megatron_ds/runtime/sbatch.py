"""`entrypoint sbatch`: write a job script that runs `entrypoint <command>` on N nodes.

Slurm scripts start one task per GPU (srun --ntasks-per-node=G) with the container runtime of the
site: pyxis (`srun --container-image`), apptainer/singularity (`srun ... singularity exec`, LUMI's
binds and CPU masks when the profile has a CPU map), oci (Slurm's own OCI containers: `srun
--container=BUNDLE`, the runtime named by the nodes' oci.conf), or none (the entrypoint installed on the host).
`--scheduler pbs` writes a PBS script for PALS mpiexec (Polaris style: mpiexec --ppn G --cpu-bind depth).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from megatron_ds import __version__
from megatron_ds.env_settings import PROFILE
from megatron_ds.runtime import profiles
from megatron_ds.runtime.profiles import ProfileError

# Host paths a container on a Slingshot (Cray) site needs for libfabric/cxi, the network plugin and PMI.
# LUMI: https://docs.lumi-supercomputer.eu/software/containers/singularity/ ;
# Polaris (aws-ofi-nccl under /soft): https://docs.alcf.anl.gov/polaris/containers/containers/
SITE_BINDS = {
    "lumi": ("/var/spool/slurmd", "/opt/cray", "/usr/lib64/libcxi.so.1", "/usr/lib64/libjansson.so.4"),
    "polaris": ("/soft", "/opt/cray"),
}


def cpu_masks(cpus_by_local_rank) -> str:
    """srun --cpu-bind=mask_cpu: list, one hex mask per local rank."""
    return ",".join(hex(sum(1 << cpu for cpu in cpus)) for cpus in cpus_by_local_rank)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="entrypoint sbatch",
        description="Write a batch script that runs `entrypoint CMD...` as one task per GPU on --nodes nodes.",
        epilog="examples:\n"
               "  entrypoint sbatch --nodes 4 --gpus-per-node 8 --image nvcr.io#myorg/mds:latest --runtime pyxis \\\n"
               "      -o job.sh -- train --preset GPT1_5B --data-path data/demo/text_document\n"
               "  entrypoint sbatch --nodes 16 --gpus-per-node 8 --image mds-rocm.sif --runtime apptainer \\\n"
               "      --profile lumi --account project_465000000 --partition standard-g -o job.sh -- train ...\n"
               "  entrypoint sbatch --scheduler pbs --nodes 2 --gpus-per-node 4 "
               "--image mds.sif --runtime apptainer \\\n"
               "      --profile polaris --account MyProject --partition debug -o job.pbs -- train ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-N", "--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node (0 for a CPU-only job)")
    parser.add_argument("--ntasks-per-node", type=int, default=None,
                        help="tasks per node (default: --gpus-per-node, i.e. one task per GPU; 1 when 0 GPUs)")
    parser.add_argument("--runtime", choices=("pyxis", "apptainer", "oci", "none"), required=True,
                        help="container runtime: pyxis/enroot, apptainer/singularity, oci (Slurm's srun --container "
                             "with an OCI bundle), or none (entrypoint on the host)")
    parser.add_argument("--image", default=None,
                        help="container image (pyxis: name or .sqsh; apptainer: .sif; oci: the bundle directory, "
                             "made by scripts/oci-bundle)")
    parser.add_argument("--scheduler", choices=("slurm", "pbs"), default="slurm", help="batch system (default slurm)")
    parser.add_argument("--profile", default=None, help="site profile for the ranks (sets MDS_PROFILE in the job)")
    parser.add_argument("-t", "--time", default="01:00:00", help="wall time limit (default 01:00:00)")
    parser.add_argument("-A", "--account", default=None, help="account / project to charge")
    parser.add_argument("-p", "--partition", default=None, help="Slurm partition, or PBS queue")
    parser.add_argument("-J", "--job-name", default="mds", help="job name (default mds)")
    parser.add_argument("--mount", action="append", default=[], metavar="SRC[:DST]",
                        help="extra bind mount into the container (repeatable); the submit directory is always mounted")
    parser.add_argument("--entrypoint", default="entrypoint", help="the entrypoint command inside the job")
    parser.add_argument("-o", "--output", default=None, help="write the script here (default: stdout)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- entrypoint command and flags, e.g. -- train ...")
    return parser


def _header_slurm(a, ntasks: int, profile) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={a.job_name}", f"#SBATCH --nodes={a.nodes}",
             f"#SBATCH --ntasks-per-node={ntasks}", f"#SBATCH --time={a.time}", "#SBATCH --output=%x-%j.out"]
    if a.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={a.gpus_per_node}")
    if profile is not None and profile.cpus_by_local_rank:
        lines += [f"#SBATCH --cpus-per-task={len(profile.cpus_by_local_rank[0])}", "#SBATCH --exclusive"]
    if a.account:
        lines.append(f"#SBATCH --account={a.account}")
    if a.partition:
        lines.append(f"#SBATCH --partition={a.partition}")
    return lines


def _header_pbs(a) -> list[str]:
    lines = ["#!/bin/bash", f"#PBS -N {a.job_name}", f"#PBS -l select={a.nodes}:system=polaris",
             "#PBS -l place=scatter", f"#PBS -l walltime={a.time}", "#PBS -l filesystems=home:eagle", "#PBS -j oe"]
    if a.account:
        lines.append(f"#PBS -A {a.account}")
    if a.partition:
        lines.append(f"#PBS -q {a.partition}")
    return lines


class _Shell(str):
    """A word that is already shell syntax (expansions, quoting): emitted as is."""


def _dq(text: str) -> _Shell:
    """Double-quote a word that may hold ${VAR} expansions (user text must not hold quotes or $)."""
    if any(c in text.replace("${WORKDIR}", "") for c in '"$`\\'):
        raise ValueError(f"cannot place {text!r} in the script: no quotes, $ or backslashes in mounts")
    return _Shell(f'"{text}"')


def _container(a, profile) -> list[str]:
    """The words that put the entrypoint inside the container (empty for --runtime none)."""
    mounts = ["${WORKDIR}"] + a.mount
    if a.runtime == "pyxis":
        return [_Shell(f"--container-image={shlex.quote(a.image)}"),
                _Shell("--container-mounts=" + _dq(",".join(mounts))),
                _Shell('--container-workdir="${WORKDIR}"'), "--no-container-mount-home"]
    if a.runtime == "apptainer":
        gpu_flag = "--rocm" if profile is not None and profile.platform == "rocm" else "--nv"
        binds = mounts + list(SITE_BINDS.get(profile.name, ()) if profile is not None else ())
        words: list[str] = [_Shell('"${CONTAINER_CMD}"'), "exec", gpu_flag]
        for bind in binds:
            words += ["-B", _dq(bind)]
        return words + [a.image]
    if a.runtime == "oci":  # the container starts in the bundle's cwd: the task moves to the work directory itself
        return [_Shell(f"--container={shlex.quote(a.image)}"), "sh", "-c", 'cd "$0" && exec "$@"',
                _Shell('"${WORKDIR}"')]
    return []


OCI_NOTE = [
    "# --container: Slurm's own OCI containers. The bundle (rootfs/ + config.json, on a path every node sees) is made",
    "# from the image with `scripts/oci-bundle IMAGE BUNDLE DIR...` (mds repository; docs/images.md): its config.json",
    "# binds each DIR (this work directory, the data, the checkpoints). The nodes' oci.conf names the OCI runtime",
    "# (runc, crun). Several tasks per container step need a Slurm that runs them (24.11 does; 22.05 runs one per",
    "# node: there use --ntasks-per-node=1 and `entrypoint launch --nproc-per-node G`).",
]


def _quote(word: str) -> str:
    return str(word) if isinstance(word, _Shell) else shlex.quote(word)


def render(a, profile) -> str:
    """The whole job script as text."""
    ntasks = a.ntasks_per_node or a.gpus_per_node or 1
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    body = [f"# Generated by mds {__version__} (entrypoint sbatch).",
            f"# {a.nodes} node(s) x {ntasks} task(s), one rank per task; the entrypoint finds its rank itself.",
            "set -euo pipefail"]
    if a.profile:
        body.append(f"export {PROFILE.name}={shlex.quote(a.profile)}")
    if a.runtime == "apptainer":
        body.append('CONTAINER_CMD="$(command -v apptainer || command -v singularity)"')
    if a.runtime == "oci":
        body += OCI_NOTE
    if a.scheduler == "slurm":
        header = _header_slurm(a, ntasks, profile)
        body += ['WORKDIR="${SLURM_SUBMIT_DIR:-$PWD}"', 'cd "${WORKDIR}"']
        words: list[str] = ["srun", "--kill-on-bad-exit=1"]
        if profile is not None and profile.cpus_by_local_rank and ntasks == len(profile.cpus_by_local_rank):
            body.append(f"CPU_MASKS={cpu_masks(profile.cpus_by_local_rank)}  # {profile.name}: one mask per local rank")
            words.append(_Shell('--cpu-bind=mask_cpu:"${CPU_MASKS}"'))
    else:
        header = _header_pbs(a)
        body += ['WORKDIR="${PBS_O_WORKDIR:-$PWD}"', 'cd "${WORKDIR}"', 'NNODES="$(wc -l < "${PBS_NODEFILE}")"',
                 f"NRANKS_PER_NODE={ntasks}", "NDEPTH=8  # CPU threads per rank (Polaris: 32 cores, 4 ranks)"]
        words = ["mpiexec", "-n", _Shell('"$((NNODES * NRANKS_PER_NODE))"'), "--ppn", _Shell('"${NRANKS_PER_NODE}"'),
                 _Shell('--depth="${NDEPTH}"'), "--cpu-bind", "depth"]
        if a.profile:
            words += ["--env", f"{PROFILE.name}={a.profile}"]
    segments = [words, _container(a, profile), [a.entrypoint, *command]]
    launch = " \\\n    ".join(" ".join(_quote(w) for w in seg) for seg in segments if seg)
    if a.runtime == "oci":
        body.append("# shellcheck disable=SC2016  # $0 and $@ are the container shell's")
    return "\n".join(header + [""] + body + [launch, ""])


def main(argv: list[str]) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        parser.error("no entrypoint command: use `entrypoint sbatch [options] -- train ...`")
    if a.nodes < 1 or a.gpus_per_node < 0 or (a.ntasks_per_node is not None and a.ntasks_per_node < 1):
        parser.error("--nodes and --ntasks-per-node must be >= 1, --gpus-per-node >= 0")
    if a.runtime != "none" and not a.image:
        what = {"pyxis": "an image name or .sqsh file", "apptainer": "a .sif file",
                "oci": "an OCI bundle directory, made by scripts/oci-bundle IMAGE BUNDLE DIR..."}[a.runtime]
        parser.error(f"--runtime {a.runtime} needs --image: {what}")
    if a.runtime == "oci" and a.mount:
        parser.error("--mount with --runtime oci: the bundle's config.json holds the binds "
                     "(scripts/oci-bundle IMAGE BUNDLE DIR... binds each DIR)")
    try:
        profile = profiles.get_profile(a.profile) if a.profile else None
    except ProfileError as err:
        parser.error(str(err))
    try:
        script = render(a, profile)
    except ValueError as err:
        parser.error(str(err))
    if a.output:
        path = Path(a.output)
        path.write_text(script)
        path.chmod(0o755)
        print(f"wrote {path} ({'sbatch' if a.scheduler == 'slurm' else 'qsub'} {path})", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0
