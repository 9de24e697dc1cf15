#!/usr/bin/env bash
# The tidepool demo on a fresh machine: builds what is missing (cached), starts a training
# cluster and two member clusters on loopback (kwok GPU nodes, and one real node each:
# containerd, kubelet, CNI, CoreDNS), runs tidepool between them with its embedded default
# config, registers both members, runs a distributed PS/trainer job made by Jobs across the
# bridge on member-a's real node (logs, exec, top through the training cluster), places an
# elastic job whole and reclaims it by band with a checkpoint notice, reclaims the real job's
# elastic trainer (it acks from inside its pod) and gives it back, then moves the whole job to
# member-b when member-a takes its real node back: its Jobs make the pods again, tidepool
# places them there, and they resume from their checkpoints. Everything stays up afterwards so you can look around with
# kubectl; `bash deploy/demo.sh down` stops it all. Needs root (the real nodes).
#
# Environment: TIDEPOOL_DEMO_DIR (state, default $TMPDIR/tidepool-demo), CP_PORT_OFFSET (0).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
state=${TIDEPOOL_DEMO_DIR:-${TMPDIR:-/tmp}/tidepool-demo}
export CP_PORT_OFFSET=${CP_PORT_OFFSET:-0}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# A step that did not happen ends the demo (and CI, which runs it): the last of tidepool's log.
fail() {
  printf '\nFAILED: %s\n-- the end of %s:\n' "$*" "$state/tidepool.log" >&2
  tail -n 30 "$state/tidepool.log" >&2 || true
  exit 1
}

stop_tidepool() {
  if [[ -f "$state/tidepool.pid" ]]; then
    pid=$(cat "$state/tidepool.pid")
    kill "$pid" 2>/dev/null && echo "stopped tidepool (pid $pid)"
    rm -f "$state/tidepool.pid"
  fi
}

if [[ "${1:-}" == down ]]; then
  stop_tidepool
  bash tests/controlplane/cluster.sh down "$state"
  exit 0
fi

say "prerequisites: the packages deploy/prerequisites lists (installed when missing)"
bash deploy/prereqs.sh
say "building the local control plane from source (cached after the first run)"
CP_BIN=$(bash tests/controlplane/build.sh | tail -n 1)
export CP_BIN
say "building the real nodes' containerd, CNI plugins and CoreDNS (cached after the first run)"
CP_NODE_BIN=$(bash tests/nodes/build.sh | tail -n 1)
export CP_NODE_BIN
say "building metrics-server (cached after the first run)"
CP_METRICS_BIN=$(bash tests/metrics/build.sh | tail -n 1)
export CP_METRICS_BIN
say "building tidepool"
cargo build --locked --bin tidepool
CP_IMAGES=$(bash tests/images/build.sh | tail -n 1)
export CP_IMAGES
stop_tidepool
say "starting the clusters: training + member-a + member-b (kwok nodes with GPUs, a real node each)"
bash tests/controlplane/cluster.sh up "$state"
# shellcheck disable=SC1091
source "$state/cluster.env"
k() { "$CP_BIN/kubectl" --kubeconfig "$TRAINING_KUBECONFIG" "$@"; }
ka() { "$CP_BIN/kubectl" --kubeconfig "$MEMBER_A_KUBECONFIG" "$@"; }

say "installing the MemberCluster CRD and registering both members"
k apply -f deploy/crds/
k wait --for condition=Established crd/memberclusters.tidepool.io --timeout=30s
k create namespace tidepool-system --dry-run=client -o yaml | k apply -f -
k -n tidepool-system create secret generic member-a-kubeconfig --from-file=kubeconfig="$MEMBER_A_TOKEN_KUBECONFIG" --dry-run=client -o yaml | k apply -f -
k -n tidepool-system create secret generic member-b-kubeconfig --from-file=kubeconfig="$MEMBER_B_TOKEN_KUBECONFIG" --dry-run=client -o yaml | k apply -f -
# member-a lends its H100 nodes and its dedicated real node as two pools.
k apply -f deploy/examples/membercluster-dedicated.yaml -f deploy/examples/membercluster-pools.yaml

