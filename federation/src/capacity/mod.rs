//! The capacity model: what a pool of member nodes can lend, from the member's watches to the
//! numbers each pool's virtual node publishes.
//!
//! ```text
//! capacity(P) = clamp≥0( Σ_n∈P (allocatable(n) − online(n))
//!                        − reserve − windows(now) − hpaHeadroom(P) − pendingOnline(P) ) × watermark
//! ```
//! over the pool's Ready, schedulable nodes, where `online(n)` is the requests of pods on `n`
//! that tidepool did not create. Offload pods do not reduce the capacity: it is what tidepool
//! may use in total, and `used(P)` is measured against it.
//!
//! Read top to bottom, following a member node's allocatable to its virtual node:
//!
//! 1. [`wire`]: what the member's node and pod watches decode (only the fields read);
//! 2. [`views`]: a node or pod as the model reads it ([`NodeView`], [`PodView`]);
//! 3. [`watches`] (I/O): the member's watches, each keeping a [`crate::view_cache::ViewCache`]
//!    of views; pods are summed per node as they change ([`index::PodIndex`]), and which
//!    nodes changed is noted ([`index::Touched`]);
//! 4. [`workloads`]: HPA headroom and replicas to come, from the HPA and workload views;
//!    [`priority`]: the online pods offload pods would not stay below (the admin is told);
//! 5. [`pool`]: each pool's sums kept node by node ([`pool::PoolModel`]), redoing only the
//!    nodes that changed;
//! 6. [`model`]: the pool's [`PoolCapacity`] from its sums and the policy (what is held back,
//!    the watermark, the per-node records);
//! 7. [`publisher`] (I/O) and [`publish`]: when a new capacity goes out on the pool's channel,
//!    which the virtual node and the dispatcher read.
//!
//! [`reference`] computes the same numbers from every node and pod at once: the reference the
//! incremental model must equal (the property test in [`index`]), used by tests and the pool
//! benchmark only.

pub mod index;
pub mod model;
pub mod pool;
pub mod priority;
pub mod publish;
pub(crate) mod publisher;
pub mod reference;
pub mod views;
pub(crate) mod watches;
pub mod wire;
pub(crate) mod workloads;

pub use model::*;
pub use publish::*;
pub use reference::*;
pub use views::*;

#[cfg(test)]
mod tests;
