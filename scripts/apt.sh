# Sourced by set-up's scripts: apt-get with retries. Debian's archive and the network to it fail
# now and then (a refused connection, a mirror mid-sync); a bare machine's set-up must not.
APT_RETRY_OPTS=(-o Acquire::Retries=5 -o Acquire::http::Timeout=60)

# apt_get ARGS...: apt-get with ARGS, tried up to three times, a short pause between tries.
apt_get() {
    local try
    for try in 1 2 3; do
        DEBIAN_FRONTEND=noninteractive apt-get "${APT_RETRY_OPTS[@]}" "$@" && return 0
        (( try < 3 )) && { echo "setup: apt-get $* failed (try $try of 3); trying again" >&2; sleep $((try * 10)); }
    done
    return 1
}

# missing_packages PACKAGE...: those of the packages dpkg does not have installed, one a line (all of
# them where dpkg-query itself is absent); never fails.
missing_packages() {
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
    done
    return 0
}

# apt_install PACKAGE...: update the lists, then install the packages (no recommends), with retries.
apt_install() {
    apt_get update -qq && apt_get install -y -qq --no-install-recommends "$@" >/dev/null
}
