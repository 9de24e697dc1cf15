//! The native pool: the training cluster's own nodes the admin offers
//! (`dispatcher.nativeNodes`), for the pods that ask for them (`tidepool.io/native`). The
//! planner sees it as one more pool ([`PoolView`], named [`NATIVE`]) whose nodes are the
//! training cluster's, each judged on every label, affinity term and taint for the pods at
//! hand ([`NativePool::view_for`]); a pod placed there is bound to its node itself. What a
//! node has room for is its allocatable minus the requests of every live pod bound to it,
//! whoever bound it. Pure: nodes and pods in, views out (the watch is `native`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tidepool_api::Resources;
use tidepool_api::keys;
use tidepool_api::node_match::NodeConstraints;
use tidepool_api::pod::PodLite;
use tidepool_federation::capacity::{GPU_PRODUCT_LABEL, NodeFree, NodeView};
use tidepool_federation::pod_network::PodNetwork;

use crate::plan::PoolView;

/// What the native pool is called where a virtual node's name would be: the placement its
/// pods record ([`keys::PLACEMENT_NATIVE`]); no virtual node can have it (they all carry the
/// virtual node prefix).
pub const NATIVE: &str = keys::PLACEMENT_NATIVE;

/// The offered nodes and the room left on each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NativePool {
    nodes: Vec<Offered>,
}

#[derive(Debug, Clone, PartialEq)]
struct Offered {
    view: NodeView,
    free: Resources,
}

/// Whether `node` is offered: one of the training cluster's own (never a virtual node,
/// whatever the selector says), carrying every label of `selector`, Ready and not cordoned.
pub fn offered(node: &NodeView, selector: &BTreeMap<String, String>) -> bool {
    !node.labels.contains_key(keys::LABEL_MEMBER)
        && node.labels.get(keys::LABEL_NODE_TYPE).map(String::as_str) != Some(keys::NODE_TYPE_VIRTUAL)
        && node.matches(selector)
        && node.ready
        && !node.unschedulable
}

impl NativePool {
    /// The offered nodes of `nodes` (see [`offered`]), each with its allocatable less the
    /// requests of the live pods of `pods` bound to it.
    pub fn new(
        nodes: impl IntoIterator<Item = NodeView>,
        selector: &BTreeMap<String, String>,
        pods: &[Arc<PodLite>],
    ) -> Self {
        let mut by_name: BTreeMap<String, Offered> = nodes
            .into_iter()
            .filter(|n| offered(n, selector))
            .map(|view| (view.name.clone(), Offered { free: view.allocatable.clone(), view }))
            .collect();
        for p in pods.iter().filter(|p| p.is_live()) {
            if let Some(n) = p.node_name().and_then(|name| by_name.get_mut(name)) {
                n.free.sub(&p.spec.requests);
            }
        }
        let nodes = by_name
            .into_values()
            .map(|mut n| {
                n.free.clamp_non_negative();
                n
            })
            .collect();
        Self { nodes }
    }

    /// The pod network of the offered nodes (their pod CIDRs).
    pub fn network(&self) -> PodNetwork {
        PodNetwork::new(self.nodes.iter().flat_map(|n| n.view.pod_cidrs.iter().cloned()))
    }

    /// Whether no node is offered.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The pool as the planner sees it for pods whose node selections are `pods` (one entry
    /// per pod, `None` for a pod without one): only the nodes every one of them may go to, by
    /// its selector, its required affinity and its tolerations of the node's taints.
    pub fn view_for(&self, pods: &[Option<&NodeConstraints>]) -> PoolView {
        let free_per_node: Vec<NodeFree> = self
            .nodes
            .iter()
            .filter(|n| pods.iter().all(|c| admits(*c, &n.view)))
            .map(|n| {
                let mut node = NodeFree::new(n.view.name.clone(), n.free.clone());
                if let Some(model) = n.view.labels.get(GPU_PRODUCT_LABEL) {
                    node.labels.insert(GPU_PRODUCT_LABEL.to_owned(), model.clone());
                }
                node
            })
            .collect();
        let mut capacity = Resources::new();
        free_per_node.iter().for_each(|n| capacity.add(&n.free));
        let models: std::collections::BTreeSet<Option<&String>> =
            free_per_node.iter().map(|n| n.labels.get(GPU_PRODUCT_LABEL)).collect();
        let gpu_product = match models.into_iter().collect::<Vec<_>>().as_slice() {
            [Some(model)] => Some((*model).clone()),
            _ => None,
        };
        PoolView {
            node: NATIVE.to_owned(),
            member: "the training cluster".to_owned(),
            pool: NATIVE.to_owned(),
            capacity,
            used: Resources::new(),
            schedulable: !free_per_node.is_empty(),
            free_per_node,
            gpu_product,
            topology: Vec::new(),
        }
    }

