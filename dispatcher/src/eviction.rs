//! A member's eviction requests for tidepool's copies, answered as reclaims.
//!
//! A member actor that speaks Kubernetes' `EvictionRequest` API (1.37, alpha) asks for a copy
//! to leave gracefully. Kubernetes 1.37 stores such requests but ships no controller that acts
//! on them, so tidepool answers the ones that target its copies itself, the way the copy's
//! managing controller would: the training pod gets the checkpoint notice (reason
//! `EvictionRequested`, the band's grace), the request's status says so
//! ([`keys::CONDITION_CHECKPOINT_NOTICE`]), and at the ack, the exit or the deadline the copy is
//! deleted and the request shows `TargetEvicted`. A request withdrawn (intent `Withdrawn`, or
//! deleted) before that withdraws the notice. Everything else about the reclaim (acks,
//! deadline, the training pod's end) is [`crate::reclaim`]'s.
//!
//! A request is answered only when it names the copy exactly: its namespace, name and UID.
//! Whoever may create eviction requests in one member namespace thus reaches only the copies
//! in that namespace, never another's through tidepool.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_federation::MemberHandle;
use tidepool_federation::eviction_requests::EvictionAsk;
use tracing::{info, warn};

use crate::context::{Context, publish};
use crate::eviction_status::{FAILED, asks_for, awaiting, canceled, write_status};
use crate::notice::{self as reclaim_notice, Cause};

/// What one copy's requests call for. Pure: from the reason of the training pod's notice,
/// if any, and the requests that name the copy.
#[derive(Debug, PartialEq, Eq)]
enum Answer<'a> {
    /// Send the notice, naming this request.
    Notice(&'a EvictionAsk),
    /// The notice is out: tell these requests, which do not show it yet.
    Report(Vec<&'a EvictionAsk>),
    /// Every request was withdrawn: withdraw the notice, and tell these (still there).
    Withdraw(Vec<&'a EvictionAsk>),
}

///
/// A notice the pod has acted on (`acted`: it acked or its containers exited) is never
/// withdrawn: the reclaim ends it, as it would any notice.
fn answer<'a>(notice_reason: Option<&str>, acted: bool, asks: &'a [EvictionAsk]) -> Option<Answer<'a>> {
    let mut wanted: Vec<&EvictionAsk> = asks.iter().filter(|a| a.wanted).collect();
    wanted.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    match notice_reason {
        None => wanted.first().map(|a| Answer::Notice(a)),
        Some(keys::REASON_EVICTION_REQUESTED) if wanted.is_empty() && !acted => {
            Some(Answer::Withdraw(asks.iter().filter(|a| !a.shows(FAILED)).collect()))
        }
        Some(_) => {
            let untold: Vec<_> = wanted.into_iter().filter(|a| !a.shows(keys::CONDITION_CHECKPOINT_NOTICE)).collect();
            (!untold.is_empty()).then_some(Answer::Report(untold))
        }
    }
}

/// Answers the eviction requests of every member that serves them: the step of the reclaim
/// pass that follows its own victims.
pub(crate) async fn answer_all(ctx: &Arc<Context>, pods: &[Arc<PodLite>], now: jiff::Timestamp) {
    let members = ctx.members.borrow().clone();
    for member in members.values().filter(|m| m.health.borrow().is_answering()) {
        let Some(asks) = member.eviction_requests.as_ref().and_then(|a| a.by_target()) else { continue };
        let on_member =
            pods.iter().filter(|p| p.is_live() && p.node_name().is_some_and(|n| member.pool_for_node(n).is_some()));
        for p in on_member {
            let reason = reclaim_notice::notice_reason(p);
            // Most passes: no request in the member, no notice of one to withdraw.
            if asks.is_empty() && reason != Some(keys::REASON_EVICTION_REQUESTED) {
                continue;
            }
            // A copy not known yet is left for a later pass (never read as "no request").
            let Some(copy_uid) = reclaim_notice::copy_uid(member, p) else { continue };
            let for_copy = asks_for(member, p, asks.get(&copy_uid).map_or(&[], Vec::as_slice));
            let acted = p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE) || p.status.containers_exited;
            let Some(todo) = answer(reason, acted, &for_copy) else { continue };
            match todo {
                Answer::Notice(ask) => notice(ctx, member, p, ask, now).await,
                Answer::Report(untold) => report(ctx, member, p, &untold).await,
                Answer::Withdraw(told) => withdraw(ctx, member, p, &told).await,
            }
        }
    }
}

async fn notice(ctx: &Arc<Context>, member: &MemberHandle, p: &PodLite, ask: &EvictionAsk, now: jiff::Timestamp) {
    info!(pod = %p.name_any(), request = %ask.key(), requester = ask.requester, "member asks to evict a copy");
    let cause = Cause {
        reason: keys::REASON_EVICTION_REQUESTED,
        text: format!("member {} asks to evict this pod's copy", member.name),
        demand: format!("EvictionRequest {} from {}", ask.key(), ask.requester),
    };
    reclaim_notice::notice(ctx, p, &cause, reclaim_notice::reclaim_band(p), "asked by the member", now).await;
    // The request hears of it at the next pass, from the pod's notice as written
    // ([`Answer::Report`]): never a notice it was not given.
}

