//! What the dispatcher's two loops share: the [`Context`] (clients, caches, the channel to
//! vk-provider, the preemption requests one loop hands the other) and the small I/O both
//! use. Neither loop's module is imported here, so [`crate::controller`] and
//! [`crate::reclaim`] depend on this one and not on each other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource};
use tidepool_api::keys::Band;
use tidepool_api::pod::PodLite;
use tidepool_api::{BridgeConfig, Resources};
use tidepool_federation::Members;
use tidepool_federation::capacity::PoolCapacity;
use tidepool_federation::published::Remote;
use tidepool_federation::writes::CopyWriter;
use tokio::sync::watch;
use tracing::warn;

use crate::error::{Result, lock};
use crate::gang::{BandRanges, GangKey, GangSource};

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
    /// Last Unschedulable message per pod UID, so an unchanged reason is not rewritten.
    explained: Mutex<HashMap<String, String>>,
    /// Gangs above band `low` that found no room in the last round: reclaim may preempt
    /// lower-band pods for them.
    preempt: Mutex<Vec<PreemptRequest>>,
    /// Writes to the training API so far (bindings, placements, Events): a pass that wrote
    /// is followed at once, one that only read is paced by its cost.
    writes: AtomicUsize,
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
            explained: Mutex::new(HashMap::new()),
            preempt: Mutex::new(Vec::new()),
            writes: AtomicUsize::new(0),
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
        let mut explained = lock(&self.explained, "explained")?;
        Ok(explained.insert(uid.to_owned(), message.to_owned()).as_deref() != Some(message))
    }

    /// Forgets the reason pod `uid` waited: it is bound.
    pub(crate) fn explained_bound(&self, uid: &str) -> Result<()> {
        lock(&self.explained, "explained")?.remove(uid);
        Ok(())
    }

    /// Hands the preemption requests of this round to reclaim.
    pub(crate) fn set_preempt(&self, requests: Vec<PreemptRequest>) -> Result<()> {
        *lock(&self.preempt, "preempt")? = requests;
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
        Ok(lock(&self.preempt, "preempt")?.clone())
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

/// The API of the PodGroups a gang source names (Volcano's or sig-scheduling's), with their
/// kind for messages.
pub(crate) fn pod_group_api(training: Client, source: &GangSource, ns: &str) -> (Api<DynamicObject>, GroupVersionKind) {
    let gvk = match source {
        GangSource::Volcano(_) => GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "PodGroup"),
        _ => GroupVersionKind::gvk("scheduling.x-k8s.io", "v1alpha1", "PodGroup"),
    };
    let ar = ApiResource::from_gvk_with_plural(&gvk, "podgroups");
    (Api::<DynamicObject>::namespaced_with(training, ns, &ar), gvk)
}

/// Publishes an Event on `pod`; a failure is logged (an Event is a record, not a step).
pub(crate) async fn publish(ctx: &Context, pod: &PodLite, type_: EventType, reason: &str, note: &str) {
    ctx.wrote();
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.to_owned()),
        action: "Schedule".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
        warn!(error = %e, reason, "cannot publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_that_wrote_is_followed_at_once_and_one_that_read_waits_ten_times_its_cost() {
        let (least, most) = (Duration::from_millis(10), Duration::from_secs(1));
        assert_eq!(pacing(Duration::from_millis(80), true, least, most), least);
        assert_eq!(pacing(Duration::from_millis(2), false, least, most), Duration::from_millis(20));
        assert_eq!(pacing(Duration::from_micros(100), false, least, most), least);
        assert_eq!(pacing(Duration::from_millis(300), false, least, most), most);
    }
}
