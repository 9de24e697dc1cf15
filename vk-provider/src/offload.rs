//! An offload pod as the member-side cache holds it.
//!
//! Like the training side (`tidepool_config::pod`), the cache keeps what the pod sync reads
//! rather than a whole `Pod`: the metadata, the ConfigMaps and Secrets the spec references
//! (kept in sync while it runs) and the member's status as the JSON it came in, which is
//! decoded only when it is copied up.

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::ObjectRef;
use tidepool_config::keys;
use tidepool_config::pod::{PodLite, trim_meta};

use crate::reflect::{self, References};

/// The prefix of the labels and annotations an offload pod keeps in the cache.
const TIDEPOOL_PREFIX: &str = "tidepool.io/";

#[derive(Clone, Debug, Default, PartialEq)]
pub struct OffloadPod {
    pub metadata: ObjectMeta,
    /// The ConfigMaps and Secrets its spec references.
    pub references: References,
    /// The member's status, as JSON.
    status: Option<Box<str>>,
}

impl From<Pod> for OffloadPod {
    fn from(pod: Pod) -> Self {
        let Pod { mut metadata, spec, status } = pod;
        trim_meta(&mut metadata);
        // The training pod's own labels and annotations travel on the copy; only tidepool's
        // are read back (origin, reclaim notice).
        for map in [&mut metadata.labels, &mut metadata.annotations].into_iter().flatten() {
            map.retain(|k, _| k.starts_with(TIDEPOOL_PREFIX));
        }
        metadata.owner_references = None;
        metadata.generate_name = None;
        OffloadPod {
            metadata,
            references: spec.as_ref().map(reflect::references).unwrap_or_default(),
            status: status.and_then(|s| serde_json::to_string(&s).ok()).map(String::into_boxed_str),
        }
    }
}

impl OffloadPod {
    /// The member's status.
    pub fn status(&self) -> Option<PodStatus> {
        serde_json::from_str(self.status.as_deref()?).ok()
    }

    /// The training pod's UID, from the origin label.
    pub fn origin_uid(&self) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(keys::LABEL_ORIGIN_UID).map(String::as_str)
    }

    /// The training pod it copies, from its origin annotations.
    pub fn origin(&self) -> Option<ObjectRef<PodLite>> {
        let a = self.metadata.annotations.as_ref()?;
        let ns = a.get(keys::ANNOTATION_ORIGIN_NAMESPACE)?;
        let name = a.get(keys::ANNOTATION_ORIGIN_NAME)?;
        Some(ObjectRef::new(name).within(ns))
    }

    /// True when this is the copy of `pod` (same origin UID).
    pub fn is_copy_of(&self, pod: &PodLite) -> bool {
        let origin = self.origin_uid();
        origin.is_some() && origin == pod.metadata.uid.as_deref()
    }
}

tidepool_config::pod_resource!(OffloadPod);

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
        let mut training = PodLite::default();
        training.metadata.uid = Some("t1".into());
        assert!(offload.is_copy_of(&training));
        training.metadata.uid = Some("t2".into());
        assert!(!offload.is_copy_of(&training));
    }
}
