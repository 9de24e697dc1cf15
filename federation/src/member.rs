//! One connected member: its client, its watches, and the capacity of its pools.
//!
//! A [`Session`] lives as long as the member's credentials and spec stay the same. Its
//! watches keep only what the capacity model needs ([`NodeView`], [`PodView`]), so a member
//! with thousands of nodes and pods costs little memory. Dropping the session stops them.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tidepool_api::crd::{PoolMode, PoolSpec, PoolToleration};
use tidepool_api::sync::Locked;
use tidepool_api::{MemberName, PoolName, VirtualNodeName};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info_span, warn};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use tidepool_api::Resources;
use tidepool_api::metrics::metrics;

use crate::capacity::{
    CapacityPolicy, HpaView, NodeView, OnlineDemand, PUBLISH_MAX_INTERVAL, PodCapacityKey, PodView, PoolCapacity,
    ReplicasToCome, pod_requests, worth_publishing,
};
use crate::capacity_index::PodIndex;
use crate::health::Health;
use crate::pod_network::PodNetwork;
use crate::pool_model::{PoolModel, Touched};
use crate::priority::{PriorityConflict, offload_ceiling};
use crate::wire::{MemberNode, MemberPod};

/// Namespace, kind and name of an HPA's scale target.
type WorkloadKey = (String, String, String);

/// An HPA as the capacity model needs it: its target and how far it may still grow.
#[derive(Debug, Clone, PartialEq)]
struct HpaRef {
    target: WorkloadKey,
    max_replicas: i32,
    current_replicas: i32,
}

/// A workload's pod template, reduced to what one replica requests and where it may land.
#[derive(Debug, Clone, PartialEq)]
struct Template {
    per_replica: Resources,
    node_selector: BTreeMap<String, String>,
    tolerations: Vec<PoolToleration>,
    /// `spec.replicas`: replicas asked for, whose pods exist or are about to.
    replicas: i32,
}

fn hpa_view(h: &HorizontalPodAutoscaler) -> Option<(WorkloadKey, HpaRef)> {
    let ns = h.namespace().unwrap_or_default();
    let spec = &h.spec;
    let target = (ns.clone(), spec.scale_target_ref.kind.clone(), spec.scale_target_ref.name.clone());
    let current = h.status.as_ref().and_then(|s| s.current_replicas).unwrap_or(0);
    Some((
        (ns, "HPA".to_owned(), h.name_any()),
        HpaRef { target, max_replicas: spec.max_replicas, current_replicas: current },
    ))
}

fn template_view(
    kind: &str,
    ns: Option<String>,
    name: String,
    template: &PodTemplateSpec,
    replicas: Option<i32>,
) -> Option<(WorkloadKey, Template)> {
    let spec = template.spec.as_ref()?;
    let mut per_replica = pod_requests(spec);
    // `pods` is a count, not part of what a replica requests from a node's resources.
    per_replica.set("pods", 1000);
    Some((
        (ns.unwrap_or_default(), kind.to_owned(), name),
        Template {
            per_replica,
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            tolerations: crate::capacity::tolerations_of(spec),
            replicas: replicas.unwrap_or(1),
        },
    ))
}

fn join_hpas(hpas: &ViewCache<WorkloadKey, HpaRef>, templates: &ViewCache<WorkloadKey, Template>) -> Vec<HpaView> {
    hpas.values()
        .filter_map(|h| {
            let t = templates.get(&h.target)?;
            Some(HpaView {
                max_replicas: h.max_replicas,
                // Replicas already asked for have pods, counted as online or pending online
                // demand, or are about to ([`ReplicasToCome`]): only growth beyond them is
                // headroom. (The HPA's status lags a scale-up by its sync period; counting
                // from it alone held the same replicas back twice.)
                current_replicas: h.current_replicas.max(t.replicas),
                per_replica: t.per_replica.clone(),
                node_selector: t.node_selector.clone(),
                tolerations: t.tolerations.clone(),
            })
        })
        .collect()
}

/// Per workload, the replicas it asks for beyond the pods it has (those not ended, counted
/// in `pods`): pods its controller is about to create, to hold room for before they exist
/// (see [`ReplicasToCome`]).
fn replicas_to_come(templates: &ViewCache<WorkloadKey, Template>, pods: &PodIndex) -> Vec<ReplicasToCome> {
    templates
        .iter()
        .filter_map(|((ns, kind, name), t)| {
            let have = match kind.as_str() {
                "Deployment" => pods.existing(ns, "Deployment", name),
                "StatefulSet" => pods.existing(ns, "StatefulSet", name),
                _ => 0,
            };
            (t.replicas > have).then(|| ReplicasToCome {
                replicas: t.replicas - have,
                per_replica: t.per_replica.clone(),
                node_selector: t.node_selector.clone(),
                tolerations: t.tolerations.clone(),
            })
        })
        .collect()
}

