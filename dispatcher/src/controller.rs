//! The dispatcher's scheduling loop: the I/O around [`crate::plan`] and [`crate::order`].
//!
//! One round: (1) read every pending `schedulerName: tidepool` pod and every pod on a
//! virtual node from the cache; (2) build each pool's view from federation's capacity,
//! minus the pods bound there but not yet visible in the member ("in flight"); (3) group
//! pods into gangs and order them; (4) admit each gang whole on one pool — record the
//! placement on every core pod, then bind — or explain why not; (5) admit elastic pods one
//! by one to their gang's pool. All state is re-derived from the API each round, so a
//! restarted dispatcher continues where the last one stopped.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tidepool_config::keys::{self, Band};
use tidepool_config::metrics::{PlacementLabels, metrics};
use tidepool_config::pod::PodLite;
use tidepool_config::{BridgeConfig, Resources};
use tidepool_federation::writes::CopyWriter;
use tidepool_federation::{Members, TrainingPods};
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};

use crate::gang::{self, BandRanges, GangKey, GangSource};
use crate::order::{QueueEntry, admission_order};
use crate::plan::{self, GangDemand, PoolView};

/// A round runs at least this often, so capacity that frees up is noticed.
const TICK: Duration = Duration::from_secs(2);
/// Coalesces bursts of pod events into one round.
const COALESCE: Duration = Duration::from_millis(50);
/// Longest wait before a round after a change.
const COALESCE_MAX: Duration = Duration::from_millis(500);
/// Pods of one gang labelled and bound at once.
const BIND_CONCURRENCY: usize = 16;
/// How long a PodGroup's `minMember` is cached.
const POD_GROUP_TTL: Duration = Duration::from_secs(5);

pub(crate) struct Context {
    pub(crate) training: Client,
    pub(crate) config: Arc<BridgeConfig>,
    scheduler_name: String,
    ranges: BandRanges,
    pub(crate) members: watch::Receiver<Members>,
    pub(crate) pods: Store<PodLite>,
    /// Asks vk-provider, the one writer of offload copies, to free a reclaimed pod's copy.
    pub(crate) copies: CopyWriter,
    recorder: Recorder,
    pod_groups: moka::future::Cache<(GangSource, String), Result<u32, String>>,
    /// Last Unschedulable message per pod UID, so an unchanged reason is not rewritten.
    explained: std::sync::Mutex<HashMap<String, String>>,
    /// Gangs above band `low` that found no room in the last round: reclaim may preempt
    /// lower-band pods for them.
    pub(crate) preempt: std::sync::Mutex<Vec<PreemptRequest>>,
    /// Writes to the training API so far (bindings, placements, Events): a pass that wrote
    /// is followed at once, one that only read is paced by its cost.
    pub(crate) writes: std::sync::atomic::AtomicUsize,
}

