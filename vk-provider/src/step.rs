//! The pod sync's decision table: from what is known of one training pod bound to a virtual
//! node, the next step to take. Pure; [`crate::pods`] gathers the facts and carries the step
//! out. Each row below is one of the sync's cases, in the order they are judged.
//!
//! | # | facts | step |
//! |---|-------|------|
//! | 0a | member lost (past the loss timeout), pod live | [`Step::Fail`] `MemberLost` |
//! | 0b | member not answering | [`Step::Requeue`] later; nothing touched anywhere |
//! | 0c | member's offload watch not listed yet | [`Step::Requeue`] soon |
//! | 1 | pod being deleted, copy there | [`Step::DeleteCopy`] with the pod's grace (once), then look again |
//! | 1' | pod being deleted, no copy | [`Step::FinishDeletion`] |
//! | 2 | the copy's name taken by a copy of ours of an earlier pod of that name (an operator made the pod again at once), being deleted | [`Step::Requeue`] until it is gone |
//! | 2a | the same, not being deleted (its pod is gone: names are unique) | [`Step::DeleteStale`], then look again |
//! | 2b | the copy's name taken by a copy of a pod of another namespace | [`Step::Conflict`] |
//! | 2c | pod ended, no copy | [`Step::Forget`] |
//! | 3 | no copy, pod ran in the member, copy freed for a reclaim | [`Step::Requeue`] until the hand-over ends |
//! | 3' | no copy, pod ran in the member | [`Step::Fail`] with the member's disruption reason |
//! | 4–6 | no copy, pod never ran | [`Step::Offload`]: policy, translation, references, create |
//! | 7a | copy there, not being deleted, freed for a reclaim | [`Step::Requeue`] until the hand-over ends |
//! | 7 | pod ended, copy ended too | [`Step::Wait`]: kept, with its logs, until the pod's deletion (row 1) |
//! | 7' | pod ended, copy still running | [`Step::DeleteCopy`] at once (if not already being deleted) |
//! | 8a | copy being deleted by the member, freed for a reclaim | [`Step::Requeue`] until the hand-over ends |
//! | 8a' | copy being deleted by the member | [`Step::Fail`] with the member's disruption reason |
//! | 8–10 | copy there and running | [`Step::Follow`]: notice down, references current, status up |

use std::time::Duration;

use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_federation::Health;

use crate::offload::OffloadPod;
use crate::translate;

/// When a pod whose member does not answer is looked at again (the member answering again
/// triggers every pod sooner).
pub const RESYNC: Duration = Duration::from_secs(300);
/// When a pod is looked at again while its member's offload watch lists.
pub const LISTING: Duration = Duration::from_secs(1);
/// When a pod whose deletion waits for its copy to go is looked at again.
pub const DELETING: Duration = Duration::from_secs(5);
/// When a pod whose copy's name is taken by a pod not of ours is looked at again.
pub const CONFLICT: Duration = Duration::from_secs(60);
/// When a pod whose copy's name an earlier pod's copy still holds is looked at again.
pub const STALE: Duration = Duration::from_millis(500);

/// What the sync knows of one training pod when it decides.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// The training pod, as the shared cache holds it.
    pub pod: &'a PodLite,
    /// The member's health.
    pub health: &'a Health,
    /// Whether the member's offload watch has listed (until then, no copy is known).
    pub listed: bool,
    /// The member pod named as the pod's copy would be, if any (ours or not).
    pub existing: Option<&'a OffloadPod>,
    /// How much longer the dispatcher owns this pod's ending, if it freed the copy for a
    /// reclaim (see [`crate::handover`]).
    pub handed_over: Option<Duration>,
}

/// The next step for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing until the pod, its copy or its member changes.
    Wait,
    /// Look again after this long (or sooner, on a change).
    Requeue(Duration),
    /// The training pod fails with `reason`; `cause` finishes the message.
    Fail { reason: &'static str, cause: Cause },
    /// Delete the copy with `grace` seconds (`None`: the copy's own), then `then`.
    DeleteCopy { grace: Option<u32>, then: Then },
    /// The copy is gone: finish deleting the training pod.
    FinishDeletion,
    /// Delete the copy of an earlier pod of this name, which holds the name this pod's copy
    /// needs, then look again.
    DeleteStale,
    /// The copy's name is taken in the member by a pod that is not this pod's copy.
    Conflict,
    /// The pod ended with no copy left: forget what it was waiting for.
    Forget,
    /// Make the copy.
    Offload,
    /// Follow the running copy: notice down, references current, status up.
    Follow,
}