    /// Books `req` on node `name`, so the round's later decisions see it taken.
    pub fn reserve(&mut self, name: &str, req: &Resources) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.view.name == name) {
            n.free.sub(req);
            n.free.clamp_non_negative();
        }
    }

    /// The first node (by name) a pod with `constraints` may go to that has room for `req`,
    /// booked for it; `None` when there is none.
    pub fn take_one(&mut self, req: &Resources, constraints: Option<&NodeConstraints>) -> Option<String> {
        let n = self.nodes.iter_mut().find(|n| admits(constraints, &n.view) && req.fits_in(&n.free))?;
        n.free.sub(req);
        Some(n.view.name.clone())
    }
}

/// A member as [`apart`] reads it: its name, its pools' virtual nodes, its pod network.
pub type MemberNetwork = (String, Vec<String>, PodNetwork);

/// The virtual nodes of the pools a native-floor job may not borrow from: those of each
/// member (`(name, its pools' virtual nodes, its pod network)`) whose pod network overlaps the
/// native nodes' (`native`) or another member's. A job's native pods and its copies must reach
/// each other by pod IP; with overlapping networks some of those IPs are other pods'.
pub fn apart(members: &[MemberNetwork], native: &PodNetwork) -> BTreeSet<String> {
    let mut apart = BTreeSet::new();
    for (name, nodes, network) in members {
        let others = members.iter().filter(|(other, _, _)| other != name).map(|(other, _, n)| (other.as_str(), n));
        let named = std::iter::once(("the native nodes", native)).chain(others);
        if tidepool_federation::pod_network::overlap_message(network, named).is_some() {
            apart.extend(nodes.iter().cloned());
        }
    }
    apart
}