impl Context {
    pub(crate) fn wrote(&self) {
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn writes(&self) -> usize {
        self.writes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How long to wait before the next pass of a loop over every training pod: right away
/// (`least`) after a pass that wrote, since what it wrote brings changes to act on; else
/// ten times the pass's cost, so a large cluster costs at most about a tenth of a core,
/// between `least` and `most`.
pub(crate) fn pacing(cost: Duration, wrote: bool, least: Duration, most: Duration) -> Duration {
    if wrote { least } else { cost.saturating_mul(10).clamp(least, most) }
}

/// A pending gang that lower-band pods could make room for.
#[derive(Debug, Clone)]
pub(crate) struct PreemptRequest {
    pub gang: String,
    pub band: Band,
    /// Requests of its whole core.
    pub demand: Resources,
}

/// Runs the dispatcher until the runtime stops.
pub async fn run(
    training: Client,
    config: Arc<BridgeConfig>,
    members: watch::Receiver<Members>,
    training_pods: TrainingPods,
    copies: CopyWriter,
) {
    let pods = training_pods.store();
    let changed = Arc::new(Notify::new());
    let notify = changed.clone();
    // Any change of any training pod (the cache is shared with the pod sync) starts a round.
    let events = training_pods.subscribe();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while events.next().await.is_some() {
            notify.notify_one();
        }
    });
    let ctx = Context {
        config: config.clone(),
        recorder: Recorder::new(
            training.clone(),
            Reporter { controller: "tidepool-dispatcher".into(), instance: None },
        ),
        training,
        scheduler_name: config.dispatcher.scheduler_name.clone(),
        ranges: BandRanges::default(),
        members: members.clone(),
        pods,
        copies,
        pod_groups: moka::future::Cache::builder().time_to_live(POD_GROUP_TTL).max_capacity(10_000).build(),
        explained: std::sync::Mutex::new(HashMap::new()),
        preempt: std::sync::Mutex::new(Vec::new()),
        writes: std::sync::atomic::AtomicUsize::new(0),
    };
    training_pods.listed().await;
    let ctx = Arc::new(ctx);
    tokio::spawn(crate::reclaim::run(ctx.clone()));
    let mut members = members;
    loop {
        let (started, writes) = (std::time::Instant::now(), ctx.writes());
        round(&ctx).await;
        let cost = started.elapsed();
        metrics().observe_sync("dispatch", cost);
        tokio::select! {
            () = changed.notified() => {}
            r = members.changed() => if r.is_err() { return },
            () = tokio::time::sleep(TICK) => {}
        }
        // A round reads every training pod (see [`pacing`]).
        tokio::time::sleep(pacing(cost, ctx.writes() != writes, COALESCE, COALESCE_MAX)).await;
    }
}

/// A gang as seen in one round.
#[derive(Debug, Default)]
struct GangState {
    pods: Vec<Arc<PodLite>>,
    /// Virtual node recorded on any of its pods (annotation or binding).
    pinned: Option<String>,
    /// Pods of the gang that completed: they count as having run.
    succeeded: usize,
}

pub(crate) fn requests(p: &PodLite) -> Resources {
    p.spec.requests.clone()
}

fn placement_of(p: &PodLite) -> Option<&str> {
    p.annotations().get(keys::ANNOTATION_PLACEMENT).map(String::as_str).or_else(|| p.node_name())
}

async fn round(ctx: &Context) {
    let all = ctx.pods.state();
    // 1–2. Pool views, with in-flight pods simulated onto them.
    let mut pools = pool_views(ctx, &all);

    // 3. Gangs of our pods.
    let mut gangs: BTreeMap<GangKey, GangState> = BTreeMap::new();
    for p in all.iter() {
        if p.spec.scheduler_name.as_deref() != Some(ctx.scheduler_name.as_str()) {
            continue;
        }
        if !p.is_live() {
            if p.status.phase.as_deref() == Some("Succeeded") {
                gangs.entry(gang::gang_of(p)).or_default().succeeded += 1;
            }
            continue;
        }
        let g = gangs.entry(gang::gang_of(p)).or_default();
        if g.pinned.is_none() {
            g.pinned = placement_of(p).map(str::to_owned);
        }
        g.pods.push(p.clone());
    }
    // A placed gang whose core is not running within its timeout is rolled back whole.
    for (key, g) in &gangs {
        if let Some(msg) = timed_out(ctx, key, g).await {
            roll_back(ctx, g, &msg).await;
        }
    }
    // A gang whose core pod failed is stopped whole; its new pods wait until it has stopped.
    let restarting = crate::restart::run(ctx, &all).await;
    gangs.retain(|key, _| !restarting.contains(key));
    gangs.retain(|_, g| g.pods.iter().any(|p| p.node_name().is_none()));
    metrics().gangs_waiting.set(i64::try_from(gangs.len()).unwrap_or(i64::MAX));
    if gangs.is_empty() {
        return;
    }

    let mut queue = Vec::new();
    let mut mins = HashMap::new();
    for (key, g) in &gangs {
        let min = match min_member(ctx, key, &g.pods).await {
            Ok(m) => m,
            Err(msg) => {
                let waiting: Vec<Arc<PodLite>> = g.pods.iter().filter(|p| p.node_name().is_none()).cloned().collect();
                explain(ctx, waiting, &msg).await;
                continue;
            }
        };
        mins.insert(key.clone(), min);
        let bound = g.pods.iter().filter(|p| p.node_name().is_some()).count() as u32;
        let priority = g.pods.iter().filter_map(|p| p.spec.priority).max().unwrap_or(0);
        let created = g
            .pods
            .iter()
            .filter_map(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()))
            .min()
            .unwrap_or(0);
        queue.push(QueueEntry {
            key: key.to_string(),
            band: gang::band_for(Some(priority).filter(|p| *p != 0), true, &ctx.ranges),
            priority,
            min,
            max: (g.pods.len() as u32).max(min),
            current: bound,
            created,
        });
    }
    admission_order(&mut queue);
    metrics().set_queue_depth("gangs", queue.len());
    let by_name: HashMap<String, GangKey> = gangs.keys().map(|k| (k.to_string(), k.clone())).collect();

