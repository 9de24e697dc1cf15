//! How a reclaim ended: the words of the training pod's final message and the outcome its
//! metric counts. Pure; shared by the reclaim pass, the notice and the eviction request records.

use tidepool_api::keys::Band;

/// How a reclaim ended: its words in the pod's final message ([`Display`](std::fmt::Display))
/// and the outcome its metric counts ([`ReclaimEnd::outcome`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReclaimEnd {
    /// The operators' annotation on the gang's PodGroup (its kind and name).
    GroupAck(String),
    /// The operators' annotation on the pod.
    Annotated,
    /// The ack from inside: the pod exited with this termination message.
    ExitAck(String),
    /// Every container exited after the notice, without an ack.
    Exited,
    /// The deadline passed without an ack.
    Deadline,
    /// The pod's band gives no checkpoint time: reclaimed with its notice.
    NoGrace(Band),
}

impl ReclaimEnd {
    /// The `outcome` label of `tidepool_reclaims_total`.
    pub(crate) fn outcome(&self) -> &'static str {
        match self {
            Self::GroupAck(_) | Self::Annotated | Self::ExitAck(_) => "acknowledged",
            Self::Exited => "exited",
            Self::Deadline | Self::NoGrace(_) => "deadline",
        }
    }
}

impl std::fmt::Display for ReclaimEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GroupAck(group) => write!(f, "checkpoint acknowledged on its {group}"),
            Self::Annotated => f.write_str("checkpoint acknowledged"),
            Self::ExitAck(ack) => write!(f, "checkpoint acknowledged by the pod as it exited ({ack})"),
            Self::Exited => f.write_str("containers exited after the notice"),
            Self::Deadline => f.write_str("checkpoint not acknowledged before the deadline"),
            Self::NoGrace(band) => write!(f, "band {} has no checkpoint grace", band.as_str()),
        }
    }
}
