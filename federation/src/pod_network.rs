//! Pod networks that collide. A copy's pod IP comes up as its training pod's `status.podIP`
//! (it is the only address the copy is reached at), so a member whose pod CIDR overlaps the
//! training cluster's, or another member's, gives training pods the IPs of other pods:
//! EndpointSlices and IP-based policies in the training cluster then point at the wrong
//! pods. Such a member is reported on its `MemberCluster` (`PodNetworkOverlap`). Pure: tested
//! on plain data.

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

pub use tidepool_api::net::Cidr;
use tidepool_api::net::number;

/// The pod CIDRs a node was given (`spec.podCIDRs`, else `spec.podCIDR`); unparsable ones
/// are left out.
pub fn node_cidrs(node: &Node) -> Vec<Cidr> {
    let Some(spec) = node.spec.as_ref() else { return Vec::new() };
    let listed = spec.pod_cidrs.iter().flatten().chain(spec.pod_cidr.iter().filter(|_| spec.pod_cidrs.is_none()));
    listed.filter_map(|c| c.parse().ok()).collect()
}

/// A pod network: every CIDR of a cluster's nodes (unique), and the same as disjoint ranges
/// (family, first, last; sorted, merged). Shared, not copied: each member's reconcile compares
/// its network with every other member's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodNetwork {
    cidrs: Arc<[Cidr]>,
    ranges: Arc<[(bool, u128, u128)]>,
}

impl PodNetwork {
    pub fn new(cidrs: impl IntoIterator<Item = Cidr>) -> Self {
        let mut cidrs: Vec<Cidr> = cidrs.into_iter().collect();
        cidrs.sort();
        cidrs.dedup();
        let mut all: Vec<(bool, u128, u128)> = cidrs.iter().map(Cidr::range).collect();
        all.sort();
        let mut ranges: Vec<(bool, u128, u128)> = Vec::with_capacity(all.len());
        for r in all {
            match ranges.last_mut() {
                Some(last) if last.0 == r.0 && r.1 <= last.2.saturating_add(1) => last.2 = last.2.max(r.2),
                _ => ranges.push(r),
            }
        }
        PodNetwork { cidrs: cidrs.into(), ranges: ranges.into() }
    }

    pub fn is_empty(&self) -> bool {
        self.cidrs.is_empty()
    }

    /// Whether address `ip` is in the network (a binary search of its merged ranges).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let at = number(ip);
        let after = self.ranges.partition_point(|r| (r.0, r.1) <= at);
        after.checked_sub(1).and_then(|i| self.ranges.get(i)).is_some_and(|r| r.0 == at.0 && at.1 <= r.2)
    }

    /// A CIDR of each network, the two overlapping, if any: one sweep of both networks'
    /// ranges, then the CIDRs holding the first shared address.
    pub fn overlap(&self, other: &PodNetwork) -> Option<(Cidr, Cidr)> {
        let (mut i, mut j) = (0, 0);
        while let (Some(a), Some(b)) = (self.ranges.get(i), other.ranges.get(j)) {
            if a.0 == b.0 && a.1 <= b.2 && b.1 <= a.2 {
                let shared = a.1.max(b.1);
                let ours = self.cidrs.iter().find(|c| c.holds(a.0, shared))?;
                let theirs = other.cidrs.iter().find(|c| c.holds(a.0, shared))?;
                return Some((*ours, *theirs));
            }
            if (a.0, a.2) < (b.0, b.2) {
                i += 1;
            } else {
                j += 1;
            }
        }
        None
    }
}

