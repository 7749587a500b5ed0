#!/bin/sh
# fetch-source.sh REPO COMMIT DIR: a shallow checkout of REPO at exactly COMMIT (submodules included),
# so every source-built component is pinned by hash, not by a moving branch or tag.
. "$(dirname "$0")/lib.sh"
repo=${1:?usage: fetch-source.sh REPO COMMIT DIR}; commit=${2:?COMMIT}; dir=${3:?DIR}
step "fetch $repo at $commit"
command -v git >/dev/null 2>&1 || die "git is needed to fetch $repo (install it in the base)"
rm -rf "$dir"
git init -q "$dir"
git -C "$dir" remote add origin "$repo"
git -C "$dir" fetch -q --depth 1 origin "$commit" || die "cannot fetch $commit from $repo"
git -C "$dir" checkout -q --detach FETCH_HEAD
git -C "$dir" submodule update -q --init --recursive --depth 1 || die "cannot fetch the submodules of $repo at $commit"
[ "$(git -C "$dir" rev-parse HEAD)" = "$commit" ] || die "$dir: HEAD $(git -C "$dir" rev-parse HEAD) is not $commit"
note "$dir is $repo at $commit"
