//! Kueue quota that follows what the members lend (pure; the loop is [`crate::kueue`]).
//!
//! Kueue admits by quota alone: a ClusterQueue's `nominalQuota` per ResourceFlavor is all it
//! knows of capacity. A quota written once by hand over lent capacity goes stale the moment a
//! window opens or an HPA's headroom grows in a member: Kueue goes on admitting what tidepool
//! would place only to reclaim. So tidepool writes that quota. An admin marks a ClusterQueue
//! or a Cohort with the annotation [`ANNOTATION`] (`"100%"`, or a tenant's share such as
//! `"40%"`), and for each of its flavors that describes lent capacity (nodeLabels that only
//! virtual nodes carry, [`is_lent`]) every covered resource's `nominalQuota` becomes that share
//! of the allocatable of the Ready, schedulable virtual nodes the flavor selects — the total the
//! members lend, which is what tidepool may use, running pods included. Borrowing and lending
//! limits, other flavors and everything else in the queue stay the admin's.

use std::collections::BTreeMap;

use serde_json::Value;
use tidepool_api::resources::{format_milli, parse_milli};
use tidepool_api::{Resources, keys};
use tidepool_federation::capacity::NodeView;

/// The annotation that asks tidepool to drive a queue's quota over lent flavors.
pub const ANNOTATION: &str = "tidepool.io/lent-quota";

/// A share of what is lent, in percent (1 to 100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share(u32);

impl Share {
    /// Reads the annotation's value: `N%` with N from 1 to 100.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("{ANNOTATION}: {text:?} is not a share of what is lent (1% to 100%, e.g. \"100%\")");
        let n: u32 = text.trim().strip_suffix('%').ok_or_else(bad)?.trim().parse().map_err(|_| bad())?;
        if (1..=100).contains(&n) { Ok(Self(n)) } else { Err(bad()) }
    }

    /// This share of `milli`, rounded down.
    fn of(self, milli: i64) -> i64 {
        i64::try_from(i128::from(milli) * i128::from(self.0) / 100).unwrap_or(i64::MAX)
    }
}

/// Whether `n` is one of tidepool's virtual nodes.
fn is_virtual(n: &NodeView) -> bool {
    n.labels.contains_key(keys::LABEL_MEMBER)
}

/// Whether a flavor with these nodeLabels describes lent capacity: it selects by the label
/// virtual-kubelet nodes carry or by one of tidepool's own, so no real node can match it.
pub fn is_lent(node_labels: &BTreeMap<String, String>) -> bool {
    node_labels.get(keys::LABEL_NODE_TYPE).is_some_and(|v| v == keys::NODE_TYPE_VIRTUAL)
        || node_labels.keys().any(|k| k.starts_with("tidepool.io/"))
}

/// The total a lent flavor with these nodeLabels stands for: the allocatable of the Ready,
/// schedulable virtual nodes it selects (federation's node view, as the capacity model reads
/// member nodes).
pub fn lent(node_labels: &BTreeMap<String, String>, nodes: &[NodeView]) -> Resources {
    let mut total = Resources::new();
    let selected = nodes.iter().filter(|n| is_virtual(n) && n.ready && !n.unschedulable);
    for n in selected.filter(|n| n.matches(node_labels)) {
        total.add(&n.allocatable);
    }
    total
}

/// A quota the admin's queue should hold, and what it holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub flavor: String,
    pub resource: String,
    pub from: String,
    pub to: String,
}

/// The queue's `spec.resourceGroups` with the quota of each lent flavor (by name, in `lent`)
/// set to `share` of what it stands for, and the changes; `None` when it holds that already
/// (compared as quantities: `1` and `1000m` are the same quota). An error names what in the
/// groups cannot be read.
pub fn resource_groups(
    groups: &Value,
    lent: &BTreeMap<String, Resources>,
    share: Share,
) -> Result<Option<(Value, Vec<Change>)>, String> {
    let mut groups = groups.clone();
    let mut changes = Vec::new();
    let list = groups.as_array_mut().ok_or("spec.resourceGroups is not a list")?;
    for flavor in list.iter_mut().filter_map(|g| g.get_mut("flavors")?.as_array_mut()).flatten() {
        let name = flavor.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
        let Some(total) = lent.get(&name) else { continue };
        for r in flavor.get_mut("resources").and_then(Value::as_array_mut).into_iter().flatten() {
            let resource = r.get("name").and_then(Value::as_str).unwrap_or_default().to_owned();
            let from = quantity(r.get("nominalQuota"));
            let want = share.of(total.get(&resource));
            let same = from.as_deref().map(parse_milli).and_then(Result::ok) == Some(want);
            if !same {
                let to = format_milli(want);
                r["nominalQuota"] = Value::String(to.clone());
                changes.push(Change { flavor: name.clone(), resource, from: from.unwrap_or_default(), to });
            }
        }
    }
    Ok((!changes.is_empty()).then_some((groups, changes)))
}

