//! Reclaim: when online demand in a member grows past what its pool lends, take capacity
//! back from offload pods, lowest band first, with a checkpoint notice before anything is
//! deleted. The I/O around [`crate::victims`].
//!
//! Every step is recorded in the training cluster (deadline annotation, condition, final
//! `Failed`/`Reclaimed` status), so a restarted dispatcher picks up notices in flight. At
//! the deadline (or the ack) the dispatcher has vk-provider, the one writer of offload copies,
//! delete the copy at once (ahead of its ordinary work), then writes that status; vk-provider
//! deletes any copy of a terminal training pod in its turn.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use tidepool_api::Resources;
use tidepool_api::bridge::BandSeconds;
use tidepool_api::keys::{self, Band};
use tidepool_api::metrics::metrics;
use tidepool_api::pod::PodLite;
use tidepool_federation::capacity::PoolCapacity;
use tracing::{error, warn};

use crate::context::{Context, pacing, pod_group_api, requests, workload_api};
use crate::error::Result;
use crate::gang::{self, GangKey, GangSource};
use crate::notice::{Cause, deadline_of, mark_reclaimed, notice, reclaim_band};
use crate::reclaim_end::ReclaimEnd;
use crate::victims::{OffloadPodView, Victim, victims};

/// How often deficits, deadlines and preemptions are checked while one is pending; a pool's
/// capacity changing wakes the check sooner.
const TICK: Duration = Duration::from_millis(100);
/// How often the checks run while no deficit, notice or preemption is pending and nothing
/// changes: the one periodic wake of an idle bridge.
const IDLE_TICK: Duration = Duration::from_secs(2);
/// The least time between two checks, however often capacities change.
const MIN_SPACING: Duration = Duration::from_millis(10);
/// Longest spacing of two checks (see [`run`]).
const MAX_SPACING: Duration = Duration::from_secs(1);

/// How long a PodGroup's checkpoint ack, once read, is trusted before it is read again.
const GANG_ACK_RECHECK: Duration = Duration::from_millis(500);

/// In-memory only: timings that are safe to lose on restart (a restart just waits one more
/// hysteresis window).
#[derive(Debug, Default)]
struct State {
    /// When each virtual node's current deficit was first seen.
    deficit_since: HashMap<String, jiff::Timestamp>,
    /// When each job last had victims picked.
    last_reclaim: HashMap<GangKey, jiff::Timestamp>,
    /// Checkpoint acks read from PodGroups of gangs under notice: when read, and the
    /// PodGroup's name if it carried the ack.
    gang_acks: HashMap<GangKey, (tokio::time::Instant, Option<String>)>,
}

impl State {
    /// Steps 1–2 for one pool, pure: the victims to notice now on virtual node `node` for
    /// `deficit`, of which `freeing` is already being freed by pods under notice.
    ///
    /// No flapping: a deficit must outlast `hysteresis` before anything is taken, and a job
    /// that lost pods is left alone for one `hysteresis` window, even when only it has
    /// candidates: a demand that keeps rising then waits at most one window for its next
    /// victims from that job. Records what it decides.
    fn plan_pool(
        &mut self,
        node: &str,
        deficit: &Resources,
        freeing: &Resources,
        candidates: Vec<OffloadPodView>,
        now: jiff::Timestamp,
        hysteresis: jiff::SignedDuration,
    ) -> Vec<Victim> {
        if deficit.is_empty() {
            self.deficit_since.remove(node);
            return Vec::new();
        }
        // 1. The deficit must outlast the hysteresis window.
        let since = *self.deficit_since.entry(node.to_owned()).or_insert(now);
        if now.duration_since(since) < hysteresis {
            return Vec::new();
        }
        let mut remaining = deficit.clone();
        remaining.sub(freeing);
        remaining.clamp_non_negative();
        if remaining.is_empty() {
            return Vec::new();
        }
        // 2. At most one reclaim per job per hysteresis window.
        let fresh: Vec<OffloadPodView> = candidates
            .into_iter()
            .filter(|c| self.last_reclaim.get(&c.job).is_none_or(|t| now.duration_since(*t) >= hysteresis))
            .collect();
        let chosen = victims(&remaining, &fresh);
        for v in &chosen {
            self.last_reclaim.insert(v.job.clone(), now);
        }
        chosen
    }
}

