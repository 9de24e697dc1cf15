# Real nodes for the local clusters: one per cluster, next to the kwok nodes. Sourced by
# cluster.sh (it uses its start/await/fail/log/api helpers and S, PKI, OFF, BIN).
#
# A real node is containerd (its own root, state and sockets under STATE_DIR/nodes/<cluster>),
# a kubelet registered with its cluster's apiserver as a production kubelet runs (client
# certificate system:node:<name>, serving certificate with its IP, webhook authentication
# and authorization, anonymous off), a pod network through the CNI bridge plugin and cluster
# DNS from CoreDNS reading that cluster's apiserver. Facts and traps: shared/realnode.md.
#
# Network, all on this machine (nothing is forwarded, no NAT, no default route in pods):
#   node IP     10.87.<g>.<10+k>/32 on lo (a loopback node IP is refused by the kubelet)
#   pod bridge  tp<g>br<k>, 10.88.<4g+k>.1/24, made here (the bridge plugin's isGateway
#               would turn on ip_forward); pods get 10.88.<4g+k>.10-250 and one route: the
#               group's /22 via their bridge address, so they reach every bridge address of
#               this cluster set (DNS, a checkpoint store) and, through the host, the pods of
#               the other clusters of the set (real_routes_up), nothing else
#   DNS         CoreDNS on the bridge address, port 53; health/ready on 127.0.0.1
#   S3          one checkpoint store for all three clusters: moto's S3 server (PyPI
#               moto[server]) on the training bridge address, port 17250 + offset, reachable
#               from every cluster's pods through their /22 route (CHECKPOINT_STORE in
#               cluster.env); in memory, gone with `down`
# where k is 0 training, 1 member-a, 2 member-b, and g = CP_PORT_OFFSET / 10 (cluster sets
# side by side keep apart).
#
# Images: pause and workload (CP_IMAGES, tests/images/build.sh) on every node, tidepool's on
# training's; and, when CP_FRAMEWORKS_IMAGES names a directory of OCI archives
# (tests/images/frameworks.sh: tidepool.invalid/frameworks:1, 2.5 GB unpacked), those on every
# node too, imported in the background while the kubelets start (about a minute each) and
# waited for before `up` returns; import.sh skips an image a node already has.
#
# Disk: a member node's kubelet root (nodefs) is a 2 GiB tmpfs evicting below 25 % free, so a
# test can put the node under disk pressure; containerd's root (imagefs) is the host disk.
#
# Nodes are tainted tidepool.io/real-node=true:NoSchedule and labelled
# tidepool.io/real-node=true, tidepool.io/test-pool=real: only pods that ask for a real node
# land there (a pool with that selector and toleration, the chart with its toleration), so
# the kwok-based tests keep their numbers and images that exist only in their heads.

REAL_TAINT_KEY=tidepool.io/real-node

real_index() { case $1 in training) echo 0 ;; member-a) echo 1 ;; member-b) echo 2 ;; esac; }
real_group() { echo $((OFF / 10)); }
real_node_name() { echo "$1-real-0"; }
real_node_ip() { echo "10.87.$(real_group).$((10 + $(real_index "$1")))"; }
real_bridge() { echo "tp$(real_group)br$(real_index "$1")"; }
real_bridge_mac() { printf '02:74:70:%02x:%02x:01\n' "$(real_group)" "$(real_index "$1")"; }  # locally administered
real_bridge_ip() { echo "10.88.$(($(real_group) * 4 + $(real_index "$1"))).1"; }
real_subnet() { echo "10.88.$(($(real_group) * 4 + $(real_index "$1"))).0/24"; }
real_group_net() { echo "10.88.$(($(real_group) * 4)).0/22"; }
real_port() {  # real_port WHAT CLUSTER: kubelet, its healthz, CoreDNS health and ready
  # One thousand apart per kind, so the port offsets of side-by-side sets never meet.
  local k; k=$(real_index "$2")
  case $1 in
    kubelet) echo $((13250 + k + OFF)) ;;
    healthz) echo $((14250 + k + OFF)) ;;
    dns-health) echo $((15250 + k + OFF)) ;;
    dns-ready) echo $((16250 + k + OFF)) ;;
    s3) echo $((17250 + OFF)) ;;   # one checkpoint store per cluster set (training's bridge)
  esac
}

# The cgroup v1 hierarchies the kubelet uses; each kubelet gets its own root so that none
# of them cleans up another's pod cgroups as orphans.
REAL_CGROUP_SUBSYSTEMS=(cpu cpuacct cpuset memory devices freezer blkio pids systemd)
real_cgroup_root() { echo "/tidepool-$(real_group)-$1"; }