/// A connected member as the rest of tidepool sees it.
pub struct MemberHandle {
    pub name: MemberName,
    /// Client for the member's API server, built from the vetted kubeconfig.
    pub client: Client,
    /// How training namespaces map to this member's offload namespaces.
    pub namespaces: Arc<tidepool_api::names::OffloadNamespaces>,
    /// `spec.copyLabels` and `spec.copyAnnotations`: what of a training pod's metadata its
    /// copy carries besides tidepool's own.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`: per-band bounds on the copies' grace.
    pub max_termination_grace: tidepool_api::crd::TerminationGraceLimits,
    /// `spec.gangScheduler` and the `schedulerName` its gangs' copies get, if set.
    pub gang_scheduling: Option<(tidepool_api::crd::GangScheduler, String)>,
    /// `spec.podSecurity`, `spec.userNamespaces`, `spec.networkPolicy`: what its offload
    /// namespaces enforce and its copies are hardened to.
    pub confinement: tidepool_api::crd::Confinement,
    pub pools: Vec<PoolHandle>,
    /// Cancelled when the session ends (member deleted, credentials or spec changed).
    pub cancelled: CancellationToken,
    /// `spec.paused`: no new placements; running offload pods stay.
    pub paused: bool,
    /// Reachability and usability, kept current by the session's prober and the controller.
    /// The session outlives an outage: consumers read this and hold back instead.
    pub health: watch::Receiver<Health>,
    /// Calls made to the member and time spent waiting for its rate limit.
    pub stats: Arc<crate::MemberStats>,
    /// Online pods at or below the offload priorities, if any; set with the first capacity.
    pub priority_conflict: watch::Receiver<Option<PriorityConflict>>,
    /// The pod CIDRs of the member's nodes; set with the first capacity.
    pub pod_network: watch::Receiver<PodNetwork>,
    /// `spec.podCIDRs`: the pod network its admin declares (empty: none declared).
    pub declared_pod_network: PodNetwork,
    /// The capacity publisher's wake-ups, for [`MemberHandle::want_capacity`].
    wakeups: Wakeups,
    /// Set before the session ends because another replica owns the member now: its virtual
    /// nodes stay (the new owner keeps them), only this replica's tasks stop.
    pub handed_over: std::sync::atomic::AtomicBool,
    /// The member's eviction requests, where it serves them (Kubernetes 1.37 with the gate).
    pub eviction_requests: Option<crate::eviction_requests::EvictionAsks>,
}

/// One pool of a member: one virtual node.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    pub name: PoolName,
    pub node: VirtualNodeName,
    pub node_selector: BTreeMap<String, String>,
    /// What every copy in the pool tolerates (`spec.pools[].tolerations`).
    pub tolerations: Vec<PoolToleration>,
    /// RuntimeClasses its offload pods may name (`spec.pools[].runtimeClassNames`).
    pub runtime_class_names: Vec<String>,
    /// Which node resources the pool lends, and so how its copies ask for them
    /// (`spec.pools[].mode`).
    pub mode: PoolMode,
    /// Node label keys of its topology domains, coarse to fine (`spec.pools[].topology`):
    /// the only keys a copy's planned domain may pin (see `ANNOTATION_PLANNED_DOMAIN`).
    pub topology: Vec<String>,
    pub capacity: watch::Receiver<PoolCapacity>,
}

impl std::fmt::Debug for MemberHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberHandle").field("name", &self.name).field("pools", &self.pools).finish_non_exhaustive()
    }
}

impl MemberHandle {
    /// The member's pod network: the one its admin declares (`spec.podCIDRs`), else its
    /// nodes' pod CIDRs as last seen. What `PodNetworkOverlap` compares.
    pub fn effective_pod_network(&self) -> PodNetwork {
        if self.declared_pod_network.is_empty() {
            self.pod_network.borrow().clone()
        } else {
            self.declared_pod_network.clone()
        }
    }

    /// Told by the dispatcher after each round: whether a gang waits for capacity. While one
    /// does, a pool whose room grows publishes at once (see [`publication`]); a drift held
    /// back when the wait begins goes out now.
    pub fn want_capacity(&self, wanted: bool) {
        if !self.wakeups.wanted.swap(wanted, Ordering::Relaxed) && wanted {
            self.wakeups.changed.notify_one();
        }
    }

    pub fn pool_for_node(&self, node: &str) -> Option<&PoolHandle> {
        self.pools.iter().find(|p| p.node.as_str() == node)
    }
}

/// Settings of a session that come from its `MemberCluster` and the bridge config.
#[derive(Debug, Clone)]
pub(crate) struct SessionOptions {
    /// How training namespaces map to the member's offload namespaces.
    pub namespaces: Arc<tidepool_api::names::OffloadNamespaces>,
    /// `spec.copyLabels`, `spec.copyAnnotations`.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`.
    pub max_termination_grace: tidepool_api::crd::TerminationGraceLimits,
    /// `spec.gangScheduler`, with the scheduler name.
    pub gang_scheduling: Option<(tidepool_api::crd::GangScheduler, String)>,
    /// `spec.podSecurity`, `spec.userNamespaces`, `spec.networkPolicy`.
    pub confinement: tidepool_api::crd::Confinement,
    /// `spec.podCIDRs`.
    pub declared_pod_network: PodNetwork,
    /// `spec.paused`.
    pub paused: bool,
    /// `memberLossTimeoutSeconds`: unreachable this long, the member counts as lost.
    pub loss_timeout: Duration,
    /// Counters of the client's throttle layer.
    pub stats: Arc<crate::MemberStats>,
    /// The fence of the session's client (see [`crate::fence`]).
    pub fence: CancellationToken,
    /// The member serves eviction requests: watch them.
    pub eviction_requests: bool,
}

/// Owns the watch tasks of one member; dropping it stops them.
#[derive(Debug)]
pub(crate) struct Session {
    pub handle: Arc<MemberHandle>,
    pub fingerprint: String,
    pub health: watch::Sender<Health>,
    /// Cancelled when the member is handed over: its client stops at once.
    pub fence: CancellationToken,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.handle.cancelled.cancel();
    }
}

/// Shortest spacing of two capacity computations: the events of a burst that arrive
/// within it cost one computation.
const COALESCE: Duration = Duration::from_millis(100);

/// Shortest spacing while online demand moves: a pool is short (a deficit), or an HPA, a
/// Deployment or StatefulSet, or a pending online pod changed since the last computation.
/// What follows a first change (an HPA raising its bound, then the Deployment scaling, its
/// pods created one after another) is more of the same demand, and it is waiting.
const COALESCE_SHORT: Duration = Duration::from_millis(10);

/// Longest spacing of two computations.
const COALESCE_MAX: Duration = Duration::from_secs(1);

/// How far apart the next computation must start from the last one, given what the last
/// one cost and whether online demand moves (`short`, see [`COALESCE_SHORT`]): ten times the
/// cost, so a large member's capacity model takes at most about a tenth of a core under
/// constant churn, between [`COALESCE`] ([`COALESCE_SHORT`] while short) and
/// [`COALESCE_MAX`]. A change after a quiet spell is computed at once (an online service
/// growing wants its capacity back now); only the changes that follow it wait for the
/// spacing. Offload churn (a burst of copies
/// starting) keeps the longer spacing: it changes nothing online demand waits for, and each
/// publication rewrites the virtual node and wakes the dispatcher.
fn coalesce_after(cost: Duration, short: bool) -> Duration {
    let least = if short { COALESCE_SHORT } else { COALESCE };
    cost.saturating_mul(10).clamp(least, COALESCE_MAX)
}

