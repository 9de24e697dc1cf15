#!/usr/bin/env bash
# Builds scheduler-plugins v0.33.5's scheduler (kube-scheduler with the Coscheduling plugin), to
# run as a second scheduler in a member cluster (tests/operators/start.sh coscheduling):
#   bin/coscheduling-scheduler   its cmd/scheduler
#   crds/                        the PodGroup CRD it schedules by
#                                (podgroups.scheduling.x-k8s.io, config/crd/bases of its module)
#
# v0.33.5 is the newest that builds from the Go module proxy here: v0.34.7 needs
# k8s.io/csi-translation-lib v0.34.7, which the proxy refuses. The module is pinned by the h1:
# hash of its zip, checked against what `go mod download -json` reports before anything is read
# or built; the build runs inside the downloaded module directory as the main module with
# -mod=readonly, so its go.sum pins every dependency. No checksum database is asked
# (GONOSUMDB='*'). Nothing of scheduler-plugins' is written into the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/scheduler-plugins-<key>, <key> being
# the sha256 of this script. Prints the output directory on its last line of stdout; progress
# goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/scheduler-plugins.sh" | cut -c1-16)
out="$cache_root/scheduler-plugins-$key"

log() { printf '[scheduler-plugins-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached scheduler-plugins is current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it builds scheduler-plugins"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

SP=sigs.k8s.io/scheduler-plugins@v0.33.5
SP_SUM=h1:9u4QAYbuoxa59aStrJKP4Bii2EQrZmGPN2tzvfs2gL0=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin" "$tmp/crds"
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$SP") || {
  log "go mod download $SP failed:"; printf '%s\n' "$json" >&2; exit 1; }
err=$(jq -r '.Error // empty' <<<"$json")
[[ -z "$err" ]] || { log "go mod download $SP: $err"; exit 1; }
sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
[[ "$sum" == "$SP_SUM" ]] || { log "$SP: hash $sum, expected $SP_SUM: refusing to build it"; exit 1; }
log "$SP: $sum ok"
(cd "$dir" && go mod download) >&2
log "dependencies downloaded ($((SECONDS - start)) s)"
(cd "$dir" && nice -n 19 go build -o "$tmp/bin/coscheduling-scheduler" ./cmd/scheduler) >&2
log "coscheduling-scheduler built ($((SECONDS - start)) s)"

f=$dir/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml
grep -q '^kind: CustomResourceDefinition' "$f" || { log "$f is not a CRD"; exit 1; }
cp "$f" "$tmp/crds/"

touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "done in $((SECONDS - start)) s: $out"
echo "$out"
