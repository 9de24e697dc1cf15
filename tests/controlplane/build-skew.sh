#!/usr/bin/env bash
# Builds the control plane of the version-skew member: kube-apiserver, kube-controller-manager,
# kube-scheduler and kubelet one Kubernetes minor below the main control plane (build.sh), from
# the pinned Go modules in k8s-1.36/. etcd and kubectl come from the main build: etcd does not
# depend on the Kubernetes version and kubectl is supported one minor either side.
#
# Cached like build.sh in $TIDEPOOL_CACHE/cp-skew-<key>, <key> the sha256 of go.mod/go.sum and
# this script; a second run with the same inputs does nothing. Prints the binary directory on
# its last line of stdout; progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(cat "$here/build-skew.sh" "$here/k8s-1.36/go.mod" "$here/k8s-1.36/go.sum" | sha256sum | cut -c1-16)
out="$cache_root/cp-skew-$key"

log() { printf '[controlplane-skew-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached binaries are current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it is needed to build the test clusters"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false"
# Only the module proxy is needed: go.sum is committed, so the checksum database is not asked.
export GONOSUMDB='*' GONOSUMCHECK=1 GOFLAGS="$GOFLAGS -mod=readonly"

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# Prints a line every 25 packages so a cold build shows it is alive.
progress() {
  local what=$1 n=0 line
  while IFS= read -r line; do
    case "$line" in
      *error*|*cannot*|*undefined*|*:[0-9]*:*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); (( n % 25 == 0 )) && log "$what: $n packages compiled ($((SECONDS - start)) s)";;
    esac
  done
  log "$what: done, $n packages ($((SECONDS - start)) s)"
}

KV=v1.36.3
ldflags="-s -w \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=36 \
 -X k8s.io/component-base/version.gitVersion=$KV \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=36 \
 -X k8s.io/client-go/pkg/version.gitVersion=$KV"

log "downloading modules"
(cd "$here/k8s-1.36" && go mod download) >&2

n=0
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
  n=$((n + 1))
  log "building $b $KV ($n/4)"
  (cd "$here/k8s-1.36" && go build -v -ldflags "$ldflags" -o "$tmp/$b" "k8s.io/kubernetes/cmd/$b") 2>&1 | progress "$b"
  [[ -x "$tmp/$b" ]] || { log "missing $b after build"; exit 1; }
done
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s: $out"
echo "$out"
