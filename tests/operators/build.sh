#!/usr/bin/env bash
# Builds the field's real training operators, to run as host processes against the local
# clusters (tests/operators/start.sh starts one):
#   training-operator   Kubeflow training-operator v1.9.3 (TFJob, PyTorchJob, XGBoostJob,
#                       PaddleJob, JAXJob; its MPIJob v1 is left to mpi-operator below)
#   mpi-operator        Kubeflow mpi-operator v0.8.0 (MPIJob kubeflow.org/v2beta1)
#   jobset              JobSet v0.10.1 (jobset.x-k8s.io/v1alpha2), the controller and its webhooks
#   trainer-controller-manager   Kubeflow Trainer v2.2.0 (TrainJob, [Cluster]TrainingRuntime
#                       trainer.kubeflow.org/v1alpha1; its TrainJobs run as JobSets)
#   crds/<operator>/    each operator's CRDs, as its module ships them
#   runtimes/trainer/   Trainer's ClusterTrainingRuntimes (torch, deepspeed, jax, mlx, xgboost)
#
# Sources come from the Go module proxy only. Each module is pinned by its h1: hash below,
# checked against what `go mod download -json` reports before anything is read or built; the
# build then runs inside the downloaded (read-only) module directory as the main module, with
# -mod=readonly, so the module's own go.sum pins every dependency. No checksum database is
# asked (GONOSUMDB='*'). Nothing of theirs is written into the repository.
#
# The output is cached outside the repo in $TIDEPOOL_CACHE/operators-<key>, <key> being the
# sha256 of this script: a second run with the same script does nothing. Prints the output
# directory on its last line of stdout; progress goes to stderr.
#
# Measured cold build times: see tests/operators/README.md.
#
# Traps:
#   - training-operator v1.9.3 ships an MPIJob v1 CRD named like mpi-operator's v2beta1 one
#     (mpijobs.kubeflow.org): both are kept here, apart; start.sh installs only the v2beta1
#     one and starts the training-operator without its MPIJob scheme.
#   - mpi-operator's health check port is a constant: see mpi_health_patch below.
#   - the modules' go.mod files say go 1.23 to 1.25: GOTOOLCHAIN=local builds them with the
#     machine's Go.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
key=$(sha256sum <"$here/build.sh" | cut -c1-16)
out="$cache_root/operators-$key"