/// The trimmed views of one member's watches, and how the watches wake the capacity
/// publisher.
#[derive(Clone)]
struct Caches {
    /// Noting which nodes changed for the pool models ([`Touched`]).
    nodes: Arc<Mutex<ViewCache<String, NodeView, Touched>>>,
    /// With the pods summed per node ([`PodIndex`]), kept up to date event by event.
    pods: Arc<Mutex<ViewCache<PodCapacityKey, PodView, PodIndex>>>,
    /// HPAs and the pod templates of their targets, for the HPA headroom (watched only when
    /// the policy keeps any).
    hpas: Arc<Mutex<ViewCache<WorkloadKey, HpaRef>>>,
    templates: Arc<Mutex<ViewCache<WorkloadKey, Template>>>,
    wakeups: Wakeups,
}

/// Set by the watches, taken by the capacity publisher.
#[derive(Clone, Default)]
pub(crate) struct Wakeups {
    /// Any event of any watch.
    changed: Arc<Notify>,
    /// Set with `changed` by a change of online demand (see [`coalesce_after`]).
    demand: Arc<AtomicBool>,
    /// A gang waits for capacity (see [`MemberHandle::want_capacity`]).
    wanted: Arc<AtomicBool>,
}

/// Every object of kind `K` in the member, watched with backoff.
pub(crate) fn watch_all<K>(
    client: &Client,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(Api::<K>::all(client.clone()), watcher::Config::default()).default_backoff()
}

impl Caches {
    /// Starts the member's watches, each keeping one cache.
    fn watch(
        client: &Client,
        name: &MemberName,
        modes: &[PoolMode],
        hpa: bool,
        cancelled: &CancellationToken,
    ) -> Caches {
        let index = PodIndex::new(modes.iter().copied(), offload_ceiling());
        let caches = Caches {
            nodes: Arc::default(),
            pods: Arc::new(Mutex::new(ViewCache::with(index))),
            hpas: Arc::default(),
            templates: Arc::default(),
            wakeups: Wakeups::default(),
        };
        let wake = &caches.wakeups;
        // Nodes and pods are many and change often: decoded lean (see `crate::wire`).
        let node_view = |n: &MemberNode| Some((n.0.name_any(), NodeView::from_node(&n.0)));
        let span = info_span!("member_nodes", member = %name);
        spawn_cache(watch_all::<MemberNode>(client), &caches.nodes, node_view, |_| false, wake, cancelled, span);
        let pod_view =
            |p: &MemberPod| Some(((p.0.namespace().unwrap_or_default(), p.0.name_any()), PodView::from_pod(&p.0)));
        let span = info_span!("member_pods", member = %name);
        let pods = watch_all::<MemberPod>(client);
        spawn_cache(pods, &caches.pods, pod_view, PodView::pending_online, wake, cancelled, span);
        if !hpa {
            return caches;
        }
        let span = info_span!("member_hpas", member = %name);
        let hpas = watch_all::<HorizontalPodAutoscaler>(client);
        spawn_cache(hpas, &caches.hpas, hpa_view, |_| true, wake, cancelled, span);
        let deployment = |d: &Deployment| {
            template_view("Deployment", d.namespace(), d.name_any(), &d.spec.template, d.spec.replicas)
        };
        let span = info_span!("member_deployments", member = %name);
        let deployments = watch_all::<Deployment>(client);
        spawn_cache(deployments, &caches.templates, deployment, |_| true, wake, cancelled, span);
        let set = |d: &StatefulSet| {
            template_view("StatefulSet", d.namespace(), d.name_any(), &d.spec.template, d.spec.replicas)
        };
        let span = info_span!("member_statefulsets", member = %name);
        let sets = watch_all::<StatefulSet>(client);
        spawn_cache(sets, &caches.templates, set, |_| true, wake, cancelled, span);
        caches
    }

    /// Every pool's capacity from the views, or `None` while the node or pod watch has not
    /// listed everything yet; updates the priority conflict on the way. Computed under the
    /// caches' locks: each pool's model redoes the nodes whose view or pods changed since the
    /// last computation, and no pod is walked for it.
    fn compute(
        &self,
        pools: &mut [PoolModel],
        policy: &CapacityPolicy,
        signals: &Signals,
    ) -> Result<Option<Vec<PoolCapacity>>, crate::Error> {
        let hpa_views = join_hpas(&*self.hpas.locked("HPA view")?, &*self.templates.locked("workload view")?);
        let mut nodes = self.nodes.locked("node view")?;
        let mut pods = self.pods.locked("pod view")?;
        if !(nodes.synced && pods.synced) {
            return Ok(None);
        }
        let nodes_touched = nodes.derived.take();
        if !nodes_touched.is_empty() {
            let network = PodNetwork::new(nodes.views().values().flat_map(|v| v.pod_cidrs.iter().copied()));
            signals.pod_network.send_if_modified(|cur| {
                let changed = *cur != network;
                *cur = network;
                changed
            });
        }
        let touched = nodes_touched.joined(pods.derived.take_touched());
        let to_come = replicas_to_come(&*self.templates.locked("workload view")?, &pods.derived);
        let demand = OnlineDemand { policy, hpas: &hpa_views, to_come: &to_come, now: jiff::Timestamp::now() };
        let found = pods.derived.priority_conflict();
        signals.conflict.send_if_modified(|cur| {
            let changed = *cur != found;
            *cur = found;
            changed
        });
        let capacity = |model: &mut PoolModel| {
            model.catch_up(&touched, nodes.views(), &pods.derived);
            model.capacity(&demand, nodes.views(), &pods.derived)
        };
        Ok(Some(pools.iter_mut().map(capacity).collect()))
    }
}

