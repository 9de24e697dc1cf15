#!/usr/bin/env bash
# Starts and stops three real local Kubernetes control planes on loopback, for tidepool's
# integration tests and demo: "training" (where tidepool's virtual kubelet registers) and
# two member clusters, "member-a" and "member-b", whose fake GPU nodes are run by kwok.
# Each cluster also gets one real node (containerd, kubelet, CNI bridge, CoreDNS) that runs
# real containers: realnode.sh beside this file.
# See shared/controlplane.md §3 for the recipe and §5 for the pitfalls behind the details.
#
# Usage:
#   tests/controlplane/cluster.sh up   STATE_DIR   start everything; returns 0 once usable
#   tests/controlplane/cluster.sh down STATE_DIR   stop what `up` started (idempotent)
#
# Environment:
#   CP_BIN          directory with etcd, kube-apiserver, kube-controller-manager,
#                   kube-scheduler, kubectl, kwok and kwok-stages/*.yaml
#                   (default: built or found in the cache by tests/controlplane/build.sh)
#   CP_PORT_OFFSET  added to every port below (default 0), for parallel runs
#   CP_REAL_NODES   1 (default): a real node per cluster (needs root); 0: kwok nodes only
#   CP_NODE_BIN     containerd, ctr, shim, runc, coredns, cni/ (default: tests/nodes/build.sh)
#   CP_IMAGES       pause.tar, workload.tar [, tidepool.tar] (default: tests/images/build.sh)
#   CP_METRICS_BIN  metrics-server (default: tests/metrics/build.sh); with real nodes only
#   CP_PROFILING    0 (default); 1: the API servers serve /debug/pprof (for finding where a
#                   benchmark's API server CPU goes: `kubectl get --raw
#                   '/debug/pprof/profile?seconds=10'`, then `go tool pprof -top`)
#   CP_SKEW_BIN     unset (default): every cluster runs CP_BIN's Kubernetes. Set: a directory
#                   with kube-apiserver, kube-controller-manager, kube-scheduler and kubelet of
#                   the previous minor (tests/controlplane/build-skew.sh), which member-b
#                   (the skew member) then runs, so the bridge is tested across versions
#
# Ports (127.0.0.1 only, plus CP_PORT_OFFSET):
#   etcd 2379 (client) 2380 (peer); kube-apiserver training 6443, member-a 6444,
#   member-b 6445; kube-controller-manager 10257/10357/10457; kube-scheduler 10259/10359/10459.
#   Kubelet APIs on their own loopback addresses: tidepool's 127.0.0.2:11250 (not started
#   here: the tests run it), kwok's for member-a 127.0.0.3:11251, for member-b 127.0.0.4:11252.
#   Runs side by side need offsets at least 3 apart and not 100 or 200 apart (e.g. 0, 10,
#   20, ...): the controller-manager and scheduler ports of the clusters are 100 apart.
#   With real nodes, metrics-server per cluster on the real node's IP, port 18250/18251/18252
#   (metrics.sh beside this file).
#   `up` checks that every port is free first.
#
# STATE_DIR after `up`:
#   cluster.env                         `export K=V` lines (kubeconfigs, server URLs, PKI dir)
#   {training,member-a,member-b}.kubeconfig     admin client cert (system:masters)
#   member-{a,b}.token.kubeconfig       bearer token of user tidepool-member (system:masters)
#   pki/                                ca.crt/key, apiserver, admin, apiserver-kubelet-client,
#                                       vk-serving (tidepool's kubelet API), sa-<cluster>, tokens.csv
#   pod-logs/<member>.log               what kwok serves as every member pod's container log
#                                       (CRI log format; append to it to feed `logs -f`)
#   exec/<member>/                      working directory of commands kwok runs for `exec`
#   pids                                "name pid" per process; `down` kills only these
#   s3/                                 the checkpoint store's (moto's) working directory
#   logs/<name>.log                     one log per process
#   .tidepool-cluster                   marker: `up` wipes a non-empty STATE_DIR only if present
set -Eeuo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=realnode.sh
source "$here/realnode.sh"
# shellcheck source=metrics.sh
source "$here/metrics.sh"
CLUSTERS=(training member-a member-b)
MEMBERS=(member-a member-b)
# The member that runs CP_SKEW_BIN's control plane and kubelet when CP_SKEW_BIN is set.
SKEW_MEMBER=member-b SKEW_BIN=""

# Fake member nodes: cluster name cpu memory gpus gpu-product pool.
NODES=(
  "member-a member-a-gpu-0 96 1Ti   8 NVIDIA-H100-80GB-HBM3  gpu"
  "member-a member-a-gpu-1 96 1Ti   8 NVIDIA-H100-80GB-HBM3  gpu"
  "member-a member-a-cpu-0 32 128Gi 0 -                      cpu"
  "member-a member-a-cpu-1 32 128Gi 0 -                      cpu"
  "member-b member-b-gpu-0 64 512Gi 4 NVIDIA-A100-SXM4-80GB  gpu"
  "member-b member-b-gpu-1 64 512Gi 4 NVIDIA-A100-SXM4-80GB  gpu"
  "member-b member-b-gpu-2 64 512Gi 4 NVIDIA-A100-SXM4-80GB  gpu"
  "member-b member-b-gpu-3 64 512Gi 4 NVIDIA-A100-SXM4-80GB  gpu"
)

