#!/usr/bin/env bash
# Idempotent build of CRIU >= 4.1 from Debian trixie's source package, as root, into
# /usr/local/lib/fanfold/criu/criu (fanfold.config.DEFAULT_CRIU). Debian 12's criu 3.17
# fails `criu check` on current kernels; fanfold uses this binary for memory snapshots,
# fork and suspend. The patches in scripts/criu/*.patch are applied (patch -p1).
#
# A stamp beside the binary records the version, the build options and the sha256 of
# each patch: when it matches and `criu check` says "Looks good", nothing is done (no
# network). Otherwise the source is fetched through a private apt configuration (the
# host's sources are left alone), verified against the archive's SHA256, built in a
# temporary directory and installed atomically.
#
#   --install-only  build and install, but do not run `criu check` against this kernel
#                   (set-up's host stage, `fanfold doctor`, checks it)
#   --check         install nothing: exit 0 when the installed CRIU is current, 1 when not
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

here="$(cd "$(dirname "$0")" && pwd)"
. "$here/apt.sh"
DEST_DIR="${FANFOLD_CRIU_DIR:-/usr/local/lib/fanfold/criu}"  # the override is for tests of the probes
BIN="$DEST_DIR/criu"
STAMP="$DEST_DIR/criu.stamp"
SUITE_SOURCE="deb-src http://deb.debian.org/debian trixie main"
MIN_VERSION=4.1
# kerndat cache: CRIU keeps RUNDIR/criu.kdat only on a tmpfs; /run is not one everywhere.
RUNDIR=/dev/shm

die() { echo "setup: criu: $*" >&2; exit 1; }

install_only=0 check=0
for arg in "$@"; do
    case "$arg" in
        --install-only) install_only=1 ;;
        --check) check=1 ;;
        *) die "unknown option '$arg' (--install-only, --check)" ;;
    esac
done
(( check )) || (( EUID == 0 )) || die "must run as root"

