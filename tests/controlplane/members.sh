#!/usr/bin/env bash
# Starts and stops N extra light member clusters beside a cluster.sh set, for the many-members
# benchmark (tests/bench/members.rs): one shared etcd (a prefix per member), and per member a
# kube-apiserver, a kube-controller-manager with only the controllers a member needs here, a
# kube-scheduler and kwok with a few fake CPU nodes. No real nodes, no metrics-server.
# Everything is recorded in STATE_DIR/pids and stopped by those PIDs only (cluster.sh's
# bookkeeping, sourced).
#
# Usage:
#   tests/controlplane/members.sh up   STATE_DIR   start CP_MEMBERS members; 0 once usable
#   tests/controlplane/members.sh down STATE_DIR   stop what `up` started (idempotent)
#
# Environment:
#   CP_BIN          as for cluster.sh (etcd, kube-apiserver, kube-controller-manager,
#                   kube-scheduler, kwok, kwok-stages/)
#   CP_PKI          the pki/ directory of a cluster.sh set: its CA, apiserver, admin and
#                   kwok-member-a certificates and tokens are copied and reused
#   CP_MEMBERS      how many members (default 6), named bench-0 .. bench-<N-1>
#   CP_MEMBER_NODES kwok nodes per member (default 4; 32 CPUs, 128Gi each)
#   CP_PORT_OFFSET  added to the ports below (default 123); must not be a cluster.sh set's
#
# Ports (127.0.0.1, plus CP_PORT_OFFSET): etcd 2379/2380; member k's kube-apiserver 6443+k,
# its kwok kubelet API 127.0.0.3:11250+k. The KCMs and schedulers serve no port.
#
# STATE_DIR after `up`: members.env (`export BENCH_<K>_KUBECONFIG=...`, CP_MEMBERS),
# bench-<k>.kubeconfig (admin), pki/, pids, logs/<name>.log.
set -Eeuo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=cluster.sh
source "$here/cluster.sh"

port_of() {  # port_of COMPONENT bench-<k>
  local k=${2#bench-}
  case $1 in
    apiserver) echo $((6443 + k + OFF)) ;;
    kubelet) echo $((11250 + k + OFF)) ;;
  esac
}

