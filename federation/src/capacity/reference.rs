//! The reference model: a pool's capacity computed from every node and pod at once. Only the
//! tests and the pool benchmark use it; the member sessions keep the same numbers
//! incrementally ([`super::pool::PoolModel`]), and the property test in [`super::index`]
//! holds the two equal.

use std::collections::BTreeMap;

use tidepool_api::crd::{PoolMode, PoolToleration};

use super::*;

/// The plain surplus of a pool (no reserves, windows or HPAs): `Σ allocatable − Σ online`.
pub fn pool_capacity<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
) -> PoolCapacity {
    let policy = CapacityPolicy::default();
    let demand = OnlineDemand { policy: &policy, hpas: &[], to_come: &[], now: jiff::Timestamp::UNIX_EPOCH };
    pool_capacity_under(nodes, pods, selector, &demand)
}

/// Capacity of the pool selected by `selector` (an empty selector takes every node):
///
/// ```text
/// capacity(P) = clamp≥0( Σ_n (allocatable(n) − online(n))
///                        − reserve − windows(now) − hpaHeadroom(P) − pendingOnline(P) ) × watermark
/// ```
/// `pendingOnline` is the online pods not yet placed and the replicas whose pods are yet to
/// be created ([`ReplicasToCome`]). HPA headroom and pending online demand count for a pool
/// when their node selector matches one of its nodes: that is where the member's scheduler
/// could put them.
pub fn pool_capacity_under<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
    demand: &OnlineDemand<'_>,
) -> PoolCapacity {
    pool_capacity_in(nodes, pods, selector, demand, PoolMode::Requests)
}

/// [`pool_capacity_under`] for a pool of resource `mode`. In a colocation mode a node's
/// allocatable is what the member's agent publishes for batch work, shown as `cpu` and
/// `memory` ([`Colocation::as_plain`]), and a pod uses of it what it requests of the batch
/// resources: the agent has already taken online pods' usage out, so their ordinary
/// requests do not count again. A node without the batch resources (no agent publishing
/// there) lends nothing. GPUs and every other resource stay request-based.
///
/// Walks every pod: the reference the member sessions' incremental model
/// ([`crate::pool_model::PoolModel`]) must equal.
pub fn pool_capacity_in<'a>(
    nodes: impl IntoIterator<Item = &'a NodeView>,
    pods: impl IntoIterator<Item = &'a PodView>,
    selector: &BTreeMap<String, String>,
    demand: &OnlineDemand<'_>,
    mode: PoolMode,
) -> PoolCapacity {
    let colocation = mode.colocation();
    let in_pool = pool_nodes(nodes, selector, colocation);
    let could_land =
        |sel: &BTreeMap<String, String>, tolerations: &[PoolToleration]| could_land(&in_pool, sel, tolerations);
    let mut sums = PoolSums::of(&in_pool, announced(demand, &could_land, colocation));
    for p in pods {
        let requests = counted(colocation, &p.requests);
        if p.pending_online() && could_land(p.node_selector(), p.tolerations()) {
            sums.held_back.add(&requests);
        }
        let Some(node) = p.node.as_deref() else { continue };
        if p.terminated || !in_pool.contains_key(node) {
            continue;
        }
        if p.offload {
            sums.used.add(&requests);
            if let Some(uid) = &p.origin_uid {
                sums.placed.insert(uid.clone(), Placed { node: node.into(), copy_uid: p.uid.clone() });
            }
        } else {
            sums.capacity.sub(&requests);
        }
        if let Some(f) = sums.free.get_mut(node) {
            f.sub(&requests);
        }
    }
    sums.finish(&in_pool, demand.policy.watermark_percent)
}
