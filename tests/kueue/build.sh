#!/usr/bin/env bash
# Builds Kueue v0.17.0, the job queueing layer tenants put in front of tidepool, to run as a
# host process against a local cluster (tests/operators/start.sh kueue):
#   bin/kueue   its cmd/kueue (controllers, webhooks, its own webhook certificates)
#   crds/       its CRDs as its module ships them (config/components/crd/bases)
#
# The module is pinned by the h1: hash of its zip, checked against what `go mod download -json`
# reports before anything is read or built; the build runs inside the downloaded module
# directory as the main module with -mod=readonly, so its go.sum pins every dependency. No
# checksum database is asked (GONOSUMDB='*'). Nothing of Kueue's is written into the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/kueue-<key>, <key> being the sha256
# of this script. Prints the output directory on its last line of stdout; progress goes to
# stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/build.sh" | cut -c1-16)
out="$cache_root/kueue-$key"

log() { printf '[kueue-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached Kueue is current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it builds Kueue"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

KUEUE=sigs.k8s.io/kueue@v0.17.0
KUEUE_SUM=h1:7hzb38M4eKGzYW+CFv2s1L+swzzacUCHOCXxZmAV90I=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin" "$tmp/crds"
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$KUEUE") || {
  log "go mod download $KUEUE failed:"; printf '%s\n' "$json" >&2; exit 1; }
err=$(jq -r '.Error // empty' <<<"$json")
[[ -z "$err" ]] || { log "go mod download $KUEUE: $err"; exit 1; }
sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
[[ "$sum" == "$KUEUE_SUM" ]] || { log "$KUEUE: hash $sum, expected $KUEUE_SUM: refusing to build it"; exit 1; }
log "$KUEUE: $sum ok"
(cd "$dir" && go mod download) >&2
log "dependencies downloaded ($((SECONDS - start)) s)"
(cd "$dir" && nice -n 19 go build -o "$tmp/bin/kueue" ./cmd/kueue) >&2
log "kueue built ($((SECONDS - start)) s)"

for f in "$dir"/config/components/crd/bases/*.yaml; do
  grep -q '^kind: CustomResourceDefinition' "$f" || { log "$f is not a CRD"; exit 1; }
  cp "$f" "$tmp/crds/"
done

touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "done in $((SECONDS - start)) s: $out"
echo "$out"
