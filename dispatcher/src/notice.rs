//! One pod's reclaim, from the notice to its end: the checkpoint notice (condition, deadline,
//! Event), the copy freed in the member, and the training pod's final status. The pass that
//! decides whom to notice and when a notice is due is [`crate::reclaim`]'s; a member's
//! eviction requests come in through the `eviction` module.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::Resources;
use tidepool_api::bridge::BandSeconds;
use tidepool_api::keys::{self, Band};
use tidepool_api::metrics::{BandLabels, ReclaimLabels, metrics};
use tidepool_api::pod::PodLite;
use tidepool_api::terminal::{Ending, terminal_status};
use tidepool_federation::MemberHandle;
use tracing::{info, warn};

use crate::context::{Context, publish};
use crate::reclaim_end::ReclaimEnd;

/// The band a pod on a virtual node is reclaimed as: the one the dispatcher gave it
/// ([`tidepool_api::pod::band_of`]). A pod bound by hand is elastic (`low`), whatever its
/// priority or labels: it was never admitted as any gang's core.
pub(crate) fn reclaim_band(p: &PodLite) -> Band {
    tidepool_api::pod::band_of(&p.metadata, p.node_name()).unwrap_or(Band::Low)
}

/// When the reclaim notice of `p` ends, if it is under notice.
///
/// The notice is tidepool's `tidepool.io/ReclaimRequested` condition (status `True`): pod
/// status is written through `pods/status`, which tenants are not granted, while the
/// `tidepool.io/reclaim-deadline` annotation is the trainer's copy and any tenant can write
/// it. So an annotation without the condition is no notice (the pod stays a candidate), and
/// one with it can bring the deadline forward but never past the condition's time plus the
/// band's grace.
pub(crate) fn deadline_of(p: &PodLite, grace: &BandSeconds) -> Option<jiff::Timestamp> {
    let notice = p
        .status
        .tidepool_conditions()
        .iter()
        .find(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED && c.status == "True")?;
    let annotated: Option<jiff::Timestamp> =
        p.annotations().get(keys::ANNOTATION_RECLAIM_DEADLINE).and_then(|d| d.parse().ok());
    let latest = notice
        .last_transition_time
        .as_ref()
        .map(|t| t.0 + jiff::SignedDuration::from_secs(i64::try_from(grace.get(reclaim_band(p))).unwrap_or(i64::MAX)));
    match (annotated, latest) {
        (Some(a), Some(l)) => Some(a.min(l)),
        (a, l) => a.or(l),
    }
}

/// A reclaim notice: its conditions and message. A pod reclaimed at once (no checkpoint grace
/// in its band) has them written and published with its final status.
struct Notice {
    /// `tidepool.io/ReclaimRequested` and the standard `DisruptionTarget`.
    conditions: [serde_json::Value; 2],
    message: String,
}

impl Notice {
    fn new(reason: &str, message: String, now: jiff::Timestamp) -> Self {
        let condition = json!({
            "type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": reason,
            "message": message, "lastTransitionTime": Time(now),
        });
        Self { conditions: [condition, disruption_target(now, &message)], message }
    }
}

/// The `DisruptionTarget` condition of a reclaim ([`tidepool_api::terminal::disruption_target`]).
fn disruption_target(now: jiff::Timestamp, message: &str) -> serde_json::Value {
    let c = tidepool_api::terminal::disruption_target(keys::REASON_DISRUPTION_RECLAIM, message, &Time(now));
    serde_json::to_value(c).unwrap_or_default()
}

/// Why a reclaim notice goes out: online demand in the member, or one of the member's
/// eviction requests (the `eviction` module).
pub(crate) struct Cause {
    /// The reason of the `tidepool.io/ReclaimRequested` condition.
    pub reason: &'static str,
    /// Who needs the pod gone (`member a needs capacity back for online demand`).
    pub text: String,
    /// What it answers, for the messages and the final status: the demand
    /// (`nvidia.com/gpu=2`) or the request (`EvictionRequest ns/name from acme.io/drain`).
    pub demand: String,
}

impl Cause {
    pub(crate) fn online(text: String, deficit: &Resources) -> Self {
        Self { reason: keys::REASON_CAPACITY_RECLAIMED, text, demand: deficit.nonzero().to_string() }
    }
}

