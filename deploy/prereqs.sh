#!/usr/bin/env bash
# The prerequisites step of the README's two commands and of CI: checks every line of
# deploy/prerequisites, installs the missing Debian and Python packages in one go, and
# checks what the long builds will need from the machine (root, disk, the Go module proxy,
# the crate registry), so a missing piece is named within the first minute, not after a
# 25-minute build.
#
#   bash deploy/prereqs.sh           check and install (as root)
#   bash deploy/prereqs.sh --check   check only; exit 1 naming what is missing
#
# Environment: TIDEPOOL_PREREQS_DONE=1 skips the step (a caller that already ran it).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
list=$here/prerequisites
mode=${1:-install}

log() { printf '[prereqs %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

[[ ${TIDEPOOL_PREREQS_DONE:-0} == 1 ]] && exit 0

# present CHECK: is it on this machine?
present() {
  local kind=${1%%:*} what=${1#*:}
  case $kind in
    cmd) command -v "$what" >/dev/null 2>&1 ;;
    file) [[ -e $what ]] ;;
    static) [[ -x $what ]] && ! ldd "$what" >/dev/null 2>&1 ;;
    py) python3 -c "import $what" >/dev/null 2>&1 ;;
    *) die "deploy/prerequisites: unknown check '$1'" ;;
  esac
}

debs=() pips=() missing=() why=()
while read -r check source reason; do
  [[ -z $check || $check == \#* ]] && continue
  present "$check" && continue
  case $source in
    debian:*) debs+=("${source#debian:}") ;;
    pypi:*) pips+=("${source#pypi:}") ;;
    toolchain:*) missing+=("${check#*:} (${source#toolchain:}, comes with the machine: $reason)") ;;
    *) die "deploy/prerequisites: unknown source '$source' for $check" ;;
  esac
  why+=("${check#*:} ($source): $reason")
done <"$list"

((${#missing[@]} == 0)) || die "missing toolchains: ${missing[*]}"

if ((${#debs[@]} + ${#pips[@]})); then
  printf '[prereqs] missing: %s\n' "${why[@]}" >&2
  [[ $mode == --check ]] && die "run bash deploy/prereqs.sh as root to install them"
  [[ $(id -u) -eq 0 ]] || die "installing packages needs root (the real nodes need it too)"
fi

if ((${#debs[@]})); then
  mapfile -t debs < <(printf '%s\n' "${debs[@]}" | sort -u)
  log "apt-get install ${debs[*]}"
  command -v apt-get >/dev/null || die "no apt-get: install ${debs[*]} with this system's package manager"
  if ! timeout 120 apt-get update -qq >&2 ||
     ! DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq --no-install-recommends \
         "${debs[@]}" >/dev/null; then
    die "apt-get could not install ${debs[*]}: is the Debian package registry reachable?"
  fi
fi
if ((${#pips[@]})); then
  log "pip install ${pips[*]}"
  timeout 300 python3 -m pip install -q "${pips[@]}" >&2 ||
    die "pip could not install ${pips[*]}: is the Python package registry reachable?"
fi

# Everything on the list is here now, or the list is wrong.
while read -r check source reason; do
  [[ -z $check || $check == \#* ]] && continue
  present "$check" || die "${check#*:} is still missing after installing $source ($reason)"
done <"$list"

# What the builds need beyond packages, asked now rather than after a long build.
[[ $mode == --check ]] && { log "all prerequisites present"; exit 0; }
[[ $(id -u) -eq 0 ]] || die "run as root: the real nodes (containerd, kubelet, CNI bridges) need it"
go_minor=$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
((${go_minor:-0} >= 26)) || die "Go 1.26 or newer is needed (found $(go env GOVERSION))"
cache_dir=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
while [[ ! -d $cache_dir ]]; do cache_dir=$(dirname "$cache_dir"); done
free_gb=$(df -Pk "$cache_dir" | awk 'NR == 2 {print int($4 / 1048576)}')
((${free_gb:-0} >= 10)) || die "about 10 GiB free are needed for the clusters' state and the builds (found ${free_gb:-?} GiB)"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
if ! (cd "$probe" && GOTOOLCHAIN=local GOFLAGS=-mod=mod GONOSUMDB='*' timeout 60 \
        go mod download github.com/google/uuid@v1.6.0) >/dev/null 2>&1; then
  die "the Go module proxy does not answer ($(go env GOPROXY)): the clusters are built from it"
fi
(cd "$root" && timeout 300 cargo fetch --locked -q) ||
  die "cargo fetch failed: the crate registry is needed to build tidepool"
log "all prerequisites present"