# Neither TLS for a remote page server nor nftables for the network lock (fanfold passes
# --network-lock skip): without gnutls and libnftables, CRIU loads 8 shared libraries instead
# of 22, and each of its runs (one inside every dump's pause, one per restore) and each process it
# forks starts ~4 ms sooner.
LEAN="without=gnutls,nftables"
# What the build depends on: build options and patches (the version is added once known).
recipe="rundir=$RUNDIR $LEAN"
shopt -s nullglob
patches=("$here"/criu/*.patch)
shopt -u nullglob
for p in "${patches[@]}"; do
    recipe+=$'\n'"patch=$(basename "$p") sha256:$(sha256sum "$p" | cut -d' ' -f1)"
done

# The probes: each answers for an absent or broken binary too, and never ends the script.
binary_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' || true; }
looks_good() { local out; out="$("$1" check 2>&1)" && [[ "$out" == *"Looks good"* ]]; }
current() {  # the installed binary is this recipe's build (and, unless install-only, works here)
    [[ -x "$BIN" && -f "$STAMP" ]] || return 1
    local version
    version="$(binary_version "$BIN")"
    [[ -n "$version" && "$(cat "$STAMP")" == "version=$version"$'\n'"$recipe" ]] || return 1
    (( install_only )) || looks_good "$BIN"
}

if (( check )); then
    current && exit 0
    echo "setup: missing: CRIU >= $MIN_VERSION with fanfold's patches at $BIN"
    exit 1
fi

mkdir -p "$DEST_DIR"
exec 9>"$DEST_DIR/.lock"
flock 9 || die "cannot lock $DEST_DIR/.lock"
current && exit 0

# Build and runtime dependencies (only the missing ones). CRIU restores network
# namespaces with `ip` and `iptables-restore`.
PACKAGES=(gcc libc6-dev make pkg-config xz-utils patch ca-certificates
          libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
          libnl-3-dev libcap-dev libnet1-dev libbsd-dev libaio-dev uuid-dev
          iproute2 iptables)
mapfile -t missing < <(missing_packages "${PACKAGES[@]}")
if (( ${#missing[@]} )); then
    echo "setup: installing CRIU build dependencies: ${missing[*]}"
    apt_install "${missing[@]}" || die "apt-get install ${missing[*]} failed"
fi

work="$(mktemp -d "${TMPDIR:-/var/tmp}/fanfold-criu.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# A private apt configuration that knows only trixie's sources: nothing of the host's
# apt state (sources, lists, caches) is read or written.
mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial"
echo "$SUITE_SOURCE" >"$work/apt/sources.list"
APT=(apt_get -q
     -o "Dir::Etc::sourcelist=$work/apt/sources.list" -o Dir::Etc::sourceparts=-
     -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache"
     -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
     -o APT::Sandbox::User=root)
"${APT[@]}" -qq update >"$work/apt.log" 2>&1 \
    || { cat "$work/apt.log" >&2; die "apt-get update of '$SUITE_SOURCE' failed"; }
uris="$("${APT[@]}" source --print-uris criu 2>"$work/apt.log")" \
    || { cat "$work/apt.log" >&2; die "no criu source package in '$SUITE_SOURCE'"; }

# Only the upstream tarball is used: 'URI' criu_X.Y.Z.orig.tar.xz SIZE SHA256:HEX
line="$(grep -E "^'[^']*/criu_[^']*\.orig\.tar\.[a-z0-9]+' " <<<"$uris" | head -n1 || true)"
[[ -n "$line" ]] || die "no .orig tarball in the criu source package: $uris"
read -r uri file _size hash <<<"$line"
uri="${uri//\'/}"
[[ "$hash" == SHA256:* ]] || die "no SHA256 for $file (got '$hash')"
sha256="${hash#SHA256:}"
version="${file#criu_}"
version="${version%.orig.tar.*}"
dpkg --compare-versions "$version" ge "$MIN_VERSION" \
    || die "trixie has criu $version, older than $MIN_VERSION"

echo "setup: building CRIU $version from Debian trixie source (about a minute)"
/usr/lib/apt/apt-helper "${APT_RETRY_OPTS[@]}" -o APT::Sandbox::User=root download-file "$uri" "$work/$file" "SHA256:$sha256" \
    >"$work/download.log" 2>&1 \
    || { cat "$work/download.log" >&2; die "download of $uri failed"; }
echo "$sha256  $work/$file" | sha256sum --check --status || die "$file does not match SHA256 $sha256"

mkdir "$work/src"
tar -xf "$work/$file" -C "$work/src" --strip-components=1 || die "cannot unpack $file"
for p in "${patches[@]}"; do
    patch -d "$work/src" -p1 --batch --forward --quiet <"$p" >"$work/patch.log" 2>&1 \
        || { cat "$work/patch.log" >&2; die "patch $(basename "$p") does not apply to criu $version"; }
done
# CRIU's build takes libnftables wherever pkg-config finds it, with no switch to say no.
printf '#!/bin/sh\nfor a in "$@"; do case "$a" in libnftables*) exit 1;; esac; done\nexec pkg-config "$@"\n' \
    >"$work/pkg-config"
chmod +x "$work/pkg-config"
make -C "$work/src" -j"$(nproc)" criu RUNDIR="$RUNDIR" NO_GNUTLS=1 PKG_CONFIG="$work/pkg-config" >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log" >&2; die "build of criu $version failed (make criu)"; }
built="$work/src/criu/criu"
[[ "$(binary_version "$built")" == "$version" ]] \
    || die "built binary reports version '$(binary_version "$built")', expected $version"

# Atomic install: a temporary name in the same directory, then rename; the stamp last.
install -m 0755 -s "$built" "$BIN.tmp.$$" || die "cannot write $BIN.tmp.$$"
mv -f "$BIN.tmp.$$" "$BIN"
printf 'version=%s\n%s\n' "$version" "$recipe" >"$STAMP.tmp.$$"
mv -f "$STAMP.tmp.$$" "$STAMP"

(( install_only )) && exit 0
out="$("$BIN" check 2>&1)" || true
[[ "$out" == *"Looks good"* ]] || { echo "$out" >&2; die "\`$BIN check\` failed on this kernel ($(uname -r))"; }