    // 4–5. Admit in order.
    let mut preempt = Vec::new();
    for entry in queue {
        let Some(key) = by_name.get(&entry.key) else { continue };
        let Some(g) = gangs.get(key) else { continue };
        let min = mins.get(key).copied().unwrap_or(1) as usize;
        if let Some(demand) = admit(ctx, key, g, min, &mut pools).await
            && entry.band > Band::Low
        {
            preempt.push(PreemptRequest { gang: key.to_string(), band: entry.band, demand });
        }
    }
    if let Ok(mut p) = ctx.preempt.lock() {
        *p = preempt;
    }
}

/// Builds the view of every offered pool: federation's capacity minus the pods bound to its
/// virtual node that the member does not show yet.
fn pool_views(ctx: &Context, all: &[Arc<PodLite>]) -> Vec<PoolView> {
    let members = ctx.members.borrow().clone();
    let mut views = Vec::new();
    for m in members.values() {
        for pool in &m.pools {
            let cap = pool.capacity.borrow().clone();
            let mut view = PoolView {
                node: pool.node.to_string(),
                member: m.name.to_string(),
                pool: pool.name.to_string(),
                capacity: cap.capacity.clone(),
                used: cap.used.clone(),
                free_per_node: cap.free_per_node.clone(),
                gpu_product: cap.gpu_product.clone(),
                // A paused member takes no new pods; nor does one that is unreachable or whose
                // credentials are broken (its session lives on for the pods it runs).
                schedulable: cap.nodes > 0 && !m.paused && m.health.borrow().is_healthy(),
            };
            for p in all.iter().filter(|p| p.is_live() && p.node_name() == Some(pool.node.as_str())) {
                let in_flight = p.metadata.uid.as_ref().is_some_and(|u| !cap.placed.contains_key(u));
                if in_flight {
                    assume(&mut view, &requests(p));
                }
            }
            views.push(view);
        }
    }
    views
}

/// Counts `req` as used in `view`, on the first member node it fits (as the member's
/// scheduler would place it), so later decisions in the round see it.
fn assume(view: &mut PoolView, req: &Resources) {
    view.used.add(req);
    if let Some(free) = view.free_per_node.iter_mut().find(|f| req.fits_in(f)) {
        free.sub(req);
    }
}

