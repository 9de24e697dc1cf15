//! What the dispatcher's two loops share: the [`Context`] (clients, caches, the channel to
//! vk-provider, the preemption requests one loop hands the other) and the small I/O both
//! use. Neither loop's module is imported here, so [`crate::controller`] and
//! [`crate::reclaim`] depend on this one and not on each other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource};
use tidepool_api::crd::GangScheduler;
use tidepool_api::keys::Band;
use tidepool_api::pod::PodLite;
use tidepool_api::{BridgeConfig, Resources};
use tidepool_federation::Members;
use tidepool_federation::capacity::PoolCapacity;
use tidepool_federation::published::Remote;
use tidepool_federation::writes::CopyWriter;
use tokio::sync::watch;
use tracing::warn;

use crate::error::Result;
use crate::gang::{BandRanges, GangKey, GangSource};
use tidepool_api::sync::Locked;

/// Longest a binding is assumed before the pod cache shows it (see [`Context::with_assumed`]).
const ASSUME_FOR: Duration = Duration::from_secs(30);

/// Native PodGroups whose reported status is remembered at most.
const GROUPS_REPORTED_MAX: usize = 10_000;

/// What each native PodGroup (`namespace/name`) was last reported as: scheduled, and the
/// message.
#[derive(Debug, Default)]
pub(crate) struct GroupReports(HashMap<String, (bool, String)>);

impl GroupReports {
    /// Records `outcome` for `group`; true when it is to be written: new, and the group was
    /// not reported scheduled before (that condition, once true, stays so, as the default
    /// scheduler keeps it). Bounded: past [`GROUPS_REPORTED_MAX`] groups it forgets them all,
    /// costing one write each at most.
    pub(crate) fn fresh(&mut self, group: &str, outcome: &str, scheduled: bool) -> bool {
        if self.0.len() >= GROUPS_REPORTED_MAX && !self.0.contains_key(group) {
            self.0.clear();
        }
        match self.0.get(group) {
            Some((true, _)) => false,
            Some((false, was)) if was == outcome && !scheduled => false,
            _ => {
                self.0.insert(group.to_owned(), (scheduled, outcome.to_owned()));
                true
            }
        }
    }

    /// Forgets what `group` was reported as: the write failed, so it shows something else.
    pub(crate) fn failed(&mut self, group: &str) {
        self.0.remove(group);
    }
}

/// How long a PodGroup's `minMember` is cached.
const POD_GROUP_TTL: Duration = Duration::from_secs(5);

pub(crate) struct Context {
    pub(crate) training: Client,
    pub(crate) config: Arc<BridgeConfig>,
    pub(crate) scheduler_name: String,
    pub(crate) ranges: BandRanges,
    /// The members this replica bridges.
    pub(crate) members: watch::Receiver<Members>,
    /// Sharded: the others, as their owners publish them.
    pub(crate) remote: Option<RemotePools>,
    pub(crate) pods: Store<PodLite>,
    /// Asks vk-provider, the one writer of offload copies, to free a reclaimed pod's copy.
    pub(crate) copies: CopyWriter,
    recorder: Recorder,
    pub(crate) pod_groups: moka::future::Cache<(GangSource, String), crate::error::Result<u32>>,
    /// The shapes of operators' jobs, read as the PodGroups are (same lifetime).
    pub(crate) workloads: moka::future::Cache<(GangSource, String), crate::error::Result<crate::workload::Shape>>,
    /// Last Unschedulable message per pod UID, so an unchanged reason is not rewritten.
    explained: Mutex<HashMap<String, String>>,
    /// What each native PodGroup (`namespace/name`) was last reported as: scheduled, and the
    /// message ([`Context::group_report_fresh`]).
    groups_reported: Mutex<GroupReports>,
    /// Gangs above band `low` that found no room in the last round: reclaim may preempt
    /// lower-band pods for them.
    preempt: Mutex<Vec<PreemptRequest>>,
    /// Wakes reclaim when a round hands it preemption requests.
    pub(crate) preempt_wanted: tokio::sync::Notify,
    /// Writes to the training API so far (bindings, placements, Events): a pass that wrote
    /// is followed at once, one that only read is paced by its cost.
    writes: AtomicUsize,
    /// Whether the training API server copies a Binding's labels onto its pod (1.35 and
    /// later, feature `PodTopologyLabelsAdmission`), so a pod's band and role travel with its
    /// binding in one write. Cleared for good when a bound pod shows they did not.
    pub(crate) labels_on_binding: AtomicBool,
    /// Pods this dispatcher bound, as the binding made them, until the pod cache shows them
    /// bound (kube-scheduler's assumed pods): a round that runs before the watch catches up
    /// sees its gang pinned and its room taken, and binds nothing twice.
    assumed: Mutex<Assumed>,
    /// Whether the training cluster serves eviction requests, read once when first needed
    /// ([`crate::reclaim_request`]).
    pub(crate) training_eviction_requests: tokio::sync::OnceCell<bool>,
    /// The training cluster's nodes the native pool is made of, once its watch runs
    /// (`native`): `None` while it does not (no `dispatcher.nativeNodes`, or not started).
    pub(crate) native_nodes: Mutex<Option<Store<k8s_openapi::api::core::v1::Node>>>,
}

