//! One connected member: its client, its watches, and the capacity of its pools.
//!
//! A [`Session`] lives as long as the member's credentials and spec stay the same. Its
//! watches keep only what the capacity model needs ([`NodeView`], [`PodView`]), so a member
//! with thousands of nodes and pods costs little memory. Dropping the session stops them.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tidepool_config::crd::{PoolSpec, PoolToleration};
use tidepool_config::{MemberName, PoolName, VirtualNodeName};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use tidepool_config::Resources;
use tidepool_config::metrics::metrics;

use crate::capacity::{
    CapacityPolicy, HpaView, NodeView, OnlineDemand, PUBLISH_MAX_INTERVAL, PodCapacityKey, PodView, PoolCapacity,
    ReplicasToCome, pod_requests, pool_capacity_under, worth_publishing,
};
use crate::health::Health;
use crate::priority::{PriorityConflict, offload_ceiling, priority_conflict};

/// Namespace, kind and name of an HPA's scale target.
type WorkloadKey = (String, String, String);

/// An HPA as the capacity model needs it: its target and how far it may still grow.
#[derive(Debug, Clone)]
struct HpaRef {
    target: WorkloadKey,
    max_replicas: i32,
    current_replicas: i32,
}

/// A workload's pod template, reduced to what one replica requests and where it may land.
#[derive(Debug, Clone)]
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
    template: Option<&PodTemplateSpec>,
    replicas: Option<i32>,
) -> Option<(WorkloadKey, Template)> {
    let spec = template?.spec.as_ref()?;
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

/// Per workload, the replicas it asks for beyond the pods it has (those not ended): pods its
/// controller is about to create, to hold room for before they exist (see
/// [`ReplicasToCome`]). One pass over the member's pods.
fn replicas_to_come<'a>(
    templates: &ViewCache<WorkloadKey, Template>,
    pods: impl Iterator<Item = (&'a PodCapacityKey, &'a PodView)>,
) -> Vec<ReplicasToCome> {
    if templates.values().next().is_none() {
        return Vec::new();
    }
    let mut existing: HashMap<(&str, &str, &str), i32> = HashMap::new();
    for ((ns, _), p) in pods {
        if let Some((kind, name)) = &p.workload
            && !p.terminated
        {
            *existing.entry((ns.as_str(), kind, name)).or_default() += 1;
        }
    }
    templates
        .iter()
        .filter_map(|((ns, kind, name), t)| {
            let have = existing.get(&(ns.as_str(), kind.as_str(), name.as_str())).copied().unwrap_or(0);
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
    /// Prefix of offload namespaces in this member.
    pub namespace_prefix: String,
    /// `spec.copyLabels` and `spec.copyAnnotations`: what of a training pod's metadata its
    /// copy carries besides tidepool's own.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`: per-band bounds on the copies' grace.
    pub max_termination_grace: tidepool_config::crd::TerminationGraceLimits,
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
    pub capacity: watch::Receiver<PoolCapacity>,
}

impl std::fmt::Debug for MemberHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberHandle").field("name", &self.name).field("pools", &self.pools).finish_non_exhaustive()
    }
}

impl MemberHandle {
    pub fn pool_for_node(&self, node: &str) -> Option<&PoolHandle> {
        self.pools.iter().find(|p| p.node.as_str() == node)
    }
}

/// Settings of a session that come from its `MemberCluster` and the bridge config.
#[derive(Debug, Clone)]
pub(crate) struct SessionOptions {
    /// Prefix of offload namespaces in the member.
    pub namespace_prefix: String,
    /// `spec.copyLabels`, `spec.copyAnnotations`.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`.
    pub max_termination_grace: tidepool_config::crd::TerminationGraceLimits,
    /// `spec.paused`.
    pub paused: bool,
    /// `memberLossTimeoutSeconds`: unreachable this long, the member counts as lost.
    pub loss_timeout: Duration,
    /// Counters of the client's throttle layer.
    pub stats: Arc<crate::MemberStats>,
}

