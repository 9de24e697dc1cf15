//! Gang restart: when a core pod of a placed gang fails (its parameter server's process dies,
//! say), the rest of the gang cannot go on without it, so it is stopped whole — as EDL does —
//! and started again: every other pod of the gang gets the reclaim notice at once, checkpoints
//! and exits, and the pods its controllers create in their place form a new gang, placed whole
//! again, that resumes from the checkpoints. An elastic pod that fails only shrinks its gang.
//!
//! The decision ([`decide`]) is pure; [`run`] is the I/O, called from each dispatcher round.
//! The notice is the one reclaim writes (`tidepool.io/ReclaimRequested`, `DisruptionTarget`,
//! the deadline annotation), so reclaim's deadline enforcement ends the noticed pods as
//! `Reclaimed` on their ack or at the deadline, and a Job's `podFailurePolicy` that ignores
//! `DisruptionTarget` replaces them without counting failures. The failed pod itself counts.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys::{self, Band};
use tidepool_api::pod::{PodLite, under_notice};
use tracing::{info, warn};

use crate::context::{Context, publish};
use crate::gang::{self, GangKey};

/// What [`decide`] found for one gang.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Failed core pods not handled yet: the cause of a restart, marked once it is under way.
    pub failed: Vec<String>,
    /// Live placed pods of the gang to give the notice now.
    pub notice: Vec<String>,
    /// The gang is stopping for a restart: its pending pods must wait, or they would join the
    /// pods that are leaving instead of forming the new gang.
    pub restarting: bool,
}

/// Whether `p` was admitted as its gang's core: the role label counts only on a pod the
/// dispatcher placed on the node it is on (tenants write their pods' labels).
pub fn is_core(p: &PodLite) -> bool {
    tidepool_api::pod::placed_by_dispatcher(&p.metadata, p.node_name())
        && p.labels().get(keys::LABEL_ROLE).map(String::as_str) == Some(keys::ROLE_CORE)
}

/// A core pod that failed of its own making — its process died, the member evicted it — not
/// one tidepool told to go (a reclaim or restart notice, the gang timeout), and whose restart
/// has not begun yet.
fn crashed(p: &PodLite) -> bool {
    p.phase() == Some("Failed")
        && is_core(p)
        && !under_notice(p.status.tidepool_conditions())
        && p.status.reason() != Some("GangTimeout")
        && !p.annotations().contains_key(keys::ANNOTATION_GANG_RESTARTED)
}

/// A live pod that a restart's notice is taking away.
fn leaving_for_restart(p: &PodLite) -> bool {
    p.is_live()
        && p.status.tidepool_conditions().iter().any(|c| {
            c.type_ == keys::CONDITION_RECLAIM_REQUESTED
                && c.status == "True"
                && c.reason.as_deref() == Some(keys::REASON_GANG_RESTART)
        })
}

/// Decides for the pods of one gang (live and ended): a failed core pod stops every live
/// placed pod that is not under notice already. Pods not yet placed are the new gang's and
/// are left alone; they wait while any pod of the old one is still leaving.
pub fn decide(pods: &[&PodLite]) -> Decision {
    let failed: Vec<String> = pods.iter().filter(|p| crashed(p)).map(|p| p.name_any()).collect();
    let notice: Vec<String> = if failed.is_empty() {
        Vec::new()
    } else {
        pods.iter()
            .filter(|p| p.is_live() && p.node_name().is_some() && !under_notice(p.status.tidepool_conditions()))
            .map(|p| p.name_any())
            .collect()
    };
    let restarting = !notice.is_empty() || pods.iter().any(|p| leaving_for_restart(p));
    Decision { failed, notice, restarting }
}

/// The band a placed pod's notice grace is taken from, trusted as reclaim trusts it.
fn band_of(p: &PodLite) -> Band {
    tidepool_api::pod::band_of(&p.metadata, p.node_name()).unwrap_or(Band::Low)
}

/// Restarts every gang of this dispatcher's pods whose core pod failed, and returns the
/// gangs that are stopping for a restart.
pub(crate) async fn run(ctx: &Context, all: &[Arc<PodLite>]) -> HashSet<GangKey> {
    let scheduler = ctx.config.dispatcher.scheduler_name.as_str();
    let mut gangs: BTreeMap<GangKey, Vec<&PodLite>> = BTreeMap::new();
    for p in all.iter().filter(|p| p.spec.scheduler_name.as_deref() == Some(scheduler)) {
        if !matches!(gang::gang_of(p).source, gang::GangSource::Single(_)) {
            gangs.entry(gang::gang_of(p)).or_default().push(p);
        }
    }
    let mut restarting = HashSet::new();
    for (key, pods) in gangs {
        let d = decide(&pods);
        if d.restarting {
            restarting.insert(key.clone());
        }
        if d.failed.is_empty() {
            continue;
        }
        restart(ctx, &key, &pods, &d).await;
    }
    restarting
}