resolve_node_bin() {
  if [[ -n ${CP_NODE_BIN:-} ]]; then
    NODE_BIN=$CP_NODE_BIN
  else
    log "CP_NODE_BIN not set: running tests/nodes/build.sh (a cold build takes minutes)"
    NODE_BIN=$("$here/../nodes/build.sh" | tail -n 1) || fail "tests/nodes/build.sh failed"
  fi
  if [[ -n ${CP_IMAGES:-} ]]; then
    IMAGES=$CP_IMAGES
  else
    IMAGES=$("$here/../images/build.sh" | tail -n 1) || fail "tests/images/build.sh failed"
  fi
  local b
  for b in containerd ctr containerd-shim-runc-v2 runc coredns cni/bridge cni/host-local cni/loopback; do
    [[ -x $NODE_BIN/$b ]] || fail "$NODE_BIN/$b is missing or not executable"
  done
  [[ -x $BIN/kubelet ]] || fail "$BIN/kubelet is missing: rebuild with tests/controlplane/build.sh"
  for b in pause workload; do
    [[ -f $IMAGES/$b.tar ]] || fail "$IMAGES/$b.tar is missing"
  done
  [[ $(id -u) == 0 ]] || fail "real nodes need root (network and cgroups); set CP_REAL_NODES=0 to run without them"
  # A kubelet holds six inotify instances, a containerd two, and kwok one per followed log;
  # with the control planes a cluster set needs about 50 of the default 128 per user, so a
  # second set side by side runs out ("inotify_init: too many open files"). Raised, never
  # lowered.
  local f=/proc/sys/fs/inotify/max_user_instances
  if [[ -w $f ]] && (($(cat "$f") < 1024)); then
    log "raising fs.inotify.max_user_instances from $(cat "$f") to 1024"
    echo 1024 >"$f"
  fi
}

