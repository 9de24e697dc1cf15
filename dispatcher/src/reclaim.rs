//! Reclaim: when online demand in a member grows past what its pool lends, take capacity
//! back from offload pods, lowest band first, with a checkpoint notice before anything is
//! deleted. The I/O around [`crate::victims`].
//!
//! Every step is recorded in the training cluster (deadline annotation, condition, final
//! `Failed`/`Reclaimed` status), so a restarted dispatcher picks up notices in flight. The
//! offload copy is deleted by vk-provider once the training pod is terminal.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_config::Resources;
use tidepool_config::keys::{self, Band};
use tidepool_config::metrics::{BandLabels, ReclaimLabels, metrics};
use tracing::{info, warn};

use crate::controller::{Context, is_live, node_of, publish, requests};
use crate::gang;
use crate::victims::{OffloadPodView, victims};

/// How often deficits and deadlines are checked.
const TICK: Duration = Duration::from_millis(100);

/// In-memory only: timings that are safe to lose on restart (a restart just waits one more
/// hysteresis window).
#[derive(Debug, Default)]
struct State {
    /// When each virtual node's current deficit was first seen.
    deficit_since: HashMap<String, jiff::Timestamp>,
    /// When each job last had victims picked.
    last_reclaim: HashMap<String, jiff::Timestamp>,
}

pub(crate) async fn run(ctx: Arc<Context>) {
    let mut state = State::default();
    loop {
        tokio::time::sleep(TICK).await;
        let now = jiff::Timestamp::now();
        let started = std::time::Instant::now();
        let pods = ctx.pods.state();
        pick_victims(&ctx, &pods, &mut state, now).await;
        preempt(&ctx, &pods, now).await;
        enforce_deadlines(&ctx, &pods, now).await;
        metrics().observe_sync("reclaim", started.elapsed());
    }
}

fn band_of(p: &Pod) -> Band {
    p.labels().get(keys::LABEL_BAND).and_then(|b| Band::parse(b)).unwrap_or(Band::Medium)
}

fn deadline_of(p: &Pod) -> Option<jiff::Timestamp> {
    p.annotations().get(keys::ANNOTATION_RECLAIM_DEADLINE)?.parse().ok()
}

/// Steps 1–3: deficit past hysteresis → victims → notice.
async fn pick_victims(ctx: &Context, pods: &[Arc<Pod>], state: &mut State, now: jiff::Timestamp) {
    let hysteresis = jiff::SignedDuration::from_secs(ctx.config.dispatcher.deficit_hysteresis_seconds as i64);
    let members = ctx.members.borrow().clone();
    // A member that does not answer shows a stale deficit: its pods are left as they are
    // (DESIGN.md "Failure and security rules") until it answers or is lost.
    for member in members.values().filter(|m| m.health.borrow().is_answering()) {
        for pool in &member.pools {
            let node = pool.node.to_string();
            let cap = pool.capacity.borrow().clone();
            let deficit = cap.deficit();
            if deficit.is_empty() {
                state.deficit_since.remove(&node);
                continue;
            }
            // 1. The deficit must outlast the hysteresis window.
            let since = *state.deficit_since.entry(node.clone()).or_insert(now);
            if now.duration_since(since) < hysteresis {
                continue;
            }
            let on_node: Vec<&Arc<Pod>> =
                pods.iter().filter(|p| is_live(p) && node_of(p) == Some(node.as_str())).collect();
            // Pods under notice, and reclaimed pods whose copy the member still shows, will
            // free their share: counting them again would take a second victim for the same
            // demand.
            let mut remaining = deficit.clone();
            let freeing = pods.iter().filter(|p| {
                node_of(p) == Some(node.as_str())
                    && deadline_of(p).is_some()
                    && p.metadata.uid.as_ref().is_some_and(|u| cap.placed.contains_key(u))
            });
            for p in freeing {
                remaining.sub(&requests(p));
            }
            remaining.clamp_non_negative();
            if remaining.is_empty() {
                continue;
            }
            // 2. Victims among the running offload pods of this pool.
            let mut jobs: BTreeMap<String, (u32, u32)> = BTreeMap::new();
            for p in &on_node {
                let e = jobs.entry(gang::gang_of(p).to_string()).or_default();
                e.1 += 1;
                if band_of(p) != Band::Low {
                    e.0 += 1;
                }
            }
            let candidates: Vec<OffloadPodView> = on_node
                .iter()
                .filter(|p| deadline_of(p).is_none())
                .filter_map(|p| {
                    let member_node = cap.placed.get(p.metadata.uid.as_ref()?)?.clone();
                    let (min, current) = jobs.get(&gang::gang_of(p).to_string()).copied().unwrap_or((1, 1));
                    Some(offload_view(p, member_node, (current, min, current)))
                })
                .collect();
            // At most one reclaim per job per hysteresis window, unless nothing else is left.
            let fresh: Vec<OffloadPodView> = candidates
                .iter()
                .filter(|c| state.last_reclaim.get(&c.job).is_none_or(|t| now.duration_since(*t) >= hysteresis))
                .cloned()
                .collect();
            let pool_candidates = if fresh.is_empty() { candidates } else { fresh };
            let chosen = victims(&remaining, &pool_candidates);
            for v in chosen {
                let Some(p) =
                    on_node.iter().find(|p| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()) == v.key)
                else {
                    continue;
                };
                state.last_reclaim.insert(v.job.clone(), now);
                let cause = format!("member {} needs capacity back for online demand", member.name);
                notice(ctx, p, &cause, &deficit, v.band, &v.reason, now).await;
            }
        }
    }
}

