#!/usr/bin/env bash
# Builds helm (used by the tests to render deploy/helm/tidepool) from the Go module pinned in
# tests/tools/helm/go.mod. Cached outside the repo in $TIDEPOOL_CACHE/helm-<key>, where <key> is
# the sha256 of this script and the module files: a second run with the same inputs does nothing.
# Prints the binary's path on its last line of stdout; progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(cat "$here/build-helm.sh" "$here/helm/go.mod" "$here/helm/go.sum" | sha256sum | cut -c1-16)
out="$cache_root/helm-$key"

log() { printf '[helm-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -x "$out/helm" ]]; then
  log "cached helm is current: $out/helm"
  echo "$out/helm"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it is needed to build helm"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
export GONOSUMDB='*' GONOSUMCHECK=1

mkdir -p "$cache_root"
tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

version=$(cd "$here/helm" && go list -m -f '{{.Version}}' helm.sh/helm/v3)
log "building helm $version (a few minutes cold; a line every 50 packages)"
(cd "$here/helm" && go build -v -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$version" \
   -o "$tmp/helm" helm.sh/helm/v3/cmd/helm) 2>&1 | {
  n=0
  while IFS= read -r line; do
    case "$line" in
      *:[0-9]*:*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); (( n % 50 == 0 )) && log "$n packages compiled ($((SECONDS - start)) s)";;
    esac
  done
  log "done, $n packages ($((SECONDS - start)) s)"
}
[[ -x "$tmp/helm" ]] || { log "helm missing after build"; exit 1; }
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s: $out/helm"
echo "$out/helm"