/// Sends the restart notice to `d.notice` at once, then marks the failed pods as handled.
async fn restart(ctx: &Context, key: &GangKey, pods: &[&PodLite], d: &Decision) {
    let message = format!(
        "gang {key}: core pod {} failed; the whole gang stops (checkpoint and exit) and is placed again",
        d.failed.join(", ")
    );
    warn!(gang = %key, failed = ?d.failed, stopping = d.notice.len(), "core pod failed: restarting the gang");
    let now = jiff::Timestamp::now();
    let noticed = pods.iter().filter(|p| d.notice.contains(&p.name_any())).map(|p| notice(ctx, p, &message, now));
    let sent = futures::future::join_all(noticed).await;
    if sent.iter().any(Result::is_err) {
        return; // retried next round: the failed pods are not marked yet
    }
    for p in pods.iter().filter(|p| d.failed.contains(&p.name_any())) {
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
        let stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
        let patch = json!({ "metadata": { "annotations": { keys::ANNOTATION_GANG_RESTARTED: stamp } } });
        ctx.wrote();
        match api.patch(&p.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
            Ok(_) => publish(ctx, p, EventType::Warning, keys::REASON_GANG_RESTART, &message).await,
            Err(e) => warn!(pod = %p.name_any(), error = %e, "cannot mark the failed core pod; will retry"),
        }
    }
    info!(gang = %key, "gang restart notices sent");
}

