//! Which nodes a pod may go to by its own words: `spec.nodeSelector` and the required node
//! affinity, matched against a node's name and labels the way kube-scheduler's NodeAffinity
//! filter matches them. For `schedulerName: tidepool` the nodes are virtual nodes, whose
//! labels ([`virtual_node_labels`]) name the member, the pool and the GPU model, so a tenant
//! can keep a job on one member (`tidepool.io/member: member-a`), one pool or one model
//! with the selectors they already write.
//!
//! A selector speaks of two kinds of nodes at once: the virtual node a pod is bound to, and
//! the member node its copy runs on (the copy keeps the terms on the member's labels, such as
//! `disktype: ssd`). So a requirement is judged here only on a key a virtual node answers
//! for: its own (`type`, `tidepool.io/…`, `kubernetes.io/hostname`, `kubernetes.io/role`) or
//! one it carries (the GPU model of a one-model pool, os, arch); any other key is the member's
//! scheduler's to judge, inside the pool.
//!
//! The training cluster's own nodes (the native floor, `dispatcher.nativeNodes`) are judged
//! on every key, as kube-scheduler judges them ([`NodeConstraints::matches_native`]), and by
//! their taints ([`NodeConstraints::tolerates_all`]). Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorRequirement, NodeSelectorTerm, PodSpec, Toleration};
use serde::{Deserialize, Serialize};

use crate::crd::PoolToleration;
use crate::keys;

/// The GPU model label of nodes (NVIDIA's GPU feature discovery); a virtual node carries it
/// when every node of its pool has the same model.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// A pod's node selection, kept only for pods that have one (boxed in [`crate::pod::SpecLite`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeConstraints {
    /// `spec.nodeSelector`: every pair must be a label of the node.
    pub selector: BTreeMap<String, String>,
    /// The required node affinity's terms: one of them must match (none: no constraint).
    pub terms: Vec<NodeSelectorTerm>,
    /// `spec.tolerations`, but for the two every pod gets at admission (a node not ready or
    /// unreachable): read only where a native node's taints are judged.
    pub tolerations: Vec<PoolToleration>,
}

/// The tolerations the DefaultTolerationSeconds admission plugin gives every pod: they say
/// nothing of where the pod asked to go.
const DEFAULT_TOLERATIONS: [&str; 2] = ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"];

impl NodeConstraints {
    /// The constraints of `spec`, or `None` when it has none.
    pub fn of(spec: &PodSpec) -> Option<Self> {
        let selector = spec.node_selector.clone().unwrap_or_default();
        let terms = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref())
            .map(|r| r.node_selector_terms.clone())
            .unwrap_or_default();
        let tolerations = spec.tolerations.iter().flatten().filter(|t| !is_default(t)).map(lite).collect();
        let c = NodeConstraints { selector, terms, tolerations };
        (c != NodeConstraints::default()).then_some(c)
    }

    /// Whether virtual node `name` with `labels` satisfies both the selector and the
    /// affinity, as far as it answers for their keys (see the module docs).
    pub fn matches(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        self.selector.iter().filter(|(k, _)| judged(k, labels)).all(|(k, v)| labels.get(k) == Some(v))
            && (self.terms.is_empty() || self.terms.iter().any(|t| term_matches(t, name, labels)))
    }

    /// Whether one of the training cluster's own nodes, `name` with `labels`, satisfies the
    /// selector and the affinity on every key (nothing is left to a member's scheduler there).
    pub fn matches_native(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        self.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            && (self.terms.is_empty() || self.terms.iter().any(|t| term_matches_with(t, name, labels, &|_| true)))
    }

    /// Whether the pod tolerates every one of `taints` (`(key, value, effect)` of a node's
    /// `NoSchedule` and `NoExecute` taints), as kube-scheduler's TaintToleration filter judges.
    pub fn tolerates_all<'a>(&self, mut taints: impl Iterator<Item = (&'a str, Option<&'a str>, &'a str)>) -> bool {
        taints.all(|(key, value, effect)| self.tolerations.iter().any(|t| t.tolerates(key, value, effect)))
    }

    /// How a tenant wrote it, for an explanation: `a=b, c In [d e]`.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self.selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let terms: Vec<String> = self
            .terms
            .iter()
            .map(|t| {
                let exprs = t.match_expressions.iter().flatten().chain(t.match_fields.iter().flatten());
                exprs.map(describe_requirement).collect::<Vec<_>>().join(", ")
            })
            .collect();
        if !terms.is_empty() {
            parts.push(format!("affinity {}", terms.join(" or ")));
        }
        if !self.tolerations.is_empty() {
            let keys: Vec<&str> = self.tolerations.iter().map(|t| t.key.as_deref().unwrap_or("*")).collect();
            parts.push(format!("tolerating {}", keys.join(" ")));
        }
        parts.join(", ")
    }
}

