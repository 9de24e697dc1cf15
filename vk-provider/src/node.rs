//! Virtual nodes: one Node per pool, its status following the pool's capacity and its
//! member's [`Health`], its Lease renewed so the node lifecycle controller keeps it Ready.
//!
//! A member that does not answer turns its nodes `Ready=Unknown` with a NoSchedule taint;
//! one whose credentials or Secret are broken turns them `Ready=False`, tainted too. The
//! nodes stay in both cases, with the pods bound to them: only a `MemberCluster` that is
//! deleted or no longer selected takes its nodes away.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::{BridgeConfig, Resources, keys};
use tidepool_federation::{Health, MemberHandle, Members, PoolCapacity, PoolHandle};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::Error;

/// Duration of a virtual node's Lease is this many renew periods (virtual-kubelet: 40 s / 10 s).
const LEASE_PERIODS: u64 = 4;
/// A full status heartbeat (conditions' heartbeat time) this often even without changes.
const STATUS_HEARTBEAT: Duration = Duration::from_secs(60);
const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// Labels of a virtual node.
pub fn node_labels(member: &str, pool: &PoolHandle, capacity: &PoolCapacity) -> BTreeMap<String, String> {
    let (name, node) = (pool.name.to_string(), pool.node.to_string());
    tidepool_api::node_match::virtual_node_labels(member, &name, &node, capacity.gpu_product.as_deref())
}

/// Reason of a colocation pool's `Ready=False` while none of its nodes publishes the batch
/// resources of its mode.
pub const REASON_COLOCATION_MISSING: &str = "ColocationResourcesMissing";

/// The health a pool's virtual node shows: the member's, or, for a pool in a colocation
/// mode none of whose nodes publishes that system's batch resources (its agent is not
/// installed, down, or has reset them), unusable with the reason. Nothing new is placed
/// there until the agent publishes again. Pure.
pub fn pool_health(member: &Health, pool: &PoolHandle, capacity: &PoolCapacity) -> Health {
    let mut health = member.clone();
    if let Some(colocation) = pool.mode.colocation()
        && capacity.nodes == 0
        && health.is_healthy()
    {
        let why = format!(
            "no node of pool {} publishes {} (pool mode {}): is {} running in the member?",
            pool.name,
            colocation.cpu,
            pool.mode.as_str(),
            colocation.system
        );
        health.unusable = Some((REASON_COLOCATION_MISSING.to_owned(), why));
    }
    health
}

/// The Ready condition's (status, reason, message) for a member's health.
pub fn readiness(health: &Health) -> (&'static str, String, String) {
    if let Some(why) = &health.unreachable {
        let reason = if health.lost { keys::REASON_MEMBER_LOST } else { keys::REASON_MEMBER_UNREACHABLE };
        return ("Unknown", reason.to_owned(), format!("member API server unreachable: {why}"));
    }
    if let Some(why) = &health.refused {
        return ("False", "MemberCredentialsRefused".to_owned(), why.clone());
    }
    if let Some((reason, why)) = &health.unusable {
        return ("False", reason.clone(), why.clone());
    }
    if let Some(why) = &health.stopped {
        return ("False", keys::REASON_MEMBER_TASK_STOPPED.to_owned(), why.clone());
    }
    ("True", "KubeletReady".to_owned(), "member cluster connected".to_owned())
}

/// Taints of a virtual node: always [`keys::TAINT_VIRTUAL`], plus a NoSchedule taint while
/// the member is unreachable or unusable (schedulers other than tidepool's dispatcher,
/// which reads the member's health directly, must hold back too), and
/// [`keys::TAINT_PAUSED`] while its `MemberCluster` is paused (`NoSchedule`: running pods
/// stay, nothing new is bound, by hand or otherwise).
pub fn node_taints(health: &Health, paused: bool) -> Vec<Taint> {
    let taint = |key: &str| Taint {
        key: key.to_owned(),
        value: Some("true".to_owned()),
        effect: "NoSchedule".to_owned(),
        time_added: None,
    };
    let mut taints = vec![taint(keys::TAINT_VIRTUAL)];
    if health.unreachable.is_some() {
        taints.push(taint(keys::TAINT_UNREACHABLE));
    } else if !health.is_healthy() {
        taints.push(taint(keys::TAINT_NOT_READY));
    }
    if paused {
        taints.push(taint(keys::TAINT_PAUSED));
    }
    taints
}