usage() {
  sed -n '/^# Usage:/,/^# Environment:/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

members_check_ports() {
  local -A want=()
  local c
  want[$((2379 + OFF))]="etcd client"; want[$((2380 + OFF))]="etcd peer"
  for c in "${CLUSTERS[@]}"; do
    want[$(port_of apiserver "$c")]="$c kube-apiserver"
    want[$(port_of kubelet "$c")]="$c kwok kubelet API"
  done
  fail_if_listening
}

# Lighter than cluster.sh's: no kubelet client (nothing here dials kwok for logs or exec),
# no aggregator.
members_start_apiserver() {
  local c=$1 port; port=$(port_of apiserver "$c")
  start "$c-apiserver" "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$((2379 + OFF))" --etcd-prefix="/$c" \
    --bind-address=127.0.0.1 --secure-port="$port" \
    --advertise-address=127.0.0.1 --endpoint-reconciler-type=none \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" \
    --authorization-mode=Node,RBAC \
    --service-account-issuer="https://127.0.0.1:$port" \
    --service-account-key-file="$PKI/sa-member-a.pub" --service-account-signing-key-file="$PKI/sa-member-a.key" \
    --service-cluster-ip-range=10.96.0.0/16 \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --allow-privileged=true --profiling=false --v=1
}

# The KCM creates default ServiceAccounts (pods need one), lifts the not-ready taint from new
# nodes, and deletes namespaces and their objects; the rest of its controllers are not
# needed here and would cost CPU times N.
members_start_kcm_and_scheduler() {
  local c=$1 k="$S/$1.kubeconfig"
  start "$c-kcm" "$BIN/kube-controller-manager" \
    --kubeconfig="$k" --authentication-kubeconfig="$k" --authorization-kubeconfig="$k" \
    --secure-port=0 --leader-elect=false --cluster-name="$c" \
    --controllers=serviceaccount,serviceaccount-token,namespace,garbagecollector,nodelifecycle \
    --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa-member-a.key" \
    --use-service-account-credentials=false --node-monitor-grace-period=50s --profiling=false
  start "$c-scheduler" "$BIN/kube-scheduler" \
    --kubeconfig="$k" --authentication-kubeconfig="$k" --authorization-kubeconfig="$k" \
    --secure-port=0 --leader-elect=false --profiling=false
}

members_start_kwok() {
  local c=$1
  start "$c-kwok" env HOME="$S" "$BIN/kwok" --kubeconfig="$S/$c.kubeconfig" --config="$S/kwok.yaml" \
    --server-address="127.0.0.3:$(port_of kubelet "$c")" \
    --node-ip=127.0.0.3 --node-port="$(port_of kubelet "$c")" \
    --tls-cert-file="$PKI/kwok-member-a.crt" --tls-private-key-file="$PKI/kwok-member-a.key"
}

members_write_env() {
  local c var
  {
    printf 'export %s=%q\n' CP_MEMBERS "$N" MEMBERS_STATE_DIR "$S"
    for c in "${CLUSTERS[@]}"; do
      var=${c^^}; var=${var//-/_}
      printf 'export %s=%q\n' "${var}_KUBECONFIG" "$S/$c.kubeconfig" \
        "${var}_SERVER" "https://127.0.0.1:$(port_of apiserver "$c")"
    done
  } >"$S/members.env"
}

members_up() {
  local c k j
  UP_OK=0
  trap on_up_exit EXIT
  trap 'log "interrupted"; exit 130' INT
  trap 'log "terminated"; exit 143' TERM
  if [[ -e $S/.tidepool-members ]]; then
    stop_all || fail "could not stop the previous run's processes in $S"
    find "$S" -mindepth 1 -delete
  elif [[ -n $(ls -A "$S") ]]; then
    fail "$S is not empty and was not made by members.sh: refusing to wipe it"
  fi
  mkdir -p "$S/logs"
  touch "$S/.tidepool-members"
  [[ -r ${CP_PKI:-}/ca.crt && -r $CP_PKI/kwok-member-a.crt ]] ||
    fail "CP_PKI must name the pki/ directory of a running cluster.sh set"
  # Copied, so that every process's command line names STATE_DIR (cluster.sh's `alive`).
  PKI=$S/pki
  mkdir -p "$PKI"
  cp "$CP_PKI"/{ca.crt,apiserver.crt,apiserver.key,admin.crt,admin.key,tokens.csv} "$PKI"/
  cp "$CP_PKI"/{sa-member-a.key,sa-member-a.pub,kwok-member-a.crt,kwok-member-a.key} "$PKI"/
  resolve_bin
  CLUSTERS=() MEMBERS=() NODES=()
  for ((k = 0; k < N; k++)); do
    CLUSTERS+=("bench-$k")
    for ((j = 0; j < NODES_PER; j++)); do NODES+=("bench-$k bench-$k-node-$j 32 128Gi 0 - cpu"); done
  done
  MEMBERS=("${CLUSTERS[@]}")
  members_check_ports
  write_kubeconfigs
  start_etcd
  await 30 "etcd healthy" etcd_ready "@" etcd
  for c in "${CLUSTERS[@]}"; do members_start_apiserver "$c"; done
  await 180 "kube-apiserver ready" apiserver_ready "@-apiserver etcd" "${CLUSTERS[@]}"
  for c in "${CLUSTERS[@]}"; do members_start_kcm_and_scheduler "$c"; done
  await 120 "default ServiceAccount exists" default_sa_exists "@-kcm @-apiserver etcd" "${CLUSTERS[@]}"
  write_kwok_config
  for c in "${CLUSTERS[@]}"; do members_start_kwok "$c"; done
  create_nodes
  await 120 "all nodes Ready and untainted" nodes_ready "@-kwok @-kcm @-scheduler @-apiserver etcd" "${CLUSTERS[@]}"
  members_write_env
  UP_OK=1
  log "$N members up in $(secs $(($(now_ms) - T0))) s; environment: $S/members.env"
}

(($# == 2)) || usage
[[ $2 ]] || usage
OFF=${CP_PORT_OFFSET:-123}
N=${CP_MEMBERS:-6}
NODES_PER=${CP_MEMBER_NODES:-4}
for v in OFF N NODES_PER; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "$v must be a non-negative integer" >&2; exit 2; }
done
((N >= 1 && N <= 26)) || { echo "CP_MEMBERS must be 1..26" >&2; exit 2; }
case $1 in
  up)
    mkdir -p "$2"
    S=$(cd "$2" && pwd -P)
    members_up ;;
  down)
    [[ -d $2 ]] || exit 0
    S=$(cd "$2" && pwd -P)
    stop_all || exit 1
    log "stopped" ;;
  *) usage ;;
esac