fn is_default(t: &Toleration) -> bool {
    t.key.as_deref().is_some_and(|k| DEFAULT_TOLERATIONS.contains(&k)) && t.effect.as_deref() == Some("NoExecute")
}

fn lite(t: &Toleration) -> PoolToleration {
    PoolToleration {
        key: t.key.clone(),
        operator: t.operator.clone(),
        value: t.value.clone(),
        effect: t.effect.clone(),
    }
}

fn describe_requirement(r: &NodeSelectorRequirement) -> String {
    match r.values.as_deref() {
        Some(v) if !v.is_empty() => format!("{} {} [{}]", r.key, r.operator, v.join(" ")),
        _ => format!("{} {}", r.key, r.operator),
    }
}

/// Whether a virtual node answers for label `key`: one of its own, or one it carries.
fn judged(key: &str, labels: &BTreeMap<String, String>) -> bool {
    key == keys::LABEL_NODE_TYPE
        || key.starts_with("tidepool.io/")
        || key == "kubernetes.io/hostname"
        || key == "kubernetes.io/role"
        || labels.contains_key(key)
}

/// A term with no requirement matches no node (as in kube-scheduler); the requirements on keys
/// the virtual node does not answer for are left to the member.
fn term_matches(term: &NodeSelectorTerm, name: &str, labels: &BTreeMap<String, String>) -> bool {
    term_matches_with(term, name, labels, &|k| judged(k, labels))
}

/// [`term_matches`] judging only the keys `judge` accepts.
fn term_matches_with(
    term: &NodeSelectorTerm,
    name: &str,
    labels: &BTreeMap<String, String>,
    judge: &dyn Fn(&str) -> bool,
) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let name_fields = BTreeMap::from([("metadata.name".to_owned(), name.to_owned())]);
    exprs.iter().filter(|r| judge(&r.key)).all(|r| requirement_matches(r, labels))
        && fields.iter().all(|r| requirement_matches(r, &name_fields))
}

fn requirement_matches(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let value = labels.get(&r.key);
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), Some(bound)) = (value.and_then(|v| number(v)), values.first().and_then(|v| number(v)))
            else {
                return false;
            };
            if r.operator == "Gt" { have > bound } else { have < bound }
        }
        _ => false,
    }
}