/// What a Node may advertise: the API server refuses fractional pods and extended resources
/// (a watermark below 100 % or a fractional reserve would produce `33300m` pods), so every
/// amount but CPU is rounded down to a whole unit.
pub fn whole_units(capacity: &Resources) -> Resources {
    let mut whole = Resources::new();
    for (name, milli) in capacity.iter() {
        let amount = if name == "cpu" { milli } else { milli - milli.rem_euclid(1000) };
        whole.set(name, amount);
    }
    whole
}

/// Status of a virtual node: the pool's capacity as allocatable, Ready following the
/// member's health, addressed at tidepool's kubelet API.
pub fn node_status(
    config: &BridgeConfig,
    capacity: &PoolCapacity,
    health: &Health,
    now: jiff::Timestamp,
) -> NodeStatus {
    let mut resources = whole_units(&capacity.capacity).to_quantities();
    // Memory in Ki, as kubelets report it (`kubectl describe node` reads the same).
    if let Some(bytes) = capacity.capacity.iter().find(|(n, _)| *n == "memory").map(|(_, milli)| milli / 1000) {
        resources.insert("memory".to_owned(), Quantity(format!("{}Ki", bytes / 1024)));
    }
    let ready = readiness(health);
    let condition = |type_: &str, status: &str, reason: &str, message: &str| NodeCondition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: None,
    };
    NodeStatus {
        capacity: Some(resources.clone()),
        allocatable: Some(resources),
        conditions: Some(vec![
            condition("Ready", ready.0, &ready.1, &ready.2),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "capacity follows the member's surplus"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "capacity follows the member's surplus"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "capacity follows the member's surplus"),
            condition("NetworkUnavailable", "False", "RouteCreated", "pods use the member's network"),
        ]),
        addresses: Some(vec![k8s_openapi::api::core::v1::NodeAddress {
            type_: "InternalIP".to_owned(),
            address: config.kubelet.node_address.to_string(),
        }]),
        daemon_endpoints: Some(k8s_openapi::api::core::v1::NodeDaemonEndpoints {
            kubelet_endpoint: Some(k8s_openapi::api::core::v1::DaemonEndpoint { port: i32::from(config.kubelet.port) }),
        }),
        node_info: Some(k8s_openapi::api::core::v1::NodeSystemInfo {
            architecture: "amd64".to_owned(),
            operating_system: "linux".to_owned(),
            kubelet_version: format!("tidepool-{}", env!("CARGO_PKG_VERSION")),
            container_runtime_version: "tidepool://member".to_owned(),
            kernel_version: String::new(),
            os_image: "tidepool virtual node".to_owned(),
            machine_id: String::new(),
            system_uuid: String::new(),
            boot_id: String::new(),
            kube_proxy_version: String::new(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Resources advertised `before` that `now` lacks become `null` in the status `patch`: a
/// strategic merge keeps the keys of a map it does not name, and the node would go on
/// advertising a resource its pool no longer lends (a pool switched to a colocation mode, the
/// last GPU node gone).
pub fn remove_withdrawn(patch: &mut serde_json::Value, before: &Resources, now: &Resources) {
    for name in before.names().filter(|n| !now.names().any(|m| m == *n)) {
        for list in ["capacity", "allocatable"] {
            if let Some(map) = patch["status"][list].as_object_mut() {
                map.insert(name.to_owned(), serde_json::Value::Null);
            }
        }
    }
}

/// Annotations of a virtual node: where metrics-server reads its pods' usage on the
/// kubelet API all virtual nodes share ([`crate::kubelet`]).
pub fn node_annotations(pool: &PoolHandle) -> BTreeMap<String, String> {
    let path = tidepool_kubelet::resource_metrics_path(pool.node.as_str());
    BTreeMap::from([(keys::ANNOTATION_RESOURCE_METRICS_PATH.to_owned(), path)])
}

/// The whole Node object for creation (status is accepted on create for Nodes).
pub fn virtual_node(
    config: &BridgeConfig,
    member: &str,
    pool: &PoolHandle,
    capacity: &PoolCapacity,
    health: &Health,
    paused: bool,
) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(pool.node.to_string()),
            labels: Some(node_labels(member, pool, capacity)),
            annotations: Some(node_annotations(pool)),
            ..Default::default()
        },
        spec: Some(NodeSpec { taints: Some(node_taints(health, paused)), ..Default::default() }),
        status: Some(node_status(config, capacity, health, jiff::Timestamp::now())),
    }
}

