#!/usr/bin/env bash
# Renders the Helm chart into the plain manifests beside it (deploy/manifests/), so clusters
# without helm can `kubectl apply -f` them. The e2e test `deploy` checks they are current.
#   training.yaml  tidepool-system namespace, CRDs included: kubectl create ns tidepool-system && kubectl apply -f
#   member.yaml    tidepool-member namespace, applied in each member cluster
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
helm=${TIDEPOOL_HELM:-$(bash "$here/../tests/tools/build-helm.sh" | tail -n 1)}
mkdir -p "$here/manifests"
"$helm" template tidepool "$here/helm/tidepool" --namespace tidepool-system --set target=training --include-crds \
  >"$here/manifests/training.yaml"
"$helm" template tidepool "$here/helm/tidepool" --namespace tidepool-member --set target=member \
  >"$here/manifests/member.yaml"
echo "rendered $here/manifests/{training,member}.yaml" >&2