# Certificates of one node: client (Node authorizer identity) and serving (its IP).
real_node_pki() {
  local c=$1 name ip rc=0
  name=$(real_node_name "$c") ip=$(real_node_ip "$c")
  set +e
  (
    set -e
    cd "$PKI"
    umask 077
    exec 2>>"$S/logs/pki.log"
    local base='basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment'
    sign "kubelet-$c-client" "/O=system:nodes/CN=system:node:$name" "$base
extendedKeyUsage=clientAuth"
    sign "kubelet-$c-serving" "/O=system:nodes/CN=system:node:$name" "$base
extendedKeyUsage=serverAuth
subjectAltName=IP:$ip,DNS:$name"
    # CoreDNS reads Services, EndpointSlices, Pods and Namespaces with this identity (a
    # ClusterRole below), nothing more.
    sign "coredns-$c" "/CN=tidepool:coredns" "$base
extendedKeyUsage=clientAuth"
    chmod 644 ./*.crt
  )
  rc=$?
  set -e
  ((rc == 0)) || fail "pki: openssl failed for the $c real node" pki
}

# Network of one cluster: node IP on lo, the pod bridge with its address. Both recorded in
# nodes/network so `down` removes exactly these.
real_network_up() {
  local c=$1 br ip
  br=$(real_bridge "$c") ip=$(real_node_ip "$c")
  if ! ip -4 addr show dev lo | grep -q " $ip/32 "; then
    ip addr add "$ip/32" dev lo || fail "cannot add $ip/32 to lo"
    echo "addr $ip/32 lo" >>"$S/nodes/network"
  fi
  if ! ip link show "$br" >/dev/null 2>&1; then
    ip link add "$br" type bridge || fail "cannot create bridge $br"
    echo "link $br" >>"$S/nodes/network"
  fi
  # A fixed address: a bridge without one takes the lowest MAC of its ports, so it changes
  # whenever that pod's veth goes, and every other pod on it keeps sending to the old gateway
  # MAC until its neighbour entry expires (20-40 s of connect timeouts, seen as a gang
  # restart's survivors failing to reach the checkpoint store).
  ip link set "$br" address "$(real_bridge_mac "$c")"
  ip addr replace "$(real_bridge_ip "$c")/24" dev "$br"
  ip link set "$br" up
}

# Routing between this cluster set's pod bridges, and nowhere else: a job's pods on the
# training cluster's own nodes (the native floor) and its copies in a member reach each other
# by pod IP. Forwarding is turned on for the bridges alone (the global ip_forward stays 0, so a
# packet that comes in on any other interface is never forwarded), and a packet that comes in
# on a bridge is routed by table 1000+g, which knows the set's bridges and nothing else:
# anything else is unreachable, so no pod sends a packet off the machine through the host,
# whatever it crafts. Addresses of the host itself (DNS, the relays, the store) are delivered
# locally before any rule. Recorded in nodes/network for `down`.
real_routes_up() {
  local c br table
  table=$((1000 + $(real_group)))
  ip -4 route flush table "$table" 2>/dev/null || true
  echo "table $table -" >>"$S/nodes/network"
  for c in "${CLUSTERS[@]}"; do
    ip -4 route replace "$(real_subnet "$c")" dev "$(real_bridge "$c")" table "$table" ||
      fail "cannot route $(real_subnet "$c") in table $table"
  done
  ip -4 route replace unreachable default table "$table" || fail "cannot close table $table"
  for c in "${CLUSTERS[@]}"; do
    br=$(real_bridge "$c")
    ip -4 rule del iif "$br" lookup "$table" 2>/dev/null || true
    ip -4 rule add iif "$br" lookup "$table" pref "$table" || fail "cannot route what comes in on $br by table $table"
    echo "rule $br $table" >>"$S/nodes/network"
    echo 1 >"/proc/sys/net/ipv4/conf/$br/forwarding" || fail "cannot turn forwarding on for $br"
  done
}

real_network_down() {
  local f=$S/nodes/network kind what dev
  [[ -f $f ]] || return 0
  while read -r kind what dev; do
    case $kind in
      addr) ip addr del "$what" dev "$dev" 2>/dev/null || true ;;
      rule) ip -4 rule del iif "$what" lookup "$dev" 2>/dev/null || true ;;
      table) ip -4 route flush table "$what" 2>/dev/null || true ;;
      link) ip link del "$what" 2>/dev/null || true ;;
      dir) rm -rf -- "$what" ;;
    esac
  done < <(tac "$f")
  rm -f "$f"
}

real_cgroups_up() {
  local root sub d
  root=$(real_cgroup_root "$1")
  for sub in "${REAL_CGROUP_SUBSYSTEMS[@]}"; do
    [[ -d /sys/fs/cgroup/$sub ]] || continue
    d=/sys/fs/cgroup/$sub$root
    mkdir -p "$d"
    if [[ $sub == cpuset ]]; then   # a new cpuset has no CPUs or memory nodes until given
      cat /sys/fs/cgroup/cpuset/cpuset.cpus >"$d/cpuset.cpus"
      cat /sys/fs/cgroup/cpuset/cpuset.mems >"$d/cpuset.mems"
    fi
  done
}

# The shims' socket directory must be short (a unix socket path has at most 108 bytes, and
# containerd refuses a socket_dir over 42 characters), so it cannot live in the state dir.
real_shim_dir() { echo "/run/tidepool-shims/$(real_group)-$(real_index "$1")"; }

write_containerd_config() {
  local c=$1 d=$S/nodes/$1
  mkdir -p "$(real_shim_dir "$c")"
  echo "dir $(real_shim_dir "$c") -" >>"$S/nodes/network"
  sed -e "s#@ROOT@#$d/containerd/root#g" -e "s#@STATE@#$d/containerd/state#g" \
      -e "s#@SHIM_SOCKETS@#$(real_shim_dir "$c")#g" -e "s#@RUNC@#$NODE_BIN/runc#g" \
      -e "s#@CNI_BIN@#$NODE_BIN/cni#g" -e "s#@CNI_CONF@#$d/cni#g" \
      -e "s#@SANDBOX_IMAGE@#tidepool.invalid/pause:3.10-tidepool#g" \
      "$here/../nodes/containerd.toml.in" >"$d/containerd.toml"
}

write_cni_config() {
  local c=$1 d=$S/nodes/$1 gw net
  gw=$(real_bridge_ip "$c") net=${gw%.1}
  mkdir -p "$d/cni" "$d/cni-ipam"
  cat >"$d/cni/10-tidepool.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tidepool-$(real_group)-$c",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$(real_bridge "$c")",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$d/cni-ipam",
        "ranges": [[{"subnet": "$(real_subnet "$c")", "rangeStart": "$net.10", "rangeEnd": "$net.250", "gateway": "$gw"}]],
        "routes": [{"dst": "$(real_group_net)", "gw": "$gw"}]
      }
    }
  ]
}
EOF
}

# A member's kubelet root (its nodefs: emptyDirs, pod volumes) is a tmpfs of its own, so a
# test can put the node under disk pressure by filling it, and the kubelet's eviction
# manager evicts for node pressure as on a production node (issue 39). Containers' layers
# stay in containerd's root on the host disk (imagefs), which must never see pressure.
REAL_NODEFS_SIZE=2g
real_nodefs_threshold() { case $1 in training) echo 1% ;; *) echo 25% ;; esac; }
real_nodefs_up() {
  local c=$1 d=$S/nodes/$1
  [[ $c == training ]] && return 0
  mountpoint -q "$d/kubelet" || mount -t tmpfs -o "size=$REAL_NODEFS_SIZE,mode=0750" "tidepool-nodefs-$c" "$d/kubelet" ||
    fail "$c: mounting the kubelet's tmpfs root on $d/kubelet failed"
}

write_kubelet_config() {
  local c=$1 d=$S/nodes/$1 name ip
  name=$(real_node_name "$c") ip=$(real_node_ip "$c")
  kubeconfig "$c" "system:node:$name" "    client-certificate: $PKI/kubelet-$c-client.crt
    client-key: $PKI/kubelet-$c-client.key" >"$d/kubelet.kubeconfig"
  : >"$d/resolv.conf"   # pods never see the host's resolvers
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: $(real_port kubelet "$c")
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $(real_port healthz "$c")
tlsCertFile: $PKI/kubelet-$c-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-$c-serving.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$d/containerd/state/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: $(real_cgroup_root "$c")
# cgroup v1 on this kind of machine: kubelet 1.36 only warns with this.
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
clusterDomain: cluster.local
clusterDNS: [$(real_bridge_ip "$c")]
resolvConf: $d/resolv.conf
podLogsDir: $d/pod-logs
volumePluginDir: $d/volume-plugins
maxPods: 40
# Nothing can be pulled here: images are imported, so image GC must never remove them, and
# disk-pressure eviction must not fire on a busy test disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: $(real_nodefs_threshold "$c"), nodefs.inodesFree: 1%, imagefs.available: 1%}
# Out of node pressure 10 s after it ends (default 5 m), so a node-pressure test leaves the
# node as it found it for the next.
evictionPressureTransitionPeriod: 10s
registerWithTaints:
- {key: $REAL_TAINT_KEY, value: "true", effect: NoSchedule}
shutdownGracePeriod: 0s
# A crashing container shows CrashLoopBackOff only once a sync after the crash writes it: at
# the default 1 m resync it is seen for a moment before each restart; at 10 s, most of the
# back-off, as a user expects.
syncFrequency: 10s
# Volumes' usage measured every 10 s (default 1 m), so an emptyDir past its sizeLimit is
# evicted within seconds, as the disruption tests expect of the eviction manager.
volumeStatsAggPeriod: 10s
EOF
}

write_corefile() {
  local c=$1 d=$S/nodes/$1
  kubeconfig "$c" tidepool:coredns "    client-certificate: $PKI/coredns-$c.crt
    client-key: $PKI/coredns-$c.key" >"$d/coredns.kubeconfig"
  # No forward plugin: names outside the cluster domain get no answer, nothing leaves.
  cat >"$d/Corefile" <<EOF
.:53 {
    bind $(real_bridge_ip "$c")
    errors
    health 127.0.0.1:$(real_port dns-health "$c")
    ready 127.0.0.1:$(real_port dns-ready "$c")
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $d/coredns.kubeconfig $c
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
}

# What CoreDNS may read, applied as the cluster admin.
apply_coredns_rbac() {
  local c=$1
  "$BIN/kubectl" --kubeconfig "$S/$c.kubeconfig" apply -f - >>"$S/logs/rbac.log" 2>&1 <<'EOF' ||
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "tidepool:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "tidepool:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "tidepool:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "tidepool:coredns"}
EOF
    fail "$c: applying CoreDNS RBAC failed (see $S/logs/rbac.log)" "$c-apiserver"
}

containerd_ready() {
  "$NODE_BIN/ctr" --address "$S/nodes/$1/containerd/state/containerd.sock" version >/dev/null 2>&1
}
kubelet_healthy() { [[ $(curl -fsS --max-time 2 "http://127.0.0.1:$(real_port healthz "$1")/healthz" 2>/dev/null) == ok ]]; }
coredns_ready() { curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$(real_port dns-ready "$1")/ready" 2>/dev/null; }
real_node_ready() {
  local body
  body=$(api "$1" "/api/v1/nodes/$(real_node_name "$1")") || return 1
  body=${body//[[:space:]]/}
  [[ $body == *'{"type":"Ready","status":"True"'* && $body != *'"key":"node.kubernetes.io/not-ready"'* ]]
}

# Starts the real node of every cluster; returns once each is Ready and DNS answers.
real_nodes_up() {
  local c d fw=() pid
  mkdir -p "$S/nodes"
  if [[ -n ${CP_FRAMEWORKS_IMAGES:-} ]]; then
    compgen -G "$CP_FRAMEWORKS_IMAGES/*.tar" >/dev/null || fail "CP_FRAMEWORKS_IMAGES=$CP_FRAMEWORKS_IMAGES has no *.tar"
  fi
  for c in "${CLUSTERS[@]}"; do
    d=$S/nodes/$c
    mkdir -p "$d/containerd/root" "$d/containerd/state" "$d/kubelet" "$d/pod-logs" "$d/volume-plugins"
    real_node_pki "$c"
    real_network_up "$c"
    real_cgroups_up "$c"
    real_nodefs_up "$c"
    write_containerd_config "$c"
    write_cni_config "$c"
    write_kubelet_config "$c"
    write_corefile "$c"
    # containerd finds the shim and runc on PATH.
    start "$c-containerd" env PATH="$NODE_BIN:$PATH" "$NODE_BIN/containerd" --config "$d/containerd.toml"
  done
  await 60 "containerd answers" containerd_ready "@-containerd" "${CLUSTERS[@]}"
  for c in "${CLUSTERS[@]}"; do
    d=$S/nodes/$c
    CTR=$NODE_BIN/ctr "$here/../images/import.sh" "$d/containerd/state/containerd.sock" "$IMAGES/pause.tar" "$IMAGES/workload.tar" \
      >>"$S/logs/$c-images.log" 2>&1 || fail "$c: importing images failed" "$c-images" "$c-containerd"
    if [[ $c == training && -f $IMAGES/tidepool.tar ]]; then
      CTR=$NODE_BIN/ctr "$here/../images/import.sh" "$d/containerd/state/containerd.sock" "$IMAGES/tidepool.tar" \
        >>"$S/logs/$c-images.log" 2>&1 || fail "$c: importing the tidepool image failed" "$c-images"
    fi
    if [[ -n ${CP_FRAMEWORKS_IMAGES:-} ]]; then
      # Recorded like every daemon (a failed `up` stops it by PID), logging to the images log.
      start "$c-frameworks-import" bash -c 'log=$1; shift; exec "$@" >>"$log" 2>&1' - "$S/logs/$c-images.log" \
        env CTR="$NODE_BIN/ctr" nice -n 10 "$here/../images/import.sh" "$d/containerd/state/containerd.sock" \
        "$CP_FRAMEWORKS_IMAGES"/*.tar
      fw+=("${PID[$c-frameworks-import]}")
    fi
    apply_coredns_rbac "$c"
    start "$c-kubelet" env PATH="$NODE_BIN:$PATH" "$(bin_of "$c" kubelet)" --config="$d/kubelet.yaml" \
      --kubeconfig="$d/kubelet.kubeconfig" --root-dir="$d/kubelet" \
      --hostname-override="$(real_node_name "$c")" --node-ip="$(real_node_ip "$c")" \
      --node-labels="$REAL_TAINT_KEY=true,tidepool.io/test-pool=real" --v=1
    start "$c-coredns" "$NODE_BIN/coredns" -conf "$d/Corefile"
  done
  real_routes_up
  await 90 "kubelet healthy" kubelet_healthy "@-kubelet @-containerd" "${CLUSTERS[@]}"
  await 90 "real node Ready" real_node_ready "@-kubelet @-containerd @-kcm @-apiserver etcd" "${CLUSTERS[@]}"
  await 60 "CoreDNS ready" coredns_ready "@-coredns" "${CLUSTERS[@]}"
  if ((${#fw[@]})); then
    log "waiting for the frameworks images to be imported (logs/<cluster>-images.log)"
    for pid in "${fw[@]}"; do
      wait "$pid" || fail "importing $CP_FRAMEWORKS_IMAGES failed" "${CLUSTERS[@]/%/-images}"
    done
    log "frameworks images imported on every real node"
  fi
  [[ $(cat /proc/sys/net/ipv4/ip_forward) == 0 ]] || fail "ip_forward got turned on: refusing to run like this"
}

# Stops the kubelets, then everything their pods left: container processes (found by the
# cgroups of this cluster set, killed by PID), containerd and its shims, mounts under the
# state dir, cgroups, the bridges and addresses. Safe to call twice.
# The PIDs of the container processes in this cluster set's cgroups, one per line.
real_cgroup_pids() {
  local c root sub
  for c in "${CLUSTERS[@]}"; do
    root=$(real_cgroup_root "$c")
    for sub in "${REAL_CGROUP_SUBSYSTEMS[@]}"; do
      [[ -d /sys/fs/cgroup/$sub$root ]] || continue
      find "/sys/fs/cgroup/$sub$root" -name cgroup.procs -exec cat {} + 2>/dev/null
    done
  done | sort -un
}

real_nodes_down() {
  local c root sub pids=() pid m deadline
  [[ -d $S/nodes ]] || return 0
  mapfile -t pids < <(real_cgroup_pids)
  # Shims live outside the pod cgroups: they are the processes whose command line names a
  # containerd socket of this state dir.
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ -r /proc/$pid/cmdline ]] || continue
    if tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | grep -q -- "containerd-shim-runc-v2.*$S/nodes/"; then pids+=("$pid"); fi
  done
  if ((${#pids[@]})); then
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  # A killed process leaves its cgroup only once it is reaped: wait (bounded) until the
  # cgroups are empty, killing what is still there, or their directories cannot be removed.
  deadline=$(($(now_ms) + 10000))
  while mapfile -t pids < <(real_cgroup_pids) && ((${#pids[@]})) && (($(now_ms) < deadline)); do
    kill -KILL "${pids[@]}" 2>/dev/null || true
    sleep 0.1
  done
  ((${#pids[@]} == 0)) || log "container processes still in the cgroups after 10 s: ${pids[*]}"
  # Deepest first: rootfs overlays and shm inside the sandbox dirs, netns pins, the
  # kubelet's bind mount of its own root.
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v s="$S/nodes/" 'index($2, s) == 1 {print $2}' /proc/self/mounts | sort -r)
  for c in "${CLUSTERS[@]}"; do
    root=$(real_cgroup_root "$c")
    for sub in "${REAL_CGROUP_SUBSYSTEMS[@]}"; do
      [[ -d /sys/fs/cgroup/$sub$root ]] || continue
      find "/sys/fs/cgroup/$sub$root" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  done
  real_network_down
  # The CNI library keeps its results in a fixed host directory; DEL removes them, a
  # killed sandbox does not.
  rm -f /var/lib/cni/results/tidepool-"$(real_group)"-*
}

# Pods cannot reach 127.0.0.1, and there is no kube-proxy behind the kubernetes Service: a
# pod that talks to an apiserver (tidepool installed from its chart) dials it on the
# training bridge address, where a TCP relay per apiserver listens (the apiserver
# certificate carries that address). socat's log file names the state dir, which is how
# `down` knows the relays are ours.
real_apiserver_relays() {
  local c addr
  addr=$(real_bridge_ip training)
  command -v socat >/dev/null || fail "socat is missing (bash deploy/prereqs.sh)"
  for c in "${CLUSTERS[@]}"; do
    start "$c-relay" socat -lf "$S/logs/$c-relay.socat.log" \
      "TCP-LISTEN:$(port_of apiserver "$c"),bind=$addr,fork,reuseaddr" "TCP:127.0.0.1:$(port_of apiserver "$c")"
  done
}

# The shared checkpoint store (issue 22): moto's S3 server, started through python so its
# command line names STATE_DIR (`alive` only counts such processes as ours). It checks no
# signatures; a request needs an Authorization header of any content (tests/workload/src/store.rs).
real_checkpoint_store() {
  local addr port py
  addr=$(real_bridge_ip training) port=$(real_port s3 training)
  python3 -c 'import moto.server' 2>/dev/null || fail "moto's server is missing (bash deploy/prereqs.sh)"
  # The interpreter itself, not a version manager's shim: until the exec chain ends the
  # process would not name STATE_DIR, and `await` would take it for dead.
  py=$(python3 -c 'import sys; print(sys.executable)')
  mkdir -p "$S/s3"
  start s3 "$py" -c 'import sys; from moto.server import main; main(sys.argv[2:])' "$S/s3" -H "$addr" -p "$port"
  await 60 "checkpoint store answers" checkpoint_store_ready "@" s3
}

checkpoint_store_ready() {
  curl -fsS -o /dev/null --max-time 2 "http://$(real_bridge_ip training):$(real_port s3 training)/" 2>/dev/null
}
