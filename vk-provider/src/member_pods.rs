//! The pod sync's way to a member's pods, narrowed to what it asks of them (as
//! virtual-kubelet's `PodLifecycleHandler` narrows a provider): create a copy, read one by
//! name, move the reclaim notice onto it, delete it by its UID. [`MemberPods`] is that
//! backend; `kube::Client` is the real one. What the sync makes of each answer
//! ([`create_copy`], [`sync_notice`], [`delete_copy`]) is written against the trait, so it
//! is tested here on plain data with a member of the tests' own making: create idempotent
//! on the origin UID, 409s, 404s, a refused write, a member that answers slowly.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_api::sync::{Locked, Poisoned};

use crate::offload::OffloadPod;

/// What the pod sync asks of one member's pods.
pub(crate) trait MemberPods: Send + Sync {
    /// Creates `pod` in namespace `ns`.
    fn create(&self, ns: &str, pod: &Pod) -> impl Future<Output = kube::Result<()>> + Send;
    /// Pod `ns/name`, `None` when there is none.
    fn get(&self, ns: &str, name: &str) -> impl Future<Output = kube::Result<Option<Pod>>> + Send;
    /// Sets (or, with `None`, removes) annotation `key` of pod `ns/name`.
    fn annotate(
        &self,
        ns: &str,
        name: &str,
        key: &str,
        value: Option<&str>,
    ) -> impl Future<Output = kube::Result<()>> + Send;
    /// Deletes pod `ns/name` if its UID is still `uid` (whatever it is when `None`), with
    /// `grace` seconds (the pod's own when `None`).
    fn delete(
        &self,
        ns: &str,
        name: &str,
        uid: Option<&str>,
        grace: Option<u32>,
    ) -> impl Future<Output = kube::Result<()>> + Send;
}

impl MemberPods for kube::Client {
    async fn create(&self, ns: &str, pod: &Pod) -> kube::Result<()> {
        Api::<Pod>::namespaced(self.clone(), ns).create(&PostParams::default(), pod).await.map(|_| ())
    }

    async fn get(&self, ns: &str, name: &str) -> kube::Result<Option<Pod>> {
        Api::<Pod>::namespaced(self.clone(), ns).get_opt(name).await
    }

    async fn annotate(&self, ns: &str, name: &str, key: &str, value: Option<&str>) -> kube::Result<()> {
        let patch = Patch::Merge(json!({ "metadata": { "annotations": { key: value } } }));
        Api::<Pod>::namespaced(self.clone(), ns).patch(name, &PatchParams::default(), &patch).await.map(|_| ())
    }

    async fn delete(&self, ns: &str, name: &str, uid: Option<&str>, grace: Option<u32>) -> kube::Result<()> {
        let dp = DeleteParams {
            grace_period_seconds: grace,
            preconditions: Some(Preconditions { uid: uid.map(str::to_owned), resource_version: None }),
            ..Default::default()
        };
        Api::<Pod>::namespaced(self.clone(), ns).delete(name, &dp).await.map(|_| ())
    }
}

/// How long a deletion the member accepted keeps a second one of the same pod from being
/// sent. A second one never helps (the member has the pod deleting or gone; one that did not
/// reach it is released at once), so this only bounds the memory: far longer than the offload
/// watch lags under a mass deletion on a loaded member (18 s was seen at 300 pods on 2 busy
/// cores, with a 10 s memory each late pod was deleted two or three times).
pub(crate) const DELETION_MEMORY: Duration = Duration::from_secs(300);

/// The offload pods (by UID) whose deletion was sent in the last [`DELETION_MEMORY`]. Under
/// a mass deletion the offload watch lags behind the deletions; a sync that reads a copy not
/// yet shown as deleting must not delete it again: it may already be gone (a DELETE answered
/// 404, a member call for nothing).
#[derive(Debug, Default)]
pub(crate) struct SentDeletions(Mutex<Sent>);

#[derive(Debug, Default)]
pub(crate) struct Sent {
    at: HashMap<String, Instant>,
    pruned: Option<Instant>,
}

impl SentDeletions {
    /// Whether the deletion of the pod `uid` is to be sent at `now`; records it if so.
    pub(crate) fn claim(&self, uid: &str, now: Instant) -> Result<bool, Poisoned> {
        let mut sent = self.0.locked("sent deletions")?;
        let old = |at: &Instant| now.saturating_duration_since(*at) >= DELETION_MEMORY;
        // Old entries go at most once a second: a mass deletion claims thousands at once.
        if sent.pruned.is_none_or(|p| now.saturating_duration_since(p) >= Duration::from_secs(1)) {
            sent.at.retain(|_, at| !old(at));
            sent.pruned = Some(now);
        }
        if sent.at.get(uid).is_some_and(|at| !old(at)) {
            return Ok(false);
        }
        sent.at.insert(uid.to_owned(), now);
        Ok(true)
    }