say "starting tidepool (embedded default config; log: $state/tidepool.log)"
KUBECONFIG="$TRAINING_KUBECONFIG" setsid "$root/target/debug/tidepool" run >"$state/tidepool.log" 2>&1 < /dev/null &
echo $! > "$state/tidepool.pid"

say "the kubelet API: tidepool asks for a serving certificate; an admin approves it"
csr=""
for _ in $(seq 120); do
  csr=$(k get csr -l app.kubernetes.io/component=kubelet-serving --no-headers 2>/dev/null | awk '$NF == "Pending" {print $1}' | tail -n 1)
  [[ -n "$csr" ]] && break; sleep 0.5
done
k certificate approve "$csr"

say "waiting for the virtual nodes"
for node in tidepool-member-a-gpu tidepool-member-a-real tidepool-member-b-a100 tidepool-member-b-real; do
  for _ in $(seq 120); do k get node "$node" >/dev/null 2>&1 && break; sleep 0.5; done
  k wait --for condition=Ready "node/$node" --timeout=60s
done
k get nodes -o wide
k get memberclusters

say "a distributed training job, as a tenant writes it: parameter servers and trainers made by Jobs"
k create namespace team-a --dry-run=client -o yaml | k apply -f -
for _ in $(seq 60); do k -n team-a get serviceaccount default >/dev/null 2>&1 && break; sleep 0.5; done
# Its checkpoints go to the local clusters' S3 store (moto's server on the training bridge).
sed "s#CHECKPOINT_STORE#$CHECKPOINT_STORE#" deploy/examples/ps-trainer-job.yaml | k apply -f -
ctr_running() {  # ctr_running N NODE: N pods of the job Running, all on virtual node NODE
  local n=$1 node=$2 got
  for _ in $(seq 240); do
    got=$(k -n team-a get pods -l job=ctr --field-selector=status.phase=Running \
            -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | grep -c "^$node\$" || true)
    [[ $got -ge $n ]] && return 0; sleep 0.5
  done
  fail "the job did not reach $n running pods on $node"
}
ctr_running 4 tidepool-member-a-real
k -n team-a get pods -l job=ctr -o wide -L tidepool.io/band,tidepool.io/role
echo "-- their copies in member-a (its namespace team-a, made by tidepool), placed by member-a's own scheduler on its real node:"
ka -n team-a get pods -o wide
trainer() {  # the live pod of trainer INDEX
  k -n team-a get pods -l job=ctr,role=trainer,batch.kubernetes.io/job-completion-index="$1" \
    --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}'
}
resumed() {  # resumed POD: the line of its log that says it resumed, else fails
  # The log is read whole first: with pipefail, a grep that stops at its match fails the
  # pipeline whenever kubectl is still writing (SIGPIPE), though the line was there.
  local log
  log=$(k -n team-a logs "$1")
  grep -m 1 'resumed at step' <<<"$log"
}
sleep 5
t0=$(trainer 0)
echo "-- kubectl logs $t0 (through the training API server, tidepool's kubelet API, member-a): the loss falls"
k -n team-a logs "$t0" --tail=3
ps0=$(k -n team-a get pods -l job=ctr,role=ps -o jsonpath='{.items[0].metadata.name}')
echo "-- kubectl exec $ps0 -- sh -c 'hostname; nslookup ctr-ps-1.ctr.team-a.svc.cluster.local; cat /etc/tidepool/annotations':"
echo "   (the training namespace's FQDNs resolve in the member: the copies run in a namespace of the same name)"
k -n team-a exec "$ps0" -- sh -c 'hostname; nslookup ctr-ps-1.ctr.team-a.svc.cluster.local | grep -A1 ^Name; cat /etc/tidepool/annotations; echo'
echo "-- kubectl top pods (metrics-server scraping the virtual node, which reads member-a's metrics):"
for _ in $(seq 90); do
  [[ $(k -n team-a top pods -l job=ctr 2>/dev/null) == *ctr* ]] && break; sleep 1