/// Step 3: the checkpoint notice: deadline annotation, condition, Event.
pub(crate) async fn notice(
    ctx: &Arc<Context>,
    pod: &PodLite,
    cause: &Cause,
    band: Band,
    why: &str,
    now: jiff::Timestamp,
) {
    ctx.wrote();
    let grace = ctx.config.dispatcher.reclaim_grace_seconds.get(band);
    let deadline = now + jiff::SignedDuration::from_secs(grace as i64);
    let deadline_text = deadline.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let name = pod.name_any();
    let patch = json!({ "metadata": { "annotations": {
        keys::ANNOTATION_RECLAIM_DEADLINE: deadline_text,
        keys::ANNOTATION_RECLAIM_DEMAND: cause.demand,
    } } });
    let (pp, patch) = (PatchParams::default(), Patch::Merge(patch));
    let annotate = api.patch(&name, &pp, &patch);
    let message = format!(
        "{} ({}); checkpoint and exit, or set annotation {} — deleted at {deadline_text} ({why})",
        cause.text,
        cause.demand,
        keys::ANNOTATION_CHECKPOINT_DONE
    );
    info!(pod = %name, cause = cause.text, band = band.as_str(), deadline = %deadline_text, "reclaim notice sent");
    metrics().reclaim_notices.get_or_create(&BandLabels { band: band.as_str() }).inc();
    let notice = Notice::new(cause.reason, message, now);
    if grace == 0 {
        // No checkpoint time in this band: the pod goes now, not at the next check (which
        // would wait for the notice to come back through the watch). The notice, which
        // stays as the record, is written alongside the copy's deletion; the final status,
        // with the notice's condition in it, once the copy is gone (see [`mark_reclaimed`]).
        let end = ReclaimEnd::NoGrace(band);
        let (annotated, freed) = tokio::join!(annotate, free_copy(ctx, pod));
        crate::reclaim_request::noticed(ctx, pod, &notice.message).await;
        record_reclaimed(ctx, pod, (cause.reason, &cause.demand), &end, Some(&notice)).await;
        crate::eviction_status::evicted(ctx, pod, freed, &end).await;
        if let Err(e) = annotated {
            warn!(pod = %name, error = %e, "cannot write reclaim notice on a pod reclaimed at once");
        }
        return;
    }
    // The condition is the notice (see [`deadline_of`]), so it goes first: a pod never shows
    // the annotation without it, when it would read as a candidate again.
    let status = json!({ "status": { "conditions": notice.conditions } });
    if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(status)).await {
        warn!(pod = %name, error = %e, "cannot write ReclaimRequested condition; will retry");
        return;
    }
    // The trainer's copy of the deadline; without it the condition still holds the notice.
    if let Err(e) = annotate.await {
        warn!(pod = %name, error = %e, "cannot write the reclaim deadline annotation");
    }
    crate::reclaim_request::noticed(ctx, pod, &notice.message).await;
    publish_later(ctx, pod, vec![(EventType::Warning, keys::REASON_RECLAIM_REQUESTED, notice.message)]);
}