/// The reclaim notice for a restart: condition first (it is the notice), then the deadline
/// the trainer reads, one band grace from now.
async fn notice(ctx: &Context, p: &PodLite, message: &str, now: jiff::Timestamp) -> Result<(), kube::Error> {
    ctx.wrote();
    let grace = ctx.config.dispatcher.reclaim_grace_seconds.get(band_of(p));
    let deadline = (now + jiff::SignedDuration::from_secs(i64::try_from(grace).unwrap_or(i64::MAX)))
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    let conditions = json!({ "status": { "conditions": [
        { "type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": keys::REASON_GANG_RESTART,
          "message": format!("{message}; deleted at {deadline}"), "lastTransitionTime": Time(now) },
        { "type": keys::CONDITION_DISRUPTION_TARGET, "status": "True", "reason": keys::REASON_DISRUPTION_RECLAIM,
          "message": message, "lastTransitionTime": Time(now) },
    ] } });
    let name = p.name_any();
    if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(conditions)).await {
        warn!(pod = %name, error = %e, "cannot write the restart notice; will retry");
        return Err(e);
    }
    let annotations = json!({ "metadata": { "annotations": {
        keys::ANNOTATION_RECLAIM_DEADLINE: deadline,
        keys::ANNOTATION_RECLAIM_DEMAND: "a restart of its gang",
    } } });
    if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(annotations)).await {
        warn!(pod = %name, error = %e, "cannot write the restart deadline annotation");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A pod of gang `g` on node `vn`, placed there by the dispatcher as `role`, in `phase`.
    fn pod(name: &str, role: &str, phase: &str) -> PodLite {
        let mut p: PodLite = PodLite {
            metadata: serde_json::from_value(json!({
                "name": name, "namespace": "ns",
                "labels": {keys::LABEL_ROLE: role, keys::LABEL_BAND: if role == "core" { "medium" } else { "low" }},
                "annotations": {keys::ANNOTATION_GANG: "g", keys::ANNOTATION_PLACEMENT: "vn"},
            }))
            .unwrap(),
            ..Default::default()
        };
        p.spec.node_name = Some("vn".into());
        p.status.phase = Some(phase.into());
        p
    }

    fn pending(name: &str) -> PodLite {
        let mut p = pod(name, "core", "Pending");
        p.spec.node_name = None;
        p.metadata.labels = None;
        p.metadata.annotations.as_mut().unwrap().remove(keys::ANNOTATION_PLACEMENT);
        p
    }

    fn noticed(mut p: PodLite, reason: &str) -> PodLite {
        p.status.marks_mut().tidepool_conditions = vec![
            serde_json::from_value(json!({
                "type": keys::CONDITION_RECLAIM_REQUESTED, "status": "True", "reason": reason,
            }))
            .unwrap(),
        ];
        p
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_failed_core_pod_stops_every_other_placed_pod_of_its_gang() {
        let pods = [
            pod("ps-0", "core", "Failed"),
            pod("ps-1", "core", "Running"),
            pod("trainer-0", "core", "Running"),
            pod("trainer-1", "elastic", "Running"),
            pod("trainer-2", "elastic", "Succeeded"),
        ];
        let d = decide(&pods.iter().collect::<Vec<_>>());
        assert_eq!(d.failed, names(&["ps-0"]));
        assert_eq!(d.notice, names(&["ps-1", "trainer-0", "trainer-1"]));
        assert!(d.restarting);
    }

    #[test]
    fn a_failed_elastic_pod_only_shrinks_the_gang() {
        let pods = [pod("ps-0", "core", "Running"), pod("trainer-1", "elastic", "Failed"), pending("trainer-1b")];
        let d = decide(&pods.iter().collect::<Vec<_>>());
        assert_eq!(d, Decision::default(), "its replacement is admitted as usual");
    }

    #[test]
    fn pods_tidepool_told_to_go_are_no_failure_of_the_gang() {
        // Reclaimed, or timed out as a gang: the job ends on tidepool's word, not by a crash.
        let reclaimed = noticed(pod("ps-0", "core", "Failed"), "CapacityReclaimed");
        let mut timed_out = pod("ps-1", "core", "Failed");
        timed_out.status.marks_mut().reason = Some("GangTimeout".into());
        let pods = [reclaimed, timed_out, pod("trainer-0", "core", "Running")];
        assert_eq!(decide(&pods.iter().collect::<Vec<_>>()), Decision::default());
    }

    #[test]
    fn a_restart_under_way_is_not_started_again_and_holds_the_new_pods_back() {
        let mut handled = pod("ps-0", "core", "Failed");
        handled.metadata.annotations.as_mut().unwrap().insert(keys::ANNOTATION_GANG_RESTARTED.into(), "t".into());
        let leaving = noticed(pod("ps-1", "core", "Running"), keys::REASON_GANG_RESTART);
        let pods = [handled.clone(), leaving, pending("ps-0b")];
        let d = decide(&pods.iter().collect::<Vec<_>>());
        assert!(d.failed.is_empty() && d.notice.is_empty());
        assert!(d.restarting, "the new ps-0 must not join the pods that are leaving");
        // Once the old pods are gone the new ones form the gang; the old failure stays handled.
        let placed_again = [handled, pod("ps-0b", "core", "Running"), pod("ps-1b", "core", "Running")];
        assert_eq!(decide(&placed_again.iter().collect::<Vec<_>>()), Decision::default());
    }

    #[test]
    fn pods_under_a_reclaim_notice_keep_it_and_pending_pods_are_left_alone() {
        let pods = [
            pod("ps-0", "core", "Failed"),
            noticed(pod("trainer-1", "elastic", "Running"), "CapacityReclaimed"),
            pending("trainer-2"),
        ];
        let d = decide(&pods.iter().collect::<Vec<_>>());
        assert_eq!(d.failed, names(&["ps-0"]));
        assert!(d.notice.is_empty(), "{d:?}");
    }

    #[test]
    fn the_role_counts_only_on_a_pod_the_dispatcher_placed_where_it_is() {
        assert!(is_core(&pod("a", "core", "Failed")));
        assert!(!is_core(&pod("a", "elastic", "Failed")));
        // Bound by hand (no placement) or elsewhere: a tenant's label makes no core.
        let mut forged = pod("a", "core", "Failed");
        forged.metadata.annotations.as_mut().unwrap().remove(keys::ANNOTATION_PLACEMENT);
        assert!(!is_core(&forged));
        forged.metadata.annotations.as_mut().unwrap().insert(keys::ANNOTATION_PLACEMENT.into(), "other".into());
        assert!(!is_core(&forged));
        let d = decide(&[&forged, &pod("b", "core", "Running")]);
        assert_eq!(d, Decision::default());
    }

    proptest::proptest! {
        /// Whatever a gang's pods: a pod not yet placed is never noticed, a pod is noticed only
        /// because a core pod failed, and only placed live pods without a notice are noticed.
        #[test]
        fn only_placed_live_pods_are_stopped_and_only_for_a_core_failure(
            spec in proptest::collection::vec((0u8..2, 0u8..4, proptest::bool::ANY), 0..8)
        ) {
            let pods: Vec<PodLite> = spec.iter().enumerate().map(|(i, (role, phase, under))| {
                let phase = ["Pending", "Running", "Failed", "Succeeded"][*phase as usize];
                let p = if *role == 0 && phase == "Pending" { pending(&format!("p{i}")) }
                        else { pod(&format!("p{i}"), if *role == 0 { "core" } else { "elastic" }, phase) };
                if *under { noticed(p, "CapacityReclaimed") } else { p }
            }).collect();
            let d = decide(&pods.iter().collect::<Vec<_>>());
            let core_failed = pods.iter().any(crashed);
            proptest::prop_assert_eq!(!d.failed.is_empty(), core_failed);
            proptest::prop_assert!(core_failed || d.notice.is_empty());
            for n in &d.notice {
                let p = pods.iter().find(|p| &p.name_any() == n).unwrap();
                proptest::prop_assert!(core_failed && p.is_live() && p.node_name().is_some());
                proptest::prop_assert!(!under_notice(p.status.tidepool_conditions()));
            }
        }
    }
}