done
k -n team-a top pods -l job=ctr || fail "kubectl top pods showed no metrics within 90 s"

say "an elastic job on the GPU pools (kwok nodes): 6 workers, a gang of 4, placed whole on one pool"
k apply -f deploy/examples/elastic-job.yaml
for _ in $(seq 120); do
  bound=$(k -n team-a get pods -l app=resnet -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | grep -c . || true)
  [[ "$bound" -ge 6 ]] && break; sleep 0.5
done
k -n team-a wait --for=jsonpath='{.status.phase}'=Running pod -l app=resnet --timeout=90s
k -n team-a get pods -l app=resnet -o wide -L tidepool.io/band
node=$(k -n team-a get pods -l app=resnet -o jsonpath='{.items[0].spec.nodeName}')
member=$(k get node "$node" -o jsonpath='{.metadata.labels.tidepool\.io/member}')
case "$member" in member-a) MK=$MEMBER_A_KUBECONFIG ;; *) MK=$MEMBER_B_KUBECONFIG ;; esac
km() { "$CP_BIN/kubectl" --kubeconfig "$MK" "$@"; }
echo "-- the whole gang is on $node (member $member)"

say "online traffic grows in $member: its HPA may now add 2 replicas of 2 GPUs"
km create namespace online --dry-run=client -o yaml | km apply -f -
for _ in $(seq 60); do km -n online get serviceaccount default >/dev/null 2>&1 && break; sleep 0.5; done
km apply -f deploy/examples/online-service.yaml
km -n online wait --for=jsonpath='{.status.currentReplicas}'=1 hpa/inference --timeout=60s
km -n online patch hpa inference --type merge -p '{"spec":{"maxReplicas":3}}'
echo "-- tidepool takes capacity back by band: elastic (low) workers get a checkpoint notice first"
noticed=""
for _ in $(seq 120); do
  noticed=$(k -n team-a get pods -l app=resnet -o jsonpath='{range .items[?(@.metadata.annotations.tidepool\.io/reclaim-deadline)]}{.metadata.name}{" "}{end}')
  [[ -n "$noticed" ]] && break; sleep 0.5
done
k -n team-a get pods -l app=resnet -o custom-columns='NAME:.metadata.name,BAND:.metadata.labels.tidepool\.io/band,PHASE:.status.phase,RECLAIM-DEADLINE:.metadata.annotations.tidepool\.io/reclaim-deadline'
echo "-- these simulated workers have no process to ack: an operator acks for them (annotation tidepool.io/checkpoint-done)"
for p in $noticed; do k -n team-a annotate pod "$p" tidepool.io/checkpoint-done=true --overwrite; done
for p in $noticed; do
  k -n team-a wait --for=jsonpath='{.status.reason}'=Reclaimed "pod/$p" --timeout=60s
done
k -n team-a get pods -l app=resnet -o custom-columns='NAME:.metadata.name,BAND:.metadata.labels.tidepool\.io/band,PHASE:.status.phase,REASON:.status.reason,MESSAGE:.status.message'
echo "-- the gang core (medium) keeps running; the Job's replacements for the reclaimed workers wait, explained:"
sleep 3
k -n team-a get pods -l app=resnet --field-selector=status.phase=Pending -o custom-columns='NAME:.metadata.name,WHY:.status.conditions[0].message'

say "member-a needs most of its real node's CPU back: the elastic trainer checkpoints, acks from inside its pod and goes"
cores=$(ka get node "$MEMBER_A_REAL_NODE" -o jsonpath='{.status.allocatable.cpu}')
# Room for the gang's core only (three pods of 50m).
k patch membercluster member-a --type merge -p "{\"spec\":{\"capacity\":{\"reserve\":{\"cpu\":\"$((cores * 1000 - 160))m\"}}}}"
t1=$(trainer 1)
k -n team-a wait --for=jsonpath='{.status.reason}'=Reclaimed "pod/$t1" --timeout=120s ||
  fail "trainer 1 was not reclaimed within 120 s"