async fn min_member(ctx: &Context, key: &GangKey, pods: &[Arc<PodLite>]) -> Result<u32, String> {
    match &key.source {
        GangSource::Single(_) => Ok(1),
        GangSource::Annotation(name) => {
            let mut min = None;
            for p in pods {
                if let Some(m) = gang::annotated_min_member(p)? {
                    min = Some(min.map_or(m, |x: u32| x.max(m)));
                }
            }
            min.ok_or_else(|| format!("gang {name} has no {} annotation", keys::ANNOTATION_MIN_MEMBER))
        }
        GangSource::PodGroup(name) | GangSource::Volcano(name) => {
            let cache_key = (key.source.clone(), key.namespace.clone());
            let training = ctx.training.clone();
            let (source, ns, name) = (key.source.clone(), key.namespace.clone(), name.clone());
            ctx.pod_groups
                .get_with(cache_key, async move { fetch_pod_group_min(training, &source, &ns, &name).await })
                .await
        }
    }
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

async fn fetch_pod_group_min(training: Client, source: &GangSource, ns: &str, name: &str) -> Result<u32, String> {
    let (api, gvk) = pod_group_api(training, source, ns);
    match api.get_opt(name).await {
        Ok(Some(pg)) => {
            let min = pg.data.get("spec").and_then(|s| s.get("minMember")).and_then(serde_json::Value::as_u64);
            match min {
                Some(m) if m >= 1 => Ok(u32::try_from(m).unwrap_or(u32::MAX)),
                _ => Err(format!("{} {ns}/{name} has no valid spec.minMember", gvk.kind)),
            }
        }
        Ok(None) => Err(format!("{} {}/{ns}/{name} not found", gvk.kind, gvk.group)),
        // No such CRD installed reads as 404 too; anything else is worth saying.
        Err(e) if tidepool_federation::api_code(&e, &[404]) => {
            Err(format!("{} {ns}/{name} not found (is its CRD installed?)", gvk.kind))
        }
        Err(e) => Err(format!("cannot read {} {ns}/{name}: {e}", gvk.kind)),
    }
}

/// Admits what it can of one gang. Returns the core's total requests when a new gang found
/// no pool (a candidate for preemption).
async fn admit(ctx: &Context, key: &GangKey, g: &GangState, min: usize, pools: &mut [PoolView]) -> Option<Resources> {
    let mut pending: Vec<&Arc<PodLite>> = g.pods.iter().filter(|p| p.node_name().is_none()).collect();
    pending.sort_by_key(|p| p.name_any());
    let bound = g.pods.len() - pending.len();

    if let Some(node) = &g.pinned {
        // The gang already has a pool: finish its core there, then grow elastically.
        let Some(idx) = pools.iter().position(|v| &v.node == node) else {
            explain(
                ctx,
                pending.iter().map(|p| (*p).clone()).collect(),
                &format!("gang {key} is placed on {node}, which is not offered right now"),
            )
            .await;
            return None;
        };
        let core_missing = min.saturating_sub(bound);
        let (core, elastic) = pending.split_at(core_missing.min(pending.len()));
        // Core pods already carry the placement (recorded before any bind): bind them.
        for p in core {
            let req = requests(p);
            assume(&mut pools[idx], &req);
            let band = gang::band_for(p.spec.priority, true, &ctx.ranges);
            bind(ctx, p, node, band, keys::ROLE_CORE).await;
        }
        let mut admitted = Vec::new();
        for p in elastic {
            let req = requests(p);
            if !plan::fits_one(&req, &pools[idx], &admitted) {
                explain(ctx, vec![(*p).clone()], &format!("gang {key}: no room for another elastic pod on {node}"))
                    .await;
                continue;
            }
            admitted.push(req);
            let band = gang::band_for(p.spec.priority, false, &ctx.ranges);
            bind(ctx, p, node, band, keys::ROLE_ELASTIC).await;
        }
        for r in &admitted {
            assume(&mut pools[idx], r);
        }
        return None;
    }

    // A new gang: all of its core or nothing.
    if pending.len() < min {
        let msg = format!("gang {key} has {} of its {min} pods; waiting for the rest", pending.len());
        explain(ctx, pending.iter().map(|p| (*p).clone()).collect(), &msg).await;
        return None;
    }
    let core = &pending[..min];
    let demand = GangDemand { key: key.to_string(), pods: core.iter().map(|p| requests(p)).collect(), pinned: None };
    match plan::place(&demand, pools) {
        Ok(placement) => {
            info!(gang = %key, node = %placement.node, pods = min, "gang placed");
            // Record the placement (and band) on every core pod before binding any of them;
            // both steps run concurrently across the gang's pods.
            let node = placement.node.as_str();
            for chunk in core.chunks(BIND_CONCURRENCY) {
                let recorded = futures::future::join_all(chunk.iter().map(|p| {
                    let band = gang::band_for(p.spec.priority, true, &ctx.ranges);
                    record_placement(ctx, p, node, band)
                }))
                .await;
                if let Some(Err(e)) = recorded.into_iter().find(Result::is_err) {
                    warn!(gang = %key, error = %e, "cannot record placement; will retry");
                    return None;
                }
            }
            if let Some(i) = pools.iter().position(|v| v.node == placement.node) {
                pools[i].reserve(&demand.pods, &placement.per_pod_member_node);
            }
            for chunk in core.chunks(BIND_CONCURRENCY) {
                futures::future::join_all(chunk.iter().map(|p| {
                    let band = gang::band_for(p.spec.priority, true, &ctx.ranges);
                    create_binding(ctx, p, node, band)
                }))
                .await;
            }
            let note = format!("gang {key} ({min} pods) placed on {} (member {})", placement.node, placement.member);
            publish(ctx, core[0], EventType::Normal, "Placed", &note).await;
        }
        Err(u) => {
            explain(ctx, pending.iter().map(|p| (*p).clone()).collect(), &format!("gang {key}: {}", u.message)).await;
            let mut total = Resources::new();
            demand.pods.iter().for_each(|r| total.add(r));
            return Some(total);
        }
    }
    None
}

/// Says why a placed gang must be rolled back: its placement is older than the gang timeout
/// and fewer than `minMember` of its pods run.
async fn timed_out(ctx: &Context, key: &GangKey, g: &GangState) -> Option<String> {
    let node = g.pinned.as_deref()?;
    let placed_at: jiff::Timestamp =
        g.pods.iter().filter_map(|p| p.annotations().get(keys::ANNOTATION_PLACED_AT)?.parse().ok()).min()?;
    let timeout = ctx.config.dispatcher.gang_timeout_seconds;
    let waited = jiff::Timestamp::now().duration_since(placed_at).as_secs();
    if waited < timeout as i64 {
        return None;
    }
    let min = min_member(ctx, key, &g.pods).await.ok()? as usize;
    let running = g.succeeded
        + g.pods.iter().filter(|p| p.node_name().is_some() && p.status.phase.as_deref() == Some("Running")).count();
    (running < min).then(|| {
        format!("gang {key}: {running} of its {min} pods running on {node} after {waited}s (timeout {timeout}s); rolled back whole so it can be placed again")
    })
}

/// Fails every live pod of the gang (reason `GangTimeout`); vk-provider then removes their
/// offload copies, and the owning controller (Job, PyTorchJob, …) creates fresh pods that
/// form the gang again.
async fn roll_back(ctx: &Context, g: &GangState, message: &str) {
    warn!(message, "gang timed out");
    metrics().gang_timeouts.inc();
    for p in &g.pods {
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
        let status = json!({ "status": { "phase": "Failed", "reason": "GangTimeout", "message": message } });
        match api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(status)).await {
            Ok(_) => publish(ctx, p, EventType::Warning, "GangTimeout", message).await,
            Err(e) => warn!(pod = %p.name_any(), error = %e, "cannot roll back gang pod"),
        }
    }
}