/// Publishes `events` on `pod`, in order, in a task of their own: the next pass does not
/// wait for the Events of this one. One pod's Events at a time: they are the least urgent
/// writes of a reclaim, and a pass that takes many victims should not send them all at once
/// beside the writes that free capacity.
fn publish_later(ctx: &Arc<Context>, pod: &PodLite, events: Vec<(EventType, &'static str, String)>) {
    static TURN: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let (ctx, pod) = (ctx.clone(), pod.clone());
    tokio::spawn(async move {
        let _turn = TURN.acquire().await;
        for (type_, reason, note) in events {
            publish(&ctx, &pod, type_, reason, &note).await;
        }
    });
}

/// Step 5: the offload copy is deleted in the member and the training pod fails with reason
/// `Reclaimed`; `end` says whether the checkpoint was acknowledged.
///
/// The capacity goes back first: online pods wait for the copy's deletion, nobody waits for
/// the training pod's status. So the member's delete is not queued behind training writes
/// in this process or at the API servers, and the status follows once the delete returns.
pub(crate) async fn mark_reclaimed(ctx: &Arc<Context>, p: &PodLite, end: &ReclaimEnd) {
    let demand = p.annotations().get(keys::ANNOTATION_RECLAIM_DEMAND).map_or("capacity", String::as_str);
    let reason = notice_reason(p).unwrap_or(keys::REASON_CAPACITY_RECLAIMED);
    let freed = free_copy(ctx, p).await;
    record_reclaimed(ctx, p, (reason, demand), end, None).await;
    crate::eviction_status::evicted(ctx, p, freed, end).await;
}

/// The reason of `p`'s reclaim notice (its true `tidepool.io/ReclaimRequested` condition).
pub(crate) fn notice_reason(p: &PodLite) -> Option<&str> {
    p.status
        .tidepool_conditions()
        .iter()
        .find(|c| c.type_ == keys::CONDITION_RECLAIM_REQUESTED && c.status == "True")
        .and_then(|c| c.reason.as_deref())
}

/// The member handle of the pool `p` is placed on, if any.
fn member_of(ctx: &Context, p: &PodLite) -> Option<Arc<MemberHandle>> {
    let node = p.node_name()?;
    ctx.members.borrow().values().find(|m| m.pool_for_node(node).is_some()).cloned()
}

/// Has vk-provider delete the copy of reclaimed pod `p` now, and waits for the member's
/// answer. The pod sync would delete it too once the `Failed` status comes back through its
/// watch; online pods waiting for the room should not wait for that. The copy's member and
/// UID, when known.
async fn free_copy(ctx: &Context, p: &PodLite) -> Option<(Arc<MemberHandle>, String)> {
    let member = member_of(ctx, p)?;
    let copy_uid = copy_uid(&member, p);
    ctx.copies.free_copy(Arc::new(p.clone()), member.clone(), copy_uid.clone()).await;
    Some((member, copy_uid?))
}

/// The UID of `p`'s copy in `member`, as the member's pool shows it.
pub(crate) fn copy_uid(member: &MemberHandle, p: &PodLite) -> Option<String> {
    let uid = p.metadata.uid.as_deref()?;
    let pool = member.pool_for_node(p.node_name()?)?;
    let cap = pool.capacity.borrow();
    cap.placed.get(uid).and_then(|c| c.copy_uid.as_deref().map(str::to_owned))
}

/// Writes the reclaimed end of pod `name` (see [`tidepool_api::terminal`]) over the version
/// just read, reading again if it changed meanwhile (its copy's last status coming up).
async fn write_reclaimed(api: &Api<Pod>, name: &str, message: &str, extra: &[PodCondition]) -> kube::Result<()> {
    let end = Ending { reason: keys::REASON_RECLAIMED, message, disruption: Some(keys::REASON_DISRUPTION_RECLAIM) };
    let mut tries = 0;
    loop {
        let pod = api.get(name).await?;
        let status = terminal_status(pod.status.as_ref(), &end, extra, &Time(jiff::Timestamp::now()));
        let patch = json!({ "metadata": { "resourceVersion": pod.metadata.resource_version }, "status": status });
        match api.patch_status(name, &PatchParams::default(), &Patch::Merge(patch)).await {
            Err(e) if tidepool_federation::api_code(&e, &[409]) && tries < 3 => tries += 1,
            other => return other.map(|_| ()),
        }
    }
}

/// The training pod's end: `Failed`, reason `Reclaimed`, then its Events. A pod reclaimed at
/// once brings its `notice` along. `cause` is the notice's reason and what it answered.
async fn record_reclaimed(
    ctx: &Arc<Context>,
    p: &PodLite,
    (reason, demand): (&str, &str),
    end: &ReclaimEnd,
    notice: Option<&Notice>,
) {
    let member = member_of(ctx, p).map_or_else(|| p.node_name().unwrap_or("?").to_owned(), |m| m.name.to_string());
    let message = if reason == keys::REASON_EVICTION_REQUESTED {
        format!("evicted by member {member} at its {demand}; {end}")
    } else {
        format!("reclaimed by member {member} for online demand ({demand}); {end}")
    };
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    let name = p.name_any();
    let extra: Vec<PodCondition> = notice
        .map(|n| n.conditions.iter().filter_map(|c| serde_json::from_value(c.clone()).ok()).collect())
        .unwrap_or_default();
    let written = if tidepool_api::pod::placed_natively(&p.metadata, p.node_name()) {
        crate::native::end(&api, &name, keys::REASON_DISRUPTION_RECLAIM, &message).await
    } else {
        write_reclaimed(&api, &name, &message, &extra).await
    };
    match written {
        Ok(_) => {
            info!(pod = %name, how = %end, "reclaimed");
            crate::reclaim_request::ended(ctx, p, end, &message).await;
            let labels = ReclaimLabels { member, band: reclaim_band(p).as_str(), outcome: end.outcome() };
            metrics().reclaims.get_or_create(&labels).inc();
            let mut events = Vec::with_capacity(2);
            if let Some(n) = notice {
                events.push((EventType::Warning, keys::REASON_RECLAIM_REQUESTED, n.message.clone()));
            }
            events.push((EventType::Warning, keys::REASON_RECLAIMED, message));
            publish_later(ctx, p, events);
        }
        Err(e) => warn!(pod = %name, error = %e, "cannot mark pod reclaimed; will retry"),
    }
}
