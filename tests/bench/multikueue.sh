#!/usr/bin/env bash
# Runs the MultiKueue benchmark (tests/bench/multikueue.rs: batch Jobs through tidepool,
# MultiKueue and the direct path) on the local clusters (tests/bench/on_clusters.sh: started,
# and stopped at exit).
set -euo pipefail
exec bash "$(dirname "$0")/on_clusters.sh" multikueue