usage() {
  sed -n '/^# Usage:/,/^# STATE_DIR after/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

# ---------------------------------------------------------------------------------------
# Timing and logging

# Messages go to fd 3, a copy of the caller's stderr: a trap can fire while bash has
# stderr redirected for a function or builtin (say to /dev/null), and its "stopping
# everything" report must still be seen. Daemons get fd 3 closed (see start), or they
# would keep the caller's stderr pipe open after `up` exits.
exec 3>&2

now_ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((t / 1000)); }   # separator is locale-dependent
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }
T0=$(now_ms)
log() { printf '[cluster %7ss] %s\n' "$(secs $(($(now_ms) - T0)))" "$*" >&3; }

# ---------------------------------------------------------------------------------------
# Process bookkeeping

declare -A PID=()

# A recorded PID counts as ours only while its command line still names STATE_DIR
# (every component gets a path inside it): this ignores zombies (empty cmdline) and
# never touches an unrelated process that reused the PID after a reboot.
alive() {
  local args=()
  [[ -r /proc/$1/cmdline ]] || return 1
  mapfile -d '' args 2>/dev/null </proc/"$1"/cmdline || return 1
  [[ " ${args[*]} " == *"$S/"* ]]
}

# start NAME COMMAND...: own session (so a Ctrl-C or a dying test harness does not take
# it down half-way), stdin closed, output to a file (an unread pipe would block Go programs).
start() {
  local name=$1; shift
  setsid "$@" </dev/null >"$S/logs/$name.log" 2>&1 3>&- &
  PID[$name]=$!
  echo "$name $!" >>"$S/pids"
}