pub(crate) async fn run(ctx: Arc<Context>, training_pods: tidepool_federation::TrainingPods) {
    let pods_changed = Arc::new(tokio::sync::Notify::new());
    {
        let (events, notify) = (training_pods.subscribe(), pods_changed.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while futures::StreamExt::next(&mut events).await.is_some() {
                notify.notify_one();
            }
        });
    }
    training_pods.listed().await;
    let mut state = State::default();
    loop {
        // Capacities as of now count as seen: a change from here on wakes the next check.
        let mut capacities: Vec<_> =
            ctx.members.borrow().values().flat_map(|m| m.pools.iter().map(|p| p.capacity.clone())).collect();
        capacities.iter_mut().for_each(|c| {
            c.borrow_and_update();
        });
        let now = jiff::Timestamp::now();
        let (started, writes) = (std::time::Instant::now(), ctx.writes());
        let pods = ctx.pods.state();
        pick_victims(&ctx, &pods, &mut state, now).await;
        crate::eviction::answer_all(&ctx, &pods, now).await;
        let preempting = match preempt(&ctx, &pods, now).await {
            Ok(preempting) => preempting,
            Err(e) => {
                error!(error = %e, "preemption skipped");
                true
            }
        };
        let noticed = enforce_deadlines(&ctx, &pods, &mut state, now).await;
        drop(pods);
        let cost = started.elapsed();
        metrics().observe_sync("reclaim", cost);
        // Each pass reads every training pod (see [`pacing`]).
        let spacing = pacing(cost, ctx.writes() != writes, MIN_SPACING, MAX_SPACING);
        tokio::time::sleep(spacing).await;
        let rest = TICK.saturating_sub(spacing);
        // Deficits waiting out their hysteresis, notices running to their deadlines and
        // preemptions are checked every TICK; with none of them a pass follows a change.
        let busy = !state.deficit_since.is_empty() || noticed > 0 || preempting;
        tokio::select! {
            () = tokio::time::sleep(if busy { rest } else { IDLE_TICK }) => {}
            () = any_changed(&mut capacities) => {}
            () = ctx.preempt_wanted.notified() => {}
            // A pod's change (an ack, a copy gone, a new pod on a virtual node) is looked at
            // within a TICK, never more often: a burst of pod changes is one pass a TICK.
            () = pods_changed.notified(), if !busy => tokio::time::sleep(rest).await,
        }
    }
}

/// Resolves when any of `capacities` changes (never, with none).
async fn any_changed(capacities: &mut [tokio::sync::watch::Receiver<PoolCapacity>]) {
    if capacities.is_empty() {
        return std::future::pending().await;
    }
    let _ = futures::future::select_all(capacities.iter_mut().map(|c| Box::pin(c.changed()))).await;
}

/// Steps 1–3: deficit past hysteresis → victims → notice.
async fn pick_victims(ctx: &Arc<Context>, pods: &[Arc<PodLite>], state: &mut State, now: jiff::Timestamp) {
    let hysteresis = jiff::SignedDuration::from_secs(ctx.config.dispatcher.deficit_hysteresis_seconds as i64);
    let grace = &ctx.config.dispatcher.reclaim_grace_seconds;
    let members = ctx.members.borrow().clone();
    // A member that does not answer shows a stale deficit: its pods are left as they are
    // (deploy/docs/architecture.md, "Rules the code keeps") until it answers or is lost.
    for member in members.values().filter(|m| m.health.borrow().is_answering()) {
        for pool in &member.pools {
            let node = pool.node.to_string();
            // Most passes find no deficit: the capacity (every member node of the pool, and
            // every offload pod placed there) is copied only for a pool that has one.
            let (cap, deficit) = {
                let cap = pool.capacity.borrow();
                let deficit = cap.deficit();
                if deficit.is_empty() {
                    state.plan_pool(&node, &deficit, &Resources::new(), Vec::new(), now, hysteresis);
                    continue;
                }
                (cap.clone(), deficit)
            };
            let on_node = on_pool(pods, &node);
            let freeing = freeing(pods, &node, &cap, grace);
            let candidates = candidates(&on_node, &cap, grace);
            let picked = state.plan_pool(&node, &deficit, &freeing, candidates, now, hysteresis);
            let cause =
                Cause::online(format!("member {} needs capacity back for online demand", member.name), &deficit);
            // All at once: the online demand waits for the last of them.
            let notices = picked.iter().filter_map(|v| {
                let p = on_node.iter().find(|p| key_of(p) == v.key)?;
                Some(notice(ctx, p, &cause, v.band, &v.reason, now))
            });
            futures::future::join_all(notices).await;
        }
    }
}

/// The live pods bound to virtual node `node`: the only ones reclaim for its pool ever picks
/// from (a job's pods elsewhere, on another pool or on the training cluster's own nodes,
/// are never its victims).
pub(crate) fn on_pool<'a>(pods: &'a [Arc<PodLite>], node: &str) -> Vec<&'a Arc<PodLite>> {
    pods.iter().filter(|p| p.is_live() && p.node_name() == Some(node)).collect()
}

/// What the pods on virtual node `node` are about to free: those under notice, and those
/// that ended (reclaimed, say) whose copy the member still shows. Counting them again would
/// take a second victim for the same demand.
fn freeing(pods: &[Arc<PodLite>], node: &str, cap: &PoolCapacity, grace: &BandSeconds) -> Resources {
    let mut freeing = Resources::new();
    let freeing_pods = pods.iter().filter(|p| {
        p.node_name() == Some(node)
            && (deadline_of(p, grace).is_some() || !p.is_live())
            && p.metadata.uid.as_deref().is_some_and(|u| cap.placed.contains_key(u))
    });
    for p in freeing_pods {
        freeing.add(&requests(p));
    }
    freeing
}