impl Context {
    pub(crate) fn new(
        training: Client,
        config: Arc<BridgeConfig>,
        (members, remote): (watch::Receiver<Members>, Option<RemotePools>),
        pods: Store<PodLite>,
        copies: CopyWriter,
    ) -> Self {
        Self {
            recorder: Recorder::new(
                training.clone(),
                Reporter { controller: "tidepool-dispatcher".into(), instance: None },
            ),
            training,
            scheduler_name: config.dispatcher.scheduler_name.clone(),
            config,
            ranges: BandRanges::default(),
            members,
            remote,
            pods,
            copies,
            pod_groups: moka::future::Cache::builder().time_to_live(POD_GROUP_TTL).max_capacity(10_000).build(),
            workloads: moka::future::Cache::builder().time_to_live(POD_GROUP_TTL).max_capacity(10_000).build(),
            explained: Mutex::new(HashMap::new()),
            groups_reported: Mutex::new(GroupReports::default()),
            preempt: Mutex::new(Vec::new()),
            preempt_wanted: tokio::sync::Notify::new(),
            writes: AtomicUsize::new(0),
            labels_on_binding: AtomicBool::new(false),
            assumed: Mutex::new(Assumed::default()),
            training_eviction_requests: tokio::sync::OnceCell::new(),
            native_nodes: Mutex::new(None),
        }
    }

    pub(crate) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn writes(&self) -> usize {
        self.writes.load(Ordering::Relaxed)
    }

    /// Records `message` as the reason pod `uid` waits; true when it is new (then it is
    /// written), false when the pod already shows it.
    pub(crate) fn explain_fresh(&self, uid: &str, message: &str) -> Result<bool> {
        let mut explained = self.explained.locked("explained")?;
        Ok(explained.insert(uid.to_owned(), message.to_owned()).as_deref() != Some(message))
    }

    /// Records `outcome` as what native PodGroup `group` (`namespace/name`) shows; true when
    /// it is to be written ([`GroupReports::fresh`]).
    pub(crate) fn group_report_fresh(&self, group: &str, outcome: &str, scheduled: bool) -> Result<bool> {
        Ok(self.groups_reported.locked("groups reported")?.fresh(group, outcome, scheduled))
    }

    /// The report of native PodGroup `group` was not written ([`GroupReports::failed`]).
    pub(crate) fn group_report_failed(&self, group: &str) -> Result<()> {
        self.groups_reported.locked("groups reported")?.failed(group);
        Ok(())
    }

    /// Forgets the reason pod `uid` waited: it is bound.
    pub(crate) fn explained_bound(&self, uid: &str) -> Result<()> {
        self.explained.locked("explained")?.remove(uid);
        Ok(())
    }

