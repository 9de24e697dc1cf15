//! A training pod's last status when tidepool ends it (a reclaim, a member-side disruption,
//! a lost or removed member, a gang rolled back), written as a kubelet would write it: phase
//! `Failed` with the reason; `Ready` and `ContainersReady` false; `DisruptionTarget` true for
//! a disruption, in the same write, so a Job's `podFailurePolicy` or an operator reading
//! conditions sees why at the moment the pod fails; and no container still running or
//! waiting: one tidepool did not see end is `terminated` with reason
//! `ContainerStatusUnknown` and exit code 137, as a kubelet reports a container it could not
//! find when the pod was ended (Kubeflow's `ExitCode` policy retries codes of 128 and more).
//! A container whose end the member reported keeps its own state, exit code and message.
//! Pure.

use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::keys;

/// Exit code given to a container whose end tidepool did not see (128 + SIGKILL).
pub const UNKNOWN_EXIT_CODE: i32 = 137;
/// Its reason, the kubelet's for a container it could not locate when the pod ended.
pub const UNKNOWN_EXIT_REASON: &str = "ContainerStatusUnknown";

/// How a pod ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending<'a> {
    /// `status.reason` (`Reclaimed`, `PreemptedByMember`, `MemberLost`, ...).
    pub reason: &'a str,
    pub message: &'a str,
    /// The `DisruptionTarget` condition's reason when the end is a disruption (anything not
    /// of the pod's own making), `None` otherwise (an offload policy refusal).
    pub disruption: Option<&'a str>,
}

/// The status `current` ends with: see the module docs. `extra` are conditions to set as
/// well (a reclaim's notice), replacing any of the same type.
pub fn terminal_status(current: Option<&PodStatus>, end: &Ending<'_>, extra: &[PodCondition], now: &Time) -> PodStatus {
    let mut s = current.cloned().unwrap_or_default();
    s.phase = Some("Failed".to_owned());
    s.reason = Some(end.reason.to_owned());
    s.message = Some(end.message.to_owned());
    for type_ in ["Ready", "ContainersReady"] {
        set_condition(&mut s, condition(type_, "False", "PodFailed", None, now));
    }
    if let Some(why) = end.disruption {
        set_condition(&mut s, disruption_target(why, end.message, now));
    }
    for c in extra {
        set_condition(&mut s, c.clone());
    }
    end_containers(&mut s, now);
    s
}

/// Sets condition `c` in `s`, replacing one of its type; an unchanged status keeps its
/// transition time.
fn set_condition(s: &mut PodStatus, c: PodCondition) {
    let conditions = s.conditions.get_or_insert_with(Vec::new);
    match conditions.iter_mut().find(|have| have.type_ == c.type_) {
        Some(have) if have.status == c.status => {
            have.reason = c.reason;
            have.message = c.message;
        }
        Some(have) => *have = c,
        None => conditions.push(c),
    }
}

/// Ends every container (and init container) of `s` that has no final state yet.
fn end_containers(s: &mut PodStatus, now: &Time) {
    for list in [&mut s.container_statuses, &mut s.init_container_statuses] {
        for c in list.iter_mut().flatten() {
            end_container(c, now);
        }
    }
}

/// The status a kubelet writes for a pod deleted while it ran, before it lets the deletion
/// complete: terminal, so controllers that wait for it (a Job with `podFailurePolicy` keeps
/// its tracking finalizer on the pod until then) see the pod end. `Succeeded` when every
/// container exited 0, else `Failed`; containers without a final state are ended as unknown;
/// no pod-level reason (a plain deletion is nobody's failure reason).
pub fn deleted_status(current: Option<&PodStatus>, now: &Time) -> PodStatus {
    let mut s = current.cloned().unwrap_or_default();
    end_containers(&mut s, now);
    let exited_0 =
        |c: &ContainerStatus| c.state.as_ref().and_then(|st| st.terminated.as_ref()).is_some_and(|t| t.exit_code == 0);
    let statuses = s.container_statuses.as_deref().unwrap_or_default();
    let succeeded = !statuses.is_empty() && statuses.iter().all(exited_0);
    let (phase, ready_reason) = if succeeded { ("Succeeded", "PodCompleted") } else { ("Failed", "PodFailed") };
    s.phase = Some(phase.to_owned());
    for type_ in ["Ready", "ContainersReady"] {
        set_condition(&mut s, condition(type_, "False", ready_reason, None, now));
    }
    s
}

/// The `DisruptionTarget` condition (`True`, `reason`, `message`) the scheduler and the
/// kubelet set on a pod they are about to take away: with it, a Job's `podFailurePolicy`
/// (`action: Ignore`, `onPodConditions: [{type: DisruptionTarget}]`) replaces the pod without
/// counting a failure.
pub fn disruption_target(reason: &str, message: &str, now: &Time) -> PodCondition {
    condition(keys::CONDITION_DISRUPTION_TARGET, "True", reason, Some(message), now)
}

fn condition(type_: &str, status: &str, reason: &str, message: Option<&str>, now: &Time) -> PodCondition {
    PodCondition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: Some(reason.to_owned()),
        message: message.map(str::to_owned),
        last_transition_time: Some(now.clone()),
        ..Default::default()
    }
}

