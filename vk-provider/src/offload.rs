//! An offload pod as the member-side cache holds it.
//!
//! Like the training side (`tidepool_api::pod`), the cache keeps what the pod sync reads
//! rather than a whole `Pod`: its identity, the few tidepool labels and annotations read
//! back, the ConfigMaps and Secrets the spec references (kept in sync while it runs) and the
//! member's status, packed ([`crate::packed`]) and decoded only when it is copied up.

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::runtime::reflector::ObjectRef;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;

use crate::packed::PackedStatus;
use crate::referenced::{self, References};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadPod {
    /// `metadata.name`, `.namespace` and `.uid`: no whole `ObjectMeta`
    /// (360 bytes before it holds anything), no labels or annotations (a map costs a whole
    /// tree node, about 0.5 KB, for a single entry): the ones read back are the fields below.
    name: Box<str>,
    namespace: Box<str>,
    uid: Option<Box<str>>,
    /// `metadata.deletionTimestamp` is set.
    deleting: bool,
    /// Label `tidepool.io/origin-uid`: the UID of the training pod it copies.
    origin_uid: Option<Box<str>>,
    /// Annotations `tidepool.io/origin-namespace` and `-name`: that pod's namespace and name.
    origin: Option<(Box<str>, Box<str>)>,
    /// Annotation `tidepool.io/reclaim-deadline`, once the notice was copied down.
    reclaim_deadline: Option<Box<str>>,
    /// The member PodGroup it joined (see [`crate::gang_group::join`]): its
    /// `spec.schedulingGroup`, label `scheduling.x-k8s.io/pod-group` or annotation
    /// `scheduling.k8s.io/group-name`.
    pod_group: Option<Box<str>>,
    /// The ConfigMaps and Secrets its spec references.
    pub references: References,
    /// The member's status, packed.
    status: Option<PackedStatus>,
}

impl From<Pod> for OffloadPod {
    fn from(pod: Pod) -> Self {
        let Pod { metadata, spec, status } = pod;
        // The training pod's own labels and annotations travel on the copy; only tidepool's
        // origin and reclaim notice are read back.
        let mut labels = metadata.labels.unwrap_or_default();
        let mut annotations = metadata.annotations.unwrap_or_default();
        let boxed = |s: Option<String>| s.map(String::into_boxed_str);
        let mut take = |key: &str| boxed(annotations.remove(key));
        let origin = take(keys::ANNOTATION_ORIGIN_NAMESPACE).zip(take(keys::ANNOTATION_ORIGIN_NAME));
        let reclaim_deadline = take(keys::ANNOTATION_RECLAIM_DEADLINE);
        let native = spec.as_ref().and_then(tidepool_api::pod::scheduling_group).map(str::to_owned);
        let pod_group = native
            .or_else(|| labels.remove(keys::LABEL_POD_GROUP))
            .or_else(|| annotations.remove(keys::ANNOTATION_VOLCANO_GROUP));
        OffloadPod {
            name: metadata.name.unwrap_or_default().into_boxed_str(),
            namespace: metadata.namespace.unwrap_or_default().into_boxed_str(),
            uid: boxed(metadata.uid),
            deleting: metadata.deletion_timestamp.is_some(),
            origin_uid: boxed(labels.remove(keys::LABEL_ORIGIN_UID)),
            origin,
            reclaim_deadline,
            pod_group: boxed(pod_group),
            references: spec.as_ref().map(referenced::references).unwrap_or_default(),
            status: status.as_ref().and_then(PackedStatus::pack),
        }
    }
}

impl OffloadPod {
    /// Its name in the member.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its namespace in the member.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Its own UID (not its origin's).
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// The member is deleting it.
    pub fn deleting(&self) -> bool {
        self.deleting
    }

    /// The member's status.
    pub fn status(&self) -> Option<PodStatus> {
        self.status.as_ref()?.unpack()
    }

    /// The training pod's UID, from the origin label.
    pub fn origin_uid(&self) -> Option<&str> {
        self.origin_uid.as_deref()
    }

    /// The member PodGroup it is a member of, if any.
    pub fn pod_group(&self) -> Option<&str> {
        self.pod_group.as_deref()
    }

    /// The namespace and name of the training pod it copies, from its origin annotations.
    pub fn origin_name(&self) -> Option<(&str, &str)> {
        self.origin.as_ref().map(|(ns, name)| (&**ns, &**name))
    }

    /// The training pod it copies, from its origin annotations.
    pub fn origin(&self) -> Option<ObjectRef<PodLite>> {
        let (ns, name) = self.origin_name()?;
        Some(ObjectRef::new(name).within(ns))
    }

    /// The reclaim deadline copied down from the training pod, if any.
    pub fn reclaim_deadline(&self) -> Option<&str> {
        self.reclaim_deadline.as_deref()
    }

    /// True when this is the copy of `pod` (same origin UID).
    pub fn is_copy_of(&self, pod: &PodLite) -> bool {
        let origin = self.origin_uid();
        origin.is_some() && origin == pod.metadata.uid.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_references_status_and_origin() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "tp-team", "uid": "m1",
                         "labels": {keys::LABEL_ORIGIN_UID: "t1"},
                         "annotations": {keys::ANNOTATION_ORIGIN_NAMESPACE: "team", keys::ANNOTATION_ORIGIN_NAME: "p"}},
            "spec": {"containers": [{"name": "c", "image": "x",
                                     "envFrom": [{"configMapRef": {"name": "settings"}}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.9"}
        }))
        .unwrap();
        let offload = OffloadPod::from(pod);
        assert_eq!(offload.references.len(), 1);
        assert_eq!(offload.status().and_then(|s| s.pod_ip).as_deref(), Some("10.0.0.9"));
        assert_eq!(offload.origin_uid(), Some("t1"));
        assert_eq!(offload.origin(), Some(ObjectRef::new("p").within("team")));
        assert_eq!(offload.reclaim_deadline(), None);
        assert_eq!(
            (offload.name(), offload.namespace(), offload.uid(), offload.deleting()),
            ("p", "tp-team", Some("m1"), false)
        );
        let mut training = PodLite::default();
        training.metadata.uid = Some("t1".into());
        assert!(offload.is_copy_of(&training));
        training.metadata.uid = Some("t2".into());
        assert!(!offload.is_copy_of(&training));
    }

    /// One per mirrored pod: a whole `ObjectMeta` alone would be 360 bytes.
    #[test]
    fn a_cache_entry_is_small() {
        assert!(std::mem::size_of::<OffloadPod>() <= 256, "{} bytes", std::mem::size_of::<OffloadPod>());
    }
}
