# Sourced, not run (by tests/run.sh and the benchmark scripts): builds every part the e2e tests
# and the benchmarks run against, each cached outside the repo by its pinned inputs, and exports
# where each is. Expects to be sourced from the repository root, after deploy/prereqs.sh.
#
# Environment: TIDEPOOL_SKEW (default 1: also the previous Kubernetes minor for member-b,
# exported as CP_SKEW_BIN; 0: every cluster on one version, CP_SKEW_BIN unset).

echo "== building the local control plane (cached after the first run)" >&2
CP_BIN=$(bash tests/controlplane/build.sh | tail -n 1)
export CP_BIN

if [[ ${TIDEPOOL_SKEW:-1} == 1 ]]; then
  echo "== building the previous Kubernetes minor for member-b (cached after the first run)" >&2
  CP_SKEW_BIN=$(bash tests/controlplane/build-skew.sh | tail -n 1)
  export CP_SKEW_BIN
else
  unset CP_SKEW_BIN
fi

echo "== building helm, to render deploy/helm/tidepool (cached after the first run)" >&2
TIDEPOOL_HELM=$(bash tests/tools/build-helm.sh | tail -n 1)
export TIDEPOOL_HELM

echo "== building the real nodes' containerd, CNI plugins and CoreDNS (cached after the first run)" >&2
CP_NODE_BIN=$(bash tests/nodes/build.sh | tail -n 1)
export CP_NODE_BIN

echo "== building metrics-server, run in each local cluster (cached after the first run)" >&2
CP_METRICS_BIN=$(bash tests/metrics/build.sh | tail -n 1)
export CP_METRICS_BIN

echo "== building the schedulers and queues around tidepool: Volcano, scheduler-plugins' Coscheduling, Kueue (cached after the first run)" >&2
TIDEPOOL_SCHEDULERS=$(bash tests/schedulers/build.sh | tail -n 1)
export TIDEPOOL_SCHEDULERS
# The member gang schedulers' PodGroup CRDs, for the tests that only install them.
export TIDEPOOL_GANG_CRDS=$TIDEPOOL_SCHEDULERS/gang-crds

echo "== building the field's training operators (training-operator, mpi-operator, JobSet, Trainer; cached after the first run)" >&2
TIDEPOOL_OPERATORS_BIN=$(bash tests/operators/build.sh | tail -n 1)
export TIDEPOOL_OPERATORS_BIN

echo "== building tidepool and its tests" >&2
cargo build --workspace --all-targets --locked

# The tidepool image the chart and deploy tests run in the clusters carries the binary the other
# tests run as a host process (the dev build, its debug info left out by build.sh): a release
# build for it alone would compile every dependency a second time (13 min on 2 cores, cold or in
# a fresh clone). A user's image is built from a release binary (README).
echo "== building the images: pause, workload, tidepool (cached by their inputs)" >&2
CP_IMAGES=$(bash tests/images/build.sh "$PWD/target/debug/tidepool" | tail -n 1)
export CP_IMAGES
echo "== building the training-frameworks image: TensorFlow, PyTorch, MPI, Paddle (cached by its inputs)" >&2
CP_FRAMEWORKS_IMAGES=$(bash tests/images/frameworks.sh | tail -n 1)
export CP_FRAMEWORKS_IMAGES