/// The victim candidates among the live pods of one pool, `on_node`: those not under notice
/// that the member shows placed, each with its job's fulfillment ([`job_fulfillments`]).
pub(crate) fn candidates(on_node: &[&Arc<PodLite>], cap: &PoolCapacity, grace: &BandSeconds) -> Vec<OffloadPodView> {
    let jobs = job_fulfillments(on_node.iter().map(|p| (gang::gang_of(p), reclaim_band(p))));
    on_node
        .iter()
        .filter(|p| deadline_of(p, grace).is_none())
        .filter_map(|p| {
            let member_node = cap.placed.get(p.metadata.uid.as_deref()?)?.node.to_string();
            let fulfillment = jobs.get(&gang::gang_of(p)).copied().unwrap_or((1, 1, 1));
            Some(offload_view(p, member_node, fulfillment))
        })
        .collect()
}

/// Each job's `(current, min, max)` on one pool, from the gang and band of each of its live
/// pods there, for victim ranking: its core (`min`) is its pods above band `low`, and it runs
/// what it has (`current` = `max` = all of its pods). Pure.
fn job_fulfillments(pods: impl IntoIterator<Item = (GangKey, Band)>) -> BTreeMap<GangKey, (u32, u32, u32)> {
    let mut jobs: BTreeMap<GangKey, (u32, u32, u32)> = BTreeMap::new();
    for (job, band) in pods {
        let (current, min, max) = jobs.entry(job).or_default();
        *current += 1;
        *max += 1;
        if band != Band::Low {
            *min += 1;
        }
    }
    jobs
}

fn key_of(p: &PodLite) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

/// A running offload pod as victim selection sees it.
fn offload_view(p: &PodLite, member_node: String, job_fulfillment: (u32, u32, u32)) -> OffloadPodView {
    OffloadPodView {
        key: key_of(p),
        job: gang::gang_of(p),
        band: reclaim_band(p),
        member_node,
        requests: requests(p),
        deletion_cost: p.annotations().get(keys::ANNOTATION_DELETION_COST).and_then(|c| c.parse().ok()).unwrap_or(0),
        priority: p.spec.priority.unwrap_or(0),
        job_fulfillment,
    }
}

/// Preemption: a pending gang above band `low` that fits nowhere may take capacity from
/// lower-band pods, through the same notice path as reclaim. One pool per gang: the one that
/// needs the least taken ([`choose_pool`]).
async fn preempt(ctx: &Arc<Context>, pods: &[Arc<PodLite>], now: jiff::Timestamp) -> Result<bool> {
    let mut pending = ctx.preempt_requests()?;
    // Most passes have none: the pools (every member node of each) are not copied for nothing.
    if pending.is_empty() {
        return Ok(false);
    }
    pending.sort_by_key(|r| std::cmp::Reverse(r.band));
    let grace = &ctx.config.dispatcher.reclaim_grace_seconds;
    // Nothing can be freed on a member that does not answer: its pods stay as they are.
    // Sharded, the pools of other replicas' members count too: the notices are written here,
    // and their owners end them.
    let pools: Vec<(String, PoolCapacity)> = ctx
        .pools()
        .into_iter()
        .filter(|pool| !pool.paused && pool.answering)
        .map(|pool| (pool.node, pool.capacity))
        .collect();
    for r in pending {
        let Some(chosen) = choose_pool(&pools, pods, &r.demand, r.band, grace) else { continue };
        let picked = victims(&chosen.need, &chosen.views);
        let text = format!("higher-band gang {} ({}) needs room on {}", r.gang, r.band.as_str(), chosen.node);
        let cause = Cause::online(text, &chosen.need);
        let notices = picked.iter().filter_map(|v| {
            let p = chosen.pods.iter().find(|p| key_of(p) == v.key)?;
            Some(notice(ctx, p, &cause, v.band, &v.reason, now))
        });
        futures::future::join_all(notices).await;
    }
    Ok(true)
}

/// A pool preemption could use.
#[derive(Debug)]
struct Preemption {
    /// What must be taken there.
    need: Resources,
    /// Its virtual node.
    node: String,
    /// The lower-band pods there, as victim selection sees them…
    views: Vec<OffloadPodView>,
    /// …and every pod the member shows placed there, to send the notices to.
    pods: Vec<Arc<PodLite>>,
}

/// Of `pools` (virtual node, capacity), the one where `demand` of band `band` needs the least
/// taken from lower-band pods (GPUs first, then cpu), with what to take and the pods to take it
/// from. `None` when some pool has room already (free, or being freed by pods under notice) or
/// none can make room. Pure.
fn choose_pool(
    pools: &[(String, PoolCapacity)],
    pods: &[Arc<PodLite>],
    demand: &Resources,
    band: Band,
    grace: &BandSeconds,
) -> Option<Preemption> {
    let mut best: Option<Preemption> = None;
    for (node, cap) in pools {
        let placed = |p: &PodLite| p.metadata.uid.as_deref().is_some_and(|u| cap.placed.contains_key(u));
        let on_node: Vec<Arc<PodLite>> =
            pods.iter().filter(|p| p.node_name() == Some(node.as_str()) && placed(p)).cloned().collect();
        // What is free, plus what pods under notice are about to free.
        let mut available = cap.capacity.clone();
        available.sub(&cap.used);
        for p in on_node.iter().filter(|p| deadline_of(p, grace).is_some()) {
            available.add(&requests(p));
        }
        let mut need = demand.clone();
        need.sub(&available);
        need.clamp_non_negative();
        if need.is_empty() {
            // Enough is free or being freed here already: nothing more to take.
            return None;
        }
        let lower: Vec<&Arc<PodLite>> = on_node
            .iter()
            .filter(|p| p.is_live() && deadline_of(p, grace).is_none() && reclaim_band(p) < band)
            .collect();
        let mut takeable = Resources::new();
        lower.iter().for_each(|p| takeable.add(&requests(p)));
        if !need.fits_in(&takeable) {
            continue;
        }
        let views = lower
            .iter()
            .filter_map(|p| {
                let member_node = cap.placed.get(p.metadata.uid.as_deref()?)?.node.to_string();
                Some(offload_view(p, member_node, (1, 1, 1)))
            })
            .collect();
        let gpu = tidepool_federation::capacity::GPU;
        let smaller =
            best.as_ref().is_none_or(|b| (need.get(gpu), need.get("cpu")) < (b.need.get(gpu), b.need.get("cpu")));
        if smaller {
            best = Some(Preemption { need, node: node.clone(), views, pods: on_node });
        }
    }
    best
}

