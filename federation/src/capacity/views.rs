//! What the capacity model reads of a member's nodes and pods: [`NodeView`] and [`PodView`],
//! made from the objects the member watches decode ([`super::wire`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use tidepool_api::crd::PoolToleration;
use tidepool_api::{Resources, keys};

/// What the capacity model needs of a member node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub ready: bool,
    pub unschedulable: bool,
    pub allocatable: Resources,
    /// `NoSchedule` and `NoExecute` taints: a pool counts the node only if its copies
    /// tolerate them all ([`NodeView::tolerated_by`]).
    pub taints: Vec<HardTaint>,
    /// The node's pod CIDRs ([`crate::pod_network`]).
    pub pod_cidrs: Vec<crate::pod_network::Cidr>,
}

/// A taint that keeps every pod off a node unless the pod tolerates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardTaint {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
}

/// Key of a member pod: namespace and name.
pub type PodCapacityKey = (String, String);

/// What the capacity model needs of a member pod. A member holds one per pod (online and
/// offload, thousands of each), so what only some online pods carry is boxed apart
/// ([`OnlineParts`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodView {
    /// `spec.nodeName`; `None` while pending.
    pub node: Option<Box<str>>,
    pub requests: Resources,
    /// Succeeded or Failed: holds no resources any more.
    pub terminated: bool,
    /// Created by tidepool (carries `tidepool.io/origin-uid`).
    pub offload: bool,
    /// `spec.priority`, resolved by the API server at admission.
    pub priority: Option<i32>,
    /// The training pod an offload pod copies.
    pub origin_uid: Option<Arc<str>>,
    /// An offload pod's own UID (`None` for online pods: not needed).
    pub uid: Option<Arc<str>>,
    /// Where a pending pod could land and the workload it belongs to; `None` when it has
    /// neither (every offload pod, most placed online pods).
    pub online: Option<Box<OnlineParts>>,
}

/// The parts of a member pod's view that only online pods have ([`PodView::online`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OnlineParts {
    /// `spec.nodeSelector`: which pools a pending pod could land in.
    pub node_selector: BTreeMap<String, String>,
    /// `spec.tolerations` of a pending online pod: a pool of tainted (dedicated) nodes is
    /// where it could land only if it tolerates them.
    pub tolerations: Vec<PoolToleration>,
    /// The online workload whose controller created the pod: kind (`Deployment`, through
    /// its ReplicaSet, or `StatefulSet`) and name. Counts the replicas that exist.
    pub workload: Option<(&'static str, Box<str>)>,
}

impl OnlineParts {
    /// The parts boxed, or `None` when there are none to keep.
    pub fn boxed(
        node_selector: BTreeMap<String, String>,
        tolerations: Vec<PoolToleration>,
        workload: Option<(&'static str, Box<str>)>,
    ) -> Option<Box<Self>> {
        let empty = node_selector.is_empty() && tolerations.is_empty() && workload.is_none();
        (!empty).then(|| Box::new(Self { node_selector, tolerations, workload }))
    }
}

/// The selector of a view without one.
static NO_SELECTOR: BTreeMap<String, String> = BTreeMap::new();

impl PodView {
    /// `spec.nodeSelector` (kept for a pending online pod only).
    pub fn node_selector(&self) -> &BTreeMap<String, String> {
        self.online.as_ref().map_or(&NO_SELECTOR, |o| &o.node_selector)
    }

    /// `spec.tolerations` (kept for a pending online pod only).
    pub fn tolerations(&self) -> &[PoolToleration] {
        self.online.as_ref().map_or(&[], |o| &o.tolerations)
    }

