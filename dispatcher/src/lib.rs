//! The elastic dispatcher: admits each job as a gang, places it whole on one pool, binds
//! its pods to that pool's virtual node, and grows it elastically by band.
//!
//! Owns: the scheduler for `schedulerName: tidepool` ([`controller`]) and reclaim (`reclaim`),
//! two loops that share a `context` and import nothing from each other; gang identity and
//! bands ([`gang`]); and the pure decisions: a round's writes (`round`), placement
//! ([`plan`]), admission order ([`order`]), reclaim victims ([`victims`]) and gang restarts
//! ([`restart`]), Kueue's quota over lent capacity ([`kueue_quota`]), the native pool of the
//! training cluster's own nodes ([`native_pool`]). Errors are [`error::Error`]. Does not own: capacity (federation) or offload
//! pods (vk-provider): a pod bound to a virtual node is the hand-off. Start at
//! [`Dispatcher::start`].

mod context;
pub mod controller;
pub mod error;
mod eviction;
mod eviction_status;
pub mod gang;
mod kueue;
pub mod kueue_quota;
mod native;
pub mod native_pool;
mod notice;
pub mod order;
pub mod plan;
mod pod_group_status;
mod reclaim;
mod reclaim_end;
mod reclaim_request;
pub mod restart;
mod round;
pub mod victims;
mod volcano;
mod volcano_group;
pub mod workload;

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

pub use context::RemotePools;
use tidepool_api::BridgeConfig;
use tidepool_federation::{Members, TrainingPods};
use tokio::sync::watch;

/// The dispatcher's two loops over one shared context.
#[derive(Clone)]
pub struct Dispatcher {
    ctx: Arc<context::Context>,
    pods: TrainingPods,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// The dispatcher of the members this replica bridges (`members`) and, sharded, of those
    /// other replicas publish (`remote`).
    pub fn new(
        training: kube::Client,
        config: Arc<BridgeConfig>,
        (members, remote): (watch::Receiver<Members>, Option<RemotePools>),
        pods: TrainingPods,
        copies: tidepool_federation::writes::CopyWriter,
    ) -> Self {
        let ctx = context::Context::new(training, config, (members, remote), pods.store(), copies);
        Self { ctx: Arc::new(ctx), pods }
    }

    /// Starts reclaim as task `reclaim` of `tasks`. It ends the reclaims on the members this
    /// replica bridges, and carries out the preemptions the scheduling loop asks for: every
    /// replica runs it, sharded or not.
    pub fn start_reclaim(&self, tasks: &mut tidepool_federation::tasks::Tasks) {
        tasks.spawn("reclaim", reclaim::run(self.ctx.clone(), self.pods.clone()));
    }

    /// The scheduling loop; sharded, only the replica holding the leader Lease runs it.
    /// With it, tidepool's part as Volcano's gang scheduler (`volcano`), the keeper of
    /// Kueue's quota over lent capacity (`kueue`) and the watch of the native nodes
    /// (`native`): they end together.
    pub fn schedule(&self) -> impl Future<Output = ()> + Send + 'static {
        let rounds = controller::run(self.ctx.clone(), self.pods.clone());
        let volcano = volcano::run(self.ctx.clone(), self.pods.clone());
        let kueue = kueue::run(self.ctx.clone());
        let native = native::run(self.ctx.clone());
        async move {
            tokio::select! {
                () = rounds => {}
                () = volcano => {}
                () = kueue => {}
                () = native => {}
            }
        }
    }

    /// One replica: reclaim, and the scheduling loop as task `dispatcher`.
    pub fn start(self, tasks: &mut tidepool_federation::tasks::Tasks) {
        self.start_reclaim(tasks);
        tasks.spawn("dispatcher", self.schedule());
    }
}
