//! The dispatcher's errors. Those of a gang's `minMember` are shown to the tenant as they are
//! (the pods' `Unschedulable` condition), so their wording is part of the interface.

use std::sync::Arc;

use tidepool_api::keys;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A PodGroup a gang names, for messages: its kind, API group, namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGroupRef {
    pub kind: String,
    pub group: String,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodGroupRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// `tidepool.io/min-member` is set on a pod but is no positive integer.
    #[error("annotation {}={value:?} is not a positive integer", keys::ANNOTATION_MIN_MEMBER)]
    MinMemberInvalid { value: String },
    /// An annotation gang none of whose pods says its `minMember`.
    #[error("gang {gang} has no {} annotation", keys::ANNOTATION_MIN_MEMBER)]
    MinMemberMissing { gang: String },
    #[error("{0} has no valid spec.minMember")]
    PodGroupInvalid(PodGroupRef),
    #[error("{} {}/{}/{} not found", .0.kind, .0.group, .0.namespace, .0.name)]
    PodGroupNotFound(PodGroupRef),
    /// No such CRD installed reads as 404 too.
    #[error("{0} not found (is its CRD installed?)")]
    PodGroupKindNotFound(PodGroupRef),
    /// An operator's job whose spec names no replicas tidepool can count.
    #[error("{0} names no replicas in its spec")]
    WorkloadInvalid(PodGroupRef),
    /// A pod of a kind tidepool does not run across the bridge ([`crate::workload::refused`]).
    #[error("{0}")]
    Refused(String),
    #[error("cannot read {group}: {source}")]
    PodGroupRead {
        group: PodGroupRef,
        #[source]
        source: Arc<kube::Error>,
    },
    /// A task panicked while it held one of the dispatcher's locks: what the lock guards may be
    /// half-written, so it is not read on ([`tidepool_api::sync::Locked`]).
    #[error("the dispatcher's {0}")]
    Poisoned(#[from] tidepool_api::sync::Poisoned),
}
