#!/usr/bin/env bash
# Fail at once, naming the shortfall, when a big install would run out of disk half-way
# (pip's own message for that is one truncated line). Usage: need-disk.sh PATH GIB WHAT
set -euo pipefail
path=$1 need_gib=$2 what=$3
mkdir -p "$path"
free_kib=$(df -Pk "$path" | awk 'NR == 2 {print $4}')
free_gib=$((free_kib / 1024 / 1024))
if (( free_gib < need_gib )); then
  echo "need-disk: $what need about $need_gib GiB under $path; only $free_gib GiB is free there" >&2
  df -h "$path" >&2
  exit 1
fi
echo "need-disk: $free_gib GiB free under $path ($what need about $need_gib GiB)"