/// Owns the watch tasks of one member; dropping it stops them.
#[derive(Debug)]
pub(crate) struct Session {
    pub handle: Arc<MemberHandle>,
    pub fingerprint: String,
    pub health: watch::Sender<Health>,
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

impl Session {
    /// Starts the member's watches. The caller has already checked that it answers.
    pub fn start(
        name: MemberName,
        client: Client,
        pools: &[PoolSpec],
        fingerprint: String,
        policy: CapacityPolicy,
        options: SessionOptions,
    ) -> Session {
        let SessionOptions {
            namespace_prefix,
            copy_labels,
            copy_annotations,
            max_termination_grace,
            paused,
            loss_timeout,
            stats,
        } = options;
        let cancelled = CancellationToken::new();
        let (health_tx, health) = watch::channel(Health::default());
        tokio::spawn(
            crate::health::run(client.clone(), health_tx.clone(), loss_timeout, cancelled.clone())
                .instrument(info_span!("member_health", member = %name)),
        );
        let changed = Arc::new(Notify::new());
        // Set with `changed` by a change of online demand (see [`coalesce_after`]).
        let demand = Arc::new(AtomicBool::new(false));
        let nodes = Arc::new(std::sync::Mutex::new(ViewCache::<String, NodeView>::default()));
        let pods = Arc::new(std::sync::Mutex::new(ViewCache::<PodCapacityKey, PodView>::default()));

        let node_events = watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).default_backoff();
        spawn_cache(
            node_events,
            nodes.clone(),
            |n: &Node| Some((n.name_any(), NodeView::from_node(n))),
            |_| false,
            (changed.clone(), demand.clone()),
            cancelled.clone(),
            info_span!("member_nodes", member = %name),
        );
        let pod_events = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()).default_backoff();
        spawn_cache(
            pod_events,
            pods.clone(),
            |p: &Pod| Some(((p.namespace().unwrap_or_default(), p.name_any()), PodView::from_pod(p))),
            PodView::pending_online,
            (changed.clone(), demand.clone()),
            cancelled.clone(),
            info_span!("member_pods", member = %name),
        );

        // HPAs and the pod templates of their targets, for the HPA headroom.
        let hpas = Arc::new(std::sync::Mutex::new(ViewCache::<WorkloadKey, HpaRef>::default()));
        let templates = Arc::new(std::sync::Mutex::new(ViewCache::<WorkloadKey, Template>::default()));
        if policy.hpa_percent > 0 {
            let hpa_events = watcher(Api::<HorizontalPodAutoscaler>::all(client.clone()), watcher::Config::default())
                .default_backoff();
            spawn_cache(
                hpa_events,
                hpas.clone(),
                hpa_view,
                |_| true,
                (changed.clone(), demand.clone()),
                cancelled.clone(),
                info_span!("member_hpas", member = %name),
            );
            let deployments =
                watcher(Api::<Deployment>::all(client.clone()), watcher::Config::default()).default_backoff();
            spawn_cache(
                deployments,
                templates.clone(),
                |d: &Deployment| {
                    let spec = d.spec.as_ref();
                    template_view("Deployment", d.namespace(), d.name_any(), spec.map(|s| &s.template), spec?.replicas)
                },
                |_| true,
                (changed.clone(), demand.clone()),
                cancelled.clone(),
                info_span!("member_deployments", member = %name),
            );
            let sets = watcher(Api::<StatefulSet>::all(client.clone()), watcher::Config::default()).default_backoff();
            spawn_cache(
                sets,
                templates.clone(),
                |d: &StatefulSet| {
                    let spec = d.spec.as_ref();
                    template_view("StatefulSet", d.namespace(), d.name_any(), spec.map(|s| &s.template), spec?.replicas)
                },
                |_| true,
                (changed.clone(), demand.clone()),
                cancelled.clone(),
                info_span!("member_statefulsets", member = %name),
            );
        }

        let mut senders = Vec::new();
        let mut handles = Vec::new();
        for pool in pools {
            let (tx, rx) = watch::channel(PoolCapacity::default());
            let pool_name = PoolName::new(pool.name.clone());
            handles.push(PoolHandle {
                node: VirtualNodeName::for_pool(&name, &pool_name),
                name: pool_name,
                node_selector: pool.node_selector.clone(),
                tolerations: pool.tolerations.clone(),
                runtime_class_names: pool.runtime_class_names.clone(),
                capacity: rx,
            });
            senders.push((pool.name.clone(), (pool.node_selector.clone(), pool.tolerations.clone()), tx));
        }

