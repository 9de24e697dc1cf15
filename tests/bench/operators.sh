#!/usr/bin/env bash
# Runs the operators benchmark (tests/bench/operators.rs: a TFJob and a PyTorchJob through
# tidepool against the same jobs submitted to member-a directly) on the local clusters
# (tests/bench/on_clusters.sh: started, and stopped at exit).
set -euo pipefail
exec bash "$(dirname "$0")/on_clusters.sh" operators