/// Whether a pod with `constraints` (`None`: none) may go to `node`: its selection on every
/// label, and every hard taint tolerated.
fn admits(constraints: Option<&NodeConstraints>, node: &NodeView) -> bool {
    let none = NodeConstraints::default();
    let c = constraints.unwrap_or(&none);
    c.matches_native(&node.name, &node.labels)
        && c.tolerates_all(node.taints.iter().map(|t| (t.key.as_str(), t.value.as_deref(), t.effect.as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use tidepool_federation::capacity::HardTaint;

    pub(crate) fn node(name: &str, cpu: i64, labels: &[(&str, &str)]) -> NodeView {
        let mut allocatable = Resources::new();
        allocatable.set("cpu", cpu * 1000);
        allocatable.set("pods", 110_000);
        NodeView {
            name: name.to_owned(),
            labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            ready: true,
            allocatable,
            ..Default::default()
        }
    }

    fn pod_on(node: &str, cpu: i64, phase: &str) -> Arc<PodLite> {
        let mut p = PodLite::default();
        p.spec.node_name = Some(node.to_owned());
        p.spec.requests.set("cpu", cpu * 1000);
        p.status.phase = Some(phase.to_owned());
        Arc::new(p)
    }

    fn constraints(spec: serde_json::Value) -> NodeConstraints {
        let mut v = spec;
        v["containers"] = serde_json::json!([]);
        NodeConstraints::of(&serde_json::from_value::<PodSpec>(v).unwrap()).unwrap()
    }

    fn names(view: &PoolView) -> Vec<&str> {
        view.free_per_node.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn only_ready_schedulable_selected_own_nodes_are_offered() {
        let selector = BTreeMap::from([("pool".to_owned(), "train".to_owned())]);
        let mut cordoned = node("cordoned", 8, &[("pool", "train")]);
        cordoned.unschedulable = true;
        let mut down = node("down", 8, &[("pool", "train")]);
        down.ready = false;
        let nodes = vec![
            node("a", 8, &[("pool", "train")]),
            node("other", 8, &[("pool", "web")]),
            node("tidepool-m", 8, &[("pool", "train"), (keys::LABEL_MEMBER, "m")]),
            node("virtual", 8, &[("pool", "train"), (keys::LABEL_NODE_TYPE, keys::NODE_TYPE_VIRTUAL)]),
            cordoned,
            down,
        ];
        let pool = NativePool::new(nodes, &selector, &[]);
        assert_eq!(names(&pool.view_for(&[None])), ["a"]);
    }

    #[test]
    fn room_is_what_the_live_pods_bound_there_leave() {
        let pods = [pod_on("a", 3, "Running"), pod_on("a", 2, "Pending"), pod_on("a", 4, "Succeeded")];
        let pool = NativePool::new([node("a", 8, &[])], &BTreeMap::new(), &pods);
        let view = pool.view_for(&[None]);
        assert_eq!(view.free_per_node[0].free.get("cpu"), 3000);
        assert_eq!(view.capacity.get("cpu"), 3000);
        assert_eq!(view.node, NATIVE);
    }

    #[test]
    fn a_node_is_in_the_view_only_when_every_pod_may_go_there() {
        let mut tainted = node("tainted", 8, &[("disk", "ssd")]);
        tainted.taints =
            vec![HardTaint { key: "dedicated".into(), value: Some("train".into()), effect: "NoSchedule".into() }];
        let pool = NativePool::new([node("plain", 8, &[]), tainted], &BTreeMap::new(), &[]);
        let ssd = constraints(serde_json::json!({"nodeSelector": {"disk": "ssd"}}));
        let tolerant = constraints(serde_json::json!({"nodeSelector": {"disk": "ssd"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"}]}));
        assert_eq!(names(&pool.view_for(&[None])), ["plain"], "a taint keeps pods that do not tolerate it off");
        assert!(names(&pool.view_for(&[Some(&ssd)])).is_empty(), "selected but not tolerated");
        assert_eq!(names(&pool.view_for(&[Some(&tolerant)])), ["tainted"]);
        assert!(names(&pool.view_for(&[Some(&tolerant), None])).is_empty(), "one pod of the gang may not go there");
    }

    fn network(cidrs: &[&str]) -> PodNetwork {
        PodNetwork::new(cidrs.iter().map(|c| c.parse().unwrap()))
    }

    #[test]
    fn members_whose_pod_network_overlaps_the_native_nodes_or_each_other_stand_apart() {
        let mut native_node = node("t", 8, &[]);
        native_node.pod_cidrs = vec!["10.1.0.0/24".parse().unwrap()];
        let native = NativePool::new([native_node], &BTreeMap::new(), &[]).network();
        let member = |name: &str, cidrs: &[&str]| (name.to_owned(), vec![format!("tidepool-{name}")], network(cidrs));
        let members = [
            member("clear", &["10.2.0.0/24"]),
            member("on-native", &["10.1.0.128/25"]),
            member("x", &["10.3.0.0/16"]),
            member("y", &["10.3.4.0/24"]),
            member("unknown", &[]),
        ];
        let apart: Vec<String> = apart(&members, &native).into_iter().collect();
        assert_eq!(apart, ["tidepool-on-native", "tidepool-x", "tidepool-y"]);
    }

    #[test]
    fn taking_one_books_the_first_node_with_room() {
        let mut pool = NativePool::new([node("a", 2, &[]), node("b", 4, &[])], &BTreeMap::new(), &[]);
        let mut three = Resources::new();
        three.set("cpu", 3000);
        assert_eq!(pool.take_one(&three, None).as_deref(), Some("b"));
        assert_eq!(pool.take_one(&three, None), None, "b has 1 left, a 2");
        pool.reserve("a", &three);
        assert_eq!(pool.view_for(&[None]).free_per_node[0].free.get("cpu"), 0);
    }
}
