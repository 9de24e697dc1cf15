//! The elastic dispatcher: admits each job as a gang, places it whole on one pool, binds
//! its pods to that pool's virtual node, and grows it elastically by band.
//!
//! Owns: the scheduler for `schedulerName: tidepool` ([`controller`]) and reclaim (`reclaim`),
//! two loops that share a `context` and import nothing from each other; gang identity and
//! bands ([`gang`]); and the pure decisions: a round's writes (`round`), placement
//! ([`plan`]), admission order ([`order`]), reclaim victims ([`victims`]) and gang restarts
//! ([`restart`]). Errors are [`error::Error`]. Does not own: capacity (federation) or offload
//! pods (vk-provider): a pod bound to a virtual node is the hand-off. Start at
//! [`Dispatcher::start`].

mod context;
pub mod controller;
pub mod error;
pub mod gang;
pub mod order;
pub mod plan;
mod reclaim;
pub mod restart;
mod round;
pub mod victims;

use std::sync::Arc;

/// Helpers shared by the property tests.
#[cfg(test)]
pub(crate) mod testutil {
    /// Deterministic Fisher–Yates shuffle (xorshift), so a failing case replays from its seed.
    pub fn shuffle<T>(v: &mut [T], seed: u64) {
        let mut s = seed | 1;
        for i in (1..v.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.swap(i, (s % (i as u64 + 1)) as usize);
        }
    }
}

use tidepool_api::BridgeConfig;
use tidepool_federation::Members;
use tokio::sync::watch;

/// Handle on the running dispatcher.
#[derive(Debug)]
pub struct Dispatcher;

impl Dispatcher {
    /// Starts the scheduling loop as task `dispatcher` of `tasks`.
    pub fn start(
        tasks: &mut tidepool_federation::tasks::Tasks,
        training: kube::Client,
        config: Arc<BridgeConfig>,
        members: watch::Receiver<Members>,
        pods: tidepool_federation::TrainingPods,
        copies: tidepool_federation::writes::CopyWriter,
    ) -> Self {
        tasks.spawn("dispatcher", controller::run(training, config, members, pods, copies));
        Self
    }
}
