#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine, as root, in two stages:
#   install: system packages, CRIU (scripts/criu.sh), runsc (scripts/runsc.sh) and a virtual
#            environment with fanfold; nothing else on the host changes;
#   host:    the host fixes `fanfold doctor --fix` makes (cgroup hybrid mode, favordynmods).
#
#   bash scripts/setup.sh                 both stages (what `make demo` and `make test` run)
#   bash scripts/setup.sh --install-only  the install stage alone (CI runs it in a bare Debian root)
#   bash scripts/setup.sh --bench         both, plus the peers the benchmarks compare with
#   bash scripts/setup.sh --check         install nothing: list what is missing, exit 1 if anything is
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt.sh

usage() { sed -n '2,10s/^# \{0,1\}//p' "$0"; }
install_only=0 bench=0 check=0
for arg in "$@"; do
    case "$arg" in
        --install-only) install_only=1 ;;
        --bench) bench=1 ;;
        --check) check=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done

PACKAGES=(crun runc debootstrap gcc libc6-dev git iproute2 nftables procps python3 python3-venv ca-certificates
          skopeo containers-storage golang-github-containers-common libseccomp2 btrfs-progs docker-registry
          apache2-utils openssl
          systemd dbus openssh-server podman podman-compose catatonit uidmap fuse-overlayfs slirp4netns)
# systemd, sshd and podman run inside sandboxes built on the host base (init="systemd", SSH, nested=True);
# catatonit is the init of podman's pods (a Recommends of podman, which apt here does not install)
if (( bench )); then
    PACKAGES+=(bubblewrap)
fi
PYTHON="${PYTHON:-python3}"
VENV="${FANFOLD_VENV:-.venv}"
STAMP="$VENV/.fanfold-installed"

# The probes (missing_packages is apt.sh's): each says what is missing and never fails because a tool is absent.
HARBOR_VENV="${FANFOLD_HARBOR_VENV:-.venv-harbor}"
HARBOR_STAMP="$HARBOR_VENV/.fanfold-installed"
harbor_venv_current() { [[ -x "$HARBOR_VENV/bin/python" && -f "$HARBOR_STAMP" && ! pyproject.toml -nt "$HARBOR_STAMP" ]]; }
# The first Python >= 3.12 of FANFOLD_HARBOR_PYTHON, PATH and pyenv's versions (newest first); fails if none.
find_harbor_python() {
    local candidate
    for candidate in "${FANFOLD_HARBOR_PYTHON:-}" python3.13 python3.12 \
                     $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -rV); do
        [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v "$candidate"; return 0; }
    done
    return 1
}
venv_current() { [[ -x "$VENV/bin/python" && -f "$STAMP" && ! pyproject.toml -nt "$STAMP" ]]; }

if (( check )); then
    status=0
    mapfile -t missing < <(missing_packages "${PACKAGES[@]}")
    if (( ${#missing[@]} )); then echo "setup: missing packages: ${missing[*]}"; status=1; fi
    venv_current || { echo "setup: missing: the virtual environment $VENV with fanfold"; status=1; }
    if find_harbor_python >/dev/null && ! harbor_venv_current; then
        echo "setup: missing: Harbor's virtual environment $HARBOR_VENV"; status=1
    fi
    bash scripts/criu.sh --check --install-only || status=1  # installed, not run against this kernel
    bash scripts/runsc.sh --check || status=1
    (( status )) || echo "setup: everything is installed"
    exit "$status"
fi

mapfile -t missing < <(missing_packages "${PACKAGES[@]}")
if (( ${#missing[@]} )); then
    echo "setup: installing ${missing[*]}"
    apt_install "${missing[@]}" || { echo "setup: apt-get install ${missing[*]} failed" >&2; exit 1; }
fi

if ! venv_current; then
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    echo "setup: installing fanfold and its extras into $VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[all,test]'  # every extra: demo and tests use them
    touch "$STAMP"
fi

# Harbor (fanfold.integrations.harbor) needs Python >= 3.12: its own virtual environment, made with the
# first such Python found (FANFOLD_HARBOR_PYTHON, python3.13/python3.12 on PATH, pyenv's); none: skipped.
if harbor_python=$(find_harbor_python); then
    if ! harbor_venv_current; then
        [[ -x "$HARBOR_VENV/bin/python" ]] || "$harbor_python" -m venv "$HARBOR_VENV"
        echo "setup: installing Harbor and fanfold into $HARBOR_VENV ($("$harbor_python" --version))"
        "$HARBOR_VENV/bin/pip" install -q --disable-pip-version-check -e '.[harbor,server,net]'
        touch "$HARBOR_STAMP"
    fi
else
    echo "setup: no Python >= 3.12 here (pyenv or python3.12/python3.13 on PATH): Harbor's environment and its tests are skipped"
fi

# CRIU >= 4.1 for memory snapshots, fork and suspend (Debian 12's 3.17 fails `criu check`).
# The install stage does not run it against the kernel: that is the host stage's doctor.
if (( install_only )); then bash scripts/criu.sh --install-only; else bash scripts/criu.sh; fi

# gVisor's runsc >= 20240729 for runtime="runsc" (Debian 12's own fails `ls -l` in a sandbox).
bash scripts/runsc.sh

if (( install_only )); then
    echo "setup: installed (the host stage is \`$VENV/bin/fanfold doctor --fix\`)"
    exit 0
fi
"$VENV/bin/fanfold" doctor --fix
