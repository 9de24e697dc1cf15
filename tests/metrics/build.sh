#!/usr/bin/env bash
# Builds metrics-server v0.8.0, which the local clusters run as a host process (one per
# cluster, started by tests/controlplane/cluster.sh) so `kubectl top` and the HPA work in the
# training cluster and the members' metrics.k8s.io API feeds the virtual nodes' kubelet API.
#
# The source comes from the Go module proxy only, pinned by the h1: hash of its zip below and
# checked against what `go mod download -json` reports before anything is built; the build runs
# inside the downloaded (read-only) module directory with -mod=readonly, so the module's own
# go.sum pins every dependency. No checksum database is asked (GONOSUMDB='*').
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/metrics-server-<key>, <key> being
# the sha256 of this script: a second run with the same script does nothing. Prints the output
# directory on its last line of stdout; progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/build.sh" | cut -c1-16)
out="$cache_root/metrics-server-$key"

log() { printf '[metrics-server-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached binary is current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it is needed to build metrics-server"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0
export GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

MS=sigs.k8s.io/metrics-server@v0.8.0
MS_SUM=h1:Zlsi3sBWEtFKCD3+xSysThvXyLQ363rUAlqpnsY5JwI=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
# `go mod download MOD@VER` must run outside any module; an empty dir is enough.
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

# Prints a line every 25 packages so a cold build shows it is alive.
progress() {
  local n=0 line
  while IFS= read -r line; do
    case "$line" in
      # `go build -v` prints bare import paths; anything with a space or colon is a message.
      *" "*|*:*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); (( n % 25 == 0 )) && log "$n packages compiled ($((SECONDS - start)) s)";;
    esac
  done
  log "done, $n packages compiled ($((SECONDS - start)) s)"
}

json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$MS") || {
  log "go mod download $MS failed:"; printf '%s\n' "$json" >&2; exit 1; }
err=$(jq -r '.Error // empty' <<<"$json")
[[ -z "$err" ]] || { log "go mod download $MS: $err"; exit 1; }
sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
[[ "$sum" == "$MS_SUM" ]] || { log "$MS: hash $sum, expected $MS_SUM: refusing to build it"; exit 1; }
log "$MS: $sum ok, in $dir"
(cd "$dir" && go mod download) >&2
log "dependencies downloaded ($((SECONDS - start)) s)"

# The version metrics-server reports, as its Makefile would stamp it.
ver=${MS#*@}
ld="-s -w -X k8s.io/client-go/pkg/version.gitVersion=$ver -X k8s.io/client-go/pkg/version.buildDate=1970-01-01T00:00:00Z"
(cd "$dir" && go build -v -ldflags "$ld" -o "$tmp/metrics-server" ./cmd/metrics-server) 2>&1 | progress

[[ -x "$tmp/metrics-server" ]] || { log "missing metrics-server after build"; exit 1; }
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "built in $((SECONDS - start)) s: $out"
echo "$out"