/// A quantity as the API gives it: a string, or a bare number.
fn quantity(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const VK_TYPE: (&str, &str) = (keys::LABEL_NODE_TYPE, keys::NODE_TYPE_VIRTUAL);

    fn node(member: &str, cpu: &str, memory: &str) -> NodeView {
        NodeView {
            labels: [(keys::LABEL_MEMBER, member), VK_TYPE].map(|(k, v)| (k.to_owned(), v.to_owned())).into(),
            ready: true,
            allocatable: Resources::from_pairs([("cpu", cpu), ("memory", memory)]).unwrap(),
            ..NodeView::default()
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_share_is_a_percentage_from_one_to_a_hundred() {
        assert_eq!(Share::parse("100%"), Ok(Share(100)));
        assert_eq!(Share::parse(" 40 % "), Ok(Share(40)));
        for bad in ["0%", "101%", "40", "half", "-5%", ""] {
            let e = Share::parse(bad).unwrap_err();
            assert!(e.contains(ANNOTATION) && e.contains("1% to 100%"), "{bad}: {e}");
        }
        assert_eq!(Share(40).of(1001), 400, "rounded down: never more than the share");
    }

    #[test]
    fn only_flavors_no_real_node_can_match_are_lent() {
        assert!(is_lent(&labels(&[VK_TYPE])));
        assert!(is_lent(&labels(&[(keys::LABEL_MEMBER, "member-a")])));
        assert!(!is_lent(&labels(&[])), "an empty selector matches the training cluster's own nodes too");
        assert!(!is_lent(&labels(&[("type", "gpu")])));
    }

    #[test]
    fn a_flavor_stands_for_the_ready_schedulable_virtual_nodes_it_selects() {
        let mut nodes =
            vec![node("a", "4", "8Gi"), node("b", "2", "4Gi"), node("c", "16", "1Gi"), node("d", "8", "1Gi")];
        nodes[2].ready = false;
        nodes[3].unschedulable = true;
        let mut real = node("x", "64", "64Gi");
        real.labels.remove(keys::LABEL_MEMBER);
        nodes.push(real);
        let all = lent(&labels(&[VK_TYPE]), &nodes);
        assert_eq!((all.get("cpu"), all.get("memory")), (6000, 12 * (1 << 30) * 1000));
        let b = lent(&labels(&[VK_TYPE, (keys::LABEL_MEMBER, "b")]), &nodes);
        assert_eq!(b.get("cpu"), 2000);
        assert!(lent(&labels(&[(keys::LABEL_MEMBER, "nowhere")]), &nodes).is_empty(), "nothing lent: zero quota");
    }

    fn groups() -> Value {
        json!([
            {"coveredResources": ["cpu", "memory"], "flavors": [
                {"name": "lent", "resources": [
                    {"name": "cpu", "nominalQuota": "300m", "borrowingLimit": "1"},
                    {"name": "memory", "nominalQuota": 1073741824u64}]},
                {"name": "native", "resources": [{"name": "cpu", "nominalQuota": "8"}, {"name": "memory", "nominalQuota": "8Gi"}]}
            ]},
            {"coveredResources": ["nvidia.com/gpu"], "flavors": [{"name": "lent-gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 4}]}]}
        ])
    }

    #[test]
    fn the_quota_of_lent_flavors_is_the_share_of_what_they_stand_for_and_nothing_else_moves() {
        let lent = BTreeMap::from([
            ("lent".to_owned(), Resources::from_pairs([("cpu", "1500m"), ("memory", "2Gi")]).unwrap()),
            ("lent-gpu".to_owned(), Resources::new()),
        ]);
        let (new, changes) = resource_groups(&groups(), &lent, Share(50)).unwrap().unwrap();
        let flavors = &new[0]["flavors"];
        assert_eq!(flavors[0]["resources"][0], json!({"name": "cpu", "nominalQuota": "750m", "borrowingLimit": "1"}));
        assert_eq!(
            flavors[0]["resources"][1]["nominalQuota"],
            json!(1073741824u64),
            "half of 2Gi: what it was, untouched"
        );
        assert_eq!(flavors[1], groups()[0]["flavors"][1], "a flavor of real nodes is the admin's");
        assert_eq!(new[1]["flavors"][0]["resources"][0]["nominalQuota"], "0", "no GPU lent: no GPU quota");
        let what: Vec<_> = changes.iter().map(|c| (c.flavor.as_str(), c.resource.as_str(), c.to.as_str())).collect();
        assert_eq!(what, [("lent", "cpu", "750m"), ("lent-gpu", "nvidia.com/gpu", "0")], "memory held it already");
        assert_eq!(changes[0].from, "300m");
        assert_eq!(resource_groups(&new, &lent, Share(50)), Ok(None), "written once, then left alone");
    }

    #[test]
    fn groups_that_are_not_a_list_are_an_error() {
        assert!(
            resource_groups(&json!({"flavors": []}), &BTreeMap::new(), Share(100)).unwrap_err().contains("not a list")
        );
        assert_eq!(resource_groups(&json!([]), &BTreeMap::new(), Share(100)), Ok(None));
    }
}
