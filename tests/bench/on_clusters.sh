#!/usr/bin/env bash
# Usage: bash tests/bench/on_clusters.sh BENCH
# Runs `cargo bench --bench BENCH` on the clusters the e2e tests use: the prerequisites, the
# same cached builds (tests/env.sh), the clusters at CP_PORT_OFFSET (default 40, beside a test
# run's 30 and the demo's 0), stopped at exit. BENCH_* variables pass through (see the
# program's header). tests/bench/operators.sh and multikueue.sh call it.
set -euo pipefail

bench=${1:?usage: on_clusters.sh BENCH}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export CP_PORT_OFFSET=${CP_PORT_OFFSET:-40}
state=${TMPDIR:-/tmp}/tidepool-bench-clusters-$CP_PORT_OFFSET

bash deploy/prereqs.sh
# One Kubernetes version on every cluster: the direct path and tidepool's compared alike.
export TIDEPOOL_SKEW=${TIDEPOOL_SKEW:-0}
# shellcheck source=tests/env.sh
source tests/env.sh
echo "== starting the local clusters in $state" >&2
trap 'bash tests/controlplane/cluster.sh down "$state" || true' EXIT
bash tests/controlplane/cluster.sh up "$state"
export TIDEPOOL_CLUSTER_ENV="$state/cluster.env"
cargo bench --locked --bench "$bench"
