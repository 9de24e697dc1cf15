//! What eviction requests are told: the status conditions Kubernetes defines for a request
//! (the target under notice, evicted, the request canceled), written to a member's requests
//! for tidepool's copies (the `eviction` module) and to tidepool's own records of its reclaims
//! in the training cluster (`reclaim_request`).

use std::sync::Arc;

use k8s_openapi::api::lifecycle::v1alpha1::EvictionRequest;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_federation::MemberHandle;
use tidepool_federation::eviction_requests::EvictionAsk;
use tracing::warn;

use crate::context::Context;
use crate::reclaim_end::ReclaimEnd;

/// Condition types and reasons of the request's status that Kubernetes defines.
pub(crate) const TARGET_EVICTED: &str = "TargetEvicted";
pub(crate) const FAILED: &str = "Failed";
const AWAITING: &str = "AwaitingEviction";
const POD_DELETED: &str = "PodDeleted";
const CANCELED: &str = "CanceledDueToNoRequesters";

/// The status conditions of a request whose target is under notice (`message` says until
/// when): tidepool's notice, the target not evicted yet, the request not failed.
pub(crate) fn awaiting(message: &str, now: &Time) -> serde_json::Value {
    json!([
        { "type": keys::CONDITION_CHECKPOINT_NOTICE, "status": "True", "reason": "NoticeSent",
          "message": message, "lastTransitionTime": now },
        { "type": TARGET_EVICTED, "status": "False", "reason": AWAITING, "message": "", "lastTransitionTime": now },
        { "type": FAILED, "status": "False", "reason": AWAITING, "message": "", "lastTransitionTime": now },
    ])
}

/// The status conditions of a request whose notice was withdrawn (`message` says why).
pub(crate) fn canceled(message: &str, now: &Time) -> serde_json::Value {
    json!([
        { "type": keys::CONDITION_CHECKPOINT_NOTICE, "status": "False", "reason": keys::REASON_EVICTION_WITHDRAWN,
          "message": message, "lastTransitionTime": now },
        { "type": FAILED, "status": "True", "reason": CANCELED, "message": message, "lastTransitionTime": now },
    ])
}

/// The status conditions of a request whose target went (`target_reason`: `PodDeleted`,
/// `PodTerminal`) as the reclaim `end`ed, in `message`'s words.
pub(crate) fn ended(target_reason: &str, message: &str, end: &ReclaimEnd, now: &Time) -> serde_json::Value {
    let reason = match end.outcome() {
        "acknowledged" => "Acknowledged",
        "exited" => "Exited",
        _ => "DeadlinePassed",
    };
    json!([
        { "type": TARGET_EVICTED, "status": "True", "reason": target_reason, "message": message, "lastTransitionTime": now },
        { "type": keys::CONDITION_CHECKPOINT_NOTICE, "status": "True", "reason": reason,
          "message": end.to_string(), "lastTransitionTime": now },
    ])
}

/// Merges `conditions` into the status of request `name` (a strategic merge: by condition
/// type); one deleted meanwhile has nobody to tell.
pub(crate) async fn write_request_status(
    api: &Api<EvictionRequest>,
    name: &str,
    conditions: serde_json::Value,
) -> kube::Result<()> {
    let patch = Patch::Strategic(json!({ "status": { "conditions": conditions } }));
    match api.patch_status(name, &PatchParams::default(), &patch).await {
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// The requests of `found` (those naming `p`'s copy's UID) that name the copy in `member`
/// exactly (namespace, name, UID): one made in another namespace, or naming another pod, is
/// not for this copy.
pub(crate) fn asks_for(member: &MemberHandle, p: &PodLite, found: &[EvictionAsk]) -> Vec<EvictionAsk> {
    let (ns, name) = (member.namespaces.member_ns(&p.namespace().unwrap_or_default()), p.name_any());
    found.iter().filter(|a| a.namespace == ns && a.target_name == name).cloned().collect()
}

/// The reclaim of `p` ended and `freed` (its copy's member and UID) is deleted: every request
/// that named the copy shows it evicted, and how the checkpoint went.
pub(crate) async fn evicted(ctx: &Context, p: &PodLite, freed: Option<(Arc<MemberHandle>, String)>, end: &ReclaimEnd) {
    let Some((member, copy_uid)) = freed else { return };
    let Some(found) = member.eviction_requests.as_ref().and_then(|a| a.for_target(&copy_uid)) else { return };
    let asks = asks_for(&member, p, &found);
    if asks.is_empty() {
        return;
    }
    ctx.wrote();
    let conditions = ended(POD_DELETED, &format!("copy deleted: {end}"), end, &Time(jiff::Timestamp::now()));
    for ask in asks.iter().filter(|a| !a.shows(TARGET_EVICTED)) {
        write_status(&member, ask, &conditions).await;
    }
}

/// Merges `conditions` into the status of member request `ask`.
pub(crate) async fn write_status(member: &MemberHandle, ask: &EvictionAsk, conditions: &serde_json::Value) {
    let api = Api::<EvictionRequest>::namespaced(member.client.clone(), &ask.namespace);
    if let Err(e) = write_request_status(&api, &ask.name, conditions.clone()).await {
        warn!(member = %member.name, request = %ask.key(), error = %e, "cannot write eviction request status");
    }
}