/// A pool preemption could use: what must be taken, its virtual node, the lower-band pods
/// there (as victim views and as pods).
type Candidate = (Resources, String, Vec<OffloadPodView>, Vec<Arc<Pod>>);

fn key_of(p: &Pod) -> String {
    format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any())
}

/// A running offload pod as victim selection sees it.
fn offload_view(p: &Pod, member_node: String, job_fulfillment: (u32, u32, u32)) -> OffloadPodView {
    OffloadPodView {
        key: key_of(p),
        job: gang::gang_of(p).to_string(),
        band: band_of(p),
        member_node,
        requests: requests(p),
        deletion_cost: p.annotations().get(keys::ANNOTATION_DELETION_COST).and_then(|c| c.parse().ok()).unwrap_or(0),
        job_fulfillment,
    }
}

/// Preemption: a pending gang above band `low` that fits nowhere may take capacity from
/// lower-band pods, through the same notice path as reclaim. One pool per gang: the one that
/// needs the least taken.
async fn preempt(ctx: &Context, pods: &[Arc<Pod>], now: jiff::Timestamp) {
    let mut pending = ctx.preempt.lock().map(|r| r.clone()).unwrap_or_default();
    pending.sort_by_key(|r| std::cmp::Reverse(r.band));
    let members = ctx.members.borrow().clone();
    for r in pending {
        let mut best: Option<Candidate> = None;
        let mut room = false;
        // Nothing can be freed on a member that does not answer: its pods stay as they are.
        'members: for member in members.values().filter(|m| !m.paused && m.health.borrow().is_answering()) {
            for pool in &member.pools {
                let node = pool.node.to_string();
                let cap = pool.capacity.borrow().clone();
                let placed = |p: &Pod| p.metadata.uid.as_ref().is_some_and(|u| cap.placed.contains_key(u));
                let on_node: Vec<Arc<Pod>> =
                    pods.iter().filter(|p| node_of(p) == Some(node.as_str()) && placed(p)).cloned().collect();
                // What is free, plus what pods under notice are about to free.
                let mut available = cap.capacity.clone();
                available.sub(&cap.used);
                for p in on_node.iter().filter(|p| deadline_of(p).is_some()) {
                    available.add(&requests(p));
                }
                let mut need = r.demand.clone();
                need.sub(&available);
                need.clamp_non_negative();
                if need.is_empty() {
                    // Enough is free or being freed here already: nothing more to take.
                    room = true;
                    break 'members;
                }
                let lower: Vec<&Arc<Pod>> =
                    on_node.iter().filter(|p| is_live(p) && deadline_of(p).is_none() && band_of(p) < r.band).collect();
                let mut takeable = Resources::new();
                lower.iter().for_each(|p| takeable.add(&requests(p)));
                if !need.fits_in(&takeable) {
                    continue;
                }
                let views = lower
                    .iter()
                    .filter_map(|p| {
                        let member_node = cap.placed.get(p.metadata.uid.as_ref()?)?.clone();
                        Some(offload_view(p, member_node, (1, 1, 1)))
                    })
                    .collect();
                let smaller = best.as_ref().is_none_or(|(n, ..)| {
                    (need.get(tidepool_federation::capacity::GPU), need.get("cpu"))
                        < (n.get(tidepool_federation::capacity::GPU), n.get("cpu"))
                });
                if smaller {
                    best = Some((need, node.clone(), views, on_node.clone()));
                }
            }
        }
        if room {
            continue;
        }
        let Some((need, node, views, on_node)) = best else { continue };
        for v in victims(&need, &views) {
            let Some(p) = on_node.iter().find(|p| key_of(p) == v.key) else { continue };
            let cause = format!("higher-band gang {} ({}) needs room on {node}", r.gang, r.band.as_str());
            notice(ctx, p, &cause, &need, v.band, &v.reason, now).await;
        }
    }
}