log() { printf '[operators-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -f "$out/.complete" ]]; then
  log "cached operators are current: $out"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { log "go is not installed: it is needed to build the operators"; exit 1; }
command -v jq >/dev/null || { log "jq is not installed (bash deploy/prereqs.sh)"; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0
export GONOSUMDB='*' GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

# module@version and the h1: hash of its zip, as the proxy served it when this was written.
TRAINING_OPERATOR=github.com/kubeflow/training-operator@v1.9.3
TRAINING_OPERATOR_SUM=h1:aaSHqskOtCY8Dn8sVd+l9p5XAczW6O0nYMPjVLAw/lc=
MPI_OPERATOR=github.com/kubeflow/mpi-operator@v0.8.0
MPI_OPERATOR_SUM=h1:22EccUiO4VDooG4TooesdE8o8euGVj89PIRhiP24SRE=
JOBSET=sigs.k8s.io/jobset@v0.10.1
JOBSET_SUM=h1:u8QKifNsrWVrlRFe6w2ofYTqFT9ma2DRHxfeB2m9xyU=
TRAINER=github.com/kubeflow/trainer/v2@v2.2.0
TRAINER_SUM=h1:whChZckEtycLo1UKH/M0hiNaCUozbLvf9JrgmMv+TAg=

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/crds"
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

# Downloads MOD@VER, checks its hash, downloads its dependencies (verified against the
# module's own go.sum), prints its directory.
fetch() {
  local modver=$1 want=$2 t0=$SECONDS json dir sum err
  json=$(cd "$scratch" && GOFLAGS=-mod=mod go mod download -json "$modver") || {
    log "go mod download $modver failed:"; printf '%s\n' "$json" >&2; return 1; }
  err=$(jq -r '.Error // empty' <<<"$json")
  [[ -z "$err" ]] || { log "go mod download $modver: $err"; return 1; }
  sum=$(jq -r .Sum <<<"$json"); dir=$(jq -r .Dir <<<"$json")
  [[ "$sum" == "$want" ]] || { log "$modver: hash $sum, expected $want: refusing to build it"; return 1; }
  log "$modver: $sum ok, in $dir ($((SECONDS - t0)) s)"
  (cd "$dir" && go mod download) >&2
  log "$modver: dependencies downloaded ($((SECONDS - t0)) s)"
  printf '%s\n' "$dir"
}

# build WHAT DIR PKG [GO BUILD ARGS...]: `go build` of PKG inside module dir DIR into $tmp/WHAT,
# at the lowest priority (the machine is shared). set -o pipefail makes a failed `go build`
# fail the pipe into progress.
build() {
  local what=$1 dir=$2 pkg=$3; shift 3
  (cd "$dir" && nice -n 19 go build -v "$@" -o "$tmp/$what" "$pkg") 2>&1 | progress "$what"
}

# copy_crds NAME FILE...: the CRDs of one operator into crds/NAME/, each checked to be one.
copy_crds() {
  local name=$1 f; shift
  mkdir -p "$tmp/crds/$name"
  for f; do
    grep -q '^kind: CustomResourceDefinition' "$f" || { log "$f is not a CRD"; return 1; }
    cp "$f" "$tmp/crds/$name/"
  done
}

# mpi-operator serves its leader-election health check on :8080, a constant (no flag): two
# cluster sets (the demo's and the tests') could not each run one, and 8080 is a common port.
# The module is copied into the partial output dir (the module cache is read-only, and Go
# refuses build overlays of files under it), the copy's listen address becomes
# $MPI_OPERATOR_HEALTH_ADDR when set (start.sh sets it), :8080 otherwise, and the copy is built
# as the main module with the module's own go.sum, then removed. Prints the copy's directory.
mpi_health_patch() {
  local src=$tmp/src/mpi-operator app
  mkdir -p "$tmp/src"
  cp -R "$1" "$src"; chmod -R u+w "$src"
  app=$src/cmd/mpi-operator/app
  sed -i 's|Addr:    fmt.Sprintf(":%d", healthCheckPort),|Addr:    healthCheckAddr(),|' "$app/server.go"
  sed -i 's|klog.Infof("Start listening to %d for health check", healthCheckPort)|klog.Infof("Start listening to %s for health check", healthCheckAddr())|' "$app/server.go"
  [[ $(grep -c 'healthCheckAddr()' "$app/server.go") == 2 ]] ||
    { log "mpi-operator: its health check address line is not where it was: update mpi_health_patch"; return 1; }
  cat >"$app/health_addr_tidepool.go" <<'GO'
package app

import (
	"fmt"
	"os"
)

// healthCheckAddr is where the health check listens: $MPI_OPERATOR_HEALTH_ADDR, or upstream's
// :8080. Added at build time by tidepool's tests/operators/build.sh.
func healthCheckAddr() string {
	if addr := os.Getenv("MPI_OPERATOR_HEALTH_ADDR"); addr != "" {
		return addr
	}
	return fmt.Sprintf(":%d", healthCheckPort)
}
GO
  printf '%s\n' "$src"
}

log "training-operator (1/4): $TRAINING_OPERATOR"
dir=$(fetch "$TRAINING_OPERATOR" "$TRAINING_OPERATOR_SUM")
build training-operator "$dir" ./cmd/training-operator.v1 -ldflags "-s -w"
# The MPIJob v1 CRD goes apart: its name is mpi-operator's (see Traps above).
copy_crds training-operator $(find "$dir/manifests/base/crds" -name 'kubeflow.org_*.yaml' ! -name '*mpijobs*' | sort)
copy_crds training-operator-mpijob-v1 "$dir/manifests/base/crds/kubeflow.org_mpijobs.yaml"

log "mpi-operator (2/4): $MPI_OPERATOR"
dir=$(fetch "$MPI_OPERATOR" "$MPI_OPERATOR_SUM")
copy_crds mpi-operator "$dir/manifests/base/kubeflow.org_mpijobs.yaml"
src=$(mpi_health_patch "$dir")
mpkg=github.com/kubeflow/mpi-operator/pkg/version
build mpi-operator "$src" ./cmd/mpi-operator -ldflags "-s -w -X $mpkg.Version=${MPI_OPERATOR#*@}"
rm -rf "$tmp/src"

log "JobSet (3/4): $JOBSET"
dir=$(fetch "$JOBSET" "$JOBSET_SUM")
jpkg=sigs.k8s.io/jobset/pkg/version
build jobset "$dir" . -ldflags "-s -w -X $jpkg.GitVersion=${JOBSET#*@}"
copy_crds jobset "$dir"/config/components/crd/bases/*.yaml

log "Trainer (4/4): $TRAINER"
dir=$(fetch "$TRAINER" "$TRAINER_SUM")
build trainer-controller-manager "$dir" ./cmd/trainer-controller-manager -ldflags "-s -w"
copy_crds trainer "$dir"/manifests/base/crds/trainer.kubeflow.org_*.yaml
mkdir -p "$tmp/runtimes/trainer"
for f in "$dir"/manifests/base/runtimes/*.yaml; do
  [[ $(basename "$f") == kustomization.yaml ]] || cp "$f" "$tmp/runtimes/trainer/"
done

for b in training-operator mpi-operator jobset trainer-controller-manager; do
  [[ -x "$tmp/$b" ]] || { log "missing $b after build"; exit 1; }
done
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
rm -rf "$scratch"
log "built in $((SECONDS - start)) s: $out"
echo "$out"