/// What the capacity computation finds out about the member besides capacity, for its
/// `MemberCluster` conditions.
struct Signals {
    conflict: watch::Sender<Option<PriorityConflict>>,
    /// The pod network of the member's nodes ([`crate::pod_network`]).
    pod_network: watch::Sender<PodNetwork>,
}

/// What becomes of a pool's newly computed capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publication {
    /// Equal to the published one: nothing to send, nothing waiting.
    Unchanged,
    /// A small change (see [`worth_publishing`]) the pool published recently: it waits, at
    /// most until [`PUBLISH_MAX_INTERVAL`] after the last publication.
    Defer,
    Publish,
}

/// Whether `next` goes out now, given the published `current`, how long ago the pool last
/// published and whether a gang waits for capacity (`wanted`): room that grows may be what it
/// waits for. Pure.
fn publication(current: &PoolCapacity, next: &PoolCapacity, since_published: Duration, wanted: bool) -> Publication {
    if current == next {
        Publication::Unchanged
    } else if since_published < PUBLISH_MAX_INTERVAL
        && !worth_publishing(current, next)
        && !(wanted && room_grew(current, next))
    {
        Publication::Defer
    } else {
        Publication::Publish
    }
}

/// Whether `next` leaves more room than `current` in any resource (capacity minus used).
fn room_grew(current: &PoolCapacity, next: &PoolCapacity) -> bool {
    let room = |c: &PoolCapacity, name: &str| c.capacity.get(name) - c.used.get(name);
    next.capacity.names().any(|name| room(next, name) > room(current, name))
}

/// The capacity publisher's memory between two computations: when each pool last published
/// and whether a small change waits, and when the last computation started, what it cost and
/// whether it found a pool short (see [`coalesce_after`]).
#[derive(Debug)]
struct Publisher {
    computed: bool,
    published: Vec<Instant>,
    deferred: Vec<bool>,
    last_started: Instant,
    last_cost: Duration,
    last_short: bool,
}

impl Publisher {
    fn new(pools: usize, now: Instant) -> Self {
        Self {
            computed: false,
            published: vec![now; pools],
            deferred: vec![false; pools],
            last_started: now,
            last_cost: Duration::ZERO,
            last_short: false,
        }
    }

    /// How long to wait for a change before computing anyway: `clock` (windows open and
    /// close with it), sooner while a small change waits.
    fn wake(&self, clock: Duration) -> Duration {
        if self.deferred.iter().any(|d| *d) { PUBLISH_MAX_INTERVAL.min(clock) } else { clock }
    }

    /// When the next computation may start; `demand_moved`: online demand changed since the
    /// last one (see [`coalesce_after`]). A pool found short counts as moving demand.
    fn next_start(&self, demand_moved: bool) -> Instant {
        self.last_started + coalesce_after(self.last_cost, demand_moved)
    }

    /// Sends each pool's `next` capacity that is due, at `now`. The first computation always
    /// goes out (consumers wait for it), whatever it is.
    fn publish(
        &mut self,
        senders: &[watch::Sender<PoolCapacity>],
        nexts: Vec<PoolCapacity>,
        now: Instant,
        wanted: bool,
    ) {
        let first = !self.computed;
        self.computed = true;
        for (i, (tx, next)) in senders.iter().zip(nexts).enumerate() {
            if first {
                tx.send_replace(next);
                continue;
            }
            let since = now.duration_since(self.published[i]);
            let sent = tx.send_if_modified(|cur| match publication(cur, &next, since, wanted) {
                Publication::Unchanged => {
                    self.deferred[i] = false;
                    false
                }
                Publication::Defer => {
                    self.deferred[i] = true;
                    false
                }
                Publication::Publish => {
                    debug!(capacity = %next.capacity, used = %next.used, nodes = next.nodes, "pool capacity changed");
                    *cur = next;
                    true
                }
            });
            if sent {
                self.published[i] = now;
                self.deferred[i] = false;
            }
        }
    }

    /// Records the computation that started at `started` and took `cost`.
    fn computed(&mut self, started: Instant, cost: Duration, short: bool) {
        (self.last_started, self.last_cost, self.last_short) = (started, cost, short);
    }
}

/// One pool as the capacity publisher serves it.
struct PoolOut {
    name: String,
    tx: watch::Sender<PoolCapacity>,
}

/// Computes every pool's capacity when the watches change and publishes what is due (see
/// [`Publisher`], [`coalesce_after`]), until `stop`. `compute` answers `None` while the
/// watches are not synced.
async fn run_publisher<F>(
    member: &MemberName,
    mut compute: F,
    pools: &[PoolOut],
    wakeups: &Wakeups,
    clock: Duration,
    stop: &CancellationToken,
) -> Result<(), crate::Error>
where
    F: FnMut() -> Result<Option<Vec<PoolCapacity>>, crate::Error>,
{
    let senders: Vec<_> = pools.iter().map(|p| p.tx.clone()).collect();
    let mut state = Publisher::new(pools.len(), Instant::now());
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = wakeups.changed.notified() => {}
            () = tokio::time::sleep(state.wake(clock)) => {}
        }
        let urgent = state.last_short || wakeups.demand.swap(false, Ordering::Relaxed);
        tokio::time::sleep_until(state.next_start(urgent)).await;
        let started = Instant::now();
        let Some(nexts) = compute()? else { continue };
        let short = nexts.iter().any(|n| !n.deficit().is_empty());
        for (pool, next) in pools.iter().zip(&nexts) {
            metrics().set_pool(member.as_str(), &pool.name, &next.capacity, &next.used, &next.deficit());
        }
        state.publish(&senders, nexts, Instant::now(), wakeups.wanted.load(Ordering::Relaxed));
        metrics().observe_sync("capacity", started.elapsed());
        state.computed(started, started.elapsed(), short);
    }
}

