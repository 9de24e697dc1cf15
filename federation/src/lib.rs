//! Federation: the member clusters as the rest of tidepool sees them, and the shared
//! plumbing every part of tidepool runs on.
//!
//! Owns, for the members: the `MemberCluster` controller (credentials from Secrets, vetting,
//! connection, status conditions), one [`member::Session`] per connected member with its
//! supervised tasks ([`member_tasks`]: one that stops marks the member), its health
//! ([`health`]), its client's rate limits, fencing and request counts ([`throttle`],
//! [`fence`], [`api_metrics`]), what it serves ([`discovery`]), its eviction requests
//! ([`eviction_requests`]), pod networks that collide ([`pod_network`]) and online pods
//! below the offload priorities ([`capacity::priority`]); and the capacity model ([`capacity`], one
//! folder: the member's watches into trimmed views ([`view_cache`]), the views, the model
//! kept node by node, the publisher) that turns those watches into each pool's lendable
//! capacity, published across replicas when sharded ([`published`]).
//!
//! Owns, shared with the other crates: the one watch of the training cluster's pods
//! ([`training`]), the channel through which the dispatcher asks vk-provider to free a copy
//! ([`writes`]), and the supervised task set every long-running task is spawned in
//! ([`tasks`]).
//!
//! Does not own: virtual nodes or pods (vk-provider), placement (dispatcher).
//!
//! Inside, `controller` connects members and writes their status and hands a deleted one to
//! `drain`; both share `context` (the running sessions, hold and stop), so `drain` never
//! reaches back into the controller.
//!
//! Start at [`Federation::start`]; consumers subscribe to [`Federation::members`], a
//! `watch` channel of connected members, each with a `watch` channel of capacity per pool.

pub mod api_metrics;
pub mod capacity;
mod context;
mod controller;
pub mod discovery;
pub mod drain;
pub mod eviction_requests;
pub mod fence;
pub mod health;
pub mod kubeconfig;
pub mod member;
pub mod member_tasks;
pub mod pod_network;
pub mod published;
pub mod tasks;
pub mod throttle;
pub mod training;
pub mod view_cache;
pub mod writes;

use std::collections::BTreeMap;
use std::sync::Arc;

use tidepool_api::{BridgeConfig, MemberName};
use tokio::sync::watch;

pub use capacity::PoolCapacity;
pub use health::Health;
pub use member::{MemberHandle, PoolHandle};
pub use throttle::MemberStats;
pub use training::{PodEvent, TrainingPods};

/// Connected members by name.
pub type Members = BTreeMap<MemberName, Arc<MemberHandle>>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("training cluster: {what}: {source}")]
    Training {
        what: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    /// A lock whose holder panicked: what it guards may be half-updated
    /// ([`tidepool_api::sync::Locked`]).
    #[error(transparent)]
    Poisoned(#[from] tidepool_api::sync::Poisoned),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How this replica shares the members with others (see the binary's `shard` module).
#[derive(Debug, Clone, Default)]
pub struct Ownership {
    /// This replica's identity, named in its member clients' user agent.
    pub identity: String,
    /// The members this replica owns now; `None`: every selected member (one replica).
    pub owned: Option<fence::Owned>,
}

impl Ownership {
    /// Who a new client of `member` says it is (this replica, in its user agent) and its
    /// fence: one replica's is cancelled only by its session's end; a sharded replica's also
    /// when the member is no longer owned.
    pub(crate) fn guard(&self, member: &MemberName) -> throttle::Guard {
        let fence =
            self.owned.as_ref().map_or_else(tokio_util::sync::CancellationToken::new, |owned| owned.fence(member));
        throttle::Guard { user_agent: Some(controller::user_agent(&self.identity)), fence }
    }
}

/// Handle on the running federation.
#[derive(Debug, Clone)]
pub struct Federation {
    members: watch::Receiver<Members>,
}

impl Federation {
    /// Starts the `MemberCluster` controller as task `federation` of `tasks`, bridging the
    /// members `ownership` gives this replica.
    pub fn start(
        tasks: &mut tasks::Tasks,
        training: kube::Client,
        config: Arc<BridgeConfig>,
        ownership: Ownership,
    ) -> Self {
        let (tx, rx) = watch::channel(Members::new());
        let (trigger, triggers) = tokio::sync::mpsc::channel(256);
        let reporter = kube::runtime::events::Reporter { controller: "tidepool".into(), instance: None };
        let ctx = Arc::new(context::Context {
            recorder: kube::runtime::events::Recorder::new(training.clone(), reporter),
            training,
            config,
            sessions: std::sync::Mutex::new(BTreeMap::new()),
            members: tx,
            trigger,
            ownership,
            training_network: tokio::sync::Mutex::default(),
        });
        tasks.spawn("federation", controller::run(ctx, triggers));
        Self { members: rx }
    }

    /// The connected members; changes when one connects, changes spec or goes away.
    pub fn members(&self) -> watch::Receiver<Members> {
        self.members.clone()
    }
}

/// True when `error` is an API answer with one of `codes` (404, 409, …).
pub fn api_code(error: &kube::Error, codes: &[u16]) -> bool {
    matches!(error, kube::Error::Api(status) if codes.contains(&status.code))
}