async fn record_placement(ctx: &Context, pod: &PodLite, node: &str, band: Band) -> Result<(), kube::Error> {
    ctx.wrote();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let patch = json!({ "metadata": {
        "labels": { keys::LABEL_BAND: band.as_str(), keys::LABEL_ROLE: keys::ROLE_CORE },
        "annotations": { keys::ANNOTATION_PLACEMENT: node, keys::ANNOTATION_PLACED_AT: now },
    } });
    api.patch(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await?;
    Ok(())
}

async fn bind(ctx: &Context, pod: &PodLite, node: &str, band: Band, role: &str) {
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let name = pod.name_any();
    let labels = json!({ "metadata": {
        "labels": { keys::LABEL_BAND: band.as_str(), keys::LABEL_ROLE: role },
        "annotations": { keys::ANNOTATION_PLACEMENT: node },
    }});
    if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(labels)).await {
        warn!(pod = %name, error = %e, "cannot label pod before binding; will retry");
        return;
    }
    create_binding(ctx, pod, node, band).await;
}

/// The Binding subresource: the pod is now the virtual node's (and vk-provider's).
async fn create_binding(ctx: &Context, pod: &PodLite, node: &str, band: Band) {
    ctx.wrote();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let name = pod.name_any();
    let binding = Binding {
        metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_owned()),
            ..Default::default()
        },
    };
    match api.create_subresource::<_, serde_json::Value>("binding", &name, &PostParams::default(), &binding).await {
        Ok(_) => {
            debug!(pod = %name, node, "bound");
            metrics().placements.get_or_create(&PlacementLabels { node: node.to_owned(), band: band.as_str() }).inc();
            if let (Some(uid), Ok(mut ex)) = (pod.metadata.uid.as_ref(), ctx.explained.lock()) {
                ex.remove(uid);
            }
        }
        Err(e) if tidepool_federation::api_code(&e, &[409]) => {}
        Err(e) => warn!(pod = %name, error = %e, "bind failed; will retry"),
    }
}

/// Says why pods wait: `PodScheduled=False`, reason `Unschedulable`, and an Event, written
/// only when the reason changes.
async fn explain(ctx: &Context, pods: Vec<Arc<PodLite>>, message: &str) {
    for p in &pods {
        let Some(uid) = p.metadata.uid.clone() else { continue };
        let fresh =
            ctx.explained.lock().is_ok_and(|mut ex| ex.insert(uid, message.to_owned()).as_deref() != Some(message));
        if !fresh {
            continue;
        }
        debug!(pod = %p.name_any(), message, "unschedulable");
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
        let status = json!({ "status": { "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
            "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
        }]}});
        if let Err(e) = api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Strategic(status)).await {
            warn!(pod = %p.name_any(), error = %e, "cannot write Unschedulable condition");
        }
        publish(ctx, p, EventType::Warning, "Unplaceable", message).await;
    }
}

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
