#!/usr/bin/env bash
# Proves set-up's install stage on a bare machine: debootstraps a fresh Debian 12 root where
# nothing is installed, copies this checkout into it, and runs `scripts/setup.sh --install-only`
# there (chrooted, as root) twice: the first run must install everything and the second must find
# it all in place. CI runs it at every submission; it takes about ten minutes and needs the
# network to reach Debian's archive and PyPI. Nothing is left behind: the root is unmounted and
# deleted on every path, and any process still running in it is killed.
#
#   bash scripts/bare-install.sh [--keep DIR]   (--keep: build the root in DIR and leave it there)
set -euo pipefail
export LC_ALL=C
cd "$(dirname "$0")/.."

MIRROR="${FANFOLD_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
die() { echo "bare-install: $*" >&2; exit 1; }
(( EUID == 0 )) || die "must run as root"
command -v debootstrap >/dev/null || die "needs debootstrap (apt-get install debootstrap)"

keep=""
case "${1:-}" in
    "") ;;
    --keep) keep="${2:?--keep needs a directory}" ;;
    *) die "unknown option '$1' (--keep DIR)" ;;
esac
if [[ -n "$keep" ]]; then
    root="$keep"; mkdir -p "$root"
    [[ -z "$(ls -A "$root")" ]] || die "--keep $root: the directory is not empty (a failed try would empty it)"
else
    root="$(mktemp -d "${TMPDIR:-/var/tmp}/fanfold-bare.XXXXXX")"
fi
chmod 0755 "$root"  # a machine's / (mktemp's 0700 would keep apt's _apt user out)

unmount_under() {  # every mount at or below $1, deepest first
    local target
    for target in $(awk -v r="$1" '$5 == r || index($5, r "/") == 1 {print $5}' /proc/self/mountinfo | sort -r); do
        umount -l "$target" 2>/dev/null || true
    done
}
release() {
    # Whatever the install started and left running inside the root (a daemon's postinst) goes first.
    local pid
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [[ "$(readlink "/proc/$pid/root" 2>/dev/null)" == "$root" ]] && kill -9 "$pid" 2>/dev/null || true
    done
    unmount_under "$root"
    if [[ -z "$keep" ]]; then rm -rf --one-file-system "$root"; fi
}
trap release EXIT

start=$SECONDS
echo "bare-install: debootstrap of Debian 12 (bookworm, minbase) into $root"
log="$(mktemp)"
for try in 1 2 3; do  # the network to the archive fails now and then: start again from nothing
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$log" 2>&1 && break
    tail -n 5 "$log" >&2
    (( try < 3 )) || { rm -f "$log"; die "debootstrap failed three times"; }
    echo "bare-install: debootstrap failed (try $try of 3); trying again" >&2
    unmount_under "$root"  # debootstrap's own /proc and /sys, when it failed in its second stage
    find "$root" -mindepth 1 -maxdepth 1 -exec rm -rf --one-file-system {} +
    sleep $((try * 10))
done
rm -f "$log"

# This site's own trust settings: a host behind an intercepting HTTPS proxy trusts its CA, and so
# does a bare machine of the same site; ca-certificates' install (set-up's) picks them up.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# No service starts inside a chroot (docker-registry's postinst would start one).
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 0755 "$root/usr/sbin/policy-rc.d"

# The checkout as CI has it: tracked and untracked files that git does not ignore.
mkdir -p "$root/src/fanfold"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$root/src/fanfold"

mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"
mount -t tmpfs tmpfs "$root/run"

# A clean environment, but for how this site reaches the registries (proxies, pip's CA bundle and
# index): a bare machine of the same site has those too. Local wheel caches stay outside.
passed=()
for name in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_CERT PIP_INDEX_URL PIP_DEFAULT_TIMEOUT; do
    [[ -n "${!name:-}" ]] && passed+=("$name=${!name}")
done
in_root() {
    chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 CI=true TERM=dumb "${passed[@]}" "$@"
}
echo "bare-install: scripts/setup.sh --install-only in the bare root ($((SECONDS - start)) s so far)"
in_root bash /src/fanfold/scripts/setup.sh --install-only </dev/null || die "set-up's install stage failed on a bare Debian 12"
echo "bare-install: a second run installs nothing, and --check finds everything in place"
again="$(in_root bash /src/fanfold/scripts/setup.sh --install-only </dev/null 2>&1)" || { echo "$again" >&2; die "a second install failed"; }
[[ "$again" != *"setup: installing"* && "$again" != *"setup: building"* ]] \
    || { echo "$again" >&2; die "a second install installed again: a probe does not see what the first installed"; }
in_root bash /src/fanfold/scripts/setup.sh --check </dev/null || die "set-up's --check finds something missing after the install"
in_root bash -c 'cd /src/fanfold && .venv/bin/fanfold --help >/dev/null && .venv/bin/python -c "import fanfold, ray, fastapi"' \
    </dev/null || die "the installed fanfold does not run"
echo "bare-install: ok: set-up's install stage works on a bare Debian 12 ($((SECONDS - start)) s)"
