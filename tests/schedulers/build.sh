#!/usr/bin/env bash
# Builds the schedulers and the queueing layer tenants and member admins run around tidepool,
# to run as host processes against the local clusters (tests/operators/start.sh starts them):
#   bin/vc-controller-manager    Volcano v1.10.0: Volcano Jobs, their PodGroups, queues, plugins
#   bin/vc-scheduler             Volcano v1.10.0: its gang scheduler
#   bin/coscheduling-scheduler   scheduler-plugins v0.33.5: kube-scheduler with Coscheduling
#   bin/kueue                    Kueue v0.17.0: job queueing by quota
#   crds/volcano/                Volcano's CRDs (config/crd/volcano/bases of its module)
#   crds/scheduler-plugins/      the PodGroup CRD of Coscheduling (config/crd/bases)
#   crds/kueue/                  Kueue's CRDs (config/components/crd/bases)
#   gang-crds/coscheduling.yaml  the two member PodGroup CRDs tidepool hands gangs to
#   gang-crds/volcano.yaml       (`spec.gangScheduler`), for the tests that only install them
#
# Versions: the newest the Go module proxy serves here that build: Volcano v1.12 and v1.13 are
# refused; scheduler-plugins v0.34.7 needs k8s.io/csi-translation-lib v0.34.7, refused.
#
# Each module is pinned by the h1: hash of its zip, checked against what `go mod download -json`
# reports before anything is read or built; each build runs inside the downloaded (read-only)
# module directory as the main module with -mod=readonly, so the module's own go.sum pins every
# dependency. No checksum database is asked (GONOSUMDB='*'). Nothing of theirs is written into
# the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/schedulers-<key>, <key> being the
# sha256 of this script. Prints the output directory on its last line of stdout; progress goes
# to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/build.sh" | cut -c1-16)
out="$cache_root/schedulers-$key"

log() { printf '[schedulers-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached schedulers are current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it builds the schedulers"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

VOLCANO=volcano.sh/volcano@v1.10.0
VOLCANO_SUM=h1:+GzQinGgeV0j58WpWpxByOXgF+YfUPW55zghM8GqjF0=
SCHEDULER_PLUGINS=sigs.k8s.io/scheduler-plugins@v0.33.5
SCHEDULER_PLUGINS_SUM=h1:9u4QAYbuoxa59aStrJKP4Bii2EQrZmGPN2tzvfs2gL0=
KUEUE=sigs.k8s.io/kueue@v0.17.0
KUEUE_SUM=h1:7hzb38M4eKGzYW+CFv2s1L+swzzacUCHOCXxZmAV90I=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin" "$tmp/gang-crds"
scratch=$(mktemp -d)
trap 'rm -rf "$tmp" "$scratch"' EXIT
start=$SECONDS

# fetch MOD@VER SUM: downloads the module, checks its hash, downloads its dependencies
# (verified against the module's own go.sum), prints its directory.
fetch() {
  local json err sum dir
  # `go mod download MOD@VER` must run outside any module; an empty dir is enough.
  json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$1") || {
    log "go mod download $1 failed:"; printf '%s\n' "$json" >&2; return 1; }
  err=$(jq -r '.Error // empty' <<<"$json")
  [[ -z "$err" ]] || { log "go mod download $1: $err"; return 1; }
  sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
  [[ "$sum" == "$2" ]] || { log "$1: hash $sum, expected $2: refusing to build it"; return 1; }
  (cd "$dir" && go mod download) >&2
  log "$1: $sum ok, dependencies downloaded ($((SECONDS - start)) s)"
  printf '%s\n' "$dir"
}

# build DIR PKG NAME: `go build` of PKG in module dir DIR into bin/NAME, at the lowest priority.
build() {
  (cd "$1" && nice -n 19 go build -o "$tmp/bin/$3" "$2") >&2
  log "$3 built ($((SECONDS - start)) s)"
}

# crds NAME FILE...: CRDs into crds/NAME/, each checked to be one.
crds() {
  local name=$1 f; shift
  mkdir -p "$tmp/crds/$name"
  for f; do
    grep -q '^kind: CustomResourceDefinition' "$f" || { log "$f is not a CRD"; return 1; }
    cp "$f" "$tmp/crds/$name/"
  done
}

vc=$(fetch "$VOLCANO" "$VOLCANO_SUM")
build "$vc" ./cmd/controller-manager vc-controller-manager
build "$vc" ./cmd/scheduler vc-scheduler
crds volcano "$vc"/config/crd/volcano/bases/*.yaml
cp "$vc/config/crd/volcano/bases/scheduling.volcano.sh_podgroups.yaml" "$tmp/gang-crds/volcano.yaml"

sp=$(fetch "$SCHEDULER_PLUGINS" "$SCHEDULER_PLUGINS_SUM")
build "$sp" ./cmd/scheduler coscheduling-scheduler
crds scheduler-plugins "$sp/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"
cp "$sp/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$tmp/gang-crds/coscheduling.yaml"

ku=$(fetch "$KUEUE" "$KUEUE_SUM")
build "$ku" ./cmd/kueue kueue
crds kueue "$ku"/config/components/crd/bases/*.yaml

touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "done in $((SECONDS - start)) s: $out"
echo "$out"
