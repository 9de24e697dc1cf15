//! What the capacity watches decode of a member's Pods and Nodes: only the fields their views
//! read ([`PodView::from_pod`](super::PodView::from_pod),
//! [`NodeView::from_node`](super::NodeView::from_node)). A watch event's JSON is
//! parsed once either way; here everything else in it (managed fields, images, commands,
//! environment, volumes, probes, node images and addresses, condition messages) is skipped as
//! it is read instead of being built into a whole `Pod` or `Node` and dropped again. What comes
//! out is still a `Pod` or a `Node`, with only those fields set, so the views read the same
//! types as everywhere else.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus, ResourceRequirements, Taint,
    Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Deserialize;

/// A member Pod as the capacity watch decodes it.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "PodWire")]
pub struct MemberPod(pub Pod);

/// A member Node as the capacity watch decodes it.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "NodeWire")]
pub struct MemberNode(pub Node);

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct MetaWire {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    owner_references: Option<Vec<OwnerReference>>,
}

impl From<MetaWire> for ObjectMeta {
    fn from(m: MetaWire) -> Self {
        ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            labels: m.labels,
            owner_references: m.owner_references,
            ..Default::default()
        }
    }
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct PodWire {
    metadata: MetaWire,
    spec: Option<PodSpecWire>,
    status: Option<PodStatusWire>,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct PodSpecWire {
    node_name: Option<String>,
    node_selector: Option<BTreeMap<String, String>>,
    tolerations: Option<Vec<Toleration>>,
    priority: Option<i32>,
    containers: Vec<ContainerWire>,
    init_containers: Option<Vec<ContainerWire>>,
    overhead: Option<BTreeMap<String, Quantity>>,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct ContainerWire {
    name: String,
    resources: Option<ResourceRequirements>,
    restart_policy: Option<String>,
}

impl From<ContainerWire> for Container {
    fn from(c: ContainerWire) -> Self {
        Container { name: c.name, resources: c.resources, restart_policy: c.restart_policy, ..Default::default() }
    }
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct PodStatusWire {
    phase: Option<String>,
}

impl From<PodWire> for MemberPod {
    fn from(p: PodWire) -> Self {
        let spec = p.spec.map(|s| PodSpec {
            node_name: s.node_name,
            node_selector: s.node_selector,
            tolerations: s.tolerations,
            priority: s.priority,
            containers: s.containers.into_iter().map(Container::from).collect(),
            init_containers: s.init_containers.map(|cs| cs.into_iter().map(Container::from).collect()),
            overhead: s.overhead,
            ..Default::default()
        });
        let status = p.status.map(|s| PodStatus { phase: s.phase, ..Default::default() });
        MemberPod(Pod { metadata: p.metadata.into(), spec, status })
    }
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct NodeWire {
    metadata: MetaWire,
    spec: Option<NodeSpecWire>,
    status: Option<NodeStatusWire>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct NodeSpecWire {
    unschedulable: Option<bool>,
    taints: Option<Vec<Taint>>,
    #[serde(rename = "podCIDR")]
    pod_cidr: Option<String>,
    #[serde(rename = "podCIDRs")]
    pod_cidrs: Option<Vec<String>>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct NodeStatusWire {
    allocatable: Option<BTreeMap<String, Quantity>>,
    conditions: Option<Vec<ConditionWire>>,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct ConditionWire {
    #[serde(rename = "type")]
    type_: String,
    status: String,
}

impl From<NodeWire> for MemberNode {
    fn from(n: NodeWire) -> Self {
        let spec = n.spec.map(|s| NodeSpec {
            unschedulable: s.unschedulable,
            taints: s.taints,
            pod_cidr: s.pod_cidr,
            pod_cidrs: s.pod_cidrs,
            ..Default::default()
        });
        let status = n.status.map(|s| NodeStatus {
            allocatable: s.allocatable,
            conditions: s.conditions.map(|cs| {
                cs.into_iter()
                    .map(|c| NodeCondition { type_: c.type_, status: c.status, ..Default::default() })
                    .collect()
            }),
            ..Default::default()
        });
        MemberNode(Node { metadata: n.metadata.into(), spec, status })
    }
}

/// `kube::Resource` of a lean type: that of the type it stands for.
macro_rules! resource_as {
    ($lean:ty, $full:ty, $scope:ty) => {
        impl kube::Resource for $lean {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::kind(dt)
            }

            fn group(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::group(dt)
            }

            fn version(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::version(dt)
            }

            fn plural(dt: &()) -> Cow<'_, str> {
                <$full as kube::Resource>::plural(dt)
            }

            fn meta(&self) -> &ObjectMeta {
                &self.0.metadata
            }

            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

resource_as!(MemberPod, Pod, k8s_openapi::NamespaceResourceScope);
resource_as!(MemberNode, Node, k8s_openapi::ClusterResourceScope);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::{NodeView, PodView};
    use serde_json::json;

    /// A pod with everything a real one carries around the fields the view reads.
    fn rich_pod(node: Option<&str>, origin: Option<&str>) -> serde_json::Value {
        let mut labels = json!({"app": "web", "pod-template-hash": "5d9f7"});
        if let Some(uid) = origin {
            labels[tidepool_api::keys::LABEL_ORIGIN_UID] = json!(uid);
        }
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "web-5d9f7-abcde", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                "generateName": "web-5d9f7-", "creationTimestamp": "2026-12-01T10:00:00Z",
                "labels": labels, "annotations": {"a": "b"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d9f7",
                                      "uid": "rs-1", "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                                   "time": "2026-12-01T10:00:00Z", "fieldsType": "FieldsV1",
                                   "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}}}]
            },
            "spec": {
                "nodeName": node, "priority": 1000, "priorityClassName": "online",
                "nodeSelector": {"pool": "a"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                 "effect": "NoExecute", "tolerationSeconds": 300}],
                "containers": [
                    {"name": "main", "image": "shop/web:1", "command": ["/web"], "env": [{"name": "A", "value": "1"}],
                     "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "1"}},
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                     "readinessProbe": {"httpGet": {"path": "/", "port": 80}}},
                    {"name": "side", "image": "shop/side:1", "resources": {"limits": {"cpu": "100m"}}}
                ],
                "initContainers": [
                    {"name": "init", "image": "shop/init:1", "resources": {"requests": {"cpu": "2"}}},
                    {"name": "proxy", "image": "shop/proxy:1", "restartPolicy": "Always",
                     "resources": {"requests": {"memory": "64Mi"}}}
                ],
                "overhead": {"cpu": "10m"},
                "volumes": [{"name": "data", "emptyDir": {}}]
            },
            "status": {
                "phase": "Running", "hostIP": "10.0.0.1", "podIP": "10.1.0.1",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T10:00:05Z"}],
                "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0, "image": "shop/web:1",
                                       "imageID": "sha256:1", "state": {"running": {"startedAt": "2026-12-01T10:00:04Z"}}}]
            }
        })
    }

    #[test]
    fn a_lean_pod_gives_the_view_the_whole_pod_gives() {
        for (node, origin) in [(Some("n1"), None), (None, None), (Some("n1"), Some("o-1")), (None, Some("o-1"))] {
            let json = rich_pod(node, origin);
            let full: Pod = serde_json::from_value(json.clone()).unwrap();
            let lean: MemberPod = serde_json::from_value(json).unwrap();
            assert_eq!(PodView::from_pod(&lean.0), PodView::from_pod(&full), "node {node:?}, origin {origin:?}");
            assert_eq!(lean.0.metadata.resource_version.as_deref(), Some("42"), "the watch resumes from it");
            assert!(lean.0.metadata.managed_fields.is_none() && lean.0.metadata.annotations.is_none());
        }
        // Terminated pods count nothing; the phase comes through.
        let mut json = rich_pod(Some("n1"), None);
        json["status"]["phase"] = json!("Succeeded");
        let lean: MemberPod = serde_json::from_value(json.clone()).unwrap();
        let full: Pod = serde_json::from_value(json).unwrap();
        assert_eq!(PodView::from_pod(&lean.0), PodView::from_pod(&full));
        // A bare object (as some events carry) decodes too.
        let bare = json!({"metadata": {"name": "p"}});
        let lean: MemberPod = serde_json::from_value(bare.clone()).unwrap();
        let full: Pod = serde_json::from_value(bare).unwrap();
        assert_eq!(PodView::from_pod(&lean.0), PodView::from_pod(&full));
    }

    #[test]
    fn a_lean_node_gives_the_view_the_whole_node_gives() {
        for (ready, unschedulable) in [("True", false), ("False", false), ("True", true)] {
            let json = json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "resourceVersion": "7", "labels": {"rack": "r1", "nvidia.com/gpu.product": "A100"},
                             "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                             "managedFields": [{"manager": "kwok", "operation": "Update", "fieldsType": "FieldsV1",
                                                "fieldsV1": {"f:status": {"f:conditions": {}}}}]},
                "spec": {"unschedulable": unschedulable, "podCIDR": "10.1.0.0/24",
                         "taints": [{"key": "gpu", "value": "a100", "effect": "NoSchedule"},
                                    {"key": "soft", "effect": "PreferNoSchedule"}]},
                "status": {
                    "capacity": {"cpu": "32", "memory": "128Gi", "pods": "110"},
                    "allocatable": {"cpu": "31500m", "memory": "120Gi", "pods": "110", "nvidia.com/gpu": "8"},
                    "conditions": [{"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
                                    "message": "kubelet has sufficient memory available"},
                                   {"type": "Ready", "status": ready, "reason": "KubeletReady",
                                    "lastHeartbeatTime": "2026-12-01T10:00:00Z"}],
                    "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                    "images": [{"names": ["shop/web:1"], "sizeBytes": 1000}],
                    "nodeInfo": {"kubeletVersion": "v1.36.0", "machineID": "m", "systemUUID": "s", "bootID": "b",
                                 "kernelVersion": "6", "osImage": "x", "containerRuntimeVersion": "c",
                                 "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"}
                }
            });
            let full: Node = serde_json::from_value(json.clone()).unwrap();
            let lean: MemberNode = serde_json::from_value(json).unwrap();
            assert_eq!(NodeView::from_node(&lean.0), NodeView::from_node(&full), "Ready {ready}");
            assert!(lean.0.status.as_ref().is_some_and(|s| s.images.is_none()), "node images skipped");
        }
    }
}