impl Session {
    /// Starts the member's watches and its capacity publisher. The caller has already
    /// checked that it answers.
    pub fn start(
        name: MemberName,
        client: Client,
        pools: &[PoolSpec],
        fingerprint: String,
        policy: CapacityPolicy,
        options: SessionOptions,
    ) -> Session {
        let cancelled = CancellationToken::new();
        let (health_tx, health) = watch::channel(Health::default());
        tokio::spawn(
            crate::health::run(client.clone(), health_tx.clone(), options.loss_timeout, cancelled.clone())
                .instrument(info_span!("member_health", member = %name)),
        );
        let modes: Vec<PoolMode> = pools.iter().map(|p| p.mode).collect();
        let caches = Caches::watch(&client, &name, &modes, policy.hpa_percent > 0, &cancelled);
        let (handles, outs): (Vec<_>, Vec<_>) = pools.iter().map(|pool| pool_channel(&name, pool)).unzip();
        let mut models: Vec<PoolModel> = pools
            .iter()
            .map(|p| PoolModel::new(p.node_selector.clone(), p.tolerations.clone(), p.mode, p.topology.clone()))
            .collect();
        let (conflict, conflict_rx) = watch::channel(None);
        let (pod_network, network_rx) = watch::channel(PodNetwork::default());
        let signals = Signals { conflict, pod_network };
        // Windows open and close with the clock, not with events.
        let clock = if policy.windows.is_empty() { Duration::from_secs(3600) } else { Duration::from_secs(1) };
        let eviction_requests = options
            .eviction_requests
            .then(|| crate::eviction_requests::EvictionAsks::watch(&client, &name, &cancelled));
        let (member, stop, wakeups) = (name.clone(), cancelled.clone(), caches.wakeups.clone());
        tokio::spawn(
            async move {
                let compute = || caches.compute(&mut models, &policy, &signals);
                if let Err(e) = run_publisher(&member, compute, &outs, &caches.wakeups, clock, &stop).await {
                    error!(error = %e, "capacity publisher stopped: the pools keep their last capacity");
                }
                for pool in &outs {
                    metrics().forget_pool(member.as_str(), &pool.name);
                }
            }
            .instrument(info_span!("capacity", member = %name)),
        );
        let handle = MemberHandle {
            name,
            client,
            namespaces: options.namespaces,
            copy_labels: options.copy_labels,
            copy_annotations: options.copy_annotations,
            max_termination_grace: options.max_termination_grace,
            gang_scheduling: options.gang_scheduling,
            confinement: options.confinement,
            pools: handles,
            cancelled,
            paused: options.paused,
            health,
            stats: options.stats,
            priority_conflict: conflict_rx,
            pod_network: network_rx,
            declared_pod_network: options.declared_pod_network,
            wakeups,
            handed_over: std::sync::atomic::AtomicBool::new(false),
            eviction_requests,
        };
        Session { handle: Arc::new(handle), fingerprint, health: health_tx, fence: options.fence }
    }
}

/// A pool's handle for consumers, and the sending side of its capacity.
fn pool_channel(member: &MemberName, pool: &PoolSpec) -> (PoolHandle, PoolOut) {
    let (tx, rx) = watch::channel(PoolCapacity::default());
    let pool_name = PoolName::new(pool.name.clone());
    let handle = PoolHandle {
        node: VirtualNodeName::for_pool(member, &pool_name),
        name: pool_name,
        node_selector: pool.node_selector.clone(),
        tolerations: pool.tolerations.clone(),
        runtime_class_names: pool.runtime_class_names.clone(),
        mode: pool.mode,
        topology: pool.topology.clone(),
        capacity: rx,
    };
    (handle, PoolOut { name: pool.name.clone(), tx })
}

impl Session {
    /// Waits until every pool's capacity has been computed once from complete watches, so
    /// nobody sees a member with an empty pool that is merely not synced yet.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let all = futures::future::join_all(self.handle.pools.iter().map(|p| {
            let mut rx = p.capacity.clone();
            async move { rx.changed().await.is_ok() }
        }));
        tokio::time::timeout(timeout, all).await.is_ok_and(|r| r.into_iter().all(|ok| ok))
    }
}

/// Creates the member PriorityClasses of the bands (below every online priority, never
/// preempting). Existing ones are left as they are: a PriorityClass value is immutable.
pub async fn bootstrap(client: &Client) -> Result<(), kube::Error> {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    use tidepool_api::keys::{self, Band};
    let api = Api::<PriorityClass>::all(client.clone());
    for band in Band::ALL {
        let pc = PriorityClass {
            metadata: kube::api::ObjectMeta {
                name: Some(band.priority_class()),
                labels: Some(BTreeMap::from([(keys::LABEL_MANAGED_BY.to_owned(), keys::MANAGED_BY.to_owned())])),
                ..Default::default()
            },
            value: Some(band.priority_value()),
            preemption_policy: Some("Never".to_owned()),
            global_default: Some(false),
            description: Some(format!(
                "tidepool offload pods of band {}: below online pods, never preempting",
                band.as_str()
            )),
        };
        match api.create(&kube::api::PostParams::default(), &pc).await {
            Ok(_) => {}
            Err(e) if crate::api_code(&e, &[409]) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether the member serves the PodGroups of `scheduler` (its CRD is installed): `Ok(false)`
/// when the API group or the resource is unknown there. Read through discovery, which every
/// authenticated identity may read, so tidepool needs no right on CRDs.
pub async fn serves_pod_groups(
    client: &Client,
    scheduler: tidepool_api::crd::GangScheduler,
) -> Result<bool, kube::Error> {
    let (group, version, plural) = scheduler.pod_group_api();
    serves(client, &format!("{group}/{version}"), plural).await
}

/// Whether `client`'s server serves resource `plural` of `group_version`, through discovery:
/// `Ok(false)` when the group, its version or the resource is unknown there.
pub async fn serves(client: &Client, group_version: &str, plural: &str) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == plural)),
        Err(e) if crate::api_code(&e, &[404]) => Ok(false),
        Err(e) => Err(e),
    }
}