/// What follows a [`Step::DeleteCopy`] (or the copy already being deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Look again after [`DELETING`]: the training pod's deletion waits for the copy.
    LookAgain,
    /// Nothing: the copy's going brings the next change.
    Wait,
}

/// Why a pod fails, for its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// The member has not answered past the loss timeout.
    MemberLost,
    /// The copy went (or is going) in the member without our deleting it; the phrase says how,
    /// `target` is the reason of the member's `DisruptionTarget` condition, when it gave one.
    Disrupted { how: &'static str, target: Option<String> },
}

/// The next step for the pod in `facts`.
pub fn next_step(facts: &Facts<'_>) -> Step {
    let Facts { pod, health, listed, existing, handed_over } = *facts;
    if health.lost && pod.is_live() {
        return Step::Fail { reason: keys::REASON_MEMBER_LOST, cause: Cause::MemberLost };
    }
    if !health.is_answering() {
        return Step::Requeue(RESYNC);
    }
    if !listed {
        return Step::Requeue(LISTING);
    }
    let copy = existing.filter(|o| o.is_copy_of(pod));
    if pod.metadata.deletion_timestamp.is_some() {
        return match copy {
            Some(c) if !c.deleting() => {
                let grace = pod.metadata.deletion_grace_period_seconds.map(|g| g.max(0) as u32);
                Step::DeleteCopy { grace, then: Then::LookAgain }
            }
            Some(_) => Step::Requeue(DELETING),
            None => Step::FinishDeletion,
        };
    }
    match copy {
        None => without_copy(pod, existing, handed_over),
        Some(copy) => with_copy(pod, copy, handed_over),
    }
}

/// Rows 2–6. `taken` is a copy of ours with this pod's copy's name but another origin.
fn without_copy(pod: &PodLite, taken: Option<&OffloadPod>, handed_over: Option<Duration>) -> Step {
    if let Some(other) = taken {
        let same_namespace = other.origin_name().map(|(ns, _)| ns) == pod.metadata.namespace.as_deref();
        return match (same_namespace, other.deleting()) {
            (true, true) => Step::Requeue(STALE),
            (true, false) => Step::DeleteStale,
            (false, _) => Step::Conflict,
        };
    }
    if pod.is_terminal() {
        return Step::Forget;
    }
    if pod.status.host_ip.is_none() {
        return Step::Offload;
    }
    if let Some(left) = handed_over {
        return Step::Requeue(left);
    }
    let target = pod.status.disruption();
    let (reason, how) = translate::member_disruption(target);
    Step::Fail { reason, cause: Cause::Disrupted { how, target: target.map(str::to_owned) } }
}

/// Whether the member reports the copy `Succeeded` or `Failed`.
fn copy_ended(copy: &OffloadPod) -> bool {
    copy.status().and_then(|s| s.phase).is_some_and(|p| p == "Succeeded" || p == "Failed")
}

