#!/usr/bin/env bash
# Builds the local control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, etcd, kwok) and the kubelet of the real nodes from the pinned Go modules beside
# this script.
#
# The binaries are cached outside the repo in $TIDEPOOL_CACHE/cp-<key>, where <key> is the
# sha256 of the go.mod/go.sum files and this script: a second run with the same inputs does
# nothing. Prints the binary directory on its last line of stdout; progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(cat "$here/build.sh" "$here/k8s/go.mod" "$here/k8s/go.sum" \
          "$here/kwok/go.mod" "$here/kwok/go.sum" | sha256sum | cut -c1-16)
out="$cache_root/cp-$key"

log() { printf '[controlplane-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

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

# Prints a line every 25 packages so a cold build (tens of minutes on 2 cores) shows it is alive.
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

KV=v1.37.2
ldflags="-s -w \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=37 \
 -X k8s.io/component-base/version.gitVersion=$KV \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z \
 -X k8s.io/client-go/pkg/version.gitMajor=1 \
 -X k8s.io/client-go/pkg/version.gitMinor=37 \
 -X k8s.io/client-go/pkg/version.gitVersion=$KV"

log "downloading modules"
(cd "$here/k8s" && go mod download) >&2
(cd "$here/kwok" && go mod download) >&2

log "building etcd (1/3)"
(cd "$here/k8s" && go build -v -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3) 2>&1 | progress etcd

log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet (2/3)"
(cd "$here/k8s" && go build -v -ldflags "$ldflags" -o "$tmp/" \
   k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
   k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
   k8s.io/kubernetes/cmd/kubelet) 2>&1 | progress kubernetes

log "building kwok (3/3)"
kwok_version=$(cd "$here/kwok" && go list -m -f '{{.Version}}' sigs.k8s.io/kwok)
(cd "$here/kwok" && go build -v -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$kwok_version" \
   -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok) 2>&1 | progress kwok

# kwok's stage definitions come from its module, read where go put it (nothing copied into the repo).
kw=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
mkdir -p "$tmp/kwok-stages"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  cp "$kw/kustomize/stage/$f" "$tmp/kwok-stages/$(basename "$f")"
done

for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kwok; do
  [[ -x "$tmp/$b" ]] || { log "missing $b after build"; exit 1; }
done
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s: $out"
echo "$out"
