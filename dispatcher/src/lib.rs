//! The elastic dispatcher: admits each job as a gang, places it whole on one pool, binds
//! its pods to that pool's virtual node, and grows it elastically by band.
//!
//! Owns: the scheduler for `schedulerName: tidepool` ([`controller`]), gang identity and
//! bands ([`gang`]), and the pure decisions: placement ([`plan`]), admission order
//! ([`order`]) and reclaim victims ([`victims`]). Does not own: capacity (federation) or
//! offload pods (vk-provider): a pod bound to a virtual node is the hand-off.
//! Start at [`Dispatcher::start`].

pub mod controller;
pub mod gang;
pub mod order;
pub mod plan;
mod reclaim;
pub mod victims;

use std::sync::Arc;

use tidepool_config::BridgeConfig;
use tidepool_federation::Members;
use tokio::sync::watch;

/// Handle on the running dispatcher.
#[derive(Debug)]
pub struct Dispatcher;

impl Dispatcher {
    /// Starts the scheduling loop; it runs until the runtime stops.
    pub fn start(training: kube::Client, config: Arc<BridgeConfig>, members: watch::Receiver<Members>) -> Self {
        tokio::spawn(controller::run(training, config, members));
        Self
    }
}
