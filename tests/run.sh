#!/usr/bin/env bash
# Runs every tidepool test: unit and property tests of the crates, then the end-to-end tests
# against real local clusters (one training and two member control planes, built from source
# by tests/controlplane/build.sh and cached outside the repo, each with kwok nodes and one
# real node: containerd, kubelet, CNI bridge and CoreDNS from tests/nodes/build.sh, a
# metrics-server from tests/metrics/build.sh, the schedulers and queues around tidepool (Volcano, Coscheduling, Kueue) and the PodGroup CRDs from tests/schedulers/build.sh, images
# from tests/images/build.sh, tidepool's own image from the tests' build of it, the frameworks
# image the operators' jobs run from tests/images/frameworks.sh; the training
# operators tests/operators/start.sh runs from tests/operators/build.sh). The clusters are
# started once (two sets, one per e2e lane: see below), shared by the tests of their lane, and
# stopped when this script exits, whatever happens.
# The builds are tests/env.sh's, which the benchmark scripts source too.
#
# Environment: CP_PORT_OFFSET (default 30, so a running demo on offset 0 is left alone),
# TIDEPOOL_TEST_STATE (cluster state dir, default $TMPDIR/tidepool-test-clusters-<offset>),
# TIDEPOOL_SKEW (default 1: member-b runs the previous Kubernetes minor, built by
# tests/controlplane/build-skew.sh, for the whole suite, and the version_skew e2e test runs;
# 0: every cluster on one version, that test skipped — for a quick local run, never CI),
# TIDEPOOL_E2E_LANES (default 2; 1: every e2e test on one cluster set), TIDEPOOL_TEST_STATE_B
# (the second set's state dir, default $TMPDIR/tidepool-test-clusters-<offset + 10>).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export CP_PORT_OFFSET=${CP_PORT_OFFSET:-30}
# Per offset: two runs at different offsets never share (and tear down) one state.
state=${TIDEPOOL_TEST_STATE:-${TMPDIR:-/tmp}/tidepool-test-clusters-$CP_PORT_OFFSET}

echo "== prerequisites: the packages deploy/prerequisites lists (installed when missing)" >&2
bash deploy/prereqs.sh
echo "== every command the scripts run is on deploy/prerequisites" >&2
cargo test --locked --test prerequisites
# The builds the e2e tests run against (cached outside the repo by their pinned inputs).
# shellcheck source=tests/env.sh
source tests/env.sh
skip=()
if [[ ${TIDEPOOL_SKEW:-1} != 1 ]]; then
  echo "== TIDEPOOL_SKEW=0: every cluster runs one Kubernetes version; version_skew:: is skipped" >&2
  skip=(--skip version_skew::)
fi

# Two lanes, each with a cluster set of its own, run the e2e tests side by side: the tests of
# the operators, schedulers and queues (real training processes on the real nodes) on one,
# every other test on the other. A test waits on clusters and processes far more than it
# computes (the bridge lane's tests alone kept the two cores 22 % busy, both lanes 69 %), so
# the suite takes about as long as its longer lane. Filters given on the command line, or
# TIDEPOOL_E2E_LANES=1, run one lane, as before.
operator_modules=(gang_scheduler:: kueue:: mpijob:: paddlejob:: pytorchjob:: tfjob:: trainjob:: volcano::)
lanes=${TIDEPOOL_E2E_LANES:-2}
(($# == 0)) || lanes=1
state_b=${TIDEPOOL_TEST_STATE_B:-${TMPDIR:-/tmp}/tidepool-test-clusters-$((CP_PORT_OFFSET + 10))}

# up STATE OFFSET [frameworks]: a cluster set, its output prefixed with its state dir's name.
up() {
  local frameworks=${3:-}
  (
    export CP_PORT_OFFSET=$2
    [[ -n $frameworks ]] || unset CP_FRAMEWORKS_IMAGES
    bash tests/controlplane/cluster.sh up "$1"
  ) 2>&1 | sed -u "s|^|[$(basename "$1")] |" >&2
}

if ((lanes == 1)); then
  echo "== starting the local clusters in $state" >&2
  trap 'bash tests/controlplane/cluster.sh down "$state" || true' EXIT
  bash tests/controlplane/cluster.sh up "$state"
else
  echo "== starting two cluster sets, one per lane: $state (offset $CP_PORT_OFFSET), $state_b (offset $((CP_PORT_OFFSET + 10)))" >&2
  trap 'bash tests/controlplane/cluster.sh down "$state" || true; CP_PORT_OFFSET=$((CP_PORT_OFFSET + 10)) bash tests/controlplane/cluster.sh down "$state_b" || true' EXIT
  # The frameworks image is imported only where the operators' jobs run.
  up "$state" "$CP_PORT_OFFSET" & up_a=$!
  up "$state_b" $((CP_PORT_OFFSET + 10)) frameworks & up_b=$!
  wait "$up_a" || { echo "== cluster set $state did not come up" >&2; exit 1; }
  wait "$up_b" || { echo "== cluster set $state_b did not come up" >&2; exit 1; }
fi
export TIDEPOOL_CLUSTER_ENV="$state/cluster.env"

echo "== unit and property tests" >&2
cargo test --workspace --locked --lib --bins
if ((lanes == 1)); then
  echo "== end-to-end tests (one at a time: they share the member clusters' capacity)" >&2
  cargo test --locked --test e2e -- --test-threads=1 "${skip[@]}" "$@"
  exit 0
fi

echo "== end-to-end tests in two lanes (one at a time in each: a lane's tests share its members' capacity)" >&2
cargo test --locked --test e2e --no-run
skips=()
for m in "${operator_modules[@]}"; do skips+=(--skip "$m"); done
# lane NAME CLUSTER_ENV ARGS...: one lane's tests, each line prefixed with the lane's name.
lane() {
  local name=$1 env=$2; shift 2
  TIDEPOOL_CLUSTER_ENV=$env cargo test --locked --test e2e -- --test-threads=1 "$@" 2>&1 | sed -u "s|^|[$name] |"
}
start=$SECONDS
lane bridge "$state/cluster.env" "${skip[@]}" "${skips[@]}" & bridge=$!
lane operators "$state_b/cluster.env" "${skip[@]}" "${operator_modules[@]}" & operators=$!
rc=0
wait "$bridge" || rc=1
echo "== lane bridge done after $((SECONDS - start)) s" >&2
wait "$operators" || rc=1
echo "== lane operators done after $((SECONDS - start)) s" >&2
((rc == 0)) || { echo "== end-to-end tests failed: see the [bridge] and [operators] lines above" >&2; exit 1; }
