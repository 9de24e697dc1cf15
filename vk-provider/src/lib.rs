//! The virtual kubelet: each pool of each connected member appears as a Node in the
//! training cluster, and pods bound to those nodes run as offload pods in the member.
//!
//! Owns: virtual Node objects and their Leases ([`node`]), pod translation ([`translate`],
//! pure), the offload policy ([`policy`], pure), reflection of the ConfigMaps and Secrets
//! pods reference ([`reflect`] pure, [`copies`] I/O), the pod controller that creates,
//! deletes and mirrors offload pods ([`pods`]), and garbage collection in members
//! ([`collect`]). Does not own: member connections and capacity (federation), deciding which
//! pod goes to which node (dispatcher). Start at [`VirtualKubelet::start`].

mod access;
pub mod collect;
pub mod copies;
pub mod kubelet;
pub mod node;
pub mod offload;
pub mod pods;
pub mod policy;
pub mod reflect;
pub mod translate;

use std::sync::Arc;

use tidepool_config::{BridgeConfig, MemberName};
use tidepool_federation::Members;
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("training cluster: {what}: {source}")]
    Training {
        what: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("member {member}: {what}: {source}")]
    Member {
        member: MemberName,
        what: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("object has no {0}")]
    MissingField(&'static str),
    #[error("created node has no uid")]
    MissingUid,
    #[error(transparent)]
    Translate(#[from] translate::TranslateError),
}

impl Error {
    pub(crate) fn training(what: &'static str, source: kube::Error) -> Self {
        Self::Training { what, source: Box::new(source) }
    }

    pub(crate) fn member(member: &MemberName, what: &'static str, source: kube::Error) -> Self {
        Self::Member { member: member.clone(), what, source: Box::new(source) }
    }

    /// Worth a quick retry (network, throttling, server errors) rather than a slow one.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Training { source, .. } | Self::Member { source, .. } => match source.as_ref() {
                kube::Error::Api(e) => e.code == 429 || e.code >= 500 || e.code == 403,
                _ => true,
            },
            _ => false,
        }
    }

    /// Stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Training { .. } => "training_api",
            Self::Member { .. } => "member_api",
            Self::MissingField(_) | Self::MissingUid => "invalid_object",
            Self::Translate(_) => "translate",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Handle on the running virtual kubelet.
#[derive(Debug)]
pub struct VirtualKubelet;

impl VirtualKubelet {
    /// Starts the node and pod controllers; they run until the runtime stops.
    pub fn start(
        training: kube::Client,
        config: Arc<BridgeConfig>,
        members: watch::Receiver<Members>,
        pods: tidepool_federation::TrainingPods,
    ) -> Self {
        tokio::spawn(node::run(training.clone(), config.clone(), members.clone()));
        tokio::spawn(pods::run(training, config, members, pods));
        Self
    }
}