k -n team-a get pod "$t1" -o jsonpath='{.status.phase} {.status.reason}: {.status.message}{"\n"}'
echo "-- its ack, the termination message the member's kubelet reported (no credentials involved):"
k -n team-a get pod "$t1" -o jsonpath='{.status.containerStatuses[0].state.terminated.message}{"\n"}'
echo "-- DisruptionTarget, so the Job's podFailurePolicy does not count it:"
k -n team-a get pod "$t1" -o jsonpath='{range .status.conditions[?(@.type=="DisruptionTarget")]}{.type}={.status} {.reason}{"\n"}{end}'
for _ in $(seq 40); do
  [[ -n $(k -n team-a get pods -l job=ctr,role=trainer --field-selector=status.phase=Pending -o name) ]] && break
  sleep 0.5
done
sleep 2
echo "-- the core trains on; the Job's new trainer 1 waits, explained:"
k -n team-a get pods -l job=ctr -o custom-columns='NAME:.metadata.name,PHASE:.status.phase,REASON:.status.reason,WHY:.status.conditions[?(@.type=="PodScheduled")].message'
k -n team-a logs "$(trainer 0)" --tail=2
echo "-- the demand falls: trainer 1 joins the same member again and resumes from its ack"
k patch membercluster member-a --type merge -p '{"spec":{"capacity":{"reserve":null}}}'
ctr_running 4 tidepool-member-a-real
sleep 5
resumed "$(trainer 1)" || fail "trainer 1 did not resume from its checkpoint"
k -n team-a logs "$(trainer 1)" --tail=2

say "member-a takes its whole real node back: the whole job is reclaimed, and its Jobs resume it on member-b"
step_before=$(k -n team-a logs "$(trainer 0)" --tail=1 | sed -n 's/.*step=\([0-9]*\).*/\1/p')
k patch membercluster member-a --type merge -p "{\"spec\":{\"capacity\":{\"reserve\":{\"cpu\":\"${cores}000m\"}}}}"
ctr_running 4 tidepool-member-b-real
echo "-- the pods member-a had: reclaimed with the notice, each acked from inside"
k -n team-a get pods -l job=ctr --field-selector=status.phase=Failed \
  -o jsonpath='{range .items[*]}{.metadata.name}  {.spec.nodeName}  {.status.reason}  {.status.containerStatuses[0].state.terminated.message}{end}'
echo "-- the Jobs' new pods, placed by tidepool on member-b's real pool:"
k -n team-a get pods -l job=ctr --field-selector=status.phase=Running -o wide
echo "-- their copies in member-b, on member-b's real node:"
"$CP_BIN/kubectl" --kubeconfig "$MEMBER_B_KUBECONFIG" -n team-a get pods -o wide
sleep 5
echo "-- kubectl logs of trainer 0: it goes on from the step it saved on member-a (it was at step ${step_before:-?})"
resumed "$(trainer 0)" || fail "trainer 0 did not resume from its checkpoint"
k -n team-a logs "$(trainer 0)" --tail=2
k patch membercluster member-a --type merge -p '{"spec":{"capacity":{"reserve":null}}}'

say "tidepool status"
KUBECONFIG="$TRAINING_KUBECONFIG" "$root/target/debug/tidepool" status

cat <<MSG

Tidepool is running (pid $(cat "$state/tidepool.pid")). Look around:
  export KUBECONFIG=$TRAINING_KUBECONFIG
  $CP_BIN/kubectl get nodes,memberclusters
  $CP_BIN/kubectl -n team-a get pods -l job=ctr -o wide     # the PS/trainer job, now on member-b's real node
  $CP_BIN/kubectl -n team-a logs -f job/ctr-trainer         # its trainer's log
  $CP_BIN/kubectl -n team-a exec -it job/ctr-ps -- sh
  $CP_BIN/kubectl -n team-a top pods
  $CP_BIN/kubectl -n team-a delete job ctr-ps ctr-trainer   # the copies are deleted in the member first, then here
Stop everything:  bash deploy/demo.sh down
MSG