/// Rows 7–10.
fn with_copy(pod: &PodLite, copy: &OffloadPod, handed_over: Option<Duration>) -> Step {
    let deleting = copy.deleting();
    match (pod.is_terminal(), deleting, handed_over) {
        // The dispatcher is deleting the copy, reclaiming the pod: neither a second delete
        // nor the notice is worth a member write.
        (_, false, Some(left)) => Step::Requeue(left),
        // A copy that ended in the member holds nothing there and keeps its containers' logs
        // for `kubectl logs`, as a native node keeps an ended pod's: it goes with its pod. A
        // copy still running for a pod that ended here (a gang rolled back, a lost member, a
        // pod failed by hand) goes at once.
        (true, false, None) if copy_ended(copy) => Step::Wait,
        (true, false, None) => Step::DeleteCopy { grace: Some(0), then: Then::Wait },
        (true, true, _) => Step::Wait,
        (false, true, Some(left)) => Step::Requeue(left),
        (false, true, None) => {
            let status = copy.status();
            let target = translate::disruption_reason(status.as_ref());
            let (reason, how) = translate::member_disruption(target);
            Step::Fail { reason, cause: Cause::Disrupted { how, target: target.map(str::to_owned) } }
        }
        (false, false, None) => Step::Follow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::json;

    fn training(status: serde_json::Value, deleting: bool) -> PodLite {
        let mut meta = json!({"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "7"});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
            meta["deletionGracePeriodSeconds"] = json!(30);
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": meta,
            "spec": {"nodeName": "tidepool-m", "containers": [{"name": "c", "image": "i"}]},
            "status": status,
        }))
        .unwrap();
        PodLite::from(pod)
    }

    fn pending() -> PodLite {
        training(json!({"phase": "Pending"}), false)
    }

    /// A pod whose copy ran (the virtual node's address is its host IP).
    fn ran(phase: &str) -> PodLite {
        training(json!({"phase": phase, "hostIP": "10.0.0.1"}), false)
    }

    fn member_pod(origin: &str, deleting: bool, status: serde_json::Value) -> OffloadPod {
        of_namespace(origin, "ns", deleting, status)
    }

    /// A copy of ours of pod `origin_ns/p` whose origin UID is `origin`.
    fn of_namespace(origin: &str, origin_ns: &str, deleting: bool, status: serde_json::Value) -> OffloadPod {
        let mut meta = json!({
            "name": "p", "namespace": "ns", "uid": "c1",
            "labels": {keys::LABEL_ORIGIN_UID: origin},
            "annotations": {keys::ANNOTATION_ORIGIN_NAMESPACE: origin_ns, keys::ANNOTATION_ORIGIN_NAME: "p"},
        });
        if deleting {
            meta["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
        }
        let pod: Pod =
            serde_json::from_value(json!({"metadata": meta, "spec": {"containers": []}, "status": status})).unwrap();
        OffloadPod::from(pod)
    }

    fn copy() -> OffloadPod {
        member_pod("u1", false, json!({"phase": "Running"}))
    }

    fn healthy() -> Health {
        Health::default()
    }

    fn decide(pod: &PodLite, existing: Option<&OffloadPod>, handed_over: Option<Duration>) -> Step {
        next_step(&Facts { pod, health: &healthy(), listed: true, existing, handed_over })
    }

    const HELD: Option<Duration> = Some(Duration::from_secs(3));

    #[test]
    fn row_0_the_members_health_comes_first() {
        let lost = Health { unreachable: Some("timeout".into()), lost: true, ..Default::default() };
        let facts = |pod, health| Facts { pod, health, listed: true, existing: None, handed_over: None };
        let running = ran("Running");
        assert_eq!(
            next_step(&facts(&running, &lost)),
            Step::Fail { reason: keys::REASON_MEMBER_LOST, cause: Cause::MemberLost }
        );
        // An ended pod of a lost member is not failed again; nothing is touched anywhere.
        let ended = ran("Succeeded");
        assert_eq!(next_step(&facts(&ended, &lost)), Step::Requeue(RESYNC));
        let unreachable = Health { unreachable: Some("timeout".into()), ..Default::default() };
        assert_eq!(next_step(&facts(&running, &unreachable)), Step::Requeue(RESYNC));
        let refused = Health { refused: Some("401".into()), ..Default::default() };
        assert_eq!(next_step(&facts(&running, &refused)), Step::Requeue(RESYNC));
        // Unusable credentials stop new placements, not the sync of what runs.
        let unusable = Health { unusable: Some(("InvalidSpec".into(), "bad".into())), ..Default::default() };
        assert_eq!(
            next_step(&facts(&running, &unusable)),
            Step::Fail { reason: "OffloadPodLost", cause: Cause::Disrupted { how: "disappeared", target: None } }
        );
        let fine = healthy();
        let unlisted = Facts { listed: false, ..facts(&running, &fine) };
        assert_eq!(next_step(&unlisted), Step::Requeue(LISTING));
    }

    #[test]
    fn row_1_a_deleted_pod_deletes_its_copy_first_with_its_grace() {
        let deleting = training(json!({"phase": "Running", "hostIP": "10.0.0.1"}), true);
        assert_eq!(decide(&deleting, Some(&copy()), None), Step::DeleteCopy { grace: Some(30), then: Then::LookAgain });
        let going = member_pod("u1", true, json!({"phase": "Running"}));
        assert_eq!(decide(&deleting, Some(&going), None), Step::Requeue(DELETING), "deleted once");
        assert_eq!(decide(&deleting, None, None), Step::FinishDeletion);
        // A same-named pod of another origin is not its copy: the deletion finishes.
        assert_eq!(decide(&deleting, Some(&member_pod("other", false, json!({}))), None), Step::FinishDeletion);
    }

    #[test]
    fn rows_2_to_6_without_a_copy() {
        // An operator made the pod again under its name while the last one's copy was going.
        let going = member_pod("earlier", true, json!({"phase": "Running"}));
        assert_eq!(decide(&pending(), Some(&going), None), Step::Requeue(STALE), "no conflict: it is leaving");
        let left = member_pod("earlier", false, json!({"phase": "Failed"}));
        assert_eq!(
            decide(&pending(), Some(&left), None),
            Step::DeleteStale,
            "the earlier pod is gone: so goes its copy"
        );
        // Two training namespaces mapped to one member namespace: never deleted, reported.
        let other_ns = of_namespace("other", "tp-ns", false, json!({"phase": "Running"}));
        assert_eq!(decide(&pending(), Some(&other_ns), None), Step::Conflict);
        assert_eq!(decide(&ran("Failed"), None, None), Step::Forget);
        assert_eq!(decide(&pending(), None, None), Step::Offload);
        assert_eq!(decide(&ran("Running"), None, HELD), Step::Requeue(Duration::from_secs(3)));
        assert_eq!(
            decide(&ran("Running"), None, None),
            Step::Fail { reason: "OffloadPodLost", cause: Cause::Disrupted { how: "disappeared", target: None } }
        );
    }

    #[test]
    fn row_3_the_members_last_word_names_the_disruption() {
        let preempted = training(
            json!({"phase": "Running", "hostIP": "10.0.0.1",
                   "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}),
            false,
        );
        assert_eq!(
            decide(&preempted, None, None),
            Step::Fail {
                reason: "PreemptedByMember",
                cause: Cause::Disrupted {
                    how: "was preempted by an online pod",
                    target: Some("PreemptionByScheduler".into())
                }
            }
        );
    }

    #[test]
    fn rows_7_to_10_with_a_copy() {
        assert_eq!(decide(&ran("Running"), Some(&copy()), HELD), Step::Requeue(Duration::from_secs(3)));
        assert_eq!(decide(&ran("Failed"), Some(&copy()), None), Step::DeleteCopy { grace: Some(0), then: Then::Wait });
        let ended = member_pod("u1", false, json!({"phase": "Failed"}));
        assert_eq!(decide(&ran("Failed"), Some(&ended), None), Step::Wait, "kept for its logs until the pod goes");
        assert_eq!(
            decide(&ran("Succeeded"), Some(&member_pod("u1", false, json!({"phase": "Succeeded"}))), None),
            Step::Wait
        );
        let going = |status| member_pod("u1", true, status);
        assert_eq!(decide(&ran("Failed"), Some(&going(json!({"phase": "Running"}))), None), Step::Wait);
        let evicted = going(json!({"phase": "Running", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]}));
        assert_eq!(
            decide(&ran("Running"), Some(&evicted), None),
            Step::Fail {
                reason: "EvictedByMember",
                cause: Cause::Disrupted { how: "was evicted", target: Some("EvictionByEvictionAPI".into()) }
            }
        );
        assert_eq!(decide(&ran("Running"), Some(&evicted), HELD), Step::Requeue(Duration::from_secs(3)));
        assert_eq!(decide(&ran("Running"), Some(&copy()), None), Step::Follow);
        assert_eq!(decide(&pending(), Some(&copy()), None), Step::Follow);
    }
}