/// Tells `asks` that `p` is under notice, and until when.
async fn report(ctx: &Context, member: &MemberHandle, p: &PodLite, asks: &[&EvictionAsk]) {
    let grace = &ctx.config.dispatcher.reclaim_grace_seconds;
    let until = reclaim_notice::deadline_of(p, grace).map_or_else(|| "its deadline".to_owned(), |d| d.to_string());
    let message = format!(
        "training pod {}/{} was told to checkpoint; its copy is deleted at the checkpoint's ack, \
         at the exit of its containers or at {until}",
        p.namespace().unwrap_or_default(),
        p.name_any()
    );
    let conditions = awaiting(&message, &Time(jiff::Timestamp::now()));
    for ask in asks {
        write_status(member, ask, &conditions).await;
    }
}

/// Withdraws `p`'s notice: no request asks for its copy any more. The pod keeps running; the
/// copy's deadline goes with the training pod's (vk-provider follows it).
async fn withdraw(ctx: &Arc<Context>, member: &MemberHandle, p: &PodLite, told: &[&EvictionAsk]) {
    ctx.wrote();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    let (name, now) = (p.name_any(), Time(jiff::Timestamp::now()));
    let message = format!("every eviction request of member {} for this pod's copy was withdrawn", member.name);
    let condition = |type_: &str| {
        json!({ "type": type_, "status": "False", "reason": keys::REASON_EVICTION_WITHDRAWN,
                "message": message, "lastTransitionTime": now })
    };
    let status = json!({ "status": { "conditions": [
        condition(keys::CONDITION_RECLAIM_REQUESTED), condition(keys::CONDITION_DISRUPTION_TARGET),
    ] } });
    if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(status)).await {
        warn!(pod = %name, error = %e, "cannot withdraw the reclaim notice; will retry");
        return;
    }
    let annotations = json!({ "metadata": { "annotations": {
        keys::ANNOTATION_RECLAIM_DEADLINE: null, keys::ANNOTATION_RECLAIM_DEMAND: null,
    } } });
    if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(annotations)).await {
        warn!(pod = %name, error = %e, "cannot remove the withdrawn reclaim deadline");
    }
    info!(pod = %name, "eviction requests withdrawn: reclaim notice withdrawn");
    crate::reclaim_request::withdrawn(ctx, p, &message).await;
    publish(ctx, p, EventType::Normal, keys::REASON_EVICTION_WITHDRAWN, &message).await;
    let conditions = canceled("withdrawn before the copy was evicted", &now);
    for ask in told {
        write_status(member, ask, &conditions).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(name: &str, wanted: bool, shows: &[&str]) -> EvictionAsk {
        EvictionAsk {
            namespace: "tp-team".into(),
            name: name.into(),
            requester: "acme.io/drain".into(),
            target_name: "trainer-0".into(),
            target_uid: "copy-1".into(),
            wanted,
            true_conditions: shows.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn a_wanted_request_for_a_copy_not_under_notice_sends_the_notice_naming_the_first() {
        let asks = [ask("b", true, &[]), ask("a", true, &[]), ask("c", false, &[])];
        assert_eq!(answer(None, false, &asks), Some(Answer::Notice(&asks[1])));
        assert_eq!(answer(None, false, &asks[2..]), None, "a withdrawn request asks nothing");
        assert_eq!(answer(None, false, &[]), None);
    }

    #[test]
    fn a_notice_out_is_reported_once_to_each_request_that_wants_it() {
        let asks = [ask("a", true, &[keys::CONDITION_CHECKPOINT_NOTICE]), ask("b", true, &[])];
        assert_eq!(answer(Some(keys::REASON_EVICTION_REQUESTED), false, &asks), Some(Answer::Report(vec![&asks[1]])));
        // A capacity reclaim already under way answers the request too.
        assert_eq!(answer(Some(keys::REASON_CAPACITY_RECLAIMED), false, &asks), Some(Answer::Report(vec![&asks[1]])));
        assert_eq!(answer(Some(keys::REASON_EVICTION_REQUESTED), false, &asks[..1]), None);
    }

    #[test]
    fn only_the_requests_own_notice_is_withdrawn_when_every_request_is() {
        let asks = [ask("a", false, &[]), ask("b", false, &[FAILED])];
        assert_eq!(answer(Some(keys::REASON_EVICTION_REQUESTED), false, &asks), Some(Answer::Withdraw(vec![&asks[0]])));
        assert_eq!(answer(Some(keys::REASON_EVICTION_REQUESTED), false, &[]), Some(Answer::Withdraw(vec![])));
        // A capacity reclaim is never withdrawn by a member's request.
        assert_eq!(answer(Some(keys::REASON_CAPACITY_RECLAIMED), false, &asks), None);
        assert_eq!(answer(Some(keys::REASON_GANG_RESTART), false, &[]), None);
        // The pod acked or exited: its reclaim ends it; withdrawing now would let its exit
        // read as the pod's own end.
        assert_eq!(answer(Some(keys::REASON_EVICTION_REQUESTED), true, &asks), None);
    }
}
