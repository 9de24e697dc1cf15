//! Copies freed for the dispatcher's reclaims, and the hand-overs they start.
//!
//! Reclaim must give the capacity back first: the copy is deleted before the training pod's
//! `Reclaimed` status is written. The dispatcher asks for the delete through a
//! [`CopyWriter`](tidepool_federation::writes::CopyWriter); [`run`] carries each request out at
//! once, apart from the pod sync's queue and its write slots, and records a hand-over first, so
//! that the pod sync, seeing the copy vanish before the status arrives, neither reports the pod
//! lost nor preempted by the member.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::{Api, ResourceExt};
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_api::sync::{Locked, Poisoned};
use tidepool_federation::MemberHandle;
use tidepool_federation::writes::{CopyWrites, FreeCopy};
use tracing::{debug, error, warn};

/// How long a hand-over holds at most: the dispatcher's status write arrives well within it,
/// and one that never does (the write failed) is judged again after it.
pub const HANDOVER_HOLD: Duration = Duration::from_secs(10);
/// The name of the hand-overs' lock, in errors.
const LOCK: &str = "reclaim hand-overs";

/// Training pods whose copy was freed for a reclaim, by UID, with when. An entry goes when the
/// pod ends or is deleted, or after [`HANDOVER_HOLD`]. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub(crate) struct Handovers(Arc<Mutex<HashMap<String, tokio::time::Instant>>>);

impl Handovers {
    fn begin(&self, uid: &str) -> Result<(), Poisoned> {
        self.0.locked(LOCK)?.insert(uid.to_owned(), tokio::time::Instant::now());
        Ok(())
    }

    /// How much longer the dispatcher owns the ending of `pod`, if it does. A pod that has
    /// ended is nobody's hand-over any more.
    pub(crate) fn held(&self, pod: &PodLite) -> Result<Option<Duration>, Poisoned> {
        let Some(uid) = pod.metadata.uid.as_deref() else { return Ok(None) };
        let mut h = self.0.locked(LOCK)?;
        let Some(since) = h.get(uid).copied() else { return Ok(None) };
        let left = HANDOVER_HOLD.checked_sub(since.elapsed()).filter(|_| !pod.is_terminal());
        if left.is_none() {
            h.remove(uid);
        }
        Ok(left)
    }

    /// `pod` is gone from training.
    pub(crate) fn end(&self, pod: &PodLite) -> Result<(), Poisoned> {
        if let Some(uid) = pod.metadata.uid.as_deref() {
            self.0.locked(LOCK)?.remove(uid);
        }
        Ok(())
    }
}

/// Carries out the dispatcher's requests until it drops its end: each at once, concurrently.
pub(crate) async fn run(mut writes: CopyWrites, handovers: Handovers) {
    while let Some(request) = writes.0.recv().await {
        if let Some(uid) = request.pod.metadata.uid.as_deref()
            && let Err(e) = handovers.begin(uid)
        {
            // Without the hand-over the pod sync would call the reclaim a loss: stop (the
            // pod sync stops with this task, and the process with it).
            error!(error = %e, "cannot record a reclaim's hand-over");
            return;
        }
        tokio::spawn(free(request));
    }
}

async fn free(request: FreeCopy) {
    let FreeCopy { pod, member, copy_uid, done } = request;
    delete_reclaimed(&member, &pod, copy_uid).await;
    let _ = done.send(());
}

/// Deletes the offload copy of reclaimed pod `p` in `member`. A pod of the same name that is
/// not this pod's copy is never touched: the delete names the copy's UID (`copy_uid`, as the
/// member's pod watch saw it) as precondition, or, without it, selects by origin UID. By name
/// is the faster of the two for the member's API server, which a collection delete makes read
/// its pods first. A copy already gone is fine; one the member refuses to delete now, the pod
/// sync deletes in its turn once the training pod has ended.
async fn delete_reclaimed(member: &MemberHandle, p: &PodLite, copy_uid: Option<String>) {
    let (Some(uid), Some(ns)) = (p.metadata.uid.as_deref(), p.metadata.namespace.as_deref()) else { return };
    let member_ns = member.namespaces.member_ns(ns);
    let api = Api::<Pod>::namespaced(member.client.clone(), &member_ns);
    let mut dp = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    let started = std::time::Instant::now();
    let deleted = match copy_uid {
        Some(copy_uid) => {
            dp.preconditions = Some(Preconditions { uid: Some(copy_uid), resource_version: None });
            match api.delete(&p.name_any(), &dp).await {
                // Gone already, or another pod by now: nothing of this pod's left to delete.
                Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => Ok(()),
                r => r.map(|_| ()),
            }
        }
        None => {
            let lp = ListParams::default().labels(&format!("{}={uid}", keys::LABEL_ORIGIN_UID));
            api.delete_collection(&dp, &lp).await.map(|_| ())
        }
    };
    match deleted {
        Ok(()) => {
            debug!(pod = %p.name_any(), member = %member.name, took = ?started.elapsed(), "reclaimed pod's copy deleted")
        }
        Err(e) => {
            warn!(pod = %p.name_any(), member = %member.name, error = %e, "cannot delete the reclaimed pod's copy now")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;

    fn pod(uid: &str, phase: &str) -> PodLite {
        let mut p = Pod::default();
        p.metadata.uid = Some(uid.into());
        p.status = Some(PodStatus { phase: Some(phase.into()), ..Default::default() });
        PodLite::from(p)
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_over_holds_until_the_pod_ends_or_its_time_is_up() {
        let h = Handovers::default();
        let running = pod("u1", "Running");
        assert_eq!(h.held(&running).unwrap(), None, "nothing was freed yet");
        h.begin("u1").unwrap();
        assert_eq!(h.held(&running).unwrap(), Some(HANDOVER_HOLD));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(h.held(&running).unwrap(), Some(HANDOVER_HOLD - Duration::from_secs(4)));
        assert_eq!(h.held(&pod("u2", "Running")).unwrap(), None, "another pod's hand-over");
        assert_eq!(h.held(&pod("u1", "Failed")).unwrap(), None, "the status has arrived");
        assert_eq!(h.held(&running).unwrap(), None, "an ended hand-over is forgotten");

        h.begin("u1").unwrap();
        tokio::time::advance(HANDOVER_HOLD + Duration::from_millis(1)).await;
        assert_eq!(h.held(&running).unwrap(), None, "the dispatcher's write never came: judged again");

        h.begin("u1").unwrap();
        h.end(&running).unwrap();
        assert_eq!(h.held(&running).unwrap(), None, "the pod is gone from training");
    }
}
