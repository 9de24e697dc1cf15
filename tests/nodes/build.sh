#!/usr/bin/env bash
# Builds what a real node needs besides the kubelet (which tests/controlplane/build.sh makes):
#   containerd, ctr, containerd-shim-runc-v2   containerd v2.4.2
#   cni/bridge, cni/host-local, cni/loopback, cni/portmap   CNI plugins v1.10.0
#   coredns                                    CoreDNS v1.15.0
#   runc                                       runc v1.4.4 (cgo, with seccomp: libseccomp-dev)
#
# Sources come from the Go module proxy only. Each module is pinned by its h1: hash below,
# checked against what `go mod download -json` reports before anything is built; the build
# then runs inside the downloaded (read-only) module directory with -mod=readonly, so the
# module's own go.sum pins every dependency. No checksum database is asked (GONOSUMDB='*').
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/nodes-<key>, <key> being the sha256
# of this script: a second run with the same script does nothing. Prints the output directory
# on its last line of stdout; progress goes to stderr.
#
# Measured cold build times (2 shared cores, `nice -n 10`, Go 1.26.8, CGO_ENABLED=0; module
# sources already in ~/go/pkg/mod, Go build cache warm only from the control-plane build,
# another build running at the same time), 295 s in all:
#   containerd + ctr            109 s  (736 packages; dependencies checked/downloaded 5 s)
#   containerd-shim-runc-v2       2 s
#   CNI plugins (4)               7 s  (deps 3 s)
#   coredns                     155 s  (1023 packages; deps 14 s)
#   runc                         11 s
# A rerun with the same script prints the cached directory at once.
#
# Traps:
#   - containerd's Makefile is not used (it wants git); the tags and ldflags it would pass
#     are given here. The shim is built with no_grpc (it only speaks ttrpc), the daemon with
#     no_btrfs (no btrfs headers needed, and it is not the snapshotter used).
#   - containerd finds the shim on PATH: put this directory on PATH of containerd's process.
#   - runc is linked against the machine's libseccomp (cgo, `-tags seccomp`): it runs on
#     machines like this one. It is built rather than taken from Debian (1.1.5 there) because
#     user namespaces (`hostUsers: false`) need runc 1.2 or later: containerd tells the kubelet
#     the runtime supports them only when runc reports idmapped mounts.
#   - `go build` in the module cache needs GOFLAGS=-mod=readonly (the dir is read-only, and
#     go.sum there is complete); GOTOOLCHAIN=local because the go.mod files say go 1.26.x.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(cat "$here/build.sh" | sha256sum | cut -c1-16)
out="$cache_root/nodes-$key"

log() { printf '[nodes-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached binaries are current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it is needed to build the node binaries"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0
export GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

# module@version and the h1: hash of its zip, as the proxy served it when this was written.
CONTAINERD=github.com/containerd/containerd/v2@v2.4.2
CONTAINERD_SUM=h1:p6Qg+xbEz8lvwdhHDx0U469xENvp4LgGBx+E7djXkGw=
CNI=github.com/containernetworking/plugins@v1.10.0
CNI_SUM=h1:4lwzpgsn5NdIneXrag/EEfKzhNSriJc1zTxZxfdfPLQ=
RUNC=github.com/opencontainers/runc@v1.4.4
RUNC_SUM=h1:mvhKTP28W0+S2JQ6RCZXRJzwvaipR4pQl81n5xBnGbA=
COREDNS=github.com/coredns/coredns@v1.15.0
COREDNS_SUM=h1:OBT+OEyHVdUiVxPhrNlC5XZVq3RkSxzQXfZQ76gm5ck=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/cni"
# `go mod download MOD@VER` must run outside any module; an empty dir is enough.
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

# Prints a line every 25 packages so a cold build shows it is alive.
progress() {
  local what=$1 t0=$SECONDS n=0 line
  while IFS= read -r line; do
    case "$line" in
      # `go build -v` prints bare import paths; anything with a space or colon is a message.
      *" "*|*:*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); (( n % 25 == 0 )) && log "$what: $n packages compiled ($((SECONDS - t0)) s)";;
    esac
  done
  log "$what: done, $n packages compiled in $((SECONDS - t0)) s"
}

# Downloads MOD@VER (with its dependencies' go.mod files as needed later), checks its hash,
# prints its directory.
fetch() {
  local modver=$1 want=$2 t0=$SECONDS json dir sum err
  json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$modver") || {
    log "go mod download $modver failed:"; printf '%s\n' "$json" >&2; return 1; }
  err=$(jq -r '.Error // empty' <<<"$json")
  [[ -z "$err" ]] || { log "go mod download $modver: $err"; return 1; }
  sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
  [[ "$sum" == "$want" ]] || { log "$modver: hash $sum, expected $want: refusing to build it"; return 1; }
  log "$modver: $sum ok, in $dir ($((SECONDS - t0)) s)"
  # The dependencies, verified against the module's own go.sum.
  (cd "$dir" && go mod download) >&2
  log "$modver: dependencies downloaded ($((SECONDS - t0)) s)"
  printf '%s\n' "$dir"
}

# set -o pipefail makes a failed `go build` fail the pipe into progress.
log "containerd (1/4): $CONTAINERD"
dir=$(fetch "$CONTAINERD" "$CONTAINERD_SUM")
cpkg=github.com/containerd/containerd/v2
cld="-s -w -X $cpkg/version.Version=${CONTAINERD#*@} -X $cpkg/version.Package=$cpkg"
(cd "$dir" && go build -v -tags "urfave_cli_no_docs no_btrfs" -ldflags "$cld" \
   -o "$tmp/" ./cmd/containerd ./cmd/ctr) 2>&1 | progress "containerd+ctr"
(cd "$dir" && go build -v -tags "urfave_cli_no_docs no_grpc" -ldflags "$cld" \
   -o "$tmp/containerd-shim-runc-v2" ./cmd/containerd-shim-runc-v2) 2>&1 | progress "containerd-shim-runc-v2"

log "CNI plugins (2/4): $CNI"
dir=$(fetch "$CNI" "$CNI_SUM")
for p in main/bridge ipam/host-local main/loopback meta/portmap; do
  (cd "$dir" && go build -v \
     -ldflags "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=${CNI#*@}" \
     -o "$tmp/cni/${p#*/}" "./plugins/$p") 2>&1 | progress "cni ${p#*/}"
done

log "CoreDNS (3/4): $COREDNS"
dir=$(fetch "$COREDNS" "$COREDNS_SUM")
(cd "$dir" && go build -v -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=${COREDNS#*@}" \
   -o "$tmp/coredns" .) 2>&1 | progress coredns

log "runc (4/4): $RUNC"
[[ -f /usr/include/seccomp.h ]] || { log "libseccomp-dev is missing: run bash deploy/prereqs.sh"; exit 1; }
dir=$(fetch "$RUNC" "$RUNC_SUM")
(cd "$dir" && CGO_ENABLED=1 go build -v -tags seccomp -ldflags "-s -w -X main.version=${RUNC#*@}" \
   -o "$tmp/runc" .) 2>&1 | progress runc
log "runc: $("$tmp/runc" --version | head -1)"

for b in containerd ctr containerd-shim-runc-v2 coredns runc cni/bridge cni/host-local cni/loopback cni/portmap; do
  [[ -x "$tmp/$b" ]] || { log "missing $b after build"; exit 1; }
done
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "built in $((SECONDS - start)) s: $out"
echo "$out"