/// What a member's `PodNetworkOverlap` condition says: the first of `others` (the training
/// cluster, other members, by name) whose pod network overlaps `member`'s.
pub fn overlap_message<'a>(
    member: &PodNetwork,
    others: impl IntoIterator<Item = (&'a str, &'a PodNetwork)>,
) -> Option<String> {
    others.into_iter().find_map(|(who, network)| {
        let (ours, theirs) = member.overlap(network)?;
        Some(format!(
            "pod CIDR {ours} of this member overlaps {theirs} of {who}: its copies' pod IPs, shown on their \
             training pods, can be other pods' IPs there (Services and network policies in the training \
             cluster would reach the wrong pods); give the clusters disjoint pod CIDRs"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(cidrs: &[&str]) -> PodNetwork {
        PodNetwork::new(cidrs.iter().map(|c| c.parse::<Cidr>().unwrap()))
    }

    #[test]
    fn cidrs_parse_and_overlap_by_their_addresses() {
        let c = |s: &str| s.parse::<Cidr>().unwrap();
        assert!(c("10.244.0.0/16").overlaps(&c("10.244.7.0/24")));
        assert!(!c("10.244.0.0/24").overlaps(&c("10.244.1.0/24")));
        assert!(c("10.244.0.9/24").overlaps(&c("10.244.0.0/30")), "host bits ignored");
        assert!(!c("10.0.0.0/8").overlaps(&c("fd00::/8")), "families never overlap");
        assert!(c("0.0.0.0/0").overlaps(&c("192.168.1.0/24")));
        assert!(c("fd00:10::/64").overlaps(&c("fd00:10::/48")));
        for bad in ["10.0.0.0", "10.0.0.0/33", "x/8", "fd00::/129"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_member_overlapping_the_training_cluster_or_another_member_is_named() {
        let training = net(&["10.244.0.0/24", "10.244.1.0/24"]);
        let member_a = net(&["10.245.0.0/24", "10.245.1.0/24"]);
        let member_b = net(&["10.246.0.0/24", "10.244.1.0/25"]);
        assert_eq!(overlap_message(&member_a, [("the training cluster", &training), ("member-b", &member_b)]), None);
        let said = overlap_message(&member_b, [("the training cluster", &training), ("member-a", &member_a)]).unwrap();
        assert!(
            said.starts_with("pod CIDR 10.244.1.0/25 of this member overlaps 10.244.1.0/24 of the training cluster"),
            "{said}"
        );
        assert_eq!(overlap_message(&PodNetwork::default(), [("the training cluster", &training)]), None);
    }

    #[test]
    fn a_nodes_cidrs_come_from_pod_cidrs_or_pod_cidr() {
        let node =
            |spec: serde_json::Value| -> Node { serde_json::from_value(serde_json::json!({"spec": spec})).unwrap() };
        let dual = node(serde_json::json!({"podCIDR": "10.1.0.0/24", "podCIDRs": ["10.1.0.0/24", "fd00:1::/64"]}));
        assert_eq!(node_cidrs(&dual).len(), 2);
        assert_eq!(node_cidrs(&node(serde_json::json!({"podCIDR": "10.1.0.0/24"}))).len(), 1);
        assert!(node_cidrs(&node(serde_json::json!({}))).is_empty());
    }

    fn arb_cidr() -> impl Strategy<Value = Cidr> {
        (any::<u32>(), 8u8..=32).prop_map(|(a, p)| Cidr::new(IpAddr::V4(a.into()), p))
    }

    proptest! {
        /// The sweep over merged ranges finds an overlap exactly when some pair of CIDRs
        /// overlaps.
        #[test]
        fn the_sweep_agrees_with_every_pair(a in prop::collection::vec(arb_cidr(), 0..12),
                                            b in prop::collection::vec(arb_cidr(), 0..12)) {
            let pairwise = a.iter().any(|x| b.iter().any(|y| x.overlaps(y)));
            let (na, nb) = (PodNetwork::new(a.clone()), PodNetwork::new(b.clone()));
            prop_assert_eq!(na.overlap(&nb).is_some(), pairwise);
            if let Some((x, y)) = na.overlap(&nb) {
                prop_assert!(a.contains(&x) && b.contains(&y) && x.overlaps(&y));
            }
        }

        /// An address is in the network exactly when one of its CIDRs holds it.
        #[test]
        fn an_address_is_in_the_network_when_a_cidr_holds_it(cidrs in prop::collection::vec(arb_cidr(), 0..12),
                                                              near in any::<u32>(), pick in any::<usize>()) {
            // Often an address next to a CIDR's edge, where a search goes wrong first.
            let at = match cidrs.get(pick % cidrs.len().max(1)) {
                Some(c) => { let (_, start, end) = c.range(); [start, end, start.wrapping_sub(1), end + 1][near as usize % 4] }
                None => u128::from(near),
            };
            let Ok(v4) = u32::try_from(at) else { return Ok(()) };
            let ip = IpAddr::V4(v4.into());
            let held = cidrs.iter().any(|c| c.holds(false, u128::from(v4)));
            prop_assert_eq!(PodNetwork::new(cidrs.clone()).contains(ip), held);
        }
    }

    #[test]
    fn addresses_of_the_other_family_are_never_in_it() {
        let n = net(&["10.244.0.0/16", "fd00::/64"]);
        assert!(n.contains("10.244.3.4".parse().unwrap()));
        assert!(!n.contains("10.96.0.10".parse().unwrap()));
        assert!(n.contains("fd00::7".parse().unwrap()));
        assert!(!n.contains("::ffff:10.244.3.4".parse().unwrap()), "a v4-mapped v6 address is v6");
        assert!(!net(&[]).contains("10.244.3.4".parse().unwrap()));
    }
}
