#!/usr/bin/env bash
# Builds Volcano v1.10.0, to run as host processes against the local clusters
# (tests/operators/start.sh starts them):
#   bin/vc-controller-manager   Volcano Jobs (batch.volcano.sh/v1alpha1), their PodGroups,
#                               queues and plugins (svc, env, ssh, tensorflow, pytorch, mpi)
#   bin/vc-scheduler            Volcano's gang scheduler
#   crds/                       Volcano's CRDs as its module ships them
#                               (config/crd/volcano/bases: jobs, podgroups, queues, commands,
#                               numatopologies)
#
# Only v1.10.0 of volcano.sh/volcano is served by the Go module proxy here (v1.12 and v1.13 are
# refused). The module is pinned by the h1: hash of its zip, checked against what
# `go mod download -json` reports before anything is read or built; the build runs inside the
# downloaded (read-only) module directory as the main module with -mod=readonly, so the
# module's own go.sum pins every dependency. No checksum database is asked (GONOSUMDB='*').
# Nothing of Volcano's is written into the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/volcano-<key>, <key> being the
# sha256 of this script. Prints the output directory on its last line of stdout; progress goes
# to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/volcano.sh" | cut -c1-16)
out="$cache_root/volcano-$key"

log() { printf '[volcano-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached Volcano is current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it builds Volcano"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

VOLCANO=volcano.sh/volcano@v1.10.0
VOLCANO_SUM=h1:+GzQinGgeV0j58WpWpxByOXgF+YfUPW55zghM8GqjF0=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin" "$tmp/crds"
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$VOLCANO") || {
  log "go mod download $VOLCANO failed:"; printf '%s\n' "$json" >&2; exit 1; }
err=$(jq -r '.Error // empty' <<<"$json")
[[ -z "$err" ]] || { log "go mod download $VOLCANO: $err"; exit 1; }
sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
[[ "$sum" == "$VOLCANO_SUM" ]] || { log "$VOLCANO: hash $sum, expected $VOLCANO_SUM: refusing to build it"; exit 1; }
log "$VOLCANO: $sum ok"
(cd "$dir" && go mod download) >&2
log "dependencies downloaded ($((SECONDS - start)) s)"

for what in controller-manager scheduler; do
  (cd "$dir" && nice -n 19 go build -o "$tmp/bin/vc-$what" "./cmd/$what") >&2
  log "vc-$what built ($((SECONDS - start)) s)"
done

for f in "$dir"/config/crd/volcano/bases/*.yaml; do
  grep -q '^kind: CustomResourceDefinition' "$f" || { log "$f is not a CRD"; exit 1; }
  cp "$f" "$tmp/crds/"
done

touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "done in $((SECONDS - start)) s: $out"
echo "$out"