fn end_container(c: &mut ContainerStatus, now: &Time) {
    c.ready = false;
    c.started = Some(false);
    let state = c.state.get_or_insert_with(Default::default);
    if state.terminated.is_some() {
        return;
    }
    let started_at = state.running.as_ref().and_then(|r| r.started_at.clone());
    *state = ContainerState {
        terminated: Some(ContainerStateTerminated {
            exit_code: UNKNOWN_EXIT_CODE,
            reason: Some(UNKNOWN_EXIT_REASON.to_owned()),
            message: Some("The container could not be located when the pod was terminated".to_owned()),
            started_at,
            finished_at: Some(now.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn now() -> Time {
        Time("2026-12-04T12:00:00Z".parse().unwrap())
    }

    fn status(containers: serde_json::Value) -> PodStatus {
        serde_json::from_value(json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": containers,
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_deleted_while_it_ran_ends_failed_with_its_containers_ended_and_no_reason() {
        let running = status(json!([{"name": "main", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
            "state": {"running": {"startedAt": "2026-12-04T11:00:00Z"}}}]));
        let s = deleted_status(Some(&running), &now());
        assert_eq!((s.phase.as_deref(), s.reason.as_deref()), (Some("Failed"), None));
        let c = &s.container_statuses.unwrap()[0];
        let t = c.state.as_ref().unwrap().terminated.as_ref().unwrap();
        assert_eq!((t.exit_code, t.reason.as_deref(), c.ready), (UNKNOWN_EXIT_CODE, Some(UNKNOWN_EXIT_REASON), false));
        let ready = s.conditions.unwrap().into_iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_deref()), ("False", Some("PodFailed")));
    }

    #[test]
    fn a_pod_deleted_after_every_container_exited_0_ends_succeeded() {
        let done = status(json!([{"name": "main", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]));
        assert_eq!(deleted_status(Some(&done), &now()).phase.as_deref(), Some("Succeeded"));
        let failed = status(json!([{"name": "main", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]));
        assert_eq!(deleted_status(Some(&failed), &now()).phase.as_deref(), Some("Failed"));
    }

    fn running() -> PodStatus {
        serde_json::from_value(json!({
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-04T11:00:00Z"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-12-04T11:00:00Z"},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-04T10:59:00Z"}
            ],
            "containerStatuses": [
                {"name": "trainer", "ready": true, "started": true, "image": "i", "imageID": "", "restartCount": 0,
                 "state": {"running": {"startedAt": "2026-12-04T11:00:00Z"}}},
                {"name": "sidecar", "ready": false, "image": "i", "imageID": "", "restartCount": 0,
                 "state": {"terminated": {"exitCode": 143, "reason": "Error", "message": "tidepool.io/checkpointed step=7"}}}
            ]
        }))
        .unwrap()
    }

    fn conditions(s: &PodStatus) -> Vec<(String, String, Option<String>)> {
        s.conditions.iter().flatten().map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone())).collect()
    }

    #[test]
    fn a_disrupted_pod_fails_not_ready_with_disruption_target_in_one_status() {
        let end =
            Ending { reason: "PreemptedByMember", message: "preempted", disruption: Some("PreemptionByScheduler") };
        let s = terminal_status(Some(&running()), &end, &[], &now());
        assert_eq!((s.phase.as_deref(), s.reason.as_deref()), (Some("Failed"), Some("PreemptedByMember")));
        assert_eq!(
            conditions(&s),
            [
                ("Ready".into(), "False".into(), Some("PodFailed".into())),
                ("ContainersReady".into(), "False".into(), Some("PodFailed".into())),
                ("PodScheduled".into(), "True".into(), None),
                ("DisruptionTarget".into(), "True".into(), Some("PreemptionByScheduler".into())),
            ]
        );
    }

    #[test]
    fn no_container_is_left_running_and_a_reported_end_is_kept() {
        let end = Ending { reason: "MemberLost", message: "lost", disruption: Some("MemberLost") };
        let s = terminal_status(Some(&running()), &end, &[], &now());
        let states: Vec<_> = s
            .container_statuses
            .unwrap()
            .into_iter()
            .map(|c| {
                let t = c.state.unwrap().terminated.unwrap();
                (c.name, c.ready, t.exit_code, t.reason.unwrap(), t.started_at.is_some())
            })
            .collect();
        assert_eq!(
            states,
            [
                ("trainer".into(), false, UNKNOWN_EXIT_CODE, UNKNOWN_EXIT_REASON.into(), true),
                ("sidecar".into(), false, 143, "Error".into(), false),
            ]
        );
    }

    #[test]
    fn a_refusal_is_no_disruption_and_a_notice_is_carried_into_the_same_write() {
        let refused = Ending { reason: "OffloadPolicy", message: "privileged", disruption: None };
        let s = terminal_status(None, &refused, &[], &now());
        assert!(!conditions(&s).iter().any(|c| c.0 == "DisruptionTarget"), "the pod's own spec is no disruption");
        let notice = condition(keys::CONDITION_RECLAIM_REQUESTED, "True", "Notice", None, &now());
        let reclaim = Ending { reason: "Reclaimed", message: "m", disruption: Some(keys::REASON_DISRUPTION_RECLAIM) };
        let s = terminal_status(Some(&running()), &reclaim, std::slice::from_ref(&notice), &now());
        assert!(conditions(&s).iter().any(|c| c.0 == keys::CONDITION_RECLAIM_REQUESTED));
    }

    #[test]
    fn an_unchanged_condition_keeps_its_transition_time() {
        let mut before = running();
        let ready = before.conditions.as_mut().unwrap().iter_mut().find(|c| c.type_ == "Ready").unwrap();
        ready.status = "False".into();
        let end = Ending { reason: "Reclaimed", message: "m", disruption: None };
        let s = terminal_status(Some(&before), &end, &[], &now());
        let ready = s.conditions.unwrap().into_iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(ready.last_transition_time.unwrap().0.to_string(), "2026-12-04T11:00:00Z");
    }
}