        let (conflict_tx, conflict_rx) = watch::channel(None);
        let stop = cancelled.clone();
        let member = name.clone();
        // Windows open and close with the clock, not with events.
        let clock = if policy.windows.is_empty() { Duration::from_secs(3600) } else { Duration::from_secs(1) };
        tokio::spawn(
            async move {
                let mut computed = false;
                // When each pool last published, and whether a small change is waiting.
                let mut published = vec![tokio::time::Instant::now(); senders.len()];
                let mut deferred = vec![false; senders.len()];
                // When the last computation started, what it cost, and whether it found a pool
                // short (see [`coalesce_after`]).
                let mut last = (tokio::time::Instant::now(), Duration::ZERO, false);
                loop {
                    let wake = if deferred.iter().any(|d| *d) { PUBLISH_MAX_INTERVAL.min(clock) } else { clock };
                    tokio::select! {
                        () = stop.cancelled() => {
                            for (pool, _, _) in &senders {
                                metrics().forget_pool(member.as_str(), pool);
                            }
                            return;
                        }
                        () = changed.notified() => {}
                        () = tokio::time::sleep(wake) => {}
                    }
                    let (last_started, last_cost, last_short) = last;
                    let urgent = last_short || demand.swap(false, Ordering::Relaxed);
                    tokio::time::sleep_until(last_started + coalesce_after(last_cost, urgent)).await;
                    let started = std::time::Instant::now();
                    let hpa_views = match (hpas.lock(), templates.lock()) {
                        (Ok(h), Ok(t)) => join_hpas(&h, &t),
                        _ => Vec::new(),
                    };
                    // Computed under the caches' locks, from the views in place: a large
                    // member's pods are not copied for it.
                    let nexts: Vec<PoolCapacity> = match (nodes.lock(), pods.lock()) {
                        (Ok(n), Ok(p)) if n.synced && p.synced => {
                            let to_come = match templates.lock() {
                                Ok(t) => replicas_to_come(&t, p.iter()),
                                Err(_) => Vec::new(),
                            };
                            let demand = OnlineDemand {
                                policy: &policy,
                                hpas: &hpa_views,
                                to_come: &to_come,
                                now: jiff::Timestamp::now(),
                            };
                            let conflict = priority_conflict(p.iter(), offload_ceiling());
                            conflict_tx.send_if_modified(|cur| {
                                let changed = *cur != conflict;
                                *cur = conflict;
                                changed
                            });
                            senders
                                .iter()
                                .map(|(_, (selector, tolerations), _)| {
                                    let nodes = n.values().filter(|node| node.tolerated_by(tolerations));
                                    pool_capacity_under(nodes, p.values(), selector, &demand)
                                })
                                .collect()
                        }
                        _ => continue,
                    };
                    let short = nexts.iter().any(|n| !n.deficit().is_empty());
                    let first = !computed;
                    computed = true;
                    for (i, ((pool, _, tx), next)) in senders.iter().zip(nexts).enumerate() {
                        metrics().set_pool(member.as_str(), pool, &next.capacity, &next.used, &next.deficit());
                        if first {
                            // Always announce the first result: consumers wait for it.
                            tx.send_replace(next);
                            continue;
                        }
                        let now = tokio::time::Instant::now();
                        let overdue = now.duration_since(published[i]) >= PUBLISH_MAX_INTERVAL;
                        let sent = tx.send_if_modified(|cur| {
                            if *cur == next {
                                deferred[i] = false;
                                return false;
                            }
                            if !overdue && !worth_publishing(cur, &next) {
                                deferred[i] = true;
                                return false;
                            }
                            debug!(capacity = %next.capacity, used = %next.used, nodes = next.nodes, "pool capacity changed");
                            *cur = next;
                            true
                        });
                        if sent {
                            published[i] = now;
                            deferred[i] = false;
                        }
                    }
                    metrics().observe_sync("capacity", started.elapsed());
                    last = (tokio::time::Instant::from_std(started), started.elapsed(), short);
                }
            }
            .instrument(info_span!("capacity", member = %name)),
        );