/// How long a stopped node task may take to finish its request in flight before its Node
/// is deleted anyway.
const TASK_EXIT: Duration = Duration::from_secs(5);

/// Keeps one task per virtual node of the connected members; deletes the Node of a pool
/// that is no longer offered, once its task has exited (so nothing registers it again).
pub async fn run(training: Client, config: Arc<BridgeConfig>, mut members: watch::Receiver<Members>) {
    let mut running: HashMap<String, Running> = HashMap::new();
    loop {
        let current = members.borrow_and_update().clone();
        let mut wanted = std::collections::HashSet::new();
        for member in current.values() {
            for pool in &member.pools {
                let node = pool.node.to_string();
                wanted.insert(node.clone());
                // A new session for the same member has a new cancellation token.
                let fresh = running.get(&node).is_none_or(|r| r.stop.is_cancelled());
                if fresh {
                    let stop = member.cancelled.child_token();
                    let task = NodeTask {
                        training: training.clone(),
                        config: config.clone(),
                        member: member.clone(),
                        pool: pool.clone(),
                        written: None,
                        shown: None,
                        transitions: Transitions::new(),
                    };
                    let span = info_span!("virtual_node", member = %member.name, node = %node);
                    let handle = tokio::spawn(task.run(stop.clone()).instrument(span));
                    running.insert(node.clone(), Running { stop, handle, member: member.clone() });
                }
            }
        }
        let gone: Vec<String> = running.keys().filter(|n| !wanted.contains(*n)).cloned().collect();
        for node in gone {
            let Some(Running { stop, handle, member }) = running.remove(&node) else { continue };
            stop.cancel();
            if tokio::time::timeout(TASK_EXIT, handle).await.is_err() {
                warn!(node = %node, "virtual node task still busy after being stopped");
            }
            // Another replica owns the member now and keeps the node (and the pods on it).
            if member.handed_over.load(std::sync::atomic::Ordering::SeqCst) {
                info!(node = %node, "member handed over; leaving its virtual node to the new owner");
                continue;
            }
            info!(node = %node, "pool no longer offered; deleting its virtual node");
            if let Err(e) = delete_node(&training, &node).await {
                warn!(node = %node, error = %e, "cannot delete virtual node");
            }
        }
        if members.changed().await.is_err() {
            return;
        }
    }
}

/// The task of one virtual node: how to stop it, and the session it serves.
struct Running {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
    member: Arc<MemberHandle>,
}

async fn delete_node(training: &Client, node: &str) -> Result<(), Error> {
    let dp = DeleteParams::default();
    match Api::<Node>::all(training.clone()).delete(node, &dp).await {
        Ok(_) => {}
        Err(e) if tidepool_federation::api_code(&e, &[404]) => {}
        Err(e) => return Err(Error::training("delete node", e)),
    }
    match Api::<Lease>::namespaced(training.clone(), NODE_LEASE_NAMESPACE).delete(node, &dp).await {
        Ok(_) => Ok(()),
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(()),
        Err(e) => Err(Error::training("delete node lease", e)),
    }
}

struct NodeTask {
    training: Client,
    config: Arc<BridgeConfig>,
    member: Arc<MemberHandle>,
    pool: PoolHandle,
    /// What the last status written carried: the allocatable and the health it followed.
    written: Option<(Resources, Health)>,
    /// What the node advertised when last read or written: the resources a new status must
    /// withdraw if it lacks them ([`remove_withdrawn`]).
    shown: Option<Resources>,
    /// Each condition's status and since when it has had it, for `lastTransitionTime`.
    transitions: Transitions,
}

/// Condition type → (status, the time it took that status).
type Transitions = BTreeMap<String, (String, Time)>;

/// Gives each condition the time its status last changed: the known one while the status
/// stays, `now` when it changes (or is new); `known` is updated.
pub fn stamp_transitions(conditions: &mut [NodeCondition], known: &mut Transitions, now: jiff::Timestamp) {
    for c in conditions {
        match known.get(&c.type_) {
            Some((status, since)) if *status == c.status => c.last_transition_time = Some(since.clone()),
            _ => {
                c.last_transition_time = Some(Time(now));
                known.insert(c.type_.clone(), (c.status.clone(), Time(now)));
            }
        }
    }
}