/// The labels of the virtual node of pool `pool` of `member`, named `node`: what a pod's
/// selector can choose it by.
pub fn virtual_node_labels(
    member: &str,
    pool: &str,
    node: &str,
    gpu_product: Option<&str>,
) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (keys::LABEL_NODE_TYPE.to_owned(), keys::NODE_TYPE_VIRTUAL.to_owned()),
        (keys::LABEL_MEMBER.to_owned(), member.to_owned()),
        (keys::LABEL_POOL.to_owned(), pool.to_owned()),
        ("kubernetes.io/hostname".to_owned(), node.to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
        ("kubernetes.io/role".to_owned(), "agent".to_owned()),
    ]);
    if let Some(product) = gpu_product {
        labels.insert(GPU_PRODUCT_LABEL.to_owned(), product.to_owned());
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(json!({"containers": [], "nodeSelector": v["nodeSelector"], "affinity": v["affinity"]}))
            .unwrap()
    }

    fn affinity(terms: serde_json::Value) -> serde_json::Value {
        json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}})
    }

    #[test]
    fn a_pod_without_selector_or_required_affinity_has_no_constraints() {
        assert_eq!(NodeConstraints::of(&spec(json!({}))), None);
        let preferred = json!({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}});
        assert_eq!(NodeConstraints::of(&spec(preferred)), None);
    }

    #[test]
    fn constraints_match_as_kube_scheduler_matches_them() {
        let real = virtual_node_labels("member-a", "real", "tidepool-member-a-real", None);
        let gpu = virtual_node_labels("member-b", "a100", "tidepool-member-b-a100", Some("NVIDIA-A100-SXM4-80GB"));
        let cases = [
            ("a selector naming the pool", json!({"nodeSelector": {"tidepool.io/pool": "real"}}), true, false),
            (
                "a selector on the member's own labels is the member's to judge",
                json!({"nodeSelector": {"disktype": "ssd"}}),
                true,
                true,
            ),
            ("a selector naming a pool no node is", json!({"nodeSelector": {"tidepool.io/pool": "x"}}), false, false),
            (
                "the GPU model where the pool has one",
                json!({"nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H100"}}),
                true,
                false,
            ),
            (
                "In on the member",
                affinity(
                    json!([{"matchExpressions": [{"key": "tidepool.io/member", "operator": "In", "values": ["member-b"]}]}]),
                ),
                false,
                true,
            ),
            (
                "NotIn on the member",
                affinity(
                    json!([{"matchExpressions": [{"key": "tidepool.io/member", "operator": "NotIn", "values": ["member-b"]}]}]),
                ),
                true,
                false,
            ),
            (
                // A pool without one model says nothing of its nodes' models: the member judges.
                "Exists on the GPU model",
                affinity(json!([{"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "Exists"}]}])),
                true,
                true,
            ),
            (
                "DoesNotExist on the GPU model",
                affinity(json!([{"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "DoesNotExist"}]}])),
                true,
                false,
            ),
            (
                "an expression on the member's labels only",
                affinity(json!([{"matchExpressions": [{"key": "disktype", "operator": "In", "values": ["ssd"]}]}])),
                true,
                true,
            ),
            (
                "one of two terms",
                affinity(
                    json!([{"matchExpressions": [{"key": "tidepool.io/pool", "operator": "In", "values": ["x"]}]},
                                                  {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["tidepool-member-a-real"]}]}]),
                ),
                true,
                false,
            ),
            ("an empty term matches nothing", affinity(json!([{}])), false, false),
            (
                "Gt on a label that is no number",
                affinity(
                    json!([{"matchExpressions": [{"key": "tidepool.io/pool", "operator": "Gt", "values": ["1"]}]}]),
                ),
                false,
                false,
            ),
            (
                "Exists on a key of the virtual nodes' that none has",
                affinity(json!([{"matchExpressions": [{"key": "tidepool.io/rack", "operator": "Exists"}]}])),
                false,
                false,
            ),
        ];
        for (what, v, on_real, on_gpu) in cases {
            let c = NodeConstraints::of(&spec(v)).unwrap();
            assert_eq!(c.matches("tidepool-member-a-real", &real), on_real, "{what} on the real pool");
            assert_eq!(c.matches("tidepool-member-b-a100", &gpu), on_gpu, "{what} on the GPU pool");
        }
    }

    #[test]
    fn constraints_are_described_as_written() {
        let mut v = affinity(
            json!([{"matchExpressions": [{"key": "tidepool.io/member", "operator": "In", "values": ["a", "b"]}]}]),
        );
        v["nodeSelector"] = json!({"tidepool.io/pool": "real"});
        let c = NodeConstraints::of(&spec(v)).unwrap();
        assert_eq!(c.describe(), "tidepool.io/pool=real, affinity tidepool.io/member In [a b]");
    }
}
