#!/usr/bin/env bash
# Run a command inside the Slurm 24.11 root (scripts/setup-slurm24-root.sh) with pivot_root in a private mount
# namespace: runc and slurmstepd need a real root, not a chroot. The host's /proc, /sys, /dev, /etc/hosts and
# /etc/resolv.conf are seen inside (ranks resolve this host's name as outside), and each DIR is bound at its own
# path, so a bundle, a job's work directory or a Slurm state directory has one name inside and out; the command
# starts in the current directory when that is bound.
#
# usage: scripts/slurm24-enter.sh ROOT [DIR...] -- COMMAND [ARG...]     (root; the environment is passed on)
set -euo pipefail

ROOT="$(realpath "$1")"
shift
binds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    binds+=("$(realpath "$1")")
    shift
done
[ "${1:-}" = "--" ] || { echo "usage: $0 ROOT [DIR...] -- COMMAND [ARG...]" >&2; exit 2; }
shift
[ -f "${ROOT}/.mds-root" ] || { echo "mds: ${ROOT} is no Slurm 24.11 root: run scripts/setup-slurm24-root.sh" >&2; exit 1; }

# The inner shell runs in the new namespace: mounts there vanish with its last process.
# shellcheck disable=SC2016
exec unshare --mount --propagation private -- bash -euc '
root=$1; cwd=$2; shift 2
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/tmp"
for file in /etc/hosts /etc/resolv.conf; do touch "$root$file"; mount --bind "$file" "$root$file"; done
while [ "$1" != "--" ]; do
    mkdir -p "$root$1"
    mount --rbind "$1" "$root$1"
    shift
done
shift
mkdir -p "$root/.oldroot"
cd "$root"
pivot_root . .oldroot
umount -l /.oldroot
cd "$cwd" 2>/dev/null || cd /
exec "$@"
' bash "${ROOT}" "${PWD}" "${binds[@]}" -- "$@"
