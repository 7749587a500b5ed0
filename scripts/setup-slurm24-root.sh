#!/usr/bin/env bash
# A Debian trixie root holding Slurm 24.11, munge, runc and Apptainer, for the Slurm container tests
# and, where the host has no Apptainer, for `make sif*` and the SIF tests (scripts/setup-apptainer.sh, scripts/apptainer)
# (tests/images/test_slurm_container.py): bookworm's Slurm 22.05 runs one task per node in an OCI container step and
# hands the container no task variables, trixie's 24.11 runs `srun -n 2 --container=BUNDLE` as users on current
# clusters do. Apptainer is sid's (no stable Debian packages it; its .deb installs on trixie), pinned so that nothing
# else comes from sid. The tests enter the root with scripts/slurm24-enter.sh (pivot_root in a private mount
# namespace) and start its daemons on their own ports.
#
# usage: scripts/setup-slurm24-root.sh [ROOT]     (default: .cache/slurm24-root in the repository; root + debootstrap)
# Idempotent: a root that is complete (its stamp names the same packages) is kept as is, in well under a second;
# otherwise it is built anew beside and moved into place only when complete. Safe to run concurrently: one run
# builds, the others wait for it.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="${1:-${REPO}/.cache/slurm24-root}"
SUITE=trixie
MIRROR=http://deb.debian.org/debian
PACKAGES=(slurmd slurmctld slurm-client munge runc apptainer/sid squashfuse fuse2fs)
STAMP="${ROOT}/.mds-root"

exit_if_complete() {
    if [ -f "${STAMP}" ] && [ "$(cat "${STAMP}")" = "${SUITE}: ${PACKAGES[*]}" ]; then
        echo "mds: slurm24 root: ${ROOT} is complete (${SUITE}: ${PACKAGES[*]})"
        exit 0
    fi
}
exit_if_complete
[ "$(id -u)" -eq 0 ] || { echo "mds: slurm24 root: needs root (debootstrap, chroot)" >&2; exit 1; }
mkdir -p "$(dirname "${ROOT}")"
exec 9>"${ROOT}.lock"
flock 9
exit_if_complete  # built by the run we waited for
command -v debootstrap >/dev/null || PATH="$PATH:/usr/sbin:/sbin"
command -v debootstrap >/dev/null || { echo "mds: slurm24 root: debootstrap not found (apt-get install debootstrap)" >&2; exit 1; }

NEW="${ROOT}.new"
rm -rf "${NEW}"
echo "+ debootstrap --variant=minbase ${SUITE} ${NEW} ${MIRROR}"
debootstrap --variant=minbase "${SUITE}" "${NEW}" "${MIRROR}" > "${NEW}.log" 2>&1 \
    || { tail -n 20 "${NEW}.log" >&2; echo "mds: slurm24 root: debootstrap failed (log above)" >&2; exit 1; }
# A frozen snapshot of the archive carries Release files past their Valid-Until date; services must not start
# inside the build (the tests start the daemons themselves).
echo 'Acquire::Check-Valid-Until "false";' > "${NEW}/etc/apt/apt.conf.d/99mds-snapshot"
printf '#!/bin/sh\nexit 101\n' > "${NEW}/usr/sbin/policy-rc.d"
echo "deb ${MIRROR} sid main" > "${NEW}/etc/apt/sources.list.d/sid.list"
printf 'Package: *\nPin: release n=sid\nPin-Priority: 100\n' > "${NEW}/etc/apt/preferences.d/sid"
chmod 755 "${NEW}/usr/sbin/policy-rc.d"
cp -L /etc/resolv.conf "${NEW}/etc/resolv.conf"
echo "+ chroot ${NEW} apt-get install ${PACKAGES[*]}"
in_root() { chroot "${NEW}" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"; }
{ in_root apt-get update -q && in_root apt-get install -q -y --no-install-recommends "${PACKAGES[@]}"; } >> "${NEW}.log" 2>&1 \
    || { tail -n 20 "${NEW}.log" >&2; echo "mds: slurm24 root: apt-get install failed (log above)" >&2; exit 1; }
in_root apt-get clean
# Root in a container asks for root's full capability set by default; where root lacks one (CAP_SYS_RESOURCE in
# some sandboxes) no container starts. `file` grants what the capability file says.
sed -i 's/^root default capabilities = .*/root default capabilities = file/' "${NEW}/etc/apptainer/apptainer.conf"
grep -q '^root default capabilities = file$' "${NEW}/etc/apptainer/apptainer.conf"
# `apptainer build --fakeroot` (its %post and %test as a mapped root) needs subordinate ids for root
echo 'root:100000:65536' > "${NEW}/etc/subuid"
echo 'root:100000:65536' > "${NEW}/etc/subgid"
mkdir -p "${NEW}/run"
in_root slurmd -V
in_root apptainer --version
echo "${SUITE}: ${PACKAGES[*]}" > "${NEW}/.mds-root"
rm -rf "${ROOT}"
mv "${NEW}" "${ROOT}"
mv "${NEW}.log" "${ROOT}.log"
echo "mds: slurm24 root: ${ROOT} ready"