/// A map of trimmed views kept in step with a watch, re-listed atomically: the views from a
/// re-list replace the old ones only once the re-list is complete. `D` is kept derived from
/// the views, told of every change ([`Derived`]).
#[derive(Debug)]
pub(crate) struct ViewCache<K, V, D = ()> {
    live: HashMap<K, V>,
    relist: Option<HashMap<K, V>>,
    /// True after the first complete list.
    pub synced: bool,
    pub derived: D,
}

/// What a [`ViewCache`] keeps derived from its views, updated with them.
pub(crate) trait Derived<K, V> {
    /// The view of `key` changed from `old` to `new` (`None`: absent).
    fn changed(&mut self, key: &K, old: Option<&V>, new: Option<&V>);
    /// A re-list replaced every view with `live`.
    fn relisted(&mut self, live: &HashMap<K, V>);
}

impl<K, V> Derived<K, V> for () {
    fn changed(&mut self, _: &K, _: Option<&V>, _: Option<&V>) {}
    fn relisted(&mut self, _: &HashMap<K, V>) {}
}

impl<V> Derived<String, V> for Touched {
    fn changed(&mut self, key: &String, _: Option<&V>, _: Option<&V>) {
        self.note(key);
    }

    fn relisted(&mut self, _: &HashMap<String, V>) {
        self.note_all();
    }
}

impl Derived<PodCapacityKey, PodView> for PodIndex {
    fn changed(&mut self, key: &PodCapacityKey, old: Option<&PodView>, new: Option<&PodView>) {
        self.change(key, old, new);
    }

    fn relisted(&mut self, live: &HashMap<PodCapacityKey, PodView>) {
        self.clear();
        for (k, v) in live {
            self.change(k, None, Some(v));
        }
    }
}

impl<K, V, D: Default> Default for ViewCache<K, V, D> {
    fn default() -> Self {
        Self::with(D::default())
    }
}

impl<K, V, D> ViewCache<K, V, D> {
    /// An empty cache keeping `derived`.
    pub fn with(derived: D) -> Self {
        Self { live: HashMap::new(), relist: None, synced: false, derived }
    }
}

impl<K: Eq + Hash, V: PartialEq, D: Derived<K, V>> ViewCache<K, V, D> {
    /// Applies one event; true when the views changed. Most events of a steady member change
    /// nothing a view keeps (a node's heartbeat, a pod's status probe): those wake no one.
    pub fn apply(&mut self, event: watcher::Event<(K, V)>) -> bool {
        match event {
            watcher::Event::Apply((k, v)) => {
                if self.live.get(&k) == Some(&v) {
                    return false;
                }
                self.derived.changed(&k, self.live.get(&k), Some(&v));
                self.live.insert(k, v);
                true
            }
            watcher::Event::Delete((k, _)) => {
                let Some(old) = self.live.remove(&k) else { return false };
                self.derived.changed(&k, Some(&old), None);
                true
            }
            watcher::Event::Init => {
                self.relist = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply((k, v)) => {
                self.relist.get_or_insert_with(HashMap::new).insert(k, v);
                false
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = self.relist.take() {
                    self.live = fresh;
                    self.derived.relisted(&self.live);
                }
                self.synced = true;
                true
            }
        }
    }
}

impl<K: Eq + Hash, V, D> ViewCache<K, V, D> {
    pub fn views(&self) -> &HashMap<K, V> {
        &self.live
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.live.values()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.live.iter()
    }

    pub fn get<Q>(&self, k: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.live.get(k)
    }
}

/// The view of one watch event; `None` for an object the view leaves out.
fn view_event<T, K, V>(event: watcher::Event<T>, view: fn(&T) -> Option<(K, V)>) -> Option<watcher::Event<(K, V)>> {
    match event {
        watcher::Event::Apply(o) => view(&o).map(watcher::Event::Apply),
        watcher::Event::Delete(o) => view(&o).map(watcher::Event::Delete),
        watcher::Event::InitApply(o) => view(&o).map(watcher::Event::InitApply),
        watcher::Event::Init => Some(watcher::Event::Init),
        watcher::Event::InitDone => Some(watcher::Event::InitDone),
    }
}

/// Keeps `cache` in step with `events` until `cancelled`, waking the capacity publisher on
/// every event that changes a view (and flagging `online_demand` changes). A poisoned cache ends the watch, with
/// an error logged: the publisher meets the same lock and stops too.
pub(crate) fn spawn_cache<T, K, V, D, S>(
    events: S,
    cache: &Arc<Mutex<ViewCache<K, V, D>>>,
    view: fn(&T) -> Option<(K, V)>,
    online_demand: fn(&V) -> bool,
    wakeups: &Wakeups,
    cancelled: &CancellationToken,
    span: tracing::Span,
) where
    S: Stream<Item = Result<watcher::Event<T>, watcher::Error>> + Send + 'static,
    T: Send + 'static,
    K: Eq + Hash + Send + 'static,
    V: PartialEq + Send + 'static,
    D: Derived<K, V> + Send + 'static,
{
    let (cache, wakeups) = (cache.clone(), wakeups.clone());
    let mut events = Box::pin(events.take_until(cancelled.clone().cancelled_owned()));
    tokio::spawn(
        async move {
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(e) => {
                        warn!(error = %e, "member watch failed; retrying with backoff");
                        continue;
                    }
                };
                let Some(e) = view_event(event, view) else { continue };
                let demand =
                    matches!(&e, watcher::Event::Apply((_, v)) | watcher::Event::Delete((_, v)) if online_demand(v));
                let changed = match cache.locked("member view") {
                    Ok(mut c) => c.apply(e),
                    Err(e) => {
                        error!(error = %e, "member watch stopped");
                        return;
                    }
                };
                if changed {
                    if demand {
                        wakeups.demand.store(true, Ordering::Relaxed);
                    }
                    wakeups.changed.notify_one();
                }
            }
        }
        .instrument(span),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::OnlineParts;

