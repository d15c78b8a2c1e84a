#!/usr/bin/env bash
# The console's browser tests drive Debian's Chromium (never one a test tool downloads).
# Present -> nothing to do; missing -> apt-get install chromium (root only); CI=true and no way
# to install it -> fail loudly (the browser tests would otherwise only be skipped).
set -euo pipefail

say() { printf '%s\n' "$*"; }
die() { printf 'ensure-browser: %s\n' "$*" >&2; exit 1; }

if command -v chromium >/dev/null 2>&1; then
  say "chromium: $(chromium --version 2>/dev/null | head -1)"
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  msg="chromium is not installed, and this script can only install it as root with apt-get; install Debian's chromium (or set KILN_CHROMIUM to a Chromium binary)."
  [[ ${CI:-} == true ]] && die "$msg"
  say "$msg The browser tests will be skipped."
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null 2>&1 || die "apt-get ran but no chromium is on PATH."
say "chromium: installed $(chromium --version 2>/dev/null | head -1)"