        Session {
            handle: Arc::new(MemberHandle {
                name,
                client,
                namespace_prefix,
                copy_labels,
                copy_annotations,
                max_termination_grace,
                pools: handles,
                cancelled,
                paused,
                health,
                stats,
                priority_conflict: conflict_rx,
            }),
            fingerprint,
            health: health_tx,
        }
    }
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
    use tidepool_config::keys::{self, Band};
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

/// A map of trimmed views kept in step with a watch, re-listed atomically: the views from a
/// re-list replace the old ones only once the re-list is complete.
#[derive(Debug)]
pub(crate) struct ViewCache<K, V> {
    live: HashMap<K, V>,
    relist: Option<HashMap<K, V>>,
    /// True after the first complete list.
    pub synced: bool,
}

impl<K, V> Default for ViewCache<K, V> {
    fn default() -> Self {
        Self { live: HashMap::new(), relist: None, synced: false }
    }
}

impl<K: Eq + Hash, V> ViewCache<K, V> {
    pub fn apply(&mut self, event: watcher::Event<(K, V)>) {
        match event {
            watcher::Event::Apply((k, v)) => {
                self.live.insert(k, v);
            }
            watcher::Event::Delete((k, _)) => {
                self.live.remove(&k);
            }
            watcher::Event::Init => self.relist = Some(HashMap::new()),
            watcher::Event::InitApply((k, v)) => {
                self.relist.get_or_insert_with(HashMap::new).insert(k, v);
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = self.relist.take() {
                    self.live = fresh;
                }
                self.synced = true;
            }
        }
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.live.values()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.live.iter()
    }

    pub fn get(&self, k: &K) -> Option<&V> {
        self.live.get(k)
    }
}

fn spawn_cache<T, K, V, S>(
    events: S,
    cache: Arc<std::sync::Mutex<ViewCache<K, V>>>,
    view: fn(&T) -> Option<(K, V)>,
    online_demand: fn(&V) -> bool,
    (changed, demand): (Arc<Notify>, Arc<AtomicBool>),
    cancelled: CancellationToken,
    span: tracing::Span,
) where
    S: Stream<Item = Result<watcher::Event<T>, watcher::Error>> + Send + 'static,
    T: Send + 'static,
    K: Eq + Hash + Send + 'static,
    V: Send + 'static,
{
    tokio::spawn(
        async move {
            let mut events = std::pin::pin!(events.take_until(cancelled.cancelled_owned()));
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        let mapped = match event {
                            watcher::Event::Apply(o) => view(&o).map(watcher::Event::Apply),
                            watcher::Event::Delete(o) => view(&o).map(watcher::Event::Delete),
                            watcher::Event::InitApply(o) => view(&o).map(watcher::Event::InitApply),
                            watcher::Event::Init => Some(watcher::Event::Init),
                            watcher::Event::InitDone => Some(watcher::Event::InitDone),
                        };
                        if let Some(e) = mapped {
                            if let watcher::Event::Apply((_, v)) | watcher::Event::Delete((_, v)) = &e
                                && online_demand(v)
                            {
                                demand.store(true, Ordering::Relaxed);
                            }
                            if let Ok(mut c) = cache.lock() {
                                c.apply(e);
                            }
                        }
                        changed.notify_one();
                    }
                    Err(e) => warn!(error = %e, "member watch failed; retrying with backoff"),
                }
            }
        }
        .instrument(span),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let view = PodView { workload: workload.map(|(k, n)| (k, n.into())), terminated, ..Default::default() };
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
        let to_come = replicas_to_come(&templates, pods.iter().map(|(k, v)| (k, v)));
        assert_eq!(to_come.len(), 1);
        assert_eq!((to_come[0].replicas, &to_come[0].per_replica), (3, &gpu("2")));
        // No workloads known: nothing to come, and the pods are not even counted.
        assert!(replicas_to_come(&ViewCache::default(), pods.iter().map(|(k, v)| (k, v))).is_empty());
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
