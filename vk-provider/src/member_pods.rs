//! The pod sync's way to a member's pods, narrowed to what it asks of them (as
//! virtual-kubelet's `PodLifecycleHandler` narrows a provider): create a copy, read one by
//! name, move the reclaim notice onto it. [`MemberPods`] is that backend; `kube::Client` is
//! the real one. What the sync makes of each answer ([`create_copy`], [`sync_notice`]) is
//! written against the trait, so it is tested here on plain data with a member of the
//! tests' own making: create idempotent on the origin UID, 409s, 404s, a refused write, a
//! member that answers slowly.

use std::future::Future;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;

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

#[cfg(test)]
mod tests;
