#!/usr/bin/env bash
# Starts one of the field's real training operators (built by tests/operators/build.sh) as a
# host process against one local cluster of a cluster set (tests/controlplane/cluster.sh), the
# way its own manifests would run it in a pod: CRDs, namespace, webhook Secret and
# configuration, a Service for its webhook. Then it `exec`s the operator, so the PID the
# caller holds is the operator's (kill it to stop it); output goes to this script's stdout
# and stderr.
#
# Usage:
#   tests/operators/start.sh OPERATOR STATE_DIR CLUSTER [-- OPERATOR FLAGS...]
#     OPERATOR   training-operator | mpi-operator | jobset | trainer | volcano | volcano-scheduler |
#                coscheduling | kueue
#     STATE_DIR  a cluster set's state dir (its cluster.env is read)
#     CLUSTER    training | member-a | member-b
#   Flags after `--` go to the operator after the ones given here (the last one wins), e.g.
#     training-operator: --gang-scheduler-name=tidepool --namespace=NS
#                        --enable-scheme=tfjob --pytorch-init-container-image=IMAGE
#     mpi-operator:      --gang-scheduling=tidepool --namespace=NS
#     jobset, trainer:   --feature-gates=..., --zap-log-level=...
#   A gang flag also installs the PodGroup CRD it needs (scheduling.x-k8s.io, or
#   scheduling.volcano.sh for `volcano`) from TIDEPOOL_GANG_CRDS (tests/schedulers/build.sh's gang-crds;
#   run when unset).
#
# Environment: TIDEPOOL_OPERATORS_BIN (tests/operators/build.sh's output; built when unset),
# TIDEPOOL_SCHEDULERS (tests/schedulers/build.sh's output: Volcano, Coscheduling, Kueue; built
# when unset),
# TIDEPOOL_GANG_CRDS (see above), KUEUE_FRAMEWORKS (see start_kueue).
#
# Ports (k = 0 training, 1 member-a, 2 member-b; plus CP_PORT_OFFSET, one thousand apart per
# kind like the real nodes' ports, so side-by-side cluster sets never meet):
#   training-operator  webhook 20250+k (all addresses: it has no flag for the host),
#                      metrics 127.0.0.1:21250+k, health 127.0.0.1:22250+k (/healthz, /readyz:
#                      ready once its webhook certificate is in place and its webhook serves)
#   mpi-operator       health 127.0.0.1:23250+k (/healthz; upstream hard-codes :8080, see
#                      build.sh), metrics off (--monitoring-port=N turns them on, all addresses)
#   jobset             webhook <real node IP>:25250+k, metrics https://127.0.0.1:26250+k
#                      (authenticated), health 127.0.0.1:27250+k
#   trainer            webhook <real node IP>:28250+k, metrics 127.0.0.1:29250+k (http),
#                      health 127.0.0.1:30250+k, status server 31250+k (all addresses; only
#                      with --feature-gates=TrainJobStatus=true)
#   volcano            vc-controller-manager: health 127.0.0.1:32250+k (/healthz)
#   coscheduling       scheduler-plugins' scheduler: https://127.0.0.1:12250+k (/healthz)
#   volcano-scheduler  vc-scheduler: health 127.0.0.1:24250+k (/healthz)
#   kueue              webhook <real node IP>:9250+k, health 127.0.0.1:8250+k (/readyz)
# (All below 32768, where the kernel's ephemeral ports start: a port there can be taken by
# any outgoing connection.)
#
# Webhooks: the API servers have no route to ClusterIPs (no kube-proxy), but run with
# --enable-aggregator-routing=true, which makes them resolve a webhook's Service reference to
# an address of its EndpointSlice, as for APIServices (tests/controlplane/metrics.sh). The
# Service has no selector; its EndpointSlice names the cluster's real node IP (10.87.x.y on
# lo: an endpoint may not be a loopback address), where the operator's webhook port listens.
# The serving certificate names the Service (<svc>.<ns>.svc), which is what the API server
# checks; it comes from a CA of this operator's own (STATE_DIR/operators/CLUSTER/OPERATOR/pki),
# made so that the training-operator's cert rotator accepts its Secret as it is and never
# rotates it; JobSet and Trainer run with their own certificate management off, reading the
# files this script writes, and their webhook configurations carry this CA.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