# terminate NAME:PID...: TERM, then KILL whatever is still there after 10 s.
terminate() {
  local entry left=() deadline killed=0
  for entry; do
    if alive "${entry#*:}"; then kill -TERM "${entry#*:}" 2>/dev/null || true; fi
  done
  deadline=$(($(now_ms) + 10000))
  while :; do
    left=()
    for entry; do
      if alive "${entry#*:}"; then left+=("$entry"); fi
    done
    ((${#left[@]})) || return 0
    if (($(now_ms) >= deadline)); then
      if ((killed)); then log "survived KILL: ${left[*]}"; return 1; fi
      log "ignored TERM for 10 s, sending KILL: ${left[*]}"
      for entry in "${left[@]}"; do kill -KILL "${entry#*:}" 2>/dev/null || true; done
      killed=1 deadline=$(($(now_ms) + 5000))   # only bounds the wait: KILL is not ignorable
    fi
    sleep 0.1
  done
}

# Kills the PIDs recorded in STATE_DIR/pids, etcd last: an apiserver whose etcd is gone
# hangs in its graceful shutdown instead of exiting.
stop_all() {
  local pidfile=$S/pids name pid first=() last=()
  [[ -f $pidfile ]] || return 0
  while read -r name pid; do
    [[ $pid =~ ^[0-9]+$ ]] || continue
    if [[ $name == etcd ]]; then last+=("$name:$pid"); else first+=("$name:$pid"); fi
  done <"$pidfile"
  terminate "${first[@]}" || return 1
  terminate "${last[@]}" || return 1
  rm -f "$pidfile"
  # Dead is not yet gone: once `up` has exited these processes belong to init, which
  # reaps them a moment later. Wait (briefly) so that a caller's `kill -0 PID` says gone.
  local entry deadline=$(($(now_ms) + 5000))
  for entry in "${first[@]}" "${last[@]}"; do
    while [[ -e /proc/${entry#*:} ]] && (($(now_ms) < deadline)); do sleep 0.05; done
  done
}

# fail MESSAGE [PROCESS...]: names the failing component, shows the end of each given
# process's log and exits; the EXIT trap then stops everything started so far.
fail() {
  local msg=$1 p; shift
  log "FAILED: $msg"
  for p in "$@"; do
    [[ -f $S/logs/$p.log ]] || continue
    printf '%s\n' "----- last 40 lines of $S/logs/$p.log -----" >&3
    tail -n 40 "$S/logs/$p.log" >&3 || true
  done
  exit 1
}

# await TIMEOUT WHAT CHECK CULPRITS NAME...
# Polls `CHECK NAME` for all NAMEs in one loop (their processes start together) and logs
# each as it turns ready. CULPRITS lists the processes behind NAME, with @ standing for
# NAME ("@-apiserver"): they must stay alive meanwhile, and their logs explain a failure.
await() {
  local timeout=$1 what=$2 check=$3 culprits=$4; shift 4
  local pending=("$@") still=() logs=() name p rc t0 deadline
  t0=$(now_ms); deadline=$((t0 + timeout * 1000))
  while :; do
    still=()
    for name in "${pending[@]}"; do
      if "$check" "$name"; then
        log "$name: $what ($(secs $(($(now_ms) - t0))) s)"
      else
        still+=("$name")
      fi
    done
    ((${#still[@]})) || return 0
    pending=("${still[@]}")
    for name in "${pending[@]}"; do
      for p in ${culprits//@/$name}; do
        if [[ ${PID[$p]:-} ]] && ! alive "${PID[$p]}"; then
          rc=0; wait "${PID[$p]}" 2>/dev/null || rc=$?
          fail "$p exited (status $rc) while waiting for $name: $what" "$p"
        fi
      done
    done
    if (($(now_ms) >= deadline)); then
      # Logs of the per-NAME processes only: a shared one (etcd) is rarely the cause
      # of a slow start, and was checked to be alive above.
      name=${pending[0]} logs=()
      for p in $culprits; do
        if [[ $p == *@* ]]; then logs+=("${p//@/$name}"); fi
      done
      fail "${logs[0]}: timed out after $timeout s; still waiting for: ${pending[*]} ($what)" "${logs[@]}"
    fi
    sleep 0.5
  done
}

# ---------------------------------------------------------------------------------------
# Ports

port_of() {  # port_of COMPONENT CLUSTER
  local base
  case $1 in
    apiserver) base=(6443 6444 6445) ;;
    kcm) base=(10257 10357 10457) ;;
    scheduler) base=(10259 10359 10459) ;;
    kubelet) base=(11250 11251 11252) ;;   # training: tidepool's; members: kwok's
  esac
  case $2 in training) echo $((base[0] + OFF)) ;; member-a) echo $((base[1] + OFF)) ;; member-b) echo $((base[2] + OFF)) ;; esac
}

# bin_of CLUSTER BINARY: the skew member's Kubernetes components come from CP_SKEW_BIN;
# etcd, kubectl and kwok are the same everywhere.
bin_of() {
  case $2 in
    kube-apiserver|kube-controller-manager|kube-scheduler|kubelet)
      if [[ -n $SKEW_BIN && $1 == "$SKEW_MEMBER" ]]; then echo "$SKEW_BIN/$2"; return; fi ;;
  esac
  echo "$BIN/$2"
}

# The feature gates a 1.37 user turns on for its gang and eviction APIs (native Workload and
# PodGroup, scheduling.k8s.io/v1beta1; EvictionRequest, lifecycle.k8s.io/v1alpha1), and the
# API versions they serve. The skew member (one minor older) runs its own defaults.
gates_of() {  # gates_of CLUSTER apiserver|component
  [[ -n $SKEW_BIN && $1 == "$SKEW_MEMBER" ]] && return 0
  echo "--feature-gates=GenericWorkload=true,EvictionRequestAPI=true"
  [[ $2 == apiserver ]] && echo "--runtime-config=scheduling.k8s.io/v1beta1=true,lifecycle.k8s.io/v1alpha1=true"
  return 0
}

# Address of a cluster's kubelet API: its nodes' InternalIP (the apiserver dials it).
kubelet_ip() {
  case $1 in training) echo 127.0.0.2 ;; member-a) echo 127.0.0.3 ;; member-b) echo 127.0.0.4 ;; esac
}

# Reads the kernel's socket tables instead of probing, so nothing is sent to a listener
# that might belong to someone else, and a listener on 0.0.0.0 or [::] counts as busy too.
check_ports() {
  local -A want=()
  local c
  want[$((2379 + OFF))]="etcd client"; want[$((2380 + OFF))]="etcd peer"
  for c in "${CLUSTERS[@]}"; do
    want[$(port_of apiserver "$c")]="$c kube-apiserver"
    want[$(port_of kcm "$c")]="$c kube-controller-manager"
    want[$(port_of scheduler "$c")]="$c kube-scheduler"
    want[$(port_of kubelet "$c")]="$c kubelet API"
    if ((REAL)); then
      want[$(real_port kubelet "$c")]="$c real kubelet"
      want[$(real_port healthz "$c")]="$c real kubelet healthz"
      want[$(real_port dns-health "$c")]="$c CoreDNS health"
      want[$(real_port dns-ready "$c")]="$c CoreDNS ready"
      want[$(metrics_port "$c")]="$c metrics-server"
    fi
  done
  if ((REAL)); then want[$(real_port s3 training)]="checkpoint store"; fi
  fail_if_listening
}

