#!/usr/bin/env bash
# The tidepool demo on a fresh machine: builds what is missing (cached), starts a training
# cluster and two member clusters on loopback (kwok GPU nodes, and one real node each:
# containerd, kubelet, CNI, CoreDNS), runs tidepool between them with its embedded default
# config, registers both members, sends a real trainer process across the bridge (its logs
# and exec through the training cluster), places an elastic job whole, reclaims by band
# with a checkpoint notice, and moves the real job to member-b when member-a takes its whole
# real node back (it resumes there from its checkpoint). Everything stays up afterwards so you can look around with
# kubectl; `bash deploy/demo.sh down` stops it all. Needs root (the real nodes).
#
# Environment: TIDEPOOL_DEMO_DIR (state, default $TMPDIR/tidepool-demo), CP_PORT_OFFSET (0).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
state=${TIDEPOOL_DEMO_DIR:-${TMPDIR:-/tmp}/tidepool-demo}
export CP_PORT_OFFSET=${CP_PORT_OFFSET:-0}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

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

say "a real trainer process on member-a's real node, across the bridge"
k create namespace team-a --dry-run=client -o yaml | k apply -f -
for _ in $(seq 60); do k -n team-a get serviceaccount default >/dev/null 2>&1 && break; sleep 0.5; done
# Its checkpoints go to the local clusters' S3 store (moto's server on the training bridge).
sed "s#CHECKPOINT_STORE#$CHECKPOINT_STORE#" deploy/examples/trainer-real.yaml | k apply -f -
k -n team-a wait --for=jsonpath='{.status.phase}'=Running pod/trainer-0 --timeout=90s
k -n team-a get pods -o wide
echo "-- its offload copy in member-a, placed by member-a's own scheduler on the real node:"
ka -n tp-team-a get pods -o wide
sleep 3
echo "-- kubectl logs trainer-0 -c trainer (through the training apiserver, tidepool's kubelet API, member-a): the loss falls"
k -n team-a logs trainer-0 -c trainer --tail=3
echo "-- kubectl exec trainer-0 -- sh -c 'hostname; cat /etc/tidepool/annotations; exit 3':"
k -n team-a exec trainer-0 -c trainer -- sh -c 'hostname; cat /etc/tidepool/annotations; exit 3' || echo "(exit code $?)"

say "an elastic training job (6 workers, gang of 4) placed whole on one pool"
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
echo "-- each trainer checkpoints and acknowledges (it sees the notice in /etc/tidepool/annotations)"
for p in $noticed; do k -n team-a annotate pod "$p" tidepool.io/checkpoint-done=true --overwrite; done
for p in $noticed; do
  k -n team-a wait --for=jsonpath='{.status.reason}'=Reclaimed "pod/$p" --timeout=60s
done
k -n team-a get pods -l app=resnet -o custom-columns='NAME:.metadata.name,BAND:.metadata.labels.tidepool\.io/band,PHASE:.status.phase,REASON:.status.reason,MESSAGE:.status.message'
k -n team-a get events --field-selector reason=ReclaimRequested -o custom-columns='OBJECT:.involvedObject.name,REASON:.reason,MESSAGE:.message' 2>/dev/null | head -5 || true
echo "-- the gang core (medium) keeps running; the Job's replacements for the reclaimed workers wait, explained:"
sleep 3
k -n team-a get pods -l app=resnet --field-selector=status.phase=Pending -o custom-columns='NAME:.metadata.name,WHY:.status.conditions[0].message'

