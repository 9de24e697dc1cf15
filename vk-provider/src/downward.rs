//! The downward API's environment variables, as the training pod's kubelet would fill them.
//!
//! A copy is another object: another UID, tidepool's labels and no tenant annotations (see
//! [`crate::translate`]), perhaps another namespace, the member's default service account and
//! the member's node. A `fieldRef` the member's kubelet resolved would tell a container about
//! the copy, not its pod: an Indexed Job's `JOB_COMPLETION_INDEX` (from the annotation
//! `batch.kubernetes.io/job-completion-index`) and Kubeflow Trainer's `PET_NODE_RANK` would
//! come out empty. So each such variable travels as the value the training pod gives it.
//!
//! `status.*` paths (the pod's and host's addresses) stay references: the member's values are
//! the real ones, and the pod's status shows the copy's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, Pod, PodSpec};

/// The value `field_path` has on `pod`, for the paths that name the pod's own metadata and
/// spec; `None` for the rest (left to the member's kubelet). A key the pod does not carry
/// reads as an empty string, as the kubelet reads it.
pub fn training_value(pod: &Pod, field_path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str, map: Option<&BTreeMap<String, String>>| {
        let key = field_path.strip_prefix(prefix)?.strip_prefix("['")?.strip_suffix("']")?;
        Some(map.and_then(|m| m.get(key)).cloned().unwrap_or_default())
    };
    match field_path {
        "metadata.name" => Some(meta.name.clone().unwrap_or_default()),
        "metadata.namespace" => Some(meta.namespace.clone().unwrap_or_default()),
        "metadata.uid" => Some(meta.uid.clone().unwrap_or_default()),
        "spec.nodeName" => Some(spec.and_then(|s| s.node_name.clone()).unwrap_or_default()),
        "spec.serviceAccountName" => Some(spec.and_then(|s| s.service_account_name.clone()).unwrap_or_default()),
        _ => keyed("metadata.labels", meta.labels.as_ref())
            .or_else(|| keyed("metadata.annotations", meta.annotations.as_ref())),
    }
}

/// Replaces, in every container of `copy`, each `env[].valueFrom.fieldRef` that names the
/// pod's own metadata or spec with the value it has on `pod`.
pub fn resolve_env(copy: &mut PodSpec, pod: &Pod) {
    let containers = copy.containers.iter_mut().chain(copy.init_containers.iter_mut().flatten());
    for var in containers.flat_map(|c| c.env.iter_mut().flatten()) {
        let path = var.value_from.as_ref().and_then(|f| f.field_ref.as_ref()).map(|r| r.field_path.as_str());
        if let Some(value) = path.and_then(|p| training_value(pod, p)) {
            *var = EnvVar { name: std::mem::take(&mut var.name), value: Some(value), value_from: None };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "job-1-abcde", "namespace": "team-a", "uid": "u-1",
                "labels": {"batch.kubernetes.io/job-completion-index": "1"},
                "annotations": {"batch.kubernetes.io/job-completion-index": "1"}},
            "spec": {"nodeName": "tidepool-member-a", "serviceAccountName": "trainer",
                "initContainers": [{"name": "init", "env": [
                    {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-completion-index']"}}}]}],
                "containers": [{"name": "main", "env": [
                    {"name": "INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                    {"name": "MISSING", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['absent']"}}},
                    {"name": "UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
                    {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                    {"name": "PLAIN", "value": "x"}]}]}
        }))
        .unwrap()
    }

    fn env(spec: &PodSpec) -> BTreeMap<String, serde_json::Value> {
        let all = spec.init_containers.iter().flatten().chain(&spec.containers);
        all.flat_map(|c| c.env.iter().flatten()).map(|e| (e.name.clone(), serde_json::to_value(e).unwrap())).collect()
    }

    #[test]
    fn metadata_and_spec_paths_take_the_training_pods_values() {
        let pod = pod();
        let mut copy = pod.spec.clone().unwrap();
        resolve_env(&mut copy, &pod);
        let env = env(&copy);
        let value = |name: &str| env[name].get("value").and_then(|v| v.as_str()).map(str::to_owned);
        assert_eq!(value("INDEX").as_deref(), Some("1"), "the Indexed Job's index");
        assert_eq!(value("RANK").as_deref(), Some("1"), "init containers too");
        assert_eq!(value("MISSING").as_deref(), Some(""), "a missing key reads empty, as the kubelet reads it");
        assert_eq!(value("UID").as_deref(), Some("u-1"));
        assert_eq!(value("NS").as_deref(), Some("team-a"));
        assert_eq!(value("NODE").as_deref(), Some("tidepool-member-a"), "the node the pod is bound to");
        assert_eq!(value("SA").as_deref(), Some("trainer"));
        assert_eq!(value("PLAIN").as_deref(), Some("x"));
        for kept in ["IP", "CPU"] {
            assert!(env[kept].get("valueFrom").is_some() && env[kept].get("value").is_none(), "{kept} is the member's");
        }
    }

    #[test]
    fn unknown_paths_are_left_to_the_member() {
        let pod = pod();
        assert_eq!(training_value(&pod, "status.hostIP"), None);
        assert_eq!(training_value(&pod, "metadata.labels"), None, "the whole map has no env form");
        assert_eq!(training_value(&pod, "metadata.annotations['unterminated"), None);
    }
}