    /// Remembers `pod` as its binding made it (see [`Context::assumed`]).
    pub(crate) fn assume_bound(&self, pod: PodLite) -> Result<()> {
        self.assumed.locked("assumed")?.insert(pod, Instant::now());
        Ok(())
    }

    /// Forgets the assumed binding of pod `uid`: it failed.
    pub(crate) fn forget_bound(&self, uid: &str) -> Result<()> {
        self.assumed.locked("assumed")?.0.remove(uid);
        Ok(())
    }

    /// The training pods as this dispatcher knows them (see [`Assumed::apply`]).
    pub(crate) fn with_assumed(&self, all: Vec<Arc<PodLite>>) -> Result<Vec<Arc<PodLite>>> {
        Ok(self.assumed.locked("assumed")?.apply(all, Instant::now()))
    }

    /// Hands the preemption requests of this round to reclaim.
    pub(crate) fn set_preempt(&self, requests: Vec<PreemptRequest>) -> Result<()> {
        if !requests.is_empty() {
            self.preempt_wanted.notify_one();
        }
        *self.preempt.locked("preempt")? = requests;
        Ok(())
    }

    /// Every pool: those of the members this replica bridges, then those of the members
    /// other replicas own (sharded) as last published. A member bridged here is read here
    /// even while an older record of it is still published.
    pub(crate) fn pools(&self) -> Vec<Pool> {
        let local = self.members.borrow().clone();
        let mut pools = Vec::new();
        for m in local.values() {
            let health = m.health.borrow().clone();
            for p in &m.pools {
                pools.push(Pool {
                    member: m.name.to_string(),
                    name: p.name.to_string(),
                    node: p.node.to_string(),
                    capacity: p.capacity.borrow().clone(),
                    paused: m.paused,
                    healthy: health.is_healthy(),
                    answering: health.is_answering(),
                });
            }
        }
        let Some(remote) = &self.remote else { return pools };
        for (name, r) in remote.records.borrow().iter().filter(|(name, _)| !local.contains_key(*name)) {
            // An owner that stopped rewriting its record may be dead: nothing goes there, and
            // nothing there is reclaimed, until the member's next owner publishes it.
            let fresh = r.fresh(remote.stale_after);
            for pool in &r.pools {
                pools.push(Pool {
                    member: name.to_string(),
                    name: pool.name.clone(),
                    node: pool.node.clone(),
                    capacity: pool.capacity.clone(),
                    paused: r.paused,
                    healthy: fresh && r.healthy,
                    answering: fresh && r.answering,
                });
            }
        }
        pools
    }

    /// The members this replica bridges, each with its pools' virtual nodes and its pod
    /// network (declared, else its nodes' pod CIDRs).
    pub(crate) fn pod_networks(&self) -> Vec<crate::native_pool::MemberNetwork> {
        let local = self.members.borrow().clone();
        local
            .values()
            .map(|m| {
                let nodes = m.pools.iter().map(|p| p.node.to_string()).collect();
                (m.name.to_string(), nodes, m.effective_pod_network())
            })
            .collect()
    }

    /// Whether virtual node `node` is a pool of a member another replica owns: its owner ends
    /// the reclaims there (only it can delete the copies).
    pub(crate) fn owned_elsewhere(&self, node: &str) -> bool {
        let Some(remote) = &self.remote else { return false };
        if self.members.borrow().values().any(|m| m.pool_for_node(node).is_some()) {
            return false;
        }
        remote.records.borrow().values().any(|r| r.pools.iter().any(|p| p.node == node))
    }

    /// The preemption requests of the last round.
    pub(crate) fn preempt_requests(&self) -> Result<Vec<PreemptRequest>> {
        Ok(self.preempt.locked("preempt")?.clone())
    }
}