    #[test]
    fn hpa_headroom_counts_from_the_replicas_already_asked_for() {
        let target: WorkloadKey = ("ns".into(), "Deployment".into(), "web".into());
        let mut hpas = ViewCache::default();
        let hpa = HpaRef { target: target.clone(), max_replicas: 5, current_replicas: 1 };
        hpas.apply(watcher::Event::Apply((("ns".into(), "HPA".into(), "web".into()), hpa)));
        let mut templates = ViewCache::default();
        let template = |replicas| Template {
            per_replica: Resources::new(),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            replicas,
        };
        templates.apply(watcher::Event::Apply((target.clone(), template(1))));
        // The HPA may still grow by 4 replicas.
        assert_eq!(join_hpas(&hpas, &templates)[0].current_replicas, 1);
        // The Deployment was scaled to 5 before the HPA's status says so: its 4 new pods are
        // pending online demand already (or replicas to come), and no headroom is left to
        // hold back for them again.
        templates.apply(watcher::Event::Apply((target, template(5))));
        assert_eq!(join_hpas(&hpas, &templates)[0].current_replicas, 5);
    }

    #[test]
    fn replicas_to_come_are_those_asked_for_beyond_the_pods_that_exist() {
        let gpu = |n: &str| Resources::from_pairs([("nvidia.com/gpu", n)]).unwrap();
        let mut templates = ViewCache::default();
        let template = |replicas| Template {
            per_replica: gpu("2"),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            replicas,
        };
        let web: WorkloadKey = ("online".into(), "Deployment".into(), "web".into());
        let db: WorkloadKey = ("online".into(), "StatefulSet".into(), "db".into());
        templates.apply(watcher::Event::Apply((web, template(5))));
        templates.apply(watcher::Event::Apply((db, template(2))));
        let pod = |ns: &str, name: &str, workload: Option<(&'static str, &str)>, terminated: bool| {
            let online = OnlineParts::boxed(BTreeMap::new(), Vec::new(), workload.map(|(k, n)| (k, n.into())));
            let view = PodView { online, terminated, ..Default::default() };
            ((ns.to_owned(), name.to_owned()), view)
        };
        let pods = [
            // web: one running, one pending, one ended (its replacement is to come).
            pod("online", "web-1", Some(("Deployment", "web")), false),
            pod("online", "web-2", Some(("Deployment", "web")), false),
            pod("online", "web-3", Some(("Deployment", "web")), true),
            // db has both its pods; a same-named Deployment elsewhere is not it.
            pod("online", "db-0", Some(("StatefulSet", "db")), false),
            pod("online", "db-1", Some(("StatefulSet", "db")), false),
            pod("other", "web-1", Some(("Deployment", "web")), false),
        ];
        let mut index = PodIndex::new([PoolMode::Requests], offload_ceiling());
        for (k, v) in &pods {
            index.change(k, None, Some(v));
        }
        let to_come = replicas_to_come(&templates, &index);
        assert_eq!(to_come.len(), 1);
        assert_eq!((to_come[0].replicas, &to_come[0].per_replica), (3, &gpu("2")));
        // No workloads known: nothing to come.
        assert!(replicas_to_come(&ViewCache::default(), &index).is_empty());
    }

    fn pool(cpu: &str, gpus: &str, used_gpus: &str) -> PoolCapacity {
        PoolCapacity {
            capacity: Resources::from_pairs([("cpu", cpu), ("nvidia.com/gpu", gpus)]).unwrap(),
            used: Resources::from_pairs([("nvidia.com/gpu", used_gpus)]).unwrap(),
            nodes: 1,
            ..Default::default()
        }
    }

    #[test]
    fn a_pool_publishes_what_matters_at_once_and_lets_drift_wait() {
        let published = pool("100", "8", "2");
        let recent = Duration::from_millis(100);
        let cases = [
            ("the same capacity is not sent again", published.clone(), recent, Publication::Unchanged),
            ("a GPU freed goes out at once", pool("100", "8", "1"), recent, Publication::Publish),
            ("a cpu drift under 1% waits", pool("100.5", "8", "2"), recent, Publication::Defer),
            ("a cpu change over 1% goes out at once", pool("102", "8", "2"), recent, Publication::Publish),
            (
                "a drift goes out once the pool has been quiet long enough",
                pool("100.5", "8", "2"),
                PUBLISH_MAX_INTERVAL,
                Publication::Publish,
            ),
            ("a new deficit goes out at once", pool("100", "8", "9"), recent, Publication::Publish),
        ];
        for (name, next, since, want) in cases {
            assert_eq!(publication(&published, &next, since, false), want, "{name}");
        }
    }

    #[test]
    fn while_a_gang_waits_room_that_grows_goes_out_at_once() {
        let published = pool("100", "8", "2");
        let recent = Duration::from_millis(100);
        let cases = [
            ("more cpu, however little", pool("100.5", "8", "2"), Publication::Publish),
            ("less cpu still waits", pool("99.5", "8", "2"), Publication::Defer),
            ("the same is not sent again", published.clone(), Publication::Unchanged),
        ];
        for (name, next, want) in cases {
            assert_eq!(publication(&published, &next, recent, true), want, "{name}");
        }
    }

    #[test]
    fn a_waiting_drift_wakes_the_publisher_sooner() {
        let mut state = Publisher::new(2, Instant::now());
        let clock = Duration::from_secs(3600);
        assert_eq!(state.wake(clock), clock);
        state.deferred[1] = true;
        assert_eq!(state.wake(clock), PUBLISH_MAX_INTERVAL);
        // Whichever comes first: windows tick, or the drift's wait ends.
        assert_eq!(state.wake(Duration::from_millis(200)), Duration::from_millis(200));
    }

    /// A capacity publisher of one pool whose watches are a value the test sets.
    struct Bench {
        input: Arc<Mutex<Option<Vec<PoolCapacity>>>>,
        wakeups: Wakeups,
        rx: watch::Receiver<PoolCapacity>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<Result<(), crate::Error>>,
    }