# Fails naming each port of the caller's `want` (port → what) that something listens on.
# Also used by members.sh.
fail_if_listening() {
  local -A busy=()
  local f local_addr st port problems=()
  for f in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $f ]] || continue
    while read -r _ local_addr _ st _; do
      if [[ $st == 0A ]]; then busy[$((16#${local_addr##*:}))]=1; fi   # 0A = LISTEN
    done < <(tail -n +2 "$f")
  done
  for port in "${!want[@]}"; do
    if [[ ${busy[$port]:-} ]]; then problems+=("$port (${want[$port]})"); fi
  done
  ((${#problems[@]} == 0)) || fail "ports already in use: ${problems[*]}; stop whatever holds them or set CP_PORT_OFFSET"
}

# ---------------------------------------------------------------------------------------
# PKI (§3.2): one CA; v3 certificates, because rustls/webpki rejects v1 and matches
# names only against the SAN.

# sign NAME SUBJECT EXTENSIONS: a key and a certificate from the local CA, in the current
# directory (the PKI dir). Also used for the real nodes (realnode.sh).
sign() {
  openssl genrsa -out "$1.key" 2048
  openssl req -new -key "$1.key" -subj "$2" |
    openssl x509 -req -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
      -extfile <(printf '%s\n' "$3") -out "$1.crt"
}

make_pki() {
  local rc=0
  mkdir -p "$PKI"
  # Run with the caller's errexit off and the subshell's on: `( ... ) || fail` would
  # silently disable set -e for every command inside.
  set +e
  (
    set -e
    cd "$PKI"
    umask 077
    exec 2>>"$S/logs/pki.log"   # openssl chats on stderr even when it works
    openssl genrsa -out ca.key 2048
    openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=tidepool-local-ca" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -out ca.crt

    local srv='basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth'
    local cli=${srv/serverAuth/clientAuth}

    # Shared by the three apiservers (and the KCMs/schedulers): all serve on 127.0.0.1.
    sign apiserver "/CN=kube-apiserver" "$srv
subjectAltName=IP:127.0.0.1,IP:$(real_bridge_ip training),IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    # system:masters bypasses authorization; KCM, scheduler and kwok use it too (§3.5).
    sign admin "/O=system:masters/CN=admin" "$cli"
    # What the apiservers present to kubelets, i.e. to tidepool's kubelet API.
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$cli"
    # What the apiservers' aggregators present to extension API servers (metrics-server).
    sign front-proxy-client "/CN=front-proxy-client" "$cli"
    # tidepool's kubelet API: the apiserver dials the node's InternalIP (127.0.0.2) and
    # checks it against the SAN (--kubelet-certificate-authority); the subject is what a
    # node-name-validating apiserver would expect.
    sign vk-serving "/O=system:nodes/CN=system:node:tidepool" "$srv
subjectAltName=IP:127.0.0.2,IP:127.0.0.1,DNS:localhost"
    # kwok's kubelet API in each member, dialled at its nodes' InternalIP.
    sign kwok-member-a "/CN=kwok-member-a" "$srv
subjectAltName=IP:127.0.0.3"
    sign kwok-member-b "/CN=kwok-member-b" "$srv
subjectAltName=IP:127.0.0.4"
    for c in "${CLUSTERS[@]}"; do
      openssl genrsa -out "sa-$c.key" 2048
      openssl rsa -in "sa-$c.key" -pubout -out "sa-$c.pub"
    done
    # token,user,uid,"groups": lets tests exercise tidepool's bearer-token member access.
    printf '%s,tidepool-member,tidepool-member,"system:masters"\n' "$(openssl rand -hex 24)" >tokens.csv
    chmod 644 ./*.crt ./*.pub
  )
  rc=$?
  set -e
  ((rc == 0)) || fail "pki: openssl failed" pki
}

# ---------------------------------------------------------------------------------------
# kubeconfigs (§3.5), self-contained (embedded data) so they can be copied anywhere

b64() { base64 -w0 <"$1"; }

kubeconfig() {  # kubeconfig CLUSTER USER USER-FIELDS
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $1
  cluster:
    server: https://127.0.0.1:$(port_of apiserver "$1")
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: $2
  user:
$3
contexts:
- name: $1
  context: {cluster: $1, user: $2}
current-context: $1
EOF
}

write_kubeconfigs() {
  local c token
  token=$(cut -d, -f1 "$PKI/tokens.csv")
  for c in "${CLUSTERS[@]}"; do
    kubeconfig "$c" admin "    client-certificate-data: $(b64 "$PKI/admin.crt")
    client-key-data: $(b64 "$PKI/admin.key")" >"$S/$c.kubeconfig"
  done
  for c in "${MEMBERS[@]}"; do
    kubeconfig "$c" tidepool-member "    token: $token" >"$S/$c.token.kubeconfig"
  done
  chmod 600 "$S"/*.kubeconfig
}

# ---------------------------------------------------------------------------------------
# Readiness checks (each takes one name; used through await)

api() {  # api CLUSTER PATH [CURL-ARGS...]: quiet admin request, fails on non-2xx
  local c=$1 path=$2; shift 2
  curl -fs --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "$@" "https://127.0.0.1:$(port_of apiserver "$c")$path"
}

etcd_ready() { [[ $(curl -fsS --max-time 2 "http://127.0.0.1:$((2379 + OFF))/health" 2>/dev/null) == *'"health":"true"'* ]]; }
apiserver_ready() { api "$1" /readyz -o /dev/null; }
component_healthy() {  # NAME = <cluster>-kcm | <cluster>-scheduler
  local c=${1%-*} comp=${1##*-}
  [[ $(curl -fsS --max-time 2 --cacert "$PKI/ca.crt" "https://127.0.0.1:$(port_of "$comp" "$c")/healthz" 2>/dev/null) == ok ]]
}
default_sa_exists() { api "$1" /api/v1/namespaces/default/serviceaccounts/default -o /dev/null; }

# Ready=True alone is not enough: the not-ready taint that admission put on the new node
# stays until the KCM's node-lifecycle controller notices, and the scheduler avoids it.
nodes_ready() {
  local line cluster name body
  for line in "${NODES[@]}"; do
    read -r cluster name _ <<<"$line"
    [[ $cluster == "$1" ]] || continue
    body=$(api "$cluster" "/api/v1/nodes/$name") || return 1
    body=${body//[[:space:]]/}   # the apiserver pretty-prints for curl's User-Agent
    [[ $body == *'{"type":"Ready","status":"True"'* ]] || return 1
    [[ $body != *'"key":"node.kubernetes.io/not-ready"'* ]] || return 1
  done
}

# ---------------------------------------------------------------------------------------
# Components

start_etcd() {
  local client=http://127.0.0.1:$((2379 + OFF)) peer=http://127.0.0.1:$((2380 + OFF))
  # --unsafe-no-fsync: throw-away test data; fsync on a busy 2-core box slows everything.
  start etcd "$BIN/etcd" --name=local --data-dir="$S/etcd" \
    --listen-client-urls="$client" --advertise-client-urls="$client" \
    --listen-peer-urls="$peer" --initial-advertise-peer-urls="$peer" \
    --initial-cluster="local=$peer" --initial-cluster-state=new \
    --unsafe-no-fsync=true --quota-backend-bytes=4294967296 --log-level=warn
}

# Members keep an audit log of every write (who, what, when): the sharding test proves from
# it that no two tidepool replicas ever wrote for one member at once. Metadata only, writes
# only, so it costs little.
audit_flags() {
  local c=$1
  [[ $c == training ]] && return 0
  mkdir -p "$S/audit"
  cat >"$S/audit/policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
POLICY
  printf '%s\n' --audit-policy-file="$S/audit/policy.yaml" --audit-log-path="$S/audit/$c.log" \
    --audit-log-format=json --audit-log-maxsize=200 --audit-log-maxbackup=1
}

start_apiserver() {
  local c=$1 port audit gates profiling=false; port=$(port_of apiserver "$c")
  [[ ${CP_PROFILING:-0} == 1 ]] && profiling=true
  mapfile -t audit < <(audit_flags "$c")
  mapfile -t gates < <(gates_of "$c" apiserver)
  # One etcd, disjoint prefixes. Loopback advertise address needs the endpoint reconciler
  # off (it may not write 127/8 into Endpoints). InternalIP first, because tidepool's node
  # reports a Hostname that does not resolve (§4).
  start "$c-apiserver" "$(bin_of "$c" kube-apiserver)" \
    --etcd-servers="http://127.0.0.1:$((2379 + OFF))" --etcd-prefix="/$c" \
    --bind-address=127.0.0.1 --secure-port="$port" \
    --advertise-address=127.0.0.1 --endpoint-reconciler-type=none \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" \
    --authorization-mode=Node,RBAC \
    --service-account-issuer="https://127.0.0.1:$port" \
    --service-account-key-file="$PKI/sa-$c.pub" --service-account-signing-key-file="$PKI/sa-$c.key" \
    --service-cluster-ip-range=10.96.0.0/16 \
    --kubelet-preferred-address-types=InternalIP,Hostname,InternalDNS,ExternalDNS,ExternalIP \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$PKI/ca.crt" \
    --requestheader-client-ca-file="$PKI/ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
    --enable-aggregator-routing=true \
    --allow-privileged=true --profiling="$profiling" --v=1 "${audit[@]}" "${gates[@]}"
}

start_kcm_and_scheduler() {
  local c=$1 k="$S/$1.kubeconfig" gates
  mapfile -t gates < <(gates_of "$c" component)
  # Serving with the apiserver's cert (SAN 127.0.0.1) lets /healthz be checked against
  # ca.crt instead of with curl -k against a self-signed in-memory cert. Giving the
  # client CA directly (skip-lookup) stops a recurring "missing content for CA bundle
  # requestheader-client-ca-file" error that would crowd the log tails shown on failure.
  local tls=(--tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key"
             --client-ca-file="$PKI/ca.crt" --authentication-skip-lookup=true)
  # The KCM is not optional: it creates the default ServiceAccount (ServiceAccount
  # admission) and lifts the not-ready taint from new nodes (node lifecycle).
  # Only the kubelet-serving signer has files: the four signers would each hold an inotify
  # instance on the files. Those are few (128 per user by default) and kwok
  # needs one per followed log (`kubectl logs -f`), so parallel cluster sets ran out.
  # The training cluster signs kubelet serving certificates (tidepool asks for its own with a
  # CSR, as a kubelet with serverTLSBootstrap does; an admin approves it).
  local signing=()
  if [[ $c == training ]]; then
    signing=(--cluster-signing-kubelet-serving-cert-file="$PKI/ca.crt"
             --cluster-signing-kubelet-serving-key-file="$PKI/ca.key")
  fi
  start "$c-kcm" "$(bin_of "$c" kube-controller-manager)" "${signing[@]}" \
    --kubeconfig="$k" --authentication-kubeconfig="$k" --authorization-kubeconfig="$k" \
    --bind-address=127.0.0.1 --secure-port="$(port_of kcm "$c")" "${tls[@]}" \
    --leader-elect=false --cluster-name="$c" --controllers='*' \
    --root-ca-file="$PKI/ca.crt" --service-account-private-key-file="$PKI/sa-$c.key" \
    --use-service-account-credentials=false --node-monitor-grace-period=50s \
    --profiling=false "${gates[@]}"
  start "$c-scheduler" "$(bin_of "$c" kube-scheduler)" \
    --kubeconfig="$k" --authentication-kubeconfig="$k" --authorization-kubeconfig="$k" \
    --bind-address=127.0.0.1 --secure-port="$(port_of scheduler "$c")" "${tls[@]}" \
    --leader-elect=false --profiling=false "${gates[@]}"
}

# kwok has no built-in stages (it exits with "no stages found"); these are the ones
# kwokctl uses with node leases on (§3.7).
write_kwok_config() {
  local f stages=("$BIN"/kwok-stages/*.yaml)
  [[ -f ${stages[0]} ]] || fail "kwok: no stage files in $BIN/kwok-stages"
  {
    cat <<'EOF'
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  manageAllNodes: false
  manageNodesWithLabelSelector: type=kwok
  nodeLeaseDurationSeconds: 40
  cidr: 10.244.0.0/16
  # kwok v0.8.0 applies its defaults only when no KwokConfiguration is given at all,
  # so a config file must spell them out (else: "node leases parallelism must be
  # greater than 0").
  nodeLeaseParallelism: 4
  nodePlayStageParallelism: 4
  podPlayStageParallelism: 4
  podsOnNodeSyncParallelism: 1
  enablePodsOnNodeSyncListPager: true
  # Logs, exec and attach on kwok's kubelet API (see write_kwok_debugging).
  enableDebuggingHandlers: true
EOF
    for f in "${stages[@]}"; do printf -- '---\n'; cat "$f"; done
  } >"$S/kwok.yaml"
}

start_kwok() {
  # HOME=STATE_DIR: kwok first loads ~/.kwok/kwok.yaml if present. --node-ip/--node-port
  # become the InternalIP and kubelet port of its nodes (node-initialize stage), where the
  # member apiserver dials kwok's kubelet API for logs and exec.
  local c=$1
  start "$c-kwok" env HOME="$S" "$BIN/kwok" --kubeconfig="$S/$c.kubeconfig" \
    --config="$S/kwok.yaml" --config="$S/kwok-$c.yaml" \
    --server-address="$(kubelet_ip "$c"):$(port_of kubelet "$c")" \
    --node-ip="$(kubelet_ip "$c")" --node-port="$(port_of kubelet "$c")" \
    --tls-cert-file="$PKI/kwok-$c.crt" --tls-private-key-file="$PKI/kwok-$c.key"
}

# What kwok's kubelet API answers for every pod of a member: the container log is one file
# the tests append to, and exec runs the command here, in a scratch directory.
write_kwok_debugging() {
  local c=$1
  mkdir -p "$S/pod-logs" "$S/exec/$c"
  printf '%s stdout F %s\n' "$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)" "$c: log file ready" >"$S/pod-logs/$c.log"
  cat >"$S/kwok-$c.yaml" <<EOF
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterLogs
metadata:
  name: all-pods
spec:
  logs:
  - logsFile: $S/pod-logs/$c.log
    follow: true
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterExec
metadata:
  name: all-pods
spec:
  execs:
  - local:
      workDir: $S/exec/$c
EOF
}

# Status is accepted on create (only updates need /status); kwok then adds the
# conditions and keeps the capacity given here.
create_nodes() {
  local line cluster name cpu mem gpus product pool gpu_label gpu_res body
  for line in "${NODES[@]}"; do
    read -r cluster name cpu mem gpus product pool <<<"$line"
    gpu_label="" gpu_res=""
    if ((gpus > 0)); then
      gpu_label="nvidia.com/gpu.product: $product"
      gpu_res=", nvidia.com/gpu: \"$gpus\""
    fi
    body="apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations: {node.alpha.kubernetes.io/ttl: \"0\"}
  labels:
    type: kwok
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    tidepool.io/test-pool: $pool
    $gpu_label
spec:
  providerID: kwok://$name
status:
  capacity:    {cpu: \"$cpu\", memory: $mem, pods: \"110\"$gpu_res}
  allocatable: {cpu: \"$cpu\", memory: $mem, pods: \"110\"$gpu_res}"
    api "$cluster" /api/v1/nodes -S -o /dev/null -H 'Content-Type: application/yaml' --data-binary "$body" ||
      fail "$cluster-apiserver: creating node $name failed" "$cluster-apiserver"
  done
}

# ---------------------------------------------------------------------------------------
# Commands

resolve_bin() {
  local b
  if [[ -n ${CP_BIN:-} ]]; then
    BIN=$CP_BIN
  else
    log "CP_BIN not set: running tests/controlplane/build.sh (a cold build takes tens of minutes)"
    BIN=$("$here/build.sh" | tail -n 1) || fail "build.sh failed"
  fi
  [[ -d $BIN ]] || fail "binary dir $BIN does not exist"
  BIN=$(cd "$BIN" && pwd -P)
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
    [[ -x $BIN/$b ]] || fail "$BIN/$b is missing or not executable"
  done
  SKEW_BIN=${CP_SKEW_BIN:-}
  [[ -z $SKEW_BIN ]] && return
  [[ -d $SKEW_BIN ]] || fail "CP_SKEW_BIN: $SKEW_BIN does not exist (tests/controlplane/build-skew.sh builds it)"
  SKEW_BIN=$(cd "$SKEW_BIN" && pwd -P)
  for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    [[ -x $SKEW_BIN/$b ]] || fail "$SKEW_BIN/$b is missing or not executable"
  done
}

# A state dir is wiped only if it is empty or was made by this script, so a wrong
# argument cannot empty someone's directory.
prepare_state_dir() {
  local entries
  shopt -s nullglob dotglob
  entries=("$S"/*)
  shopt -u nullglob dotglob
  if [[ -e $S/.tidepool-cluster ]]; then
    stop_all || fail "could not stop the previous run's processes in $S"
    real_nodes_down
    rm -rf -- "${entries[@]}"
  elif ((${#entries[@]})); then
    fail "$S is not empty and was not made by cluster.sh: refusing to wipe it"
  fi
  mkdir -p "$S/logs"
  touch "$S/.tidepool-cluster"
}

write_env() {
  local c var
  {
    printf 'export %s=%q\n' CP_BIN "$BIN" CP_STATE_DIR "$S" CP_PKI "$PKI" CP_PORT_OFFSET "$OFF"
    for c in "${CLUSTERS[@]}"; do
      var=${c^^}; var=${var//-/_}
      printf 'export %s=%q\n' "${var}_KUBECONFIG" "$S/$c.kubeconfig" \
        "${var}_SERVER" "https://127.0.0.1:$(port_of apiserver "$c")"
    done
    for c in "${MEMBERS[@]}"; do
      var=${c^^}; var=${var//-/_}
      printf 'export %s=%q\n' "${var}_TOKEN_KUBECONFIG" "$S/$c.token.kubeconfig" \
        "${var}_AUDIT_LOG" "$S/audit/$c.log" \
        "${var}_POD_LOG" "$S/pod-logs/$c.log" "${var}_EXEC_DIR" "$S/exec/$c"
    done
    # tidepool's kubelet API, as the training apiserver expects it (vk-serving has its SAN).
    printf 'export %s=%q\n' TIDEPOOL_KUBELET_ADDRESS "$(kubelet_ip training)" \
      TIDEPOOL_KUBELET_PORT "$(port_of kubelet training)" \
      TIDEPOOL_KUBELET_CERT "$PKI/vk-serving.crt" TIDEPOOL_KUBELET_KEY "$PKI/vk-serving.key" \
      TIDEPOOL_KUBELET_CLIENT_CA "$PKI/ca.crt" KUBECTL "$BIN/kubectl"
    printf 'export %s=%q\n' CP_REAL_NODES "$REAL"
    if [[ -n $SKEW_BIN ]]; then
      printf 'export %s=%q\n' CP_SKEW_BIN "$SKEW_BIN" CP_SKEW_MEMBER "$SKEW_MEMBER"
    fi
    if ((REAL)); then
      printf 'export %s=%q\n' CP_NODE_BIN "$NODE_BIN" CP_IMAGES "$IMAGES" CTR "$NODE_BIN/ctr" \
        CP_METRICS_BIN "$METRICS_BIN" \
        APISERVER_RELAY_HOST "$(real_bridge_ip training)" \
        WORKLOAD_IMAGE tidepool.invalid/workload:1 REAL_NODE_TAINT "$REAL_TAINT_KEY" \
        CHECKPOINT_STORE "http://$(real_bridge_ip training):$(real_port s3 training)"
      for c in "${CLUSTERS[@]}"; do
        var=${c^^}; var=${var//-/_}
        printf 'export %s=%q\n' "${var}_REAL_NODE" "$(real_node_name "$c")" \
          "${var}_BRIDGE_IP" "$(real_bridge_ip "$c")" \
          "${var}_CONTAINERD" "$S/nodes/$c/containerd/state/containerd.sock"
      done
    fi
  } >"$S/cluster.env"
}

on_up_exit() {
  local rc=$?
  ((UP_OK)) && return
  log "start-up failed (exit $rc): stopping what was started"
  if stop_all; then real_nodes_down; log "stopped"; fi
}

cmd_up() {
  local c t
  # Whatever makes `up` exit early (a failed wait, an unexpected error, Ctrl-C, a test
  # harness's TERM) stops what was started, so a failed run leaves no process behind.
  UP_OK=0   # global: the EXIT trap runs after this function's locals are gone
  trap on_up_exit EXIT
  trap 'log "interrupted"; exit 130' INT
  trap 'log "terminated"; exit 143' TERM
  trap 'log "unexpected error at line $LINENO: $BASH_COMMAND"' ERR

  prepare_state_dir
  resolve_bin
  if ((REAL)); then resolve_node_bin; resolve_metrics_bin; fi
  log "binaries: $BIN"
  if [[ -n $SKEW_BIN ]]; then log "$SKEW_MEMBER runs the Kubernetes of $SKEW_BIN"; fi
  check_ports

  t=$(now_ms)
  make_pki
  write_kubeconfigs
  log "PKI and kubeconfigs written ($(secs $(($(now_ms) - t))) s)"

  start_etcd
  await 30 "etcd healthy" etcd_ready "@" etcd

  for c in "${CLUSTERS[@]}"; do start_apiserver "$c"; done
  await 120 "kube-apiserver ready" apiserver_ready "@-apiserver etcd" "${CLUSTERS[@]}"

  for c in "${CLUSTERS[@]}"; do start_kcm_and_scheduler "$c"; done
  await 90 "healthy" component_healthy "@" \
    "${CLUSTERS[@]/%/-kcm}" "${CLUSTERS[@]/%/-scheduler}"
  # Pods are rejected by ServiceAccount admission until this exists (§5.3).
  await 90 "default ServiceAccount exists" default_sa_exists "@-kcm @-apiserver etcd" "${CLUSTERS[@]}"

  write_kwok_config
  for c in "${MEMBERS[@]}"; do write_kwok_debugging "$c"; start_kwok "$c"; done
  create_nodes
  await 60 "all nodes Ready and untainted" nodes_ready "@-kwok @-kcm @-apiserver etcd" "${MEMBERS[@]}"
  if ((REAL)); then
    t=$(now_ms)
    real_nodes_up
    real_apiserver_relays
    real_checkpoint_store
    log "real nodes up ($(secs $(($(now_ms) - t))) s)"
    t=$(now_ms)
    metrics_servers_up
    log "metrics-servers up ($(secs $(($(now_ms) - t))) s)"
  fi

  write_env
  UP_OK=1
  log "up in $(secs $(($(now_ms) - T0))) s; environment: source $S/cluster.env"
}

cmd_down() {
  # Nothing was started if the directory is not there (down is idempotent).
  [[ -d $S ]] || return 0
  stop_all || exit 1
  real_nodes_down
  # The real nodes' containerd roots hold every image imported (gigabytes with the frameworks
  # images) and are made again by the next `up`: they go; logs (the pods' too), audit and
  # etcd stay to read. Only once nothing is mounted below them any more.
  if [[ -d $S/nodes ]] && ! awk -v s="$S/nodes/" 'index($2, s) == 1 {m = 1} END {exit !m}' /proc/self/mounts; then
    rm -rf -- "$S"/nodes/*/containerd
  fi
  log "stopped"
}

# ---------------------------------------------------------------------------------------

# Sourced (members.sh reuses the functions above): define only.
[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0

(($# == 2)) || usage
[[ $2 ]] || usage
OFF=${CP_PORT_OFFSET:-0}
REAL=${CP_REAL_NODES:-1}
[[ $REAL =~ ^[01]$ ]] || { echo "CP_REAL_NODES must be 0 or 1" >&2; exit 2; }
[[ $OFF =~ ^[0-9]+$ ]] || { echo "CP_PORT_OFFSET must be a non-negative integer" >&2; exit 2; }
case $1 in
  up)
    mkdir -p "$2"
    S=$(cd "$2" && pwd -P) PKI=$S/pki
    cmd_up ;;
  down)
    if [[ -d $2 ]]; then S=$(cd "$2" && pwd -P); else S=$2; fi
    cmd_down ;;
  *) usage ;;
esac
