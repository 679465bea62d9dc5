#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine, as root: system packages, a
# virtual environment with fanfold, and the host fixes `fanfold doctor --fix` makes.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(crun runc debootstrap gcc libc6-dev git iproute2 nftables procps python3 python3-venv ca-certificates
          skopeo containers-storage golang-github-containers-common libseccomp2 btrfs-progs docker-registry
          apache2-utils openssl)
if [[ "${1:-}" == "--bench" ]]; then
    PACKAGES+=(bubblewrap podman uidmap)
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if (( ${#missing[@]} )); then
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.fanfold-installed
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]]; then
    .venv/bin/pip install -q --disable-pip-version-check -e '.[all,test]'  # every extra: demo and tests use them
    touch "$stamp"
fi

# CRIU >= 4.1 for memory snapshots, fork and suspend (Debian 12's 3.17 fails `criu check`).
bash scripts/criu.sh

# gVisor's runsc >= 20240729 for runtime="runsc" (Debian 12's own fails `ls -l` in a sandbox).
bash scripts/runsc.sh

.venv/bin/fanfold doctor --fix
