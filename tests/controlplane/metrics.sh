# metrics-server for the local clusters: one host process per cluster, so `kubectl top` and
# the HPA work in the training cluster (reading tidepool's kubelet API for the offloaded pods)
# and each member's metrics.k8s.io API is there for tidepool to read. Sourced by cluster.sh
# (it uses its start/await/fail/log/api/sign helpers and S, PKI, OFF, BIN); needs the real
# nodes (the lo address below is made by realnode.sh).
#
# Per cluster:
#   serving     the real node's IP (10.87.<g>.<10+k>, on lo), port 18250 + k + offset: the
#               aggregator dials an Endpoints address, which may not be loopback
#   APIService  v1beta1.metrics.k8s.io → Service kube-system/metrics-server (no selector) →
#               Endpoints at that address; --enable-aggregator-routing on the apiservers
#               sends the request there instead of to a ClusterIP no kube-proxy serves
#   identity    one client certificate, CN=system:metrics-server, for the apiserver and the
#               kubelets alike, with the RBAC metrics-server's own manifests grant
#               (nodes/metrics on the kubelets; delegated authn/authz)
#   kubelets    InternalIP at the node's status port, verified against the cluster CA
#               (the real kubelets' and tidepool's serving certificates both come from it);
#               kwok nodes are left out (they serve no resource metrics)
#   resolution  15 s, so two samples (a rate) exist half a minute after a pod starts

metrics_port() { echo $((18250 + $(real_index "$1") + OFF)); }

resolve_metrics_bin() {
  if [[ -n ${CP_METRICS_BIN:-} ]]; then
    METRICS_BIN=$CP_METRICS_BIN
  else
    log "CP_METRICS_BIN not set: running tests/metrics/build.sh (a cold build takes minutes)"
    METRICS_BIN=$(bash "$here/../metrics/build.sh" | tail -n 1) || fail "tests/metrics/build.sh failed"
  fi
  [[ -x $METRICS_BIN/metrics-server ]] || fail "$METRICS_BIN/metrics-server is missing or not executable"
}

# Certificates: the metrics-servers' serving certificates (the aggregator checks the
# Service's DNS name against the APIService's caBundle) and their client identity.
metrics_pki() {
  local c rc=0
  set +e
  (
    set -e
    cd "$PKI"
    umask 077
    exec 2>>"$S/logs/pki.log"
    sign metrics-client "/CN=system:metrics-server" 'basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth'
    for c in "${CLUSTERS[@]}"; do
      sign "metrics-$c" "/CN=metrics-server.kube-system.svc" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:metrics-server.kube-system.svc,IP:$(real_node_ip "$c")"
    done
    chmod 644 ./*.crt
  )
  rc=$?
  set -e
  ((rc == 0)) || fail "pki: openssl failed for metrics-server" pki
}

start_metrics_server() {
  local c=$1
  kubeconfig "$c" system:metrics-server "    client-certificate: $PKI/metrics-client.crt
    client-key: $PKI/metrics-client.key" >"$S/$c.metrics.kubeconfig"
  start "$c-metrics-server" "$METRICS_BIN/metrics-server" \
    --kubeconfig="$S/$c.metrics.kubeconfig" \
    --authentication-kubeconfig="$S/$c.metrics.kubeconfig" \
    --authorization-kubeconfig="$S/$c.metrics.kubeconfig" \
    --bind-address="$(real_node_ip "$c")" --secure-port="$(metrics_port "$c")" \
    --tls-cert-file="$PKI/metrics-$c.crt" --tls-private-key-file="$PKI/metrics-$c.key" \
    --kubelet-preferred-address-types=InternalIP --kubelet-use-node-status-port \
    --kubelet-certificate-authority="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/metrics-client.crt" --kubelet-client-key="$PKI/metrics-client.key" \
    --node-selector='type!=kwok' --metric-resolution=15s --profiling=false --v=1
}

# The RBAC of metrics-server's own manifests, its Service and Endpoints, and the APIService.
apply_metrics_objects() {
  local c=$1
  "$BIN/kubectl" --kubeconfig "$S/$c.kubeconfig" apply -f - >>"$S/logs/metrics-objects.log" 2>&1 <<EOF ||
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:metrics-server"}
rules:
- {apiGroups: [""], resources: [nodes/metrics], verbs: [get]}
- {apiGroups: [""], resources: [pods, nodes], verbs: [get, list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:metrics-server"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:metrics-server"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "metrics-server:system:auth-delegator"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:auth-delegator"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: "metrics-server-auth-reader", namespace: kube-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: "extension-apiserver-authentication-reader"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:metrics-server"}]
---
apiVersion: v1
kind: Service
metadata: {name: metrics-server, namespace: kube-system}
spec:
  ports: [{name: https, port: 443, targetPort: $(metrics_port "$c")}]
---
apiVersion: v1
kind: Endpoints
metadata: {name: metrics-server, namespace: kube-system}
subsets:
- addresses: [{ip: "$(real_node_ip "$c")"}]
  ports: [{name: https, port: $(metrics_port "$c")}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta1.metrics.k8s.io}
spec:
  group: metrics.k8s.io
  version: v1beta1
  groupPriorityMinimum: 100
  versionPriority: 100
  service: {name: metrics-server, namespace: kube-system, port: 443}
  caBundle: $(b64 "$PKI/ca.crt")
EOF
    fail "$c: applying the metrics-server objects failed (see $S/logs/metrics-objects.log)" "$c-apiserver"
}

metrics_available() {
  local body
  body=$(api "$1" /apis/apiregistration.k8s.io/v1/apiservices/v1beta1.metrics.k8s.io) || return 1
  body=${body//[[:space:]]/}
  [[ $body == *'{"type":"Available","status":"True"'* ]]
}

metrics_servers_up() {
  local c
  metrics_pki
  # RBAC first: metrics-server reads the request-header CA from kube-system as it starts.
  for c in "${CLUSTERS[@]}"; do apply_metrics_objects "$c"; done
  for c in "${CLUSTERS[@]}"; do start_metrics_server "$c"; done
  await 60 "metrics.k8s.io available" metrics_available "@-metrics-server @-apiserver" "${CLUSTERS[@]}"
}