/// What a node's existing conditions say about their transitions (a restarted tidepool
/// keeps the times its predecessor wrote).
fn known_transitions(node: &Node) -> Transitions {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_deref()).unwrap_or_default();
    conditions
        .iter()
        .filter_map(|c| Some((c.type_.clone(), (c.status.clone(), c.last_transition_time.clone()?))))
        .collect()
}

impl NodeTask {
    async fn run(mut self, stop: CancellationToken) {
        let renew = Duration::from_secs(self.config.lease_renew_seconds);
        let mut lease_tick = tokio::time::interval(renew);
        let mut heartbeat = tokio::time::interval(STATUS_HEARTBEAT);
        let mut registered: Option<String> = None;
        let mut health = self.member.health.clone();
        loop {
            // 1. register the node (once, or again after someone deleted it), unless stopped:
            //    a node deleted because its pool is gone must not come back
            if registered.is_none() {
                let outcome = tokio::select! {
                    biased;
                    () = stop.cancelled() => return,
                    outcome = self.register() => outcome,
                };
                match outcome {
                    Ok(uid) => registered = Some(uid),
                    Err(e) => warn!(error = %e, "cannot register virtual node; retrying"),
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                // 2. capacity changed: new allocatable right away
                res = self.pool.capacity.changed() => {
                    if res.is_err() { return; }
                    if let Err(e) = self.patch_status(false).await { warn!(error = %e, "cannot update virtual node status"); registered = None; }
                }
                // 3. the member's health changed: Ready condition and taints follow at once
                res = health.changed() => {
                    if res.is_err() { return; }
                    if let Err(e) = self.sync_health().await { warn!(error = %e, "cannot update virtual node health"); registered = None; }
                }
                // 4. lease renewal: tidepool itself is alive, whatever the member's health
                _ = lease_tick.tick() => {
                    if let Some(uid) = &registered
                        && let Err(e) = self.renew_lease(uid).await
                    {
                        warn!(error = %e, "cannot renew virtual node lease");
                    }
                }
                // 5. periodic status heartbeat (and taints, in case a health change was missed)
                _ = heartbeat.tick() => {
                    if registered.is_some() && let Err(e) = self.sync_health().await {
                        warn!(error = %e, "cannot update virtual node status");
                        registered = None;
                    }
                }
            }
        }
    }

    /// Creates the Node, or brings an existing one's labels and status up to date. Returns
    /// its UID (the Lease's owner).
    async fn register(&mut self) -> Result<String, Error> {
        self.written = None;
        let api = Api::<Node>::all(self.training.clone());
        let capacity = self.pool.capacity.borrow_and_update().clone();
        let health = pool_health(&self.member.health.borrow(), &self.pool, &capacity);
        let member = &self.member;
        let mut node = virtual_node(&self.config, member.name.as_str(), &self.pool, &capacity, &health, member.paused);
        if let Some(conditions) = node.status.as_mut().and_then(|s| s.conditions.as_mut()) {
            stamp_transitions(conditions, &mut self.transitions, jiff::Timestamp::now());
        }
        let name = self.pool.node.to_string();
        let created = match api.create(&PostParams::default(), &node).await {
            Ok(n) => {
                info!(capacity = %capacity.capacity, "virtual node registered");
                n
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let labels = json!({ "metadata": {
                    "labels": node.metadata.labels, "annotations": node.metadata.annotations,
                } });
                api.patch(&name, &PatchParams::default(), &Patch::Merge(labels))
                    .await
                    .map_err(|e| Error::training("update node labels", e))?;
                self.sync_health().await?;
                api.get(&name).await.map_err(|e| Error::training("read node", e))?
            }
            Err(e) => return Err(Error::training("create node", e)),
        };
        created.metadata.uid.ok_or(Error::MissingUid)
    }

    /// Brings the Ready condition and the health taints in line with the member's health.
    async fn sync_health(&mut self) -> Result<(), Error> {
        let health = pool_health(&self.member.health.borrow(), &self.pool, &self.pool.capacity.borrow());
        let api = Api::<Node>::all(self.training.clone());
        let node = api.get(self.pool.node.as_str()).await.map_err(|e| Error::training("read node", e))?;
        if self.transitions.is_empty() {
            self.transitions = known_transitions(&node);
        }
        if self.shown.is_none() {
            let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
            self.shown = allocatable.and_then(|a| Resources::from_quantities(a).ok());
        }
        let current = node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        // Keep everyone else's taints; ours are exactly what the health says.
        let ours = [keys::TAINT_VIRTUAL, keys::TAINT_UNREACHABLE, keys::TAINT_NOT_READY, keys::TAINT_PAUSED];
        let mut taints: Vec<Taint> = current.iter().filter(|t| !ours.contains(&t.key.as_str())).cloned().collect();
        taints.extend(node_taints(&health, self.member.paused));
        let same = |a: &[Taint], b: &[Taint]| {
            a.len() == b.len() && a.iter().all(|t| b.iter().any(|u| u.key == t.key && u.effect == t.effect))
        };
        if !same(&current, &taints) {
            // The resourceVersion makes this a compare-and-swap: a taint someone else added
            // meanwhile is never overwritten (the next change or heartbeat tries again).
            let patch = json!({
                "metadata": { "resourceVersion": node.metadata.resource_version },
                "spec": { "taints": taints },
            });
            api.patch(self.pool.node.as_str(), &PatchParams::default(), &Patch::Merge(patch))
                .await
                .map_err(|e| Error::training("update node taints", e))?;
            info!(healthy = health.is_healthy(), "virtual node taints updated");
        }
        self.patch_status(true).await
    }

    /// Writes the node's status; unless `always` (a heartbeat, a health change), only when
    /// what it advertises changed. Most capacity changes are the pool's usage, which the
    /// node does not show: they cost no write.
    async fn patch_status(&mut self, always: bool) -> Result<(), Error> {
        let capacity = self.pool.capacity.borrow_and_update().clone();
        let health = pool_health(&self.member.health.borrow(), &self.pool, &capacity);
        let advertised = (whole_units(&capacity.capacity), health);
        if !always && self.written.as_ref() == Some(&advertised) {
            return Ok(());
        }
        let health = &advertised.1;
        let now = jiff::Timestamp::now();
        let mut status = node_status(&self.config, &capacity, health, now);
        if let Some(conditions) = status.conditions.as_mut() {
            stamp_transitions(conditions, &mut self.transitions, now);
        }
        debug!(capacity = %capacity.capacity, "virtual node status");
        let mut patch = json!({ "status": status });
        if let Some(before) = &self.shown {
            remove_withdrawn(&mut patch, before, &advertised.0);
        }
        Api::<Node>::all(self.training.clone())
            .patch_status(self.pool.node.as_str(), &PatchParams::default(), &Patch::Strategic(patch))
            .await
            .map_err(|e| Error::training("update node status", e))?;
        self.shown = Some(advertised.0.clone());
        self.written = Some(advertised);
        Ok(())
    }

    async fn renew_lease(&self, node_uid: &str) -> Result<(), Error> {
        let api = Api::<Lease>::namespaced(self.training.clone(), NODE_LEASE_NAMESPACE);
        let name = self.pool.node.to_string();
        let now = MicroTime(jiff::Timestamp::now());
        let patch = json!({ "spec": { "renewTime": now, "holderIdentity": name } });
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(NODE_LEASE_NAMESPACE.to_owned()),
                        owner_references: Some(vec![OwnerReference {
                            api_version: "v1".to_owned(),
                            kind: "Node".to_owned(),
                            name: name.clone(),
                            uid: node_uid.to_owned(),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(name.clone()),
                        lease_duration_seconds: Some((self.config.lease_renew_seconds * LEASE_PERIODS) as i32),
                        renew_time: Some(now),
                        ..Default::default()
                    }),
                };
                api.create(&PostParams::default(), &lease)
                    .await
                    .map_err(|e| Error::training("create node lease", e))?;
                Ok(())
            }
            Err(e) => Err(Error::training("renew node lease", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_api::{PoolName, Resources, VirtualNodeName};

    fn pool() -> PoolHandle {
        let (_tx, rx) = watch::channel(PoolCapacity::default());
        PoolHandle {
            name: PoolName::from("default"),
            node: VirtualNodeName::from("tidepool-member-a"),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            runtime_class_names: Vec::new(),
            mode: Default::default(),
            topology: Vec::new(),
            capacity: rx,
        }
    }

    #[test]
    fn a_resource_the_pool_no_longer_lends_is_removed_from_the_node() {
        let before = Resources::from_pairs([("cpu", "4"), ("kubernetes.io/batch-cpu", "12k")]).unwrap();
        let now = Resources::from_pairs([("cpu", "12")]).unwrap();
        let mut patch = json!({"status": {"capacity": {"cpu": "12"}, "allocatable": {"cpu": "12"}}});
        remove_withdrawn(&mut patch, &before, &now);
        let want = json!({"cpu": "12", "kubernetes.io/batch-cpu": null});
        assert_eq!(patch, json!({"status": {"capacity": want, "allocatable": want}}));
    }

    #[test]
    fn a_colocation_pool_without_nodes_publishing_its_resources_is_not_ready_with_the_reason() {
        let colocated = PoolHandle { mode: tidepool_api::crd::PoolMode::KoordinatorBatch, ..pool() };
        let none = PoolCapacity::default();
        let some = PoolCapacity { nodes: 2, ..Default::default() };
        let (status, reason, message) = readiness(&pool_health(&Health::default(), &colocated, &none));
        assert_eq!((status, reason.as_str()), ("False", REASON_COLOCATION_MISSING));
        assert!(message.contains("kubernetes.io/batch-cpu"), "{message}");
        assert_eq!(readiness(&pool_health(&Health::default(), &colocated, &some)).0, "True");
        // A requests pool with no nodes is the member's business as before; an unreachable
        // member keeps its own reason.
        assert_eq!(readiness(&pool_health(&Health::default(), &pool(), &none)).0, "True");
        let down = Health { unreachable: Some("timeout".into()), ..Default::default() };
        assert_eq!(readiness(&pool_health(&down, &colocated, &none)).1, keys::REASON_MEMBER_UNREACHABLE);
    }

    #[test]
    fn a_condition_keeps_its_transition_time_until_its_status_changes() {
        let at = |s: &str| -> jiff::Timestamp { s.parse().unwrap() };
        let cond = |status: &str| NodeCondition { type_: "Ready".into(), status: status.into(), ..Default::default() };
        let mut known = Transitions::new();
        let mut first = [cond("True")];
        stamp_transitions(&mut first, &mut known, at("2026-12-01T10:00:00Z"));
        assert_eq!(first[0].last_transition_time, Some(Time(at("2026-12-01T10:00:00Z"))), "new: now");
        let mut again = [cond("True")];
        stamp_transitions(&mut again, &mut known, at("2026-12-01T10:05:00Z"));
        assert_eq!(again[0].last_transition_time, Some(Time(at("2026-12-01T10:00:00Z"))), "same status: kept");
        let mut flipped = [cond("False")];
        stamp_transitions(&mut flipped, &mut known, at("2026-12-01T10:07:00Z"));
        assert_eq!(flipped[0].last_transition_time, Some(Time(at("2026-12-01T10:07:00Z"))), "changed: now");
        // A restarted tidepool starts from what the node says.
        let node = Node {
            status: Some(NodeStatus { conditions: Some(flipped.to_vec()), ..Default::default() }),
            ..Default::default()
        };
        let mut restarted = known_transitions(&node);
        let mut later = [cond("False")];
        stamp_transitions(&mut later, &mut restarted, at("2026-12-01T11:00:00Z"));
        assert_eq!(later[0].last_transition_time, Some(Time(at("2026-12-01T10:07:00Z"))));
    }

    #[test]
    fn memory_is_shown_in_ki_as_kubelets_show_it() {
        let capacity = PoolCapacity {
            capacity: Resources::from_pairs([("cpu", "4"), ("memory", "16Gi")]).unwrap(),
            ..Default::default()
        };
        let status = node_status(&BridgeConfig::default(), &capacity, &Health::default(), jiff::Timestamp::UNIX_EPOCH);
        assert_eq!(status.allocatable.unwrap()["memory"], Quantity("16777216Ki".into()));
    }

    #[test]
    fn a_virtual_node_says_what_it_is_and_where_its_kubelet_listens() {
        let capacity = PoolCapacity {
            capacity: Resources::from_pairs([("cpu", "250"), ("nvidia.com/gpu", "16")]).unwrap(),
            gpu_product: Some("NVIDIA-H100".into()),
            ..Default::default()
        };
        let node = virtual_node(&BridgeConfig::default(), "member-a", &pool(), &capacity, &Health::default(), false);
        let labels = node.metadata.labels.unwrap();
        assert_eq!(labels["type"], "virtual-kubelet");
        assert_eq!(labels[keys::LABEL_MEMBER], "member-a");
        assert_eq!(labels[keys::LABEL_POOL], "default");
        assert_eq!(labels["nvidia.com/gpu.product"], "NVIDIA-H100");
        let taint = &node.spec.unwrap().taints.unwrap()[0];
        assert_eq!((taint.key.as_str(), taint.effect.as_str()), (keys::TAINT_VIRTUAL, "NoSchedule"));
        let status = node.status.unwrap();
        assert_eq!(status.allocatable.unwrap()["nvidia.com/gpu"].0, "16");
        let fractional = Resources::from_pairs([
            ("cpu", "1500m"),
            ("pods", "33300m"),
            ("nvidia.com/gpu", "7.5"),
            ("memory", "1001m"),
        ])
        .unwrap();
        let whole = whole_units(&fractional).to_quantities();
        let shown: Vec<(&str, &str)> = whole.iter().map(|(k, v)| (k.as_str(), v.0.as_str())).collect();
        assert_eq!(shown, [("cpu", "1500m"), ("memory", "1"), ("nvidia.com/gpu", "7"), ("pods", "33")]);
        assert_eq!(status.addresses.unwrap()[0].address, "127.0.0.2");
        assert_eq!(status.daemon_endpoints.unwrap().kubelet_endpoint.unwrap().port, 10250);
        let ready = status.conditions.unwrap().into_iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(ready.status, "True");
    }

    #[test]
    fn an_unhealthy_member_makes_its_nodes_not_ready_and_tainted() {
        let cases = [
            ("healthy", Health::default(), "True", "KubeletReady", None),
            (
                "unreachable",
                Health { unreachable: Some("timeout".into()), ..Default::default() },
                "Unknown",
                keys::REASON_MEMBER_UNREACHABLE,
                Some(keys::TAINT_UNREACHABLE),
            ),
            (
                "lost",
                Health { unreachable: Some("timeout".into()), lost: true, ..Default::default() },
                "Unknown",
                keys::REASON_MEMBER_LOST,
                Some(keys::TAINT_UNREACHABLE),
            ),
            (
                "refused credentials",
                Health { refused: Some("401".into()), ..Default::default() },
                "False",
                "MemberCredentialsRefused",
                Some(keys::TAINT_NOT_READY),
            ),
            (
                "unusable Secret",
                Health { unusable: Some(("KubeconfigInvalid".into(), "bad".into())), ..Default::default() },
                "False",
                "KubeconfigInvalid",
                Some(keys::TAINT_NOT_READY),
            ),
            (
                "a task of the session stopped",
                Health { stopped: Some("pod watch ended".into()), ..Default::default() },
                "False",
                keys::REASON_MEMBER_TASK_STOPPED,
                Some(keys::TAINT_NOT_READY),
            ),
        ];
        for (name, health, status, reason, taint) in cases {
            let (s, r, _) = readiness(&health);
            assert_eq!((s, r.as_str()), (status, reason), "{name}");
            let taints: Vec<String> = node_taints(&health, false).into_iter().map(|t| t.key).collect();
            let mut want = vec![keys::TAINT_VIRTUAL.to_owned()];
            want.extend(taint.map(str::to_owned));
            assert_eq!(taints, want, "{name}");
        }
    }

    #[test]
    fn a_paused_member_taints_its_nodes_no_schedule_and_unpausing_lifts_it() {
        let keys_of =
            |taints: Vec<Taint>| -> Vec<(String, String)> { taints.into_iter().map(|t| (t.key, t.effect)).collect() };
        let paused = virtual_node(
            &BridgeConfig::default(),
            "member-a",
            &pool(),
            &PoolCapacity::default(),
            &Health::default(),
            true,
        );
        let taints = paused.spec.unwrap().taints.unwrap();
        let want = |k: &str| (k.to_owned(), "NoSchedule".to_owned());
        assert_eq!(keys_of(taints), [want(keys::TAINT_VIRTUAL), want(keys::TAINT_PAUSED)]);
        assert_eq!(keys_of(node_taints(&Health::default(), false)), [want(keys::TAINT_VIRTUAL)]);
        // Paused and unreachable: both say why nothing new lands there.
        let down = Health { unreachable: Some("timeout".into()), ..Default::default() };
        assert_eq!(
            keys_of(node_taints(&down, true)),
            [want(keys::TAINT_VIRTUAL), want(keys::TAINT_UNREACHABLE), want(keys::TAINT_PAUSED)]
        );
    }
}