    impl Bench {
        fn start() -> Bench {
            let (tx, rx) = watch::channel(PoolCapacity::default());
            let input: Arc<Mutex<Option<Vec<PoolCapacity>>>> = Arc::default();
            let (wakeups, stop) = (Wakeups::default(), CancellationToken::new());
            let (i, w, s) = (input.clone(), wakeups.clone(), stop.clone());
            let task = tokio::spawn(async move {
                let pools = [PoolOut { name: "gpu".into(), tx }];
                let member = MemberName::new("bench".to_owned());
                run_publisher(&member, || Ok(i.lock().unwrap().clone()), &pools, &w, Duration::from_secs(3600), &s)
                    .await
            });
            Bench { input, wakeups, rx, stop, task }
        }

        /// The watches now show `capacity`; `demand`: an online demand change among them.
        fn set(&self, capacity: PoolCapacity, demand: bool) {
            *self.input.lock().unwrap() = Some(vec![capacity]);
            if demand {
                self.wakeups.demand.store(true, Ordering::Relaxed);
            }
            self.wakeups.changed.notify_one();
        }

        /// The next published capacity, and how long (in paused time) it took from now.
        /// Bounded: a publication that never comes fails the test.
        async fn next(&mut self) -> (PoolCapacity, Duration) {
            let since = Instant::now();
            let limit = Duration::from_secs(4 * 3600);
            tokio::time::timeout(limit, self.rx.changed()).await.expect("nothing published").unwrap();
            (self.rx.borrow_and_update().clone(), since.elapsed())
        }

        /// Publishes `capacity` as the first result, then lets the publisher rest.
        async fn settled(&mut self, capacity: PoolCapacity) {
            self.set(capacity.clone(), false);
            assert_eq!(self.next().await.0, capacity);
            tokio::time::sleep(Duration::from_secs(60)).await;
        }

        async fn stop(self) {
            self.stop.cancel();
            self.task.await.unwrap().unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_goes_out_before_the_watches_are_synced_then_the_first_result_does() {
        let mut bench = Bench::start();
        bench.wakeups.changed.notify_one();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap(), "not synced: nothing published");
        // The first result goes out even though it equals the channel's initial value.
        bench.set(PoolCapacity::default(), false);
        assert_eq!(bench.next().await, (PoolCapacity::default(), Duration::ZERO));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_after_a_quiet_spell_goes_out_at_once() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await, (pool("100", "8", "3"), Duration::ZERO));
        // The same capacity again: nothing is sent.
        bench.set(pool("100", "8", "3"), false);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap());
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_coalesced_into_one_computation_after_the_spacing() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        // Two more changes right after: one computation, COALESCE after the last, sees the
        // later of them.
        bench.set(pool("100", "8", "4"), false);
        bench.set(pool("100", "8", "5"), false);
        assert_eq!(bench.next().await, (pool("100", "8", "5"), COALESCE));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap(), "the burst cost one publication");
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_drift_waits_for_the_publication_interval() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        // Computed after the spacing, deferred as a drift, published when the wake-up for
        // waiting drifts comes.
        bench.set(pool("100.5", "8", "3"), false);
        assert_eq!(bench.next().await, (pool("100.5", "8", "3"), COALESCE + PUBLISH_MAX_INTERVAL));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn moving_online_demand_shortens_the_spacing() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        bench.set(pool("100", "6", "3"), true);
        assert_eq!(bench.next().await, (pool("100", "6", "3"), COALESCE_SHORT));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_pool_goes_out_at_once_and_keeps_the_spacing_short() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        // Online demand took GPUs offload pods use: the deficit goes out at once.
        bench.set(pool("100", "1", "2"), false);
        assert_eq!(bench.next().await, (pool("100", "1", "2"), Duration::ZERO));
        // While short, the next change follows after the short spacing, demand flag or not.
        bench.set(pool("100", "0", "2"), false);
        assert_eq!(bench.next().await, (pool("100", "0", "2"), COALESCE_SHORT));
        bench.stop().await;
    }

    #[test]
    fn a_costly_computation_waits_longer_for_the_next() {
        assert_eq!(coalesce_after(Duration::from_millis(1), false), COALESCE);
        assert_eq!(coalesce_after(Duration::from_millis(30), false), Duration::from_millis(300));
        assert_eq!(coalesce_after(Duration::from_secs(5), false), COALESCE_MAX);
        // Online demand moving (a pool short, an HPA or workload changed): the next
        // computation follows sooner, cost permitting.
        assert_eq!(coalesce_after(Duration::from_millis(1), true), COALESCE_SHORT);
        assert_eq!(coalesce_after(Duration::from_millis(30), true), Duration::from_millis(300));
    }

    #[test]
    fn only_events_that_change_a_view_wake_the_publisher() {
        let mut c = ViewCache::<&str, u32>::default();
        assert!(!c.apply(watcher::Event::Init));
        assert!(!c.apply(watcher::Event::InitApply(("a", 1))));
        assert!(c.apply(watcher::Event::InitDone), "the first list is news");
        // A node's heartbeat or a pod's probe: the object changed, its view did not.
        assert!(!c.apply(watcher::Event::Apply(("a", 1))));
        assert!(c.apply(watcher::Event::Apply(("a", 2))));
        assert!(c.apply(watcher::Event::Apply(("b", 1))));
        assert!(c.apply(watcher::Event::Delete(("b", 1))));
        assert!(!c.apply(watcher::Event::Delete(("b", 1))), "already gone");
    }

    #[test]
    fn a_relist_replaces_the_cache_only_when_complete() {
        let mut c = ViewCache::<&str, u32>::default();
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(("a", 1)));
        c.apply(watcher::Event::InitDone);
        assert!(c.synced);
        c.apply(watcher::Event::Apply(("b", 2)));
        c.apply(watcher::Event::Init);
        c.apply(watcher::Event::InitApply(("c", 3)));
        // The old view stays visible while the re-list runs.
        assert_eq!(c.values().count(), 2);
        c.apply(watcher::Event::InitDone);
        assert_eq!(c.values().copied().collect::<Vec<_>>(), vec![3]);
        c.apply(watcher::Event::Delete(("c", 0)));
        assert_eq!(c.values().count(), 0);
    }
}