say "member-a needs its real node's CPU back: the real job checkpoints, acks from inside the pod, and resumes"
cores=$(ka get node "$MEMBER_A_REAL_NODE" -o jsonpath='{.status.allocatable.cpu}')
k patch membercluster member-a --type merge -p "{\"spec\":{\"capacity\":{\"reserve\":{\"cpu\":\"$((cores * 1000 - 100))m\"}}}}"
if k -n team-a wait --for=jsonpath='{.status.reason}'=Reclaimed pod/trainer-0 --timeout=120s; then
  echo "-- its final status (the ack is the trainer's termination message, no credentials involved):"
  k -n team-a get pod trainer-0 -o jsonpath='{.status.phase} {.status.reason}: {.status.message}{"\n"}'
  k -n team-a get pod trainer-0 -o jsonpath='{range .status.containerStatuses[*]}{.name}: {.state.terminated.message}{end}'
  echo "-- room again: the same job started anew resumes from its checkpoint"
  k patch membercluster member-a --type merge -p '{"spec":{"capacity":{"reserve":null}}}'
  k -n team-a delete pod trainer-0 --wait=true
  sed "s#CHECKPOINT_STORE#$CHECKPOINT_STORE#" deploy/examples/trainer-real.yaml | k apply -f -
  k -n team-a wait --for=jsonpath='{.status.phase}'=Running pod/trainer-0 --timeout=90s || true
  sleep 3
  k -n team-a logs trainer-0 -c trainer --tail=3 || true
else
  echo "(trainer-0 was not reclaimed within 120 s; see $state/tidepool.log)"
  k patch membercluster member-a --type merge -p '{"spec":{"capacity":{"reserve":null}}}'
fi

say "a deeper deficit: member-a takes its whole real node back; the job resumes on member-b"
if k -n team-a wait --for=jsonpath='{.status.phase}'=Running pod/trainer-0 --timeout=30s 2>/dev/null; then
  k patch membercluster member-a --type merge -p "{\"spec\":{\"capacity\":{\"reserve\":{\"cpu\":\"${cores}000m\"}}}}"
  if k -n team-a wait --for=jsonpath='{.status.reason}'=Reclaimed pod/trainer-0 --timeout=120s; then
    echo "-- reclaimed whole from member-a (parameter servers and trainer); the acks, from inside the pod:"
    k -n team-a get pod trainer-0 -o jsonpath='{range .status.containerStatuses[*]}{.name}: {.state.terminated.message}{end}'
    echo "-- placed again on member-b's real pool, same checkpoint store, same job:"
    k -n team-a delete pod trainer-0 --wait=true
    sed "s#CHECKPOINT_STORE#$CHECKPOINT_STORE#; s#tidepool-member-a-real#tidepool-member-b-real#" deploy/examples/trainer-real.yaml | k apply -f -
    k -n team-a wait --for=jsonpath='{.status.phase}'=Running pod/trainer-0 --timeout=90s || true
    k -n team-a get pod trainer-0 -o wide
    echo "-- its copy in member-b, on member-b's real node:"
    "$CP_BIN/kubectl" --kubeconfig "$MEMBER_B_KUBECONFIG" -n tp-team-a get pods -o wide
    sleep 3
    echo "-- kubectl logs trainer-0 -c trainer: it goes on from the step it saved on member-a"
    k -n team-a logs trainer-0 -c trainer --tail=3 || true
  else
    echo "(trainer-0 was not reclaimed within 120 s; see $state/tidepool.log)"
  fi
  k patch membercluster member-a --type merge -p '{"spec":{"capacity":{"reserve":null}}}'
fi

say "tidepool status"
KUBECONFIG="$TRAINING_KUBECONFIG" "$root/target/debug/tidepool" status

cat <<MSG

Tidepool is running (pid $(cat "$state/tidepool.pid")). Look around:
  export KUBECONFIG=$TRAINING_KUBECONFIG
  $CP_BIN/kubectl get nodes,memberclusters
  $CP_BIN/kubectl -n team-a logs -f trainer-0 -c trainer   # a real training job, now on member-b's real node
  $CP_BIN/kubectl -n team-a exec -it trainer-0 -c trainer -- sh
  $CP_BIN/kubectl -n team-a delete pod trainer-0     # deleted in the member first, then here
Stop everything:  bash deploy/demo.sh down
MSG
