#!/bin/sh
# System packages posttrain uses: bubblewrap (sandbox for untrusted code) and chromium (report rendering test).
# `sh scripts/sysdeps.sh [package ...]` (default: both) installs those missing with apt where we are root;
# otherwise says how.
packages="${*:-bubblewrap chromium}"
missing=""
for package in $packages; do
  case "$package" in
    bubblewrap) command -v bwrap >/dev/null 2>&1 || missing="$missing bubblewrap" ;;
    *) command -v "$package" >/dev/null 2>&1 || missing="$missing $package" ;;
  esac
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages:$missing"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null && exit 0
  echo "apt-get could not install:$missing" >&2
fi
echo "posttrain needs:$missing. Install with: sudo apt-get install -y$missing" >&2
echo "(bubblewrap is required for code-execution rewards; chromium only for the report rendering test)" >&2
# Not fatal: the parts that need them fail with a clear error naming the package.
exit 0
