#!/usr/bin/env bash
# Idempotent install of gVisor's runsc >= 20240729, as root, for fanfold's stronger tier
# (runtime="runsc"). Debian 12's own runsc (20221219) fails `statx` with AT_NO_AUTOMOUNT, so
# `ls -l` of Debian's coreutils fails in every sandbox, and has no systrap platform; the one in
# bookworm-backports (Debian's build of 20240729) has neither problem. It is fetched through a
# private apt configuration (the host's sources are left alone) and installed with dpkg.
set -euo pipefail
. "$(dirname "$0")/apt.sh"
export DEBIAN_FRONTEND=noninteractive LC_ALL=C
MIN_VERSION=20240729
SUITE="deb http://deb.debian.org/debian bookworm-backports main"

die() { echo "setup: runsc: $*" >&2; exit 1; }
check=0
case "${1:-}" in
    "") ;;
    --check) check=1 ;;  # install nothing: exit 0 when a recent enough runsc is installed, 1 when not
    *) die "unknown option '$1' (--check)" ;;
esac

# The probe: empty for an absent or unparsable runsc, and never ends the script.
installed_version() { runsc --version 2>/dev/null | sed -n 's/^runsc version 0\.0~\([0-9]\{8\}\).*/\1/p' || true; }
current() { local v; v="$(installed_version)"; [[ -n "$v" && "$v" -ge "$MIN_VERSION" ]]; }

if (( check )); then
    current && exit 0
    echo "setup: missing: gVisor's runsc >= $MIN_VERSION"
    exit 1
fi
(( EUID == 0 )) || die "must run as root"
current && exit 0
if [[ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" != bookworm ]]; then
    apt_install runsc  # later Debians ship a recent one
    exit 0
fi
echo "setup: installing runsc from bookworm-backports"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
echo "$SUITE" > "$work/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::archives=$work" -o "APT::Sandbox::User=root")
apt_get -qq "${apt_private[@]}" update >/dev/null || die "cannot reach bookworm-backports"
(cd "$work" && apt_get -qq "${apt_private[@]}" download "runsc/bookworm-backports" >/dev/null) \
    || die "cannot download runsc from bookworm-backports"
dpkg -i "$work"/runsc_*.deb >/dev/null
current || die "runsc '$(installed_version)' installed, $MIN_VERSION or later needed"