    /// The deletion of `uid` did not reach the member: the next look may send it again.
    pub(crate) fn release(&self, uid: &str) -> Result<(), Poisoned> {
        self.0.locked("sent deletions")?.at.remove(uid);
        Ok(())
    }
}

/// What became of a copy's create.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Created {
    /// Made now.
    Made,
    /// A pod of that name is there and is this pod's copy, or an earlier pod's of this
    /// training cluster and namespace, or could not be read: the member's watch brings it,
    /// and the next sync deletes it, waits for it or looks again. Never overwritten.
    There,
    /// A pod of that name is there with another origin (the words say whose).
    Foreign(String),
    /// The member refused the copy for want of tidepool's PriorityClasses (deleted by its
    /// admin, or by the drain of another MemberCluster on the same API server).
    PriorityClassesMissing(String),
    /// The namespace is not there (deleted under us): it is to be made again.
    NamespaceGone,
}

/// Creates `copy` of training pod `pod` (of training cluster `cluster`) in namespace `ns`
/// of `member`, and says what became of it; an error is any other refusal, for the pod
/// sync's error policy.
pub(crate) async fn create_copy(
    member: &impl MemberPods,
    (ns, copy): (&str, &Pod),
    (cluster, pod): (&str, &PodLite),
) -> kube::Result<Created> {
    match member.create(ns, copy).await {
        Ok(()) => Ok(Created::Made),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let found = member.get(ns, &copy.name_any()).await.ok().flatten();
            Ok(match found.filter(|found| !is_ours(found, cluster, pod)) {
                Some(_) => Created::Foreign(format!("already has pod {ns}/{} with another origin", copy.name_any())),
                None => Created::There,
            })
        }
        Err(kube::Error::Api(e)) if e.code == 403 && e.message.contains("no PriorityClass") => {
            Ok(Created::PriorityClassesMissing(e.message))
        }
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Created::NamespaceGone),
        Err(e) => Err(e),
    }
}

/// Whether member pod `found` is `pod`'s copy (its origin UID), or the copy of an earlier
/// pod of the same name of this training cluster and namespace. Pure.
pub(crate) fn is_ours(found: &Pod, cluster: &str, pod: &PodLite) -> bool {
    let label = |k: &str| found.metadata.labels.as_ref().and_then(|l| l.get(k));
    let annotation = |k: &str| found.metadata.annotations.as_ref().and_then(|a| a.get(k));
    let this_cluster = label(keys::LABEL_ORIGIN_CLUSTER).map(String::as_str) == Some(cluster)
        && annotation(keys::ANNOTATION_ORIGIN_NAMESPACE) == pod.metadata.namespace.as_ref();
    this_cluster || OffloadPod::from(found.clone()).is_copy_of(pod)
}

/// Moves the reclaim deadline `want` (from the training pod's notice) onto `copy`, or takes
/// a withdrawn one off; `true` when it wrote.
pub(crate) async fn sync_notice(member: &impl MemberPods, copy: &OffloadPod, want: Option<&str>) -> kube::Result<bool> {
    if copy.reclaim_deadline() == want {
        return Ok(false);
    }
    member.annotate(copy.namespace(), copy.name(), keys::ANNOTATION_RECLAIM_DEADLINE, want).await?;
    Ok(true)
}

/// Deletes `copy` (of its UID only) with `grace` seconds, unless its deletion was sent at
/// `now` or lately and the member's watch has not shown it yet (`sent`): `false` then. A
/// member that answers 404 (gone) or 409 (the name is another pod's now) has nothing left
/// to delete; any other refusal is an error, and the next sync sends the deletion again.
pub(crate) async fn delete_copy(
    member: &impl MemberPods,
    sent: &SentDeletions,
    copy: &OffloadPod,
    grace: Option<u32>,
    now: Instant,
) -> Result<bool, DeleteFailed> {
    let uid = copy.uid().unwrap_or_default();
    if !sent.claim(uid, now)? {
        return Ok(false);
    }
    match member.delete(copy.namespace(), copy.name(), copy.uid(), grace).await {
        Ok(()) => Ok(true),
        Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => Ok(true),
        Err(e) => {
            sent.release(uid)?;
            Err(DeleteFailed::Member(e))
        }
    }
}

/// Why a copy's deletion did not go out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DeleteFailed {
    #[error("the member refused: {0}")]
    Member(kube::Error),
    #[error(transparent)]
    Poisoned(#[from] Poisoned),
}

#[cfg(test)]
mod tests;