/// Whether the PodGroup of `gang` (sig-scheduling or Volcano), or the operator's job it is,
/// carries the checkpoint ack, which then holds for every pod of the gang: the object's kind
/// and name if so. Read at
/// most once per [`GANG_ACK_RECHECK`] per gang, and only for gangs with pods under notice.
async fn gang_ack(ctx: &Context, state: &mut State, gang: &GangKey) -> Option<String> {
    let (name, (api, gvk)) = match &gang.source {
        GangSource::Native(n) | GangSource::PodGroup(n) | GangSource::Volcano(n) => {
            (n.clone(), pod_group_api(ctx.training.clone(), &gang.source, &gang.namespace))
        }
        GangSource::Workload(kind, n) => (n.clone(), workload_api(ctx.training.clone(), *kind, &gang.namespace)),
        GangSource::Annotation(_) | GangSource::Single(_) => return None,
    };
    if let Some((read, acked)) = state.gang_acks.get(gang)
        && read.elapsed() < GANG_ACK_RECHECK
    {
        return acked.clone();
    }
    let acked = match api.get_opt(&name).await {
        Ok(pg) => pg
            .filter(|pg| pg.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE))
            .map(|_| format!("{} {name}", gvk.kind)),
        // No PodGroup (or no such CRD): no ack there; the pods' own acks still count.
        Err(e) if tidepool_federation::api_code(&e, &[404]) => None,
        Err(e) => {
            warn!(gang = %gang, error = %e, "cannot read the gang's PodGroup for a checkpoint ack");
            None
        }
    };
    state.gang_acks.insert(gang.clone(), (tokio::time::Instant::now(), acked.clone()));
    acked
}

/// Whether a pod under notice is reclaimed now, and how. Pure.
///
/// The acks, each something only the pod's owners or the pod itself can give: the operators'
/// annotation on the pod or on its PodGroup (`group`), or the ack from inside — every
/// container exited after the notice, one with [`keys::TERMINATION_ACK_PREFIX`] in its
/// termination message. Containers that merely exited also end the wait (nothing more can be
/// saved); otherwise the deadline does. A deadline or ack annotation is never read on a pod
/// that is not under notice: [`deadline_of`] holds only with tidepool's own condition.
fn reclaim_now(
    p: &PodLite,
    deadline: jiff::Timestamp,
    group: Option<&str>,
    now: jiff::Timestamp,
) -> Option<ReclaimEnd> {
    if let Some(group) = group {
        return Some(ReclaimEnd::GroupAck(group.to_owned()));
    }
    if p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE) {
        return Some(ReclaimEnd::Annotated);
    }
    match (p.status.exit_ack(), p.status.containers_exited) {
        (Some(ack), true) => Some(ReclaimEnd::ExitAck(ack.to_owned())),
        (None, true) => Some(ReclaimEnd::Exited),
        _ if now >= deadline => Some(ReclaimEnd::Deadline),
        _ => None,
    }
}

