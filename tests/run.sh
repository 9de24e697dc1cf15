#!/usr/bin/env bash
# Runs every tidepool test: unit and property tests of the crates, then the end-to-end tests
# against real local clusters (one training and two member control planes, built from source
# by tests/controlplane/build.sh and cached outside the repo, each with kwok nodes and one
# real node: containerd, kubelet, CNI bridge and CoreDNS from tests/nodes/build.sh, a
# metrics-server from tests/metrics/build.sh, the schedulers and queues around tidepool (Volcano, Coscheduling, Kueue) and the PodGroup CRDs from tests/schedulers/build.sh, images
# from tests/images/build.sh, tidepool's own image from its release binary, the frameworks
# image the operators' jobs run from tests/images/frameworks.sh; the training
# operators tests/operators/start.sh runs from tests/operators/build.sh). The clusters are
# started once, shared by all e2e tests, and stopped when this script exits, whatever happens.
# The builds are tests/env.sh's, which the benchmark scripts source too.
#
# Environment: CP_PORT_OFFSET (default 30, so a running demo on offset 0 is left alone),
# TIDEPOOL_TEST_STATE (cluster state dir, default $TMPDIR/tidepool-test-clusters-<offset>),
# TIDEPOOL_SKEW (default 1: member-b runs the previous Kubernetes minor, built by
# tests/controlplane/build-skew.sh, for the whole suite, and the version_skew e2e test runs;
# 0: every cluster on one version, that test skipped — for a quick local run, never CI).
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

echo "== starting the local clusters in $state" >&2
trap 'bash tests/controlplane/cluster.sh down "$state" || true' EXIT
bash tests/controlplane/cluster.sh up "$state"
export TIDEPOOL_CLUSTER_ENV="$state/cluster.env"

echo "== unit and property tests" >&2
cargo test --workspace --locked --lib --bins
echo "== end-to-end tests (one at a time: they share the member clusters' capacity)" >&2
cargo test --locked --test e2e -- --test-threads=1 "${skip[@]}" "$@"
