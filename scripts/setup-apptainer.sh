#!/usr/bin/env bash
# An Apptainer for `make sif*` and the SIF tests, set up when the host has none. A host with `apptainer` or
# `singularity` on PATH is used as it is. Otherwise (Debian bookworm and trixie package neither) this builds,
# once, a Debian sid root holding sid's apptainer at $MDS_APPTAINER_ROOT, which scripts/apptainer enters
# (root, debootstrap and Debian's archive needed). Safe to run concurrently: one run builds, the others wait.
set -euo pipefail

ROOT=${MDS_APPTAINER_ROOT:-/var/lib/mds/apptainer-sid}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES="apptainer squashfuse fuse2fs"

fail() { echo "mds: apptainer: ERROR: $*" >&2; exit 1; }

for name in apptainer singularity; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "mds: apptainer: using $(command -v "$name")"
        exit 0
    fi
done
if [ -x "$ROOT/usr/bin/apptainer" ]; then
    echo "mds: apptainer: using the Debian sid root $ROOT"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || fail "no apptainer or singularity on PATH, and setting one up needs root: install Apptainer (https://apptainer.org/docs/admin/main/installation.html) or run this as root"
PATH="$PATH:/usr/sbin:/sbin"
for tool in debootstrap unshare flock; do
    command -v "$tool" >/dev/null 2>&1 || fail "no apptainer on PATH, and $tool, needed to set one up, is missing (apt-get install debootstrap util-linux)"
done

mkdir -p "$(dirname "$ROOT")"
exec 9>"$ROOT.lock"
flock 9
if [ -x "$ROOT/usr/bin/apptainer" ]; then  # built by the run we waited for
    echo "mds: apptainer: using the Debian sid root $ROOT"
    exit 0
fi

run() { echo "+ $*"; "$@"; }
new="$ROOT.new"
rm -rf "$new"
echo "mds: apptainer: none on this host: building a Debian sid root with sid's apptainer in $ROOT (about a minute)"
run debootstrap --variant=minbase sid "$new" "$MIRROR"
# the archive may be a frozen snapshot whose Release files have expired
echo 'Acquire::Check-Valid-Until "false";' > "$new/etc/apt/apt.conf.d/99mds-snapshot"
cp /etc/resolv.conf "$new/etc/resolv.conf"
echo "+ chroot $new apt-get install $PACKAGES"
# shellcheck disable=SC2016  # the inner script expands its own arguments
unshare --mount --propagation private -- sh -ec '
    mount -t proc proc "$1/proc"
    chroot "$1" sh -ec "DEBIAN_FRONTEND=noninteractive; export DEBIAN_FRONTEND
        apt-get update -q && apt-get install -q -y --no-install-recommends $2 && apt-get clean"
' sh "$new" "$PACKAGES"

conf="$new/etc/apptainer/apptainer.conf"
[ -f "$conf" ] || fail "the sid root has no $conf after installing apptainer"
# A container started by root asks for root's full capability set by default; a host whose root lacks one
# (CAP_SYS_RESOURCE in some sandboxes) then cannot start any. `file` grants what the capability file says.
sed -i 's/^root default capabilities = .*/root default capabilities = file/' "$conf"
grep -q '^root default capabilities = file$' "$conf" || fail "could not set 'root default capabilities = file' in $conf"
# `apptainer build --fakeroot` (its %post and %test as a mapped root) needs subordinate ids for root
echo 'root:100000:65536' > "$new/etc/subuid"
echo 'root:100000:65536' > "$new/etc/subgid"
mkdir -p "$new/run"
mv "$new" "$ROOT"
echo "mds: apptainer: ready: $("$(dirname "$0")/apptainer" --version)"