    /// The online workload the pod belongs to: kind and name.
    pub fn workload(&self) -> Option<(&'static str, &str)> {
        self.online.as_ref()?.workload.as_ref().map(|(kind, name)| (*kind, &**name))
    }
}

impl PodView {
    /// An online pod the member's scheduler has not placed (yet): demand to answer at once.
    pub fn pending_online(&self) -> bool {
        !self.offload && !self.terminated && self.node.is_none()
    }
}

impl NodeView {
    pub fn from_node(node: &Node) -> Self {
        let status = node.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let allocatable = status
            .and_then(|s| s.allocatable.as_ref())
            .map(|a| {
                // One malformed quantity must not hide the whole node: skip just that entry.
                let mut r = Resources::new();
                for (k, v) in a {
                    if let Ok(m) = tidepool_api::resources::parse_milli(&v.0) {
                        r.add_one(k, m);
                    }
                }
                r
            })
            .unwrap_or_default();
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            ready,
            unschedulable: node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
            allocatable,
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .filter(|t| matches!(t.effect.as_str(), "NoSchedule" | "NoExecute"))
                .map(|t| HardTaint { key: t.key.clone(), value: t.value.clone(), effect: t.effect.clone() })
                .collect(),
            pod_cidrs: crate::pod_network::node_cidrs(node),
        }
    }

    /// Whether pods carrying `tolerations` may be placed here as far as taints go: the
    /// member's scheduler would keep a copy off a node with any hard taint it does not
    /// tolerate, so such a node lends nothing to the pool.
    pub fn tolerated_by(&self, tolerations: &[PoolToleration]) -> bool {
        self.taints.iter().all(|t| tolerations.iter().any(|tol| tol.tolerates(&t.key, t.value.as_deref(), &t.effect)))
    }

    pub fn matches(&self, selector: &BTreeMap<String, String>) -> bool {
        selector.iter().all(|(k, v)| self.labels.get(k) == Some(v))
    }
}

impl PodView {
    pub fn from_pod(pod: &Pod) -> Self {
        let origin_uid =
            pod.metadata.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_UID)).map(|u| u.as_str().into());
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).map(Box::from);
        // Only a pending online pod's selector is ever read (which pools it could land in).
        let (node_selector, tolerations) = match (&node, &origin_uid) {
            (None, None) => (
                pod.spec.as_ref().and_then(|s| s.node_selector.clone()).unwrap_or_default(),
                pod.spec.as_ref().map(tolerations_of).unwrap_or_default(),
            ),
            _ => (BTreeMap::new(), Vec::new()),
        };
        let online = origin_uid.is_none();
        Self {
            node,
            requests: pod.spec.as_ref().map(pod_requests).unwrap_or_default(),
            terminated: matches!(phase, Some("Succeeded" | "Failed")),
            offload: origin_uid.is_some(),
            uid: if online { None } else { pod.metadata.uid.as_deref().map(Arc::from) },
            origin_uid,
            priority: pod.spec.as_ref().and_then(|s| s.priority),
            online: OnlineParts::boxed(node_selector, tolerations, if online { workload_of(pod) } else { None }),
        }
    }
}

/// The Deployment or StatefulSet whose controller owns `pod`. A Deployment's pods are owned
/// by one of its ReplicaSets, named after it and the template hash the pods carry as a label.
fn workload_of(pod: &Pod) -> Option<(&'static str, Box<str>)> {
    let owner = pod.metadata.owner_references.as_ref()?.iter().find(|o| o.controller == Some(true))?;
    match owner.kind.as_str() {
        "StatefulSet" => Some(("StatefulSet", owner.name.as_str().into())),
        "ReplicaSet" => {
            let hash = pod.metadata.labels.as_ref()?.get("pod-template-hash")?;
            let name = owner.name.strip_suffix(hash.as_str())?.strip_suffix('-')?;
            Some(("Deployment", name.into()))
        }
        _ => None,
    }
}

pub use tidepool_api::pod::pod_requests;

/// A pod spec's tolerations as the capacity model matches them against node taints
/// (`tolerationSeconds` does not matter for where a pod may land).
pub fn tolerations_of(spec: &k8s_openapi::api::core::v1::PodSpec) -> Vec<PoolToleration> {
    spec.tolerations
        .iter()
        .flatten()
        .map(|t| PoolToleration {
            key: t.key.clone(),
            operator: t.operator.clone(),
            value: t.value.clone(),
            effect: t.effect.clone(),
        })
        .collect()
}
