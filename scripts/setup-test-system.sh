#!/usr/bin/env bash
# The system pieces `make test` needs beyond Python, installed when missing (Debian/Ubuntu, as root): one
# `apt-get update`, then one `apt-get install` of the missing packages. A no-op when every command is present.
# Without root or apt it prints what is missing and exits 0: the tests that need a missing piece then fail,
# naming it (none is skipped). Services are not started here: the test fixtures start munged, slurmctld and
# slurmd (tests/runtime) and dockerd (tests/images) when they are not running, and stop what they started.
# Another apt or dpkg at work (unattended upgrades, a second set-up) holds the package manager's locks: apt-get
# waits for them, up to MDS_APT_LOCK_TIMEOUT seconds (default 900), instead of failing at once.
set -euo pipefail

# one group per line: Debian packages | commands that prove them present | why the tests need them
GROUPS_TABLE='slurm-wlm munge|munged mungekey slurmctld slurmd srun sbatch sinfo scontrol|tests/runtime start a local Slurm (munged, slurmctld, slurmd) and submit with srun and sbatch
openmpi-bin mpich|mpirun.openmpi mpiexec.hydra|tests/runtime launch ranks with Open MPI mpirun and MPICH mpiexec.hydra
shellcheck|shellcheck|tests lint the generated sbatch scripts and the image step scripts
docker.io debootstrap git|dockerd docker debootstrap git|tests/images build and run the image recipes on a local Debian CPU base (Docker engine, debootstrap for its root file system, git for the revision label)
fuse3|fusermount3|tests/checkpoint mount a FUSE filesystem that fails with EIO (failing_disk.py: mfusepy over libfuse3)'
# tests/test_setup_system.py hands in a table of its own, to make the script install something
GROUPS_TABLE="${MDS_SYSTEM_GROUPS_TABLE:-${GROUPS_TABLE}}"
LOCK_TIMEOUT="${MDS_APT_LOCK_TIMEOUT:-900}"

# daemons live in sbin, which a non-root PATH may lack
have() { PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1; }

missing_packages=()
while IFS='|' read -r packages commands why; do
    absent=()
    for command in $commands; do
        have "$command" || absent+=("$command")
    done
    if [ ${#absent[@]} -gt 0 ]; then
        echo "mds: system: installing $packages (missing ${absent[*]}): $why"
        read -ra group <<< "$packages"
        missing_packages+=("${group[@]}")
    fi
done <<< "$GROUPS_TABLE"

if [ ${#missing_packages[@]} -eq 0 ]; then
    echo "mds: system: Slurm + munge, Open MPI + MPICH, shellcheck, Docker + debootstrap + git, FUSE 3 all present"
    exit 0
fi

cannot() {
    echo "mds: system: WARNING: cannot install ${missing_packages[*]}: $1." >&2
    echo "mds: system: the tests that need them will FAIL naming what is missing (install them, or deselect with -m)." >&2
    exit 0
}
[ "$(id -u)" -eq 0 ] || cannot "not root (run make test as root, or install them with sudo apt-get install)"
have apt-get || cannot "no apt-get on this machine (install the equivalents with its package manager)"

export DEBIAN_FRONTEND=noninteractive
apt_get() { apt-get -o "DPkg::Lock::Timeout=${LOCK_TIMEOUT}" "$@"; }
echo "+ apt-get update"
apt_get update -q || cannot "apt-get update failed (above)"
echo "+ apt-get install -y --no-install-recommends ${missing_packages[*]}"
apt_get install -q -y --no-install-recommends "${missing_packages[@]}" || cannot "apt-get install failed (above)"