/// Step 3: the checkpoint notice: deadline annotation, condition, Event.
async fn notice(
    ctx: &Context,
    pod: &Pod,
    cause: &str,
    deficit: &Resources,
    band: Band,
    why: &str,
    now: jiff::Timestamp,
) {
    let grace = ctx.config.dispatcher.reclaim_grace_seconds.get(band);
    let deadline = now + jiff::SignedDuration::from_secs(grace as i64);
    let deadline_text = deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let name = pod.name_any();
    let patch = json!({ "metadata": { "annotations": {
        keys::ANNOTATION_RECLAIM_DEADLINE: deadline_text,
        keys::ANNOTATION_RECLAIM_DEMAND: deficit.nonzero().to_string(),
    } } });
    if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await {
        warn!(pod = %name, error = %e, "cannot write reclaim notice; will retry");
        return;
    }
    let message = format!(
        "{cause} ({}); checkpoint and exit, or set annotation {} — deleted at {deadline_text} ({why})",
        deficit.nonzero(),
        keys::ANNOTATION_CHECKPOINT_DONE
    );
    let status = json!({ "status": { "conditions": [{
        "type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": "CapacityReclaimed",
        "message": message, "lastTransitionTime": Time(now),
    }]}});
    if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(status)).await {
        warn!(pod = %name, error = %e, "cannot write ReclaimRequested condition");
    }
    info!(pod = %name, cause, band = band.as_str(), deadline = %deadline_text, "reclaim notice sent");
    metrics().reclaim_notices.get_or_create(&BandLabels { band: band.as_str() }).inc();
    publish(ctx, pod, EventType::Warning, "ReclaimRequested", &message).await;
}

/// Steps 4–5: ack or deadline → the training pod fails with reason `Reclaimed`.
async fn enforce_deadlines(ctx: &Context, pods: &[Arc<Pod>], now: jiff::Timestamp) {
    for p in pods.iter().filter(|p| is_live(p)) {
        let Some(deadline) = deadline_of(p) else { continue };
        let acked = p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE);
        let exited = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).is_some_and(|cs| {
            !cs.is_empty() && cs.iter().all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
        });
        if !(acked || exited || now >= deadline) {
            continue;
        }
        let member = node_of(p)
            .and_then(|n| {
                ctx.members.borrow().values().find(|m| m.pool_for_node(n).is_some()).map(|m| m.name.to_string())
            })
            .unwrap_or_else(|| node_of(p).unwrap_or("?").to_owned());
        let how = if acked {
            "checkpoint acknowledged"
        } else if exited {
            "containers exited after the notice"
        } else {
            "checkpoint not acknowledged before the deadline"
        };
        let demand = p.annotations().get(keys::ANNOTATION_RECLAIM_DEMAND).map_or("capacity", String::as_str);
        let message = format!("reclaimed by member {member} for online demand ({demand}); {how}");
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
        let status = json!({ "status": { "phase": "Failed", "reason": keys::REASON_RECLAIMED, "message": message } });
        match api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(status)).await {
            Ok(_) => {
                info!(pod = %p.name_any(), acked, "reclaimed");
                let band = band_of(p);
                let outcome = if acked {
                    "acknowledged"
                } else if exited {
                    "exited"
                } else {
                    "deadline"
                };
                let labels = ReclaimLabels { member: member.clone(), band: band.as_str(), outcome };
                metrics().reclaims.get_or_create(&labels).inc();
                if acked {
                    // The notice went out one grace period before the deadline.
                    let grace = ctx.config.dispatcher.reclaim_grace_seconds.get(band) as i64;
                    let noticed = deadline - jiff::SignedDuration::from_secs(grace);
                    let waited = now.duration_since(noticed).as_secs_f64().max(0.0);
                    metrics().checkpoint_ack_seconds.observe(waited);
                }
                publish(ctx, p, EventType::Warning, keys::REASON_RECLAIMED, &message).await;
            }
            Err(e) => warn!(pod = %p.name_any(), error = %e, "cannot mark pod reclaimed; will retry"),
        }
    }
}