/// Pods bound by this dispatcher that the pod cache may not show bound yet, each as its
/// binding left it, with when it was bound.
#[derive(Debug, Default)]
pub(crate) struct Assumed(HashMap<String, (Arc<PodLite>, Instant)>);

impl Assumed {
    fn insert(&mut self, pod: PodLite, at: Instant) {
        if let Some(uid) = pod.metadata.uid.clone() {
            self.0.insert(uid, (Arc::new(pod), at));
        }
    }

    /// `all` (the cache's pods) with each assumed pod that the cache still shows unbound
    /// taken as bound. An assumption ends once the cache shows the pod bound or gone, or
    /// [`ASSUME_FOR`] after the binding.
    fn apply(&mut self, mut all: Vec<Arc<PodLite>>, now: Instant) -> Vec<Arc<PodLite>> {
        if self.0.is_empty() {
            return all;
        }
        let mut unseen = std::collections::HashSet::new();
        for p in &mut all {
            let Some(uid) = p.metadata.uid.as_deref() else { continue };
            let Some((bound, at)) = self.0.get(uid) else { continue };
            if p.node_name().is_none() && p.is_live() && now.duration_since(*at) < ASSUME_FOR {
                unseen.insert(uid.to_owned());
                *p = bound.clone();
            }
        }
        self.0.retain(|uid, _| unseen.contains(uid));
        all
    }
}

/// The pools of members other replicas own, as published (see
/// [`tidepool_federation::published`]).
#[derive(Debug, Clone)]
pub struct RemotePools {
    pub records: watch::Receiver<Remote>,
    /// A record not rewritten for this long is its dead owner's.
    pub stale_after: Duration,
    /// Whether a gang waits for capacity, for the other replicas' members (see
    /// [`tidepool_federation::published::publish_wanted`]).
    pub wanted: watch::Sender<bool>,
}

/// One pool as the dispatcher sees it (see [`Context::pools`]).
#[derive(Debug, Clone)]
pub(crate) struct Pool {
    pub member: String,
    pub name: String,
    /// Its virtual node.
    pub node: String,
    pub capacity: PoolCapacity,
    pub paused: bool,
    /// New pods may go there.
    pub healthy: bool,
    /// Its pods may be reclaimed: its API server answers.
    pub answering: bool,
}

/// How long to wait before the next pass of a loop over every training pod: right away
/// (`least`) after a pass that wrote, since what it wrote brings changes to act on; else
/// ten times the pass's cost, so a large cluster costs at most about a tenth of a core,
/// between `least` and `most`.
pub(crate) fn pacing(cost: Duration, wrote: bool, least: Duration, most: Duration) -> Duration {
    if wrote { least } else { cost.saturating_mul(10).clamp(least, most) }
}

/// A pending gang that lower-band pods could make room for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreemptRequest {
    pub gang: GangKey,
    pub band: Band,
    /// Requests of its whole core.
    pub demand: Resources,
}

pub(crate) fn requests(p: &PodLite) -> Resources {
    p.spec.requests.clone()
}

/// The API of the PodGroups a gang source names (Kubernetes', Volcano's or sig-scheduling's),
/// with their kind for messages.
pub(crate) fn pod_group_api(training: Client, source: &GangSource, ns: &str) -> (Api<DynamicObject>, GroupVersionKind) {
    let scheduler = match source {
        GangSource::Native(_) => GangScheduler::Kubernetes,
        GangSource::Volcano(_) => GangScheduler::Volcano,
        _ => GangScheduler::Coscheduling,
    };
    let ar = scheduler.pod_group_resource();
    let gvk = GroupVersionKind::gvk(&ar.group, &ar.version, &ar.kind);
    (Api::<DynamicObject>::namespaced_with(training, ns, &ar), gvk)
}

/// The API of the jobs of `kind` in `ns`, and their group-version-kind.
pub(crate) fn workload_api(
    training: Client,
    kind: crate::workload::WorkloadKind,
    ns: &str,
) -> (Api<DynamicObject>, GroupVersionKind) {
    let (group, version, kind, plural) = kind.api();
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
    (Api::<DynamicObject>::namespaced_with(training, ns, &ar), gvk)
}