/// Steps 4–5: ack or deadline → the training pod fails with reason `Reclaimed`.
async fn enforce_deadlines(
    ctx: &Arc<Context>,
    pods: &[Arc<PodLite>],
    state: &mut State,
    now: jiff::Timestamp,
) -> usize {
    state.gang_acks.retain(|_, (read, _)| read.elapsed() < GANG_ACK_RECHECK * 20);
    let grace = &ctx.config.dispatcher.reclaim_grace_seconds;
    let (mut due, mut noticed) = (Vec::new(), 0);
    for p in pods.iter().filter(|p| p.is_live()) {
        let Some(deadline) = deadline_of(p, grace) else { continue };
        // Another replica's member: that replica ends its reclaims.
        if p.node_name().is_some_and(|n| ctx.owned_elsewhere(n)) {
            continue;
        }
        noticed += 1;
        let pod_acked = p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE) || p.status.exit_ack().is_some();
        let group_acked = if pod_acked { None } else { gang_ack(ctx, state, &gang::gang_of(p)).await };
        let Some(end) = reclaim_now(p, deadline, group_acked.as_deref(), now) else { continue };
        if end.outcome() == "acknowledged" {
            // The notice went out one grace period before the deadline.
            let grace = ctx.config.dispatcher.reclaim_grace_seconds.get(reclaim_band(p)) as i64;
            let noticed = deadline - jiff::SignedDuration::from_secs(grace);
            metrics().checkpoint_ack_seconds.observe(now.duration_since(noticed).as_secs_f64().max(0.0));
        }
        due.push((p, end));
    }
    let ends = due.iter().map(|(p, end)| mark_reclaimed(ctx, p, end));
    futures::future::join_all(ends).await;
    noticed
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use proptest::prelude::*;
    use serde_json::json;
    use tidepool_federation::capacity::GPU;

    /// A training pod from its JSON, as the cache holds it.
    fn lite(pod: serde_json::Value) -> PodLite {
        PodLite::from(serde_json::from_value::<Pod>(pod).unwrap())
    }

    const NOTICED: &str = "2026-12-01T10:00:00Z";

    /// A pod on virtual node `tidepool-m` with `meta` (labels, annotations) and `conditions`.
    fn on_node(meta: serde_json::Value, conditions: serde_json::Value) -> PodLite {
        let mut metadata = json!({"name": "p", "namespace": "ns", "uid": "u1"});
        metadata.as_object_mut().unwrap().extend(meta.as_object().unwrap().clone());
        lite(json!({
            "metadata": metadata,
            "spec": {"nodeName": "tidepool-m", "schedulerName": "tidepool", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running", "conditions": conditions},
        }))
    }

    fn reclaim_requested(at: &str) -> serde_json::Value {
        json!([{"type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": "CapacityReclaimed",
                "lastTransitionTime": at},
               {"type": keys::CONDITION_DISRUPTION_TARGET, "status": "True", "reason": keys::REASON_DISRUPTION_RECLAIM,
                "lastTransitionTime": at}])
    }

    /// A running low pod with `gpus` GPUs, placed by the dispatcher on virtual node `node`.
    fn low_on(node: &str, uid: &str, gpus: u32) -> Arc<PodLite> {
        Arc::new(lite(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid,
                         "labels": {keys::LABEL_BAND: "low"}, "annotations": {keys::ANNOTATION_PLACEMENT: node}},
            "spec": {"nodeName": node, "schedulerName": "tidepool",
                     "containers": [{"name": "c", "image": "i",
                                     "resources": {"requests": {"nvidia.com/gpu": gpus.to_string()},
                                                   "limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
            "status": {"phase": "Running"},
        })))
    }

    /// A pool of `capacity` GPUs holding `pods` (all placed on member node `n`).
    fn pool_of(node: &str, capacity: i64, pods: &[&Arc<PodLite>]) -> (String, PoolCapacity) {
        let mut cap = PoolCapacity::default();
        cap.capacity.set(GPU, capacity * 1000);
        let mut placed = BTreeMap::new();
        for p in pods {
            cap.used.add(&requests(p));
            let uid = p.metadata.uid.clone().unwrap();
            placed.insert(uid.into(), tidepool_federation::capacity::Placed { node: "n".into(), copy_uid: None });
        }
        cap.placed = Arc::new(placed);
        (node.to_owned(), cap)
    }

    #[test]
    fn preemption_takes_from_the_pool_that_needs_the_least_taken() {
        // Pool a: 8 GPUs, full with two 4-GPU low pods. Pool b: 8 GPUs, 6 used by three
        // 2-GPU low pods. A high gang of 4 GPUs needs 4 taken on a, 2 on b: b, whichever
        // comes first.
        let a = [low_on("tidepool-a", "a1", 4), low_on("tidepool-a", "a2", 4)];
        let b = [low_on("tidepool-b", "b1", 2), low_on("tidepool-b", "b2", 2), low_on("tidepool-b", "b3", 2)];
        let pods: Vec<Arc<PodLite>> = a.iter().chain(&b).cloned().collect();
        let pa = pool_of("tidepool-a", 8, &a.iter().collect::<Vec<_>>());
        let pb = pool_of("tidepool-b", 8, &b.iter().collect::<Vec<_>>());
        let demand = Resources::from_pairs([(GPU, "4")]).unwrap();
        let grace = BandSeconds::default();
        for pools in [vec![pa.clone(), pb.clone()], vec![pb.clone(), pa.clone()]] {
            let chosen = choose_pool(&pools, &pods, &demand, Band::High, &grace).unwrap();
            assert_eq!(chosen.node, "tidepool-b");
            assert_eq!(chosen.need.get(GPU), 2000);
            assert_eq!(chosen.views.len(), 3, "the pool's lower-band pods are the candidates");
        }
        // Room already on a pool: nothing is taken anywhere.
        let roomy = pool_of("tidepool-c", 8, &[]);
        assert!(choose_pool(&[pa.clone(), roomy], &pods, &demand, Band::High, &grace).is_none());
        // Pods of the same band or above are never taken: a gang of band low takes nothing.
        assert!(choose_pool(&[pa, pb], &pods, &demand, Band::Low, &grace).is_none());
    }

    #[test]
    fn a_deadline_a_tenant_wrote_without_tidepools_condition_is_no_notice() {
        let forged = on_node(
            json!({"labels": {keys::LABEL_BAND: "low"},
                   "annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2099-01-01T00:00:00Z",
                                   keys::ANNOTATION_PLACEMENT: "tidepool-m"}}),
            json!([]),
        );
        assert_eq!(deadline_of(&forged, &BandSeconds::default()), None, "a deadline annotation alone is not a notice");
        // Nor does a condition of the right type count when it is not true.
        let mut conditions = reclaim_requested(NOTICED);
        conditions[0]["status"] = json!("False");
        let half =
            on_node(json!({"annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2099-01-01T00:00:00Z"}}), conditions);
        assert_eq!(deadline_of(&half, &BandSeconds::default()), None);
    }

    #[test]
    fn a_notice_tidepool_wrote_holds_its_deadline() {
        // Band low, grace 30 s in the defaults: noticed at 10:00:00, deleted at 10:00:30.
        let noticed = on_node(
            json!({"labels": {keys::LABEL_BAND: "low"},
                   "annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2026-12-01T10:00:30Z",
                                   keys::ANNOTATION_PLACEMENT: "tidepool-m"}}),
            reclaim_requested(NOTICED),
        );
        assert_eq!(deadline_of(&noticed, &BandSeconds::default()), Some("2026-12-01T10:00:30Z".parse().unwrap()));
    }

    #[test]
    fn a_tenant_cannot_push_the_deadline_of_a_real_notice_later() {
        // A low pod has 30 s from its notice, whatever its annotation says afterwards.
        let pushed = on_node(
            json!({"labels": {keys::LABEL_BAND: "low"},
                   "annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2099-01-01T00:00:00Z",
                                   keys::ANNOTATION_PLACEMENT: "tidepool-m"}}),
            reclaim_requested(NOTICED),
        );
        assert_eq!(deadline_of(&pushed, &BandSeconds::default()), Some("2026-12-01T10:00:30Z".parse().unwrap()));
    }

    /// A pod under notice since `NOTICED` whose containers are `state` (JSON container state).
    fn noticed_with(annotations: serde_json::Value, state: serde_json::Value) -> PodLite {
        let mut p = on_node(json!({"annotations": annotations}), reclaim_requested(NOTICED));
        let status: k8s_openapi::api::core::v1::PodStatus = serde_json::from_value(json!({
            "phase": "Running", "conditions": reclaim_requested(NOTICED),
            "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                                   "state": state}],
        }))
        .unwrap();
        let pod = Pod { metadata: p.metadata.clone(), spec: None, status: Some(status) };
        p.status = PodLite::from(pod).status;
        p
    }

    #[test]
    fn the_pod_acks_from_inside_by_exiting_with_the_ack_as_its_termination_message() {
        let deadline: jiff::Timestamp = "2026-12-01T10:10:00Z".parse().unwrap();
        let early: jiff::Timestamp = "2026-12-01T10:00:05Z".parse().unwrap();
        let running = noticed_with(json!({}), json!({"running": {}}));
        assert_eq!(reclaim_now(&running, deadline, None, early), None, "still checkpointing: wait");
        let acked = noticed_with(
            json!({}),
            json!({"terminated": {"exitCode": 0, "message": "tidepool.io/checkpointed step=40 offset=1280\n"}}),
        );
        let ack = "tidepool.io/checkpointed step=40 offset=1280";
        assert_eq!(reclaim_now(&acked, deadline, None, early), Some(ReclaimEnd::ExitAck(ack.into())));
        let crashed = noticed_with(json!({}), json!({"terminated": {"exitCode": 139}}));
        assert_eq!(reclaim_now(&crashed, deadline, None, early), Some(ReclaimEnd::Exited));
        // An ack line in the message of a container still running is no ack (it has not exited).
        assert_eq!(reclaim_now(&running, deadline, None, deadline), Some(ReclaimEnd::Deadline));
    }

    #[test]
    fn the_operators_annotation_and_the_podgroups_still_ack() {
        let deadline: jiff::Timestamp = "2026-12-01T10:10:00Z".parse().unwrap();
        let early: jiff::Timestamp = "2026-12-01T10:00:05Z".parse().unwrap();
        let annotated = noticed_with(json!({keys::ANNOTATION_CHECKPOINT_DONE: "true"}), json!({"running": {}}));
        assert_eq!(reclaim_now(&annotated, deadline, None, early), Some(ReclaimEnd::Annotated));
        let running = noticed_with(json!({}), json!({"running": {}}));
        let end = reclaim_now(&running, deadline, Some("PodGroup g"), early);
        assert_eq!(end, Some(ReclaimEnd::GroupAck("PodGroup g".into())));
    }

    #[test]
    fn checkpoint_done_on_a_pod_not_under_notice_reclaims_nothing() {
        // enforce_deadlines only looks at pods with a deadline, and there is none without
        // tidepool's condition, whatever the tenant wrote.
        let forged = on_node(
            json!({"annotations": {keys::ANNOTATION_CHECKPOINT_DONE: "true",
                                   keys::ANNOTATION_RECLAIM_DEADLINE: "2026-12-01T10:00:00Z"}}),
            json!([]),
        );
        assert_eq!(deadline_of(&forged, &BandSeconds::default()), None);
        // Removing the deadline annotation of a real notice does not lift it.
        let removed = on_node(json!({}), reclaim_requested(NOTICED));
        let grace = BandSeconds { low: 30, ..Default::default() };
        assert_eq!(deadline_of(&removed, &grace), Some("2026-12-01T10:00:30Z".parse().unwrap()));
    }

    #[test]
    fn a_hand_bound_pod_labelled_high_is_not_high() {
        // No placement by tidepool: the band comes from the priority, as the dispatcher
        // would have decided it for an elastic pod, never from the tenant's label.
        let hand_bound = on_node(json!({"labels": {keys::LABEL_BAND: "high"}}), json!([]));
        assert_eq!(reclaim_band(&hand_bound), Band::Low);
        // Whatever its priority: it was never admitted as a gang's core, so it is elastic.
        let mut by_priority = on_node(json!({"labels": {keys::LABEL_BAND: "high"}}), json!([]));
        by_priority.spec.priority = Some(2500);
        assert_eq!(reclaim_band(&by_priority), Band::Low, "a hand-bound pod is elastic, not its label's band");
        // A placement on another node is no placement of this pod.
        let elsewhere = on_node(
            json!({"labels": {keys::LABEL_BAND: "high"}, "annotations": {keys::ANNOTATION_PLACEMENT: "tidepool-other"}}),
            json!([]),
        );
        assert_eq!(reclaim_band(&elsewhere), Band::Low);
    }

    #[test]
    fn a_pod_the_dispatcher_placed_keeps_the_band_it_was_given() {
        for band in Band::ALL {
            let placed = on_node(
                json!({"labels": {keys::LABEL_BAND: band.as_str()},
                       "annotations": {keys::ANNOTATION_PLACEMENT: "tidepool-m"}}),
                json!([]),
            );
            assert_eq!(reclaim_band(&placed), band);
        }
    }

    #[test]
    fn a_pod_with_a_forged_deadline_is_still_a_victim_candidate() {
        let forged = on_node(
            json!({"labels": {keys::LABEL_BAND: "low"},
                   "annotations": {keys::ANNOTATION_RECLAIM_DEADLINE: "2099-01-01T00:00:00Z",
                                   keys::ANNOTATION_PLACEMENT: "tidepool-m"}}),
            json!([]),
        );
        let mut request = Resources::new();
        request.set(GPU, 2000);
        let mut state = State::default();
        let now: jiff::Timestamp = NOTICED.parse().unwrap();
        let candidates: Vec<OffloadPodView> = [&forged]
            .into_iter()
            .filter(|p| deadline_of(p, &BandSeconds::default()).is_none())
            .map(|p| OffloadPodView { requests: request.clone(), ..offload_view(p, "n1".into(), (1, 1, 1)) })
            .collect();
        let picked =
            state.plan_pool("tidepool-m", &request, &Resources::new(), candidates, now, jiff::SignedDuration::ZERO);
        assert_eq!(picked.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(), ["ns/p"]);
    }

    #[test]
    fn each_way_a_reclaim_ends_has_its_words_and_its_outcome() {
        let cases = [
            (ReclaimEnd::GroupAck("PodGroup g".into()), "checkpoint acknowledged on its PodGroup g", "acknowledged"),
            (ReclaimEnd::Annotated, "checkpoint acknowledged", "acknowledged"),
            (
                ReclaimEnd::ExitAck("tidepool.io/checkpointed step=3".into()),
                "checkpoint acknowledged by the pod as it exited (tidepool.io/checkpointed step=3)",
                "acknowledged",
            ),
            (ReclaimEnd::Exited, "containers exited after the notice", "exited"),
            (ReclaimEnd::Deadline, "checkpoint not acknowledged before the deadline", "deadline"),
            (ReclaimEnd::NoGrace(Band::Low), "band low has no checkpoint grace", "deadline"),
        ];
        for (end, words, outcome) in cases {
            assert_eq!((end.to_string().as_str(), end.outcome()), (words, outcome), "{end:?}");
        }
    }

    #[test]
    fn a_jobs_core_is_its_pods_above_band_low_and_it_runs_all_it_has() {
        let (a, b) = (GangKey::annotation("ns", "a"), GangKey::annotation("ns", "b"));
        let pods = [
            (a.clone(), Band::Medium),
            (a.clone(), Band::Medium),
            (a.clone(), Band::Low),
            (b.clone(), Band::Low),
            (a.clone(), Band::High),
        ];
        let jobs = job_fulfillments(pods);
        // a: four pods, three of them above low; b: one elastic pod, no core here.
        assert_eq!(jobs.get(&a), Some(&(4, 3, 4)));
        assert_eq!(jobs.get(&b), Some(&(1, 0, 1)));
        assert_eq!(jobs.len(), 2);
        assert!(job_fulfillments([]).is_empty());
    }

    const POD_GPUS: i64 = 2;
    const PODS_PER_JOB: usize = 4;

    fn gpus(n: i64) -> Resources {
        let mut r = Resources::new();
        r.set(GPU, n * 1000);
        r
    }

    /// One offload pod of the simulated pool.
    struct SimPod {
        key: String,
        job: String,
        noticed: Option<jiff::Timestamp>,
    }

    /// Drives [`State::plan_pool`] the way the reclaim loop does, every 100 ms of simulated
    /// time, on one pool whose online demand follows `online` (GPUs taken by the online side,
    /// held for the given milliseconds, repeated), with three elastic jobs of 2-GPU pods that
    /// the dispatcher grows back whenever room appears (the churn hysteresis must damp).
    /// Returns, per job, the instants victims were picked from it.
    fn simulate(
        online: &[(i64, u64)],
        hysteresis_s: i64,
        grace_ms: i64,
        total_ms: i64,
    ) -> BTreeMap<String, Vec<jiff::Timestamp>> {
        let pool_gpus = 16;
        let hysteresis = jiff::SignedDuration::from_secs(hysteresis_s);
        let grace = jiff::SignedDuration::from_millis(grace_ms);
        let start = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        let period: u64 = online.iter().map(|(_, ms)| ms).sum::<u64>().max(1);
        let online_at = |t_ms: i64| {
            let mut t = (t_ms as u64) % period;
            for (gpus, ms) in online {
                if t < *ms {
                    return *gpus;
                }
                t -= ms;
            }
            0
        };
        let mut state = State::default();
        let mut pods: Vec<SimPod> = Vec::new();
        let mut next = 0;
        let mut picks: BTreeMap<String, Vec<jiff::Timestamp>> = BTreeMap::new();
        for step in 0..(total_ms / 100) {
            let t_ms = step * 100;
            let now = start + jiff::SignedDuration::from_millis(t_ms);
            pods.retain(|p| p.noticed.is_none_or(|n| now < n + grace));
            let capacity = (pool_gpus - online_at(t_ms)).max(0);
            let used = pods.len() as i64 * POD_GPUS;
            let deficit = gpus((used - capacity).max(0));
            let freeing = gpus(pods.iter().filter(|p| p.noticed.is_some()).count() as i64 * POD_GPUS);
            let candidates = pods
                .iter()
                .filter(|p| p.noticed.is_none())
                .map(|p| OffloadPodView {
                    key: p.key.clone(),
                    job: GangKey::annotation("ns", &p.job),
                    band: Band::Low,
                    member_node: format!("m{}", next % 4),
                    requests: gpus(POD_GPUS),
                    deletion_cost: 0,
                    priority: 0,
                    job_fulfillment: (1, 1, PODS_PER_JOB as u32),
                })
                .collect();
            let chosen = state.plan_pool("vn", &deficit, &freeing, candidates, now, hysteresis);
            let mut jobs: Vec<&GangKey> = chosen.iter().map(|v| &v.job).collect();
            jobs.dedup();
            for job in jobs {
                picks.entry(job.to_string()).or_default().push(now);
            }
            for v in &chosen {
                if let Some(p) = pods.iter_mut().find(|p| p.key == v.key) {
                    p.noticed = Some(now);
                }
            }
            // The dispatcher admits one elastic pod per round where room is, to the job with
            // the fewest pods.
            if capacity - used >= POD_GPUS {
                let job = (0..3)
                    .map(|j| format!("job-{j}"))
                    .min_by_key(|j| pods.iter().filter(|p| &p.job == j).count())
                    .unwrap_or_default();
                if pods.iter().filter(|p| p.job == job).count() < PODS_PER_JOB {
                    next += 1;
                    pods.push(SimPod { key: format!("{job}-{next}"), job, noticed: None });
                }
            }
        }
        picks
    }

    #[test]
    fn a_deficit_shorter_than_the_hysteresis_window_reclaims_nothing() {
        // The HPA takes 6 GPUs for 900 ms, then gives them back for 2 s, over and over.
        let picks = simulate(&[(6, 900), (0, 2000)], 1, 0, 60_000);
        assert!(picks.is_empty(), "{picks:?}");
    }

    #[test]
    fn a_deficit_that_outlasts_the_window_is_reclaimed_only_after_the_window() {
        // The HPA takes 6 GPUs for 5 s out of every 10 s; hysteresis 1 s. Victims are picked,
        // and only from 1 s into a rise on.
        let picks = simulate(&[(6, 5000), (0, 5000)], 1, 0, 60_000);
        assert!(!picks.is_empty());
        let start = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        for at in picks.values().flatten() {
            let into_period = at.duration_since(start).as_millis() % 10_000;
            assert!((1000..5000).contains(&into_period), "picked {into_period} ms into a period");
        }
    }

    proptest! {
        /// No flapping: whatever the HPAs do, a job loses pods at most once per hysteresis
        /// window.
        #[test]
        fn at_most_one_reclaim_per_job_per_hysteresis_window(
            online in prop::collection::vec((0i64..=8, 100u64..6000), 1..6),
            hysteresis_s in 1i64..6,
            grace_ms in prop::sample::select(vec![0i64, 500, 3000]),
        ) {
            let online: Vec<(i64, u64)> = online.into_iter().map(|(g, ms)| (g * 2, ms)).collect();
            let picks = simulate(&online, hysteresis_s, grace_ms, 90_000);
            for (job, at) in &picks {
                for pair in at.windows(2) {
                    prop_assert!(
                        pair[1].duration_since(pair[0]) >= jiff::SignedDuration::from_secs(hysteresis_s),
                        "{job} reclaimed at {} and again at {} (window {hysteresis_s} s, online {online:?})",
                        pair[0], pair[1]
                    );
                }
            }
        }
    }
}
