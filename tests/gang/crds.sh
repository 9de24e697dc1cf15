#!/usr/bin/env bash
# Fetches the PodGroup CRDs of the member gang schedulers tidepool hands gangs to
# (`spec.gangScheduler`), for the e2e tests, which install them in member-b:
#   coscheduling.yaml  podgroups.scheduling.x-k8s.io, as scheduler-plugins v0.33.5 ships it
#                      (config/crd/bases of its module; tests/gang/scheduler-plugins.sh builds
#                      that scheduler);
#   volcano.yaml       podgroups.scheduling.volcano.sh, as Volcano v1.10.0 ships it
#                      (config/crd/volcano/bases of its module; tests/gang/volcano.sh builds
#                      that Volcano).
#
# Everything comes from the Go module proxy, each module pinned by the h1: hash of its zip and
# checked against what `go mod download -json` reports before anything is read or built; no
# checksum database is asked (GONOSUMDB='*'). Nothing is written into the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/gang-crds-<key>, <key> being the
# sha256 of this script. Prints the output directory on its last line of stdout.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/crds.sh" | cut -c1-16)
out="$cache_root/gang-crds-$key"

log() { printf '[gang-crds %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached CRDs are current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it fetches the PodGroup CRDs"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

SP=sigs.k8s.io/scheduler-plugins@v0.33.5
SP_SUM=h1:9u4QAYbuoxa59aStrJKP4Bii2EQrZmGPN2tzvfs2gL0=
VC=volcano.sh/volcano@v1.10.0
VC_SUM=h1:+GzQinGgeV0j58WpWpxByOXgF+YfUPW55zghM8GqjF0=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

# The directory of module `$1`, downloaded and checked against hash `$2`.
module_dir() {
  local json err sum
  # `go mod download MOD@VER` must run outside any module; an empty dir is enough.
  json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$1") || {
    log "go mod download $1 failed:"; printf '%s\n' "$json" >&2; return 1; }
  err=$(jq -r '.Error // empty' <<<"$json")
  [[ -z "$err" ]] || { log "go mod download $1: $err"; return 1; }
  sum=$(jq -r .Sum <<<"$json")
  [[ "$sum" == "$2" ]] || { log "$1: hash $sum, expected $2: refusing it"; return 1; }
  log "$1: $sum ok"
  jq -r .Dir <<<"$json"
}

sp=$(module_dir "$SP" "$SP_SUM")
cp "$sp/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$tmp/coscheduling.yaml"

vc=$(module_dir "$VC" "$VC_SUM")
cp "$vc/config/crd/volcano/bases/scheduling.volcano.sh_podgroups.yaml" "$tmp/volcano.yaml"

for f in coscheduling volcano; do
  grep -q '^kind: CustomResourceDefinition' "$tmp/$f.yaml" || { log "$f.yaml is not a CRD"; exit 1; }
done
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "done in $((SECONDS - start)) s: $out"
echo "$out"