/// Publishes an Event on `pod`; a failure is logged (an Event is a record, not a step).
pub(crate) async fn publish(ctx: &Context, pod: &PodLite, type_: EventType, reason: &str, note: &str) {
    publish_on(ctx, &pod.object_ref(&()), type_, reason, note).await;
}

/// Publishes an Event on the object `on`; a failure is logged.
pub(crate) async fn publish_on(
    ctx: &Context,
    on: &k8s_openapi::api::core::v1::ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    ctx.wrote();
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.to_owned()),
        action: "Schedule".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, on).await {
        warn!(error = %e, reason, "cannot publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, node: Option<&str>) -> Arc<PodLite> {
        let mut p = PodLite::default();
        p.metadata.uid = Some(uid.into());
        p.spec.node_name = node.map(str::to_owned);
        Arc::new(p)
    }

    #[test]
    fn a_group_is_reported_on_each_new_reason_and_once_scheduled_never_again() {
        let mut r = GroupReports::default();
        assert!(r.fresh("ns/g", "3 of its 4 pods", false));
        assert!(!r.fresh("ns/g", "3 of its 4 pods", false), "unchanged: no write");
        assert!(r.fresh("ns/g", "no pool fits", false), "a new reason");
        assert!(r.fresh("ns/g", "placed on tidepool-a", true));
        assert!(!r.fresh("ns/g", "placed on tidepool-a", true));
        assert!(!r.fresh("ns/g", "elastic pods wait", false), "scheduled stays so");
        assert!(r.fresh("ns/h", "3 of its 4 pods", false), "groups apart");
        r.failed("ns/h");
        assert!(r.fresh("ns/h", "3 of its 4 pods", false), "a failed write is tried again");
        for i in 0..GROUPS_REPORTED_MAX {
            r.fresh(&format!("ns/{i}"), "waits", false);
        }
        assert!(r.0.len() <= GROUPS_REPORTED_MAX, "bounded: {}", r.0.len());
    }

    #[test]
    fn a_pod_bound_here_is_taken_as_bound_until_the_cache_shows_it_or_the_assumption_expires() {
        let (mut assumed, t0) = (Assumed::default(), Instant::now());
        assumed.insert((*pod("a", Some("tidepool-x"))).clone(), t0);
        assumed.insert((*pod("b", Some("tidepool-x"))).clone(), t0);
        // The cache lags: both still unbound there.
        let all = assumed.apply(vec![pod("a", None), pod("b", None), pod("c", None)], t0);
        let nodes: Vec<_> = all.iter().map(|p| p.node_name()).collect();
        assert_eq!(nodes, [Some("tidepool-x"), Some("tidepool-x"), None]);
        // The cache shows a bound: a's assumption ends; b is still assumed.
        let all = assumed.apply(vec![pod("a", Some("tidepool-x")), pod("b", None)], t0);
        assert_eq!(all[1].node_name(), Some("tidepool-x"));
        assert_eq!(assumed.0.len(), 1);
        // A binding the cache never shows is given up after ASSUME_FOR.
        let all = assumed.apply(vec![pod("b", None)], t0 + ASSUME_FOR);
        assert_eq!(all[0].node_name(), None);
        assert!(assumed.0.is_empty());
    }

    #[test]
    fn a_pass_that_wrote_is_followed_at_once_and_one_that_read_waits_ten_times_its_cost() {
        let (least, most) = (Duration::from_millis(10), Duration::from_secs(1));
        assert_eq!(pacing(Duration::from_millis(80), true, least, most), least);
        assert_eq!(pacing(Duration::from_millis(2), false, least, most), Duration::from_millis(20));
        assert_eq!(pacing(Duration::from_micros(100), false, least, most), least);
        assert_eq!(pacing(Duration::from_millis(300), false, least, most), most);
    }
}
