//! When a pool's new capacity is worth publishing on its virtual node at once.

use super::*;
use tidepool_api::Resources;

/// A change of a pool's capacity smaller than this (per resource, in hundredths of a percent
/// of the published value) waits for [`PUBLISH_MAX_INTERVAL`] before it is published.
pub const PUBLISH_THRESHOLD_BASIS_POINTS: i64 = 100;
/// Longest a small change of capacity waits before it is published anyway.
pub const PUBLISH_MAX_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Whether `next` differs from the published `current` enough to publish it at once, rather
/// than within [`PUBLISH_MAX_INTERVAL`]. Pure.
///
/// At once: anything tidepool's own decisions rest on — offload usage and placements, node
/// count, GPU product, a new or changed deficit (reclaim), any change of a resource counted
/// in whole devices (GPUs and other extended resources), on the pool or on a node. Held back:
/// drifts of cpu, memory, storage and pod counts below the threshold, which online churn
/// causes all the time and which would otherwise rewrite the virtual node on every event.
pub fn worth_publishing(current: &PoolCapacity, next: &PoolCapacity) -> bool {
    fn fungible(name: &str) -> bool {
        matches!(name, "cpu" | "memory" | "ephemeral-storage" | "pods") || name.starts_with("hugepages-")
    }
    fn significant(a: &Resources, b: &Resources) -> bool {
        a.names().chain(b.names()).any(|name| {
            let (x, y) = (a.get(name), b.get(name));
            if x == y {
                return false;
            }
            if !fungible(name) || x == 0 || y == 0 {
                return true;
            }
            let delta = i128::from(x.abs_diff(y));
            delta * 10_000 > i128::from(x.abs()) * i128::from(PUBLISH_THRESHOLD_BASIS_POINTS)
        })
    }
    if current.used != next.used
        || current.placed != next.placed
        || current.nodes != next.nodes
        || current.gpu_product != next.gpu_product
        || current.deficit() != next.deficit()
        || current.free_per_node.len() != next.free_per_node.len()
        || current.topology != next.topology
    {
        return true;
    }
    let devices =
        |r: &Resources| r.iter().filter(|(n, _)| !fungible(n)).map(|(n, v)| (n.to_owned(), v)).collect::<Vec<_>>();
    let moved =
        |a: &NodeFree, b: &NodeFree| a.name != b.name || a.labels != b.labels || devices(&a.free) != devices(&b.free);
    if current.free_per_node.iter().zip(&next.free_per_node).any(|(a, b)| moved(a, b)) {
        return true;
    }
    significant(&current.capacity, &next.capacity)
}
