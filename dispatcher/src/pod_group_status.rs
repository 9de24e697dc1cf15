//! Kubernetes' own PodGroups (`scheduling.k8s.io/v1beta1`) of gangs tidepool schedules tell
//! their scheduling the way the default scheduler's do: condition
//! `PodGroupInitiallyScheduled`, `True` with reason `Scheduled` once the gang is placed (for
//! good: it never turns back, as upstream), `False` with reason `Unschedulable` and the
//! dispatcher's explanation while it waits. Controllers and `kubectl` that read the group see
//! the truth without knowing tidepool.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tracing::{debug, warn};

use crate::context::{Context, pod_group_api};
use crate::error::Result;
use crate::gang::{GangKey, GangSource};

/// The condition type the default scheduler writes on a PodGroup.
pub const CONDITION: &str = "PodGroupInitiallyScheduled";

/// What a gang's group is to say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome<'a> {
    Scheduled(&'a str),
    Unschedulable(&'a str),
}

impl<'a> Outcome<'a> {
    /// Whether the gang is placed, and the message.
    fn parts(self) -> (bool, &'a str) {
        match self {
            Outcome::Scheduled(m) => (true, m),
            Outcome::Unschedulable(m) => (false, m),
        }
    }
}

/// The status patch for `outcome`: one condition, merged by type (a strategic merge: the
/// group's other conditions stay).
pub(crate) fn condition_patch(outcome: Outcome<'_>, now: Time) -> serde_json::Value {
    let (scheduled, message) = outcome.parts();
    let (status, reason) = if scheduled { ("True", "Scheduled") } else { ("False", "Unschedulable") };
    json!({"status": {"conditions": [{
        "type": CONDITION, "status": status, "reason": reason, "message": message, "lastTransitionTime": now,
    }]}})
}

/// Writes `outcome` on the native PodGroup of gang `key`, unless it shows it already; other
/// gangs have none. A failure is logged (the pods carry the same news) and retried at the
/// next report.
pub(crate) async fn report(ctx: &Context, key: &GangKey, outcome: Outcome<'_>) -> Result<()> {
    let GangSource::Native(name) = &key.source else { return Ok(()) };
    let (scheduled, text) = outcome.parts();
    let group = format!("{}/{name}", key.namespace);
    if !ctx.group_report_fresh(&group, text, scheduled)? {
        return Ok(());
    }
    debug!(gang = %key, scheduled, "PodGroup status");
    let (api, _) = pod_group_api(ctx.training.clone(), &key.source, &key.namespace);
    let patch = condition_patch(outcome, Time(jiff::Timestamp::now()));
    ctx.wrote();
    if let Err(e) = api.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await {
        warn!(gang = %key, error = %e, "cannot write the PodGroup's scheduling condition");
        // Not written: the next report tries again rather than taking it as shown.
        ctx.group_report_failed(&group)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_reads_as_the_default_schedulers() {
        let now = Time(jiff::Timestamp::UNIX_EPOCH);
        let placed = condition_patch(Outcome::Scheduled("placed on tidepool-a"), now.clone());
        let c = &placed["status"]["conditions"][0];
        assert_eq!(
            (c["type"].as_str(), c["status"].as_str(), c["reason"].as_str()),
            (Some(CONDITION), Some("True"), Some("Scheduled"))
        );
        let waiting = condition_patch(Outcome::Unschedulable("no pool fits 4 pods"), now);
        let c = &waiting["status"]["conditions"][0];
        assert_eq!((c["status"].as_str(), c["reason"].as_str()), (Some("False"), Some("Unschedulable")));
        assert_eq!(c["message"], "no pool fits 4 pods");
    }
}