log() { printf '[operators-start %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
usage() {
  sed -n '/^# Usage:/,/^# Environment:/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

(($# >= 3)) || usage
OPERATOR=$1 STATE=$2 CLUSTER=$3
shift 3
if (($#)); then
  [[ $1 == -- ]] || usage
  shift
fi
EXTRA=("$@")

[[ -f $STATE/cluster.env ]] || die "$STATE/cluster.env is missing: start the clusters with tests/controlplane/cluster.sh up $STATE"
# shellcheck disable=SC1091
source "$STATE/cluster.env"
OFF=$CP_PORT_OFFSET

case $CLUSTER in
  training) K=0 ;;
  member-a) K=1 ;;
  member-b) K=2 ;;
  *) die "unknown cluster $CLUSTER (training, member-a or member-b)" ;;
esac
var=${CLUSTER^^}; var=${var//-/_}
kcv=${var}_KUBECONFIG nodev=${var}_REAL_NODE
export KUBECONFIG=${!kcv}
KC=("$KUBECTL")
DIR=$CP_STATE_DIR/operators/$CLUSTER/$OPERATOR
mkdir -p "$DIR"

# port BASE: this operator's port of one kind for CLUSTER in this cluster set.
port() { echo $(($1 + K + OFF)); }

resolve_bin() {
  if [[ -z ${TIDEPOOL_OPERATORS_BIN:-} ]]; then
    log "TIDEPOOL_OPERATORS_BIN not set: running tests/operators/build.sh (a cold build takes minutes)"
    TIDEPOOL_OPERATORS_BIN=$(bash "$here/build.sh" | tail -n 1) || die "tests/operators/build.sh failed"
  fi
  BIN=$TIDEPOOL_OPERATORS_BIN
  local exe=$OPERATOR
  [[ $OPERATOR != trainer ]] || exe=trainer-controller-manager
  [[ -x $BIN/$exe ]] || die "$BIN/$exe is missing or not executable"
}

# Fails naming each given port something already listens on (the operator would die on its
# bind with a less helpful message). Reads the kernel's socket tables, like cluster.sh.
check_ports() {
  local -A busy=()
  local f local_addr st p problems=()
  for f in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $f ]] || continue
    while read -r _ local_addr _ st _; do
      if [[ $st == 0A ]]; then busy[$((16#${local_addr##*:}))]=1; fi   # 0A = LISTEN
    done < <(tail -n +2 "$f")
  done
  for p; do
    if [[ ${busy[$p]:-} ]]; then problems+=("$p"); fi
  done
  ((${#problems[@]} == 0)) ||
    die "ports already in use: ${problems[*]} (another $OPERATOR on this cluster set? stop it first)"
}

# flag_value NAME: the value of --NAME / -NAME among the extra flags (the last one given), as
# Go's flag package reads them (--name=v, --name v).
flag_value() {
  local name=$1 i a v=""
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    a=${EXTRA[i]}
    case $a in
      --"$name"=*|-"$name"=*) v=${a#*=} ;;
      --"$name"|-"$name") v=${EXTRA[i + 1]:-} ;;
    esac
  done
  printf '%s' "$v"
}

# flag_values NAME: every value of a repeatable flag, one per line.
flag_values() {
  local name=$1 i a
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    a=${EXTRA[i]}
    case $a in
      --"$name"=*|-"$name"=*) printf '%s\n' "${a#*=}" ;;
      --"$name"|-"$name") printf '%s\n' "${EXTRA[i + 1]:-}" ;;
    esac
  done
}

# CRDs are large (the training-operator's are over 500 KB each): client-side apply would put
# a copy of each in an annotation, over the size limit, so server-side apply.
apply_crds() {
  local f names=()
  "${KC[@]}" apply --server-side --force-conflicts --field-manager=tidepool-operators -f "$1" >&2 ||
    die "applying the CRDs in $1 failed"
  for f in "$1"/*.yaml; do
    names+=("crd/$(awk '/^metadata:/{m=1; next} m && /^  name:/{print $2; exit}' "$f")")
  done
  # A CRD just applied may have no status yet, which `kubectl wait` takes for an error: retried.
  local tries=0
  until "${KC[@]}" wait --for condition=Established --timeout=60s "${names[@]}" >/dev/null 2>&1; do
    ((++tries < 30)) || die "the CRDs in $1 did not become Established"
    sleep 1
  done
}

# The PodGroup CRD a gang flag's value needs (any name but volcano means scheduler-plugins'
# coscheduling PodGroup, for both operators).
gang_crds() {
  local scheduler=$1 dir
  [[ -n $scheduler ]] || return 0
  if [[ -z ${TIDEPOOL_GANG_CRDS:-} ]]; then
    resolve_schedulers
    TIDEPOOL_GANG_CRDS=$TIDEPOOL_SCHEDULERS/gang-crds
  fi
  dir=$(mktemp -d)
  if [[ $scheduler == volcano ]]; then
    cp "$TIDEPOOL_GANG_CRDS/volcano.yaml" "$dir/"
  else
    cp "$TIDEPOOL_GANG_CRDS/coscheduling.yaml" "$dir/"
  fi
  apply_crds "$dir"
  rm -rf "$dir"
}

# webhook_secret NAME NAMESPACE: Secret NAME holding webhook_pki's CA (with its key) and serving
# certificate, as an operator's cert rotator keeps them: it finds them valid and leaves them.
webhook_secret() {
  "${KC[@]}" apply --server-side --force-conflicts --field-manager=tidepool-operators -f - >/dev/null <<EOF ||
apiVersion: v1
kind: Secret
metadata: {name: $1, namespace: $2}
type: Opaque
data:
  ca.crt: $(b64 "$DIR/pki/ca.crt")
  ca.key: $(b64 "$DIR/pki/ca.key")
  tls.crt: $(b64 "$DIR/pki/tls.crt")
  tls.key: $(b64 "$DIR/pki/tls.key")
EOF
    die "applying the webhook Secret $2/$1 failed"
}

# The address the API server dials for webhooks: the cluster's real node IP (on lo).
webhook_ip() {
  local node=${!nodev:-} ip
  [[ ${CP_REAL_NODES:-0} == 1 && -n $node ]] ||
    die "webhooks need the cluster set's real nodes (CP_REAL_NODES=1): their IPs are this host's non-loopback addresses the API servers may dial"
  ip=$("${KC[@]}" get node "$node" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}') ||
    die "cannot read node $node"
  [[ -n $ip ]] || die "node $node has no InternalIP"
  # Read whole before matching: `ip … | grep -q` fails under pipefail when grep stops early.
  local addrs
  addrs=$(ip -4 -o addr show)
  [[ $addrs == *" $ip/"* ]] || die "$ip (node $node) is not an address of this host"
  echo "$ip"
}

# webhook_pki SERVICE NAMESPACE CA_NAME CA_ORG: a CA and a serving certificate for
# SERVICE.NAMESPACE.svc in $DIR/pki, made once per state dir (a restarted operator finds the
# same Secret, valid, and starts at once). The shapes are what the cert-controller rotator the
# operators use checks before it would rotate: the CA verifies as a server certificate for
# its own name (DNS SAN = CA_NAME, no extended key usage) with its key in PKCS#1 (it parses
# ca.key so); the serving certificate verifies for the Service's DNS name; both valid long
# past its 90-day look-ahead.
webhook_pki() {
  local svc=$1 ns=$2 ca_name=$3 ca_org=$4 dns pki=$DIR/pki
  dns=$svc.$ns.svc
  if [[ -f $pki/tls.crt && $(openssl x509 -in "$pki/tls.crt" -noout -ext subjectAltName 2>/dev/null) == *"DNS:$dns"* ]]; then
    return 0
  fi
  rm -rf "$pki"; mkdir -p "$pki"
  (
    cd "$pki"
    umask 077
    exec 2>>"$DIR/pki.log"   # openssl chats on stderr even when it works
    openssl genrsa -traditional -out ca.key 2048
    openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/O=$ca_org/CN=$ca_name" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment" \
      -addext "subjectAltName=DNS:$ca_name" -out ca.crt
    openssl genrsa -traditional -out tls.key 2048
    openssl req -new -key tls.key -subj "/CN=$dns" |
      openssl x509 -req -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 3650 \
        -extfile <(printf '%s\n' 'basicConstraints=critical,CA:FALSE' \
          'keyUsage=critical,digitalSignature,keyEncipherment' 'extendedKeyUsage=serverAuth' \
          "subjectAltName=DNS:$dns,DNS:$svc.$ns.svc.cluster.local") -out tls.crt
  ) || die "openssl failed (see $DIR/pki.log)"
}

b64() { base64 -w0 <"$1"; }

# webhook_service SERVICE NAMESPACE PORT_NAME PORT: the Service the webhook configuration
# names (port 443, no selector) and its EndpointSlice at this host's real node IP and PORT.
# The slice's managed-by label keeps it away from the KCM's EndpointSlice controllers.
webhook_service() {
  local svc=$1 ns=$2 pname=$3 p=$4 ip
  ip=$(webhook_ip)
  "${KC[@]}" apply --server-side --force-conflicts --field-manager=tidepool-operators -f - >&2 <<EOF ||
apiVersion: v1
kind: Service
metadata: {name: $svc, namespace: $ns, labels: {app.kubernetes.io/managed-by: tidepool-operators}}
spec:
  ports: [{name: $pname, port: 443, protocol: TCP, targetPort: $p}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: $svc-host
  namespace: $ns
  labels: {kubernetes.io/service-name: $svc, endpointslice.kubernetes.io/managed-by: tidepool-operators}
addressType: IPv4
ports: [{name: $pname, port: $p, protocol: TCP}]
endpoints: [{addresses: ["$ip"], conditions: {ready: true}}]
EOF
    die "applying the webhook Service of $OPERATOR failed"
  log "webhook: Service $ns/$svc → $ip:$p"
}

# webhook NAME SERVICE NAMESPACE PATH GROUP VERSION RESOURCE OPERATIONS [OBJECT_SELECTOR]: one
# entry of a webhook configuration (YAML, for webhook_configuration), calling SERVICE at PATH
# with this operator's CA as caBundle, failing closed as upstream's manifests do.
webhook() {
  local selector=""
  [[ -z ${9:-} ]] || selector="
  objectSelector: $9"
  printf '%s' "
- name: $1
  admissionReviewVersions: [v1]
  clientConfig:
    service: {name: $2, namespace: $3, port: 443, path: $4}
    caBundle: $(b64 "$DIR/pki/ca.crt")
  failurePolicy: Fail
  sideEffects: None
  rules: [{apiGroups: [\"$5\"], apiVersions: [$6], operations: $8, resources: [$7]}]$selector"
}

# webhook_configuration Validating|Mutating NAME ENTRIES: (re)creates the configuration. A
# replace, not an apply: entries dropped since the last start (schemes turned off) must go.
# Labelled with the operator: the tests delete it when they stop the operator.
webhook_configuration() {
  local kind=$1WebhookConfiguration
  "${KC[@]}" delete "${kind,,}" "$2" --ignore-not-found >/dev/null
  "${KC[@]}" create -f - >/dev/null <<EOF ||
apiVersion: admissionregistration.k8s.io/v1
kind: $kind
metadata: {name: $2, labels: {app.kubernetes.io/managed-by: tidepool-operators, tidepool.io/operator: $OPERATOR}}
webhooks:$3
EOF
    die "creating the $kind $2 failed"
}

# serving_certs DIR: the webhook's certificate and key where the operator reads them.
serving_certs() {
  mkdir -p "$1"
  cp "$DIR/pki/tls.crt" "$DIR/pki/tls.key" "$DIR/pki/ca.crt" "$1/"
}

namespace() {
  "${KC[@]}" create namespace "$1" --dry-run=client -o yaml |
    "${KC[@]}" apply --server-side --field-manager=tidepool-operators -f - >/dev/null ||
    die "creating namespace $1 failed"
}

# ---------------------------------------------------------------------------------------
# training-operator (Kubeflow, v1 jobs)

# Its cmd/training-operator.v1 and pkg/cert: before any controller starts it waits for the
# cert-controller rotator, which needs the Secret training-operator-webhook-cert in namespace
# kubeflow (MY_POD_NAMESPACE) and the ValidatingWebhookConfiguration
# validator.training-operator.kubeflow.org to exist, injects the Secret's ca.crt into that
# configuration, and waits for /tmp/k8s-webhook-server/serving-certs/tls.crt to exist (a path
# it hard-codes, what the Secret's volume would be in a pod). The webhook server itself reads
# tls.crt/tls.key from $TMPDIR/k8s-webhook-server/serving-certs (controller-runtime's default
# directory is under os.TempDir()): each operator instance gets its own TMPDIR, so instances
# of several cluster sets never serve each other's certificates.
start_training_operator() {
  local ns=kubeflow svc=training-operator webhook metrics health schemes=() s kind hooks=""
  webhook=$(port 20250) metrics=$(port 21250) health=$(port 22250)
  check_ports "$webhook" "$metrics" "$health"

  # Its MPIJob v1 is not started: the MPIJob CRD is mpi-operator's v2beta1 (build.sh).
  mapfile -t schemes < <(flag_values enable-scheme)
  if ((${#schemes[@]} == 0)); then
    schemes=(tfjob pytorchjob xgboostjob paddlejob jaxjob)
    EXTRA=("${schemes[@]/#/--enable-scheme=}" "${EXTRA[@]}")
  fi
  for s in "${schemes[@]}"; do
    [[ ${s,,} != mpijob ]] ||
      die "--enable-scheme=mpijob: the MPIJob CRD here is mpi-operator's v2beta1; start mpi-operator instead"
  done

  apply_crds "$BIN/crds/training-operator"
  gang_crds "$(flag_value gang-scheduler-name)"
  namespace "$ns"
  webhook_pki "$svc" "$ns" training-operator-ca training-operator
  webhook_secret training-operator-webhook-cert "$ns"
  webhook_service "$svc" "$ns" webhook-server "$webhook"

  # One validating webhook per enabled kind, at the path controller-runtime registers for it
  # (a webhook for a kind whose scheme is off would reject that kind: nothing serves it).
  for s in "${schemes[@]}"; do
    kind=${s,,}
    hooks+=$(webhook "validator.$kind.training-operator.kubeflow.org" "$svc" "$ns" \
      "/validate-kubeflow-org-v1-$kind" kubeflow.org v1 "${kind}s" "[CREATE, UPDATE]")
  done
  webhook_configuration Validating validator.training-operator.kubeflow.org "$hooks"

  serving_certs "$DIR/tmp/k8s-webhook-server/serving-certs"
  # The rotator only checks that this file exists; whichever instance wrote it first, its
  # content is never served (see above). Written atomically, never replaced.
  if [[ ! -f /tmp/k8s-webhook-server/serving-certs/tls.crt ]]; then
    mkdir -p /tmp/k8s-webhook-server/serving-certs
    cp "$DIR/pki/tls.crt" "/tmp/k8s-webhook-server/serving-certs/.tls.crt.$$"
    mv -n "/tmp/k8s-webhook-server/serving-certs/.tls.crt.$$" /tmp/k8s-webhook-server/serving-certs/tls.crt
    rm -f "/tmp/k8s-webhook-server/serving-certs/.tls.crt.$$"
  fi

  # PyTorchJob's init container waits for the master's DNS name with nslookup, in alpine:3.10
  # by default, which cannot be pulled here: the workload image (busybox) does the same.
  # The workers' init container waits for the master's Service with `nslookup <short name>`:
  # the frameworks image's nslookup resolves with the pod's search domains (busybox's, in
  # the workload image, asks the name as written and never finds it).
  EXTRA=(--pytorch-init-container-image="tidepool.invalid/frameworks:1" "${EXTRA[@]}")
  log "training-operator on $CLUSTER: webhook :$webhook, metrics 127.0.0.1:$metrics, health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  export TMPDIR=$DIR/tmp MY_POD_NAMESPACE=$ns
  exec "$BIN/training-operator" \
    --metrics-bind-address="127.0.0.1:$metrics" --health-probe-bind-address="127.0.0.1:$health" \
    --webhook-server-port="$webhook" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# mpi-operator (MPIJob v2beta1)

# Its cmd/mpi-operator: exits unless MPIJobs v2beta1 can be listed; runs its controller only as
# the leader of Lease mpi-operator/mpi-operator (--lock-namespace), renewed every 3 s, taken
# over 15 s after its holder stops renewing; reads KUBECONFIG. The launcher is an ordinary pod
# of the user's image (no kubectl delivery in v2); it reaches the workers over SSH with keys
# the operator puts in a Secret.
start_mpi_operator() {
  local health lock_ns renew age
  health=$(port 23250)
  check_ports "$health"
  apply_crds "$BIN/crds/mpi-operator"
  gang_crds "$(flag_value gang-scheduling)"
  lock_ns=$(flag_value lock-namespace); lock_ns=${lock_ns:-mpi-operator}
  namespace "$lock_ns"
  # A killed leader leaves its Lease held for 15 s, and a new operator would idle that long.
  # Its ports are free (checked above), so no operator of this cluster set runs here: a Lease
  # not renewed for 4 s (a live leader renews every 3 s) is a dead one's.
  renew=$("${KC[@]}" -n "$lock_ns" get lease mpi-operator -o jsonpath='{.spec.renewTime}' 2>/dev/null || true)
  if [[ -n $renew ]]; then
    age=$(($(date +%s) - $(date -d "$renew" +%s)))
    if ((age > 4)); then
      "${KC[@]}" -n "$lock_ns" delete lease mpi-operator --ignore-not-found >/dev/null
      log "deleted the Lease of a stopped mpi-operator (renewed $age s ago)"
    fi
  fi
  log "mpi-operator on $CLUSTER: health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  export MPI_OPERATOR_HEALTH_ADDR=127.0.0.1:$health
  exec "$BIN/mpi-operator" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# JobSet

# Its main.go and pkg/util/cert: with internalCertManagement off in its Configuration it starts
# its controllers at once and serves its webhooks (JobSet defaulting and validation, and a pod
# mutating/validating webhook for pods labelled jobset.sigs.k8s.io/jobset-name) with the files
# in webhook.certDir. Its defaults (e.g. the Jobs' completion mode, the pods' subdomain) come
# from that defaulting webhook: JobSets created while it is not running are rejected.
start_jobset() {
  local ns=jobset-system svc=jobset-webhook-service webhook metrics health ip sel hooks
  webhook=$(port 25250) metrics=$(port 26250) health=$(port 27250)
  check_ports "$webhook" "$metrics" "$health"
  apply_crds "$BIN/crds/jobset"
  namespace "$ns"
  webhook_pki "$svc" "$ns" jobset-ca jobset
  ip=$(webhook_ip)
  webhook_service "$svc" "$ns" webhook-server "$webhook"
  sel='{matchExpressions: [{key: jobset.sigs.k8s.io/jobset-name, operator: Exists}]}'
  hooks=$(webhook mjobset.kb.io "$svc" "$ns" /mutate-jobset-x-k8s-io-v1alpha2-jobset \
            jobset.x-k8s.io v1alpha2 jobsets "[CREATE]")
  hooks+=$(webhook mpod.kb.io "$svc" "$ns" /mutate--v1-pod "" v1 pods "[CREATE]" "$sel")
  webhook_configuration Mutating jobset-mutating-webhook-configuration "$hooks"
  hooks=$(webhook vjobset.kb.io "$svc" "$ns" /validate-jobset-x-k8s-io-v1alpha2-jobset \
            jobset.x-k8s.io v1alpha2 jobsets "[CREATE, UPDATE]")
  hooks+=$(webhook vpod.kb.io "$svc" "$ns" /validate--v1-pod "" v1 pods "[CREATE]" "$sel")
  webhook_configuration Validating jobset-validating-webhook-configuration "$hooks"

  serving_certs "$DIR/certs"
  cat >"$DIR/config.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
webhook: {port: $webhook, host: "$ip", certDir: "$DIR/certs"}
metrics: {bindAddress: "127.0.0.1:$metrics", certDir: "$DIR/certs"}
health: {healthProbeBindAddress: "127.0.0.1:$health"}
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
EOF
  log "jobset on $CLUSTER: webhook $ip:$webhook, metrics https://127.0.0.1:$metrics, health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  export TMPDIR=$DIR/tmp
  mkdir -p "$TMPDIR"
  exec "$BIN/jobset" --config="$DIR/config.yaml" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# Trainer v2 (kubeflow/trainer)

# Its cmd/trainer-controller-manager: with certManagement off in its Configuration it starts at
# once and serves its webhooks (TrainJob defaulting and validation, [Cluster]TrainingRuntime
# validation) with $TMPDIR/k8s-webhook-server/serving-certs (controller-runtime's default dir).
# A TrainJob becomes a JobSet: the JobSet CRD is installed here, and `start.sh jobset` must
# run for its pods. Its ClusterTrainingRuntimes (BIN/runtimes/trainer) name upstream images;
# apply them (or your own) once /readyz answers, as their validating webhook is needed.
start_trainer() {
  local ns=kubeflow-system svc=kubeflow-trainer-controller-manager webhook metrics health status ip hooks
  webhook=$(port 28250) metrics=$(port 29250) health=$(port 30250) status=$(port 31250)
  check_ports "$webhook" "$metrics" "$health" "$status"
  apply_crds "$BIN/crds/jobset"
  apply_crds "$BIN/crds/trainer"
  namespace "$ns"
  webhook_pki "$svc" "$ns" kubeflow-trainer-ca kubeflow-trainer
  ip=$(webhook_ip)
  webhook_service "$svc" "$ns" webhook-server "$webhook"
  hooks=$(webhook defaulter.trainjob.trainer.kubeflow.org "$svc" "$ns" \
            /mutate-trainer-kubeflow-org-v1alpha1-trainjob trainer.kubeflow.org v1alpha1 trainjobs "[CREATE, UPDATE]")
  webhook_configuration Mutating defaulter.trainer.kubeflow.org "$hooks"
  hooks=""
  for kind in clustertrainingruntime trainingruntime trainjob; do
    hooks+=$(webhook "validator.$kind.trainer.kubeflow.org" "$svc" "$ns" \
      "/validate-trainer-kubeflow-org-v1alpha1-$kind" trainer.kubeflow.org v1alpha1 "${kind}s" "[CREATE, UPDATE]")
  done
  webhook_configuration Validating validator.trainer.kubeflow.org "$hooks"

  serving_certs "$DIR/tmp/k8s-webhook-server/serving-certs"
  cat >"$DIR/config.yaml" <<EOF
apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
webhook: {port: $webhook, host: "$ip"}
metrics: {bindAddress: "127.0.0.1:$metrics", secureServing: false}
health: {healthProbeBindAddress: "127.0.0.1:$health"}
leaderElection: {leaderElect: false}
certManagement: {enable: false, webhookServiceName: $svc}
statusServer: {port: $status}
EOF
  log "trainer on $CLUSTER: webhook $ip:$webhook, metrics 127.0.0.1:$metrics, health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  export TMPDIR=$DIR/tmp
  exec "$BIN/trainer-controller-manager" --config="$DIR/config.yaml" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# Volcano

resolve_schedulers() {
  if [[ -z ${TIDEPOOL_SCHEDULERS:-} ]]; then
    log "TIDEPOOL_SCHEDULERS not set: running tests/schedulers/build.sh (a cold build takes minutes)"
    TIDEPOOL_SCHEDULERS=$(bash "$here/../schedulers/build.sh" | tail -n 1) || die "tests/schedulers/build.sh failed"
  fi
  [[ -x $TIDEPOOL_SCHEDULERS/bin/kueue ]] || die "$TIDEPOOL_SCHEDULERS/bin/kueue is missing"
}

# Its cmd/controller-manager: Volcano Jobs, their PodGroups (made before any pod; the job's pods
# are made once the group leaves Pending, which a gang scheduler does), queues and the job
# plugins (svc, env, tensorflow, ...). Without its admission webhooks (vc-webhook-manager),
# which only default and validate, so a Job names its queue, minAvailable, task names and
# maxRetry itself. The queue `default` is made here, as a Volcano install makes it (its
# scheduler creates it at start): the controller refuses a Job whose queue does not exist.
# Leader election off: one process, restarted at once. The jobflow controllers are off (their
# CRDs are not installed). Health on 127.0.0.1:32250+k (/healthz).
start_volcano() {
  local health
  health=$(port 32250)
  check_ports "$health"
  apply_crds "$TIDEPOOL_SCHEDULERS/crds/volcano"
  "${KC[@]}" apply --server-side --field-manager=tidepool-operators -f - >&2 <<'EOF' || die "creating the default queue failed"
apiVersion: scheduling.volcano.sh/v1beta1
kind: Queue
metadata: {name: default}
spec: {weight: 1, reclaimable: true}
EOF
  log "vc-controller-manager on $CLUSTER: health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  exec "$TIDEPOOL_SCHEDULERS/bin/vc-controller-manager" --kubeconfig="$KUBECONFIG" --leader-elect=false \
    --controllers=job-controller,pg-controller,queue-controller,gc-controller \
    --enable-healthz --healthz-address="127.0.0.1:$health" "${EXTRA[@]}"
}

# Its cmd/scheduler, a member's gang scheduler, with Volcano's default scheduling configuration
# written out: actions enqueue, allocate, backfill (no preempt or reclaim action, so it never
# evicts a pod), plugins priority, gang, conformance, then overcommit, drf, predicates,
# proportion, nodeorder. It handles pods of schedulerName `volcano` and makes the queue
# `default` at its start. CSI storage tracking and metrics stay off (their defaults). Health on
# 127.0.0.1:24250+k (/healthz).
start_volcano_scheduler() {
  local health conf=$DIR/scheduler.conf
  health=$(port 24250)
  check_ports "$health"
  apply_crds "$TIDEPOOL_SCHEDULERS/crds/volcano"
  cat >"$conf" <<'EOF'
actions: "enqueue, allocate, backfill"
tiers:
- plugins: [{name: priority}, {name: gang}, {name: conformance}]
- plugins: [{name: overcommit}, {name: drf}, {name: predicates}, {name: proportion}, {name: nodeorder}]
EOF
  log "vc-scheduler on $CLUSTER: health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  exec "$TIDEPOOL_SCHEDULERS/bin/vc-scheduler" --kubeconfig="$KUBECONFIG" --leader-elect=false \
    --scheduler-conf="$conf" --enable-healthz --healthz-address="127.0.0.1:$health" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# scheduler-plugins' Coscheduling, a member's gang scheduler


# scheduler-plugins' kube-scheduler as a second scheduler, as its manifests/coscheduling
# configure it but under its own name (`scheduler-plugins-scheduler`, tidepool's default
# gangSchedulerName for coscheduling) beside the cluster's default scheduler: the Coscheduling
# plugin sorts, holds (Permit, 10 s) and lets go a PodGroup's pods all or none. Its PodGroup
# CRD from the same module. Serves HTTPS on 127.0.0.1:12250+k (/healthz, anonymous).
start_coscheduling() {
  local health config=$DIR/scheduler-config.yaml
  health=$(port 12250)
  check_ports "$health"
  apply_crds "$TIDEPOOL_SCHEDULERS/crds/scheduler-plugins"
  cat >"$config" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection: {leaderElect: false}
clientConnection: {kubeconfig: "$KUBECONFIG"}
profiles:
- schedulerName: scheduler-plugins-scheduler
  plugins:
    multiPoint: {enabled: [{name: Coscheduling}]}
    queueSort: {enabled: [{name: Coscheduling}], disabled: [{name: "*"}]}
  pluginConfig:
  - {name: Coscheduling, args: {permitWaitingTimeSeconds: 10}}
EOF
  log "coscheduling scheduler on $CLUSTER: https://127.0.0.1:$health/healthz; flags: ${EXTRA[*]}"
  exec "$TIDEPOOL_SCHEDULERS/bin/coscheduling-scheduler" --config="$config" \
    --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
    --bind-address=127.0.0.1 --secure-port="$health" "${EXTRA[@]}"
}

# ---------------------------------------------------------------------------------------
# Kueue

# Its cmd/kueue with its batch/v1 Job, JobSet and PyTorchJob integrations: a job naming a
# LocalQueue (kueue.x-k8s.io/queue-name) is suspended at creation by Kueue's mutating webhook
# and let go once its Workload is admitted by quota (the JobSet and PyTorchJob controllers
# start once their CRDs are served: the operators' starts install them). Kueue's own certificate management stays on (with it
# off Kueue insists on metrics certificates under /etc): it keeps its serving certificate in
# Secret kueue-webhook-server-cert and writes the CA into its webhook configurations and into
# the CRDs whose versions it converts (their conversion is pointed at its webhook Service here,
# as its install does). Its webhooks
# would call it for every job of the cluster: here only for namespaces labelled
# tidepool.io/e2e-kueue=true, so the Jobs of other tests never wait on a Kueue that is not
# running. KUEUE_FRAMEWORKS (quoted, comma-separated) narrows the integrations: a MultiKueue
# manager watches the objects of each of them in its workers, and refuses a worker that does
# not serve one. waitForPodsReady on (60 s, requeued after 5 s): an admitted job whose pods are not
# all ready by then is evicted and queued again. Visibility server and metrics off. Webhook <real node IP>:9250+k, health
# 127.0.0.1:8250+k (/readyz).
start_kueue() {
  local ns=kueue-system svc=kueue-webhook-service webhook health ip hooks sel crd conversion
  local frameworks=${KUEUE_FRAMEWORKS:-'"batch/job", "jobset.x-k8s.io/jobset", "kubeflow.org/pytorchjob"'}
  webhook=$(port 9250) health=$(port 8250)
  check_ports "$webhook" "$health"
  apply_crds "$TIDEPOOL_SCHEDULERS/crds/kueue"
  namespace "$ns"
  # The Secret Kueue's certificate rotator reads (it must exist, as Kueue's install makes it),
  # filled with this script's CA and serving certificate in the shape the rotator accepts as
  # they are (webhook_pki): the webhook configurations and the CRDs' conversion carry that CA
  # from the start, and Kueue serves with that certificate at once.
  webhook_pki "$svc" "$ns" kueue-ca kueue
  webhook_secret kueue-webhook-server-cert "$ns"
  # Where the Secret's volume would put it in a pod: Kueue's rotator waits for the files to match
  # the Secret before it reports ready.
  serving_certs "$DIR/certs"
  conversion='{"spec":{"conversion":{"strategy":"Webhook","webhook":{"conversionReviewVersions":["v1"],
    "clientConfig":{"caBundle":"'$(b64 "$DIR/pki/ca.crt")'",
    "service":{"name":"'$svc'","namespace":"'$ns'","path":"/convert","port":443}}}}}}'
  for crd in localqueues clusterqueues workloads cohorts multikueueclusters; do
    "${KC[@]}" patch crd "$crd.kueue.x-k8s.io" --type merge -p "$conversion" >/dev/null ||
      die "pointing the conversion of $crd at Kueue failed"
  done
  ip=$(webhook_ip)
  webhook_service "$svc" "$ns" webhook-server "$webhook"
  sel='
  namespaceSelector: {matchLabels: {tidepool.io/e2e-kueue: "true"}}'
  hooks=$(webhook mjob.kb.io "$svc" "$ns" /mutate-batch-v1-job batch v1 jobs "[CREATE]")$sel
  hooks+=$(webhook mjobset.kb.io "$svc" "$ns" /mutate-jobset-x-k8s-io-v1alpha2-jobset jobset.x-k8s.io v1alpha2 jobsets "[CREATE]")$sel
  hooks+=$(webhook mpytorchjob.kb.io "$svc" "$ns" /mutate-kubeflow-org-v1-pytorchjob kubeflow.org v1 pytorchjobs "[CREATE]")$sel
  webhook_configuration Mutating kueue-mutating-webhook-configuration "$hooks"
  hooks=$(webhook vjob.kb.io "$svc" "$ns" /validate-batch-v1-job batch v1 jobs "[CREATE, UPDATE]")$sel
  hooks+=$(webhook vjobset.kb.io "$svc" "$ns" /validate-jobset-x-k8s-io-v1alpha2-jobset jobset.x-k8s.io v1alpha2 jobsets "[CREATE, UPDATE]")$sel
  hooks+=$(webhook vpytorchjob.kb.io "$svc" "$ns" /validate-kubeflow-org-v1-pytorchjob kubeflow.org v1 pytorchjobs "[CREATE, UPDATE]")$sel
  webhook_configuration Validating kueue-validating-webhook-configuration "$hooks"
  cat >"$DIR/config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: $ns
health: {healthProbeBindAddress: "127.0.0.1:$health"}
metrics: {bindAddress: "0"}
webhook: {port: $webhook, host: "$ip", certDir: "$DIR/certs"}
leaderElection: {leaderElect: false}
internalCertManagement: {enable: true, webhookServiceName: $svc, webhookSecretName: kueue-webhook-server-cert}
manageJobsWithoutQueueName: false
waitForPodsReady:
  timeout: 60s
  requeuingStrategy: {timestamp: Eviction, backoffBaseSeconds: 5, backoffMaxSeconds: 20}
integrations: {frameworks: [$frameworks]}
EOF
  log "kueue on $CLUSTER: webhook $ip:$webhook, health 127.0.0.1:$health; flags: ${EXTRA[*]}"
  exec "$TIDEPOOL_SCHEDULERS/bin/kueue" --config="$DIR/config.yaml" --kubeconfig="$KUBECONFIG" \
    --feature-gates=VisibilityOnDemand=false "${EXTRA[@]}"
}

case $OPERATOR in
  training-operator|mpi-operator|jobset|trainer) resolve_bin ;;
  volcano|volcano-scheduler|coscheduling|kueue) resolve_schedulers ;;
  *) die "unknown operator $OPERATOR (training-operator, mpi-operator, jobset, trainer, volcano, volcano-scheduler, coscheduling or kueue)" ;;
esac
case $OPERATOR in
  training-operator) start_training_operator ;;
  mpi-operator) start_mpi_operator ;;
  jobset) start_jobset ;;
  trainer) start_trainer ;;
  volcano) start_volcano ;;
  volcano-scheduler) start_volcano_scheduler ;;
  coscheduling) start_coscheduling ;;
  kueue) start_kueue ;;
esac
