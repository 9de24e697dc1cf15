//! The virtual kubelet: each pool of each connected member appears as a Node in the
//! training cluster, and pods bound to those nodes run as offload pods in the member.
//!
//! Owns: virtual Node objects and their Leases ([`node`]), pod translation ([`translate`],
//! pure), the offload policy ([`policy`], pure), reflection of the ConfigMaps and Secrets
//! pods reference ([`referenced`] pure, [`copies`] I/O), the pod controller that creates,
//! deletes and mirrors offload pods ([`pods`]), and garbage collection in members
//! ([`collect`]). Does not own: member connections and capacity (federation), deciding which
//! pod goes to which node (dispatcher). Start at [`VirtualKubelet::start`].

mod access;
pub mod bounded;
pub mod collect;
mod context;
pub mod copies;
pub mod downward;
pub mod gang_group;
mod handover;
pub mod harden;
pub mod isolation;
mod member_events;
mod member_pods;
mod mirror;
mod native_names;
pub mod native_slices;
pub mod node;
pub mod offload;
pub mod offload_cache;
pub mod packed;
pub mod pods;
pub mod policy;
pub mod referenced;
pub mod relay;
pub mod services;
pub mod step;
pub mod translate;

use std::sync::Arc;

use tidepool_api::{BridgeConfig, MemberName};
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
    #[error("member {member}: {namespace} is {owner}; nothing of this training cluster goes in it")]
    ForeignNamespace { member: MemberName, namespace: String, owner: String },
    #[error("object has no {0}")]
    MissingField(&'static str),
    #[error("created node has no uid")]
    MissingUid,
    #[error(transparent)]
    Translate(#[from] translate::TranslateError),
    #[error(transparent)]
    Poisoned(#[from] tidepool_api::sync::Poisoned),
}

impl Error {
    pub(crate) fn training(what: &'static str, source: kube::Error) -> Self {
        Self::Training { what, source: Box::new(source) }
    }

    pub(crate) fn member(member: &MemberName, what: &'static str, source: kube::Error) -> Self {
        Self::Member { member: member.clone(), what, source: Box::new(source) }
    }

    /// Worth a quick retry (network, throttling, server errors, a namespace still being
    /// deleted) rather than a slow one. A refusal (401, 403, or any other 4xx) is not: the
    /// same call is refused again until someone changes RBAC, credentials or the object, so
    /// it is reported ([`Error::event_reason`]) and retried slowly.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Training { source, .. } | Self::Member { source, .. } => match source.as_ref() {
                e if namespace_terminating(e) => true,
                kube::Error::Api(e) => e.code == 429 || e.code >= 500,
                _ => true,
            },
            _ => false,
        }
    }

    /// Reason of the Warning Event on the pod for an error that needs a person (tidepool
    /// lacks a permission, its credentials are refused, the offload namespace is somebody
    /// else's), or `None`.
    pub fn event_reason(&self) -> Option<&'static str> {
        let refused = |source: &kube::Error| {
            matches!(source, kube::Error::Api(e) if e.code == 401 || e.code == 403) && !namespace_terminating(source)
        };
        match self {
            Self::Member { source, .. } if refused(source) => Some("MemberForbidden"),
            Self::Training { source, .. } if refused(source) => Some("TrainingForbidden"),
            Self::ForeignNamespace { .. } => Some("OffloadNamespaceConflict"),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A write refused because its namespace is being deleted (a 403 with cause
/// `NamespaceTerminating`): not a permission anybody must fix, and over once the namespace is
/// gone and made again. An offload namespace deleted by the member's admin or by a drain is
/// re-created within seconds, instead of the pod waiting out a refusal's slow retry.
pub fn namespace_terminating(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403
        && s.details.as_ref().is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating")))
}

/// Handle on the running virtual kubelet.
#[derive(Debug)]
pub struct VirtualKubelet;

impl VirtualKubelet {
    /// Starts the node and pod controllers as tasks `virtual-nodes` and `pod-sync` of
    /// `tasks`. The pod sync stops once `stop` is cancelled and its reconciles in flight
    /// have finished.
    pub fn start(
        tasks: &mut tidepool_federation::tasks::Tasks,
        stop: tokio_util::sync::CancellationToken,
        training: kube::Client,
        config: Arc<BridgeConfig>,
        members: watch::Receiver<Members>,
        pods: tidepool_federation::TrainingPods,
        copy_writes: tidepool_federation::writes::CopyWrites,
    ) -> Self {
        tasks.spawn("virtual-nodes", node::run(training.clone(), config.clone(), members.clone()));
        tasks.spawn("pod-sync", pods::run(training, config, members, pods, copy_writes, stop));
        Self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(
            serde_json::from_value(serde_json::json!({"code": code, "message": "m", "reason": "r"})).unwrap(),
        ))
    }

    #[test]
    fn refusals_are_not_retried_hot_and_outages_are() {
        let member = MemberName::from("member-a");
        let cases = [
            ("forbidden: RBAC will not change in 2 s", 403, false),
            ("unauthorized: credentials will not change in 2 s", 401, false),
            ("invalid: the same write fails the same way", 422, false),
            ("throttled", 429, true),
            ("server error", 500, true),
            ("unavailable", 503, true),
        ];
        for (name, code, transient) in cases {
            assert_eq!(Error::member(&member, "create offload pod", api(code)).is_transient(), transient, "{name}");
            assert_eq!(Error::training("update pod status", api(code)).is_transient(), transient, "{name}");
        }
    }

    #[test]
    fn a_refusal_is_told_to_people_with_a_reason() {
        let member = MemberName::from("member-a");
        assert_eq!(Error::member(&member, "create offload pod", api(403)).event_reason(), Some("MemberForbidden"));
        assert_eq!(Error::member(&member, "create offload pod", api(401)).event_reason(), Some("MemberForbidden"));
        assert_eq!(Error::training("update pod status", api(403)).event_reason(), Some("TrainingForbidden"));
        assert_eq!(Error::member(&member, "create offload pod", api(503)).event_reason(), None);
    }

    #[test]
    fn a_write_into_a_namespace_being_deleted_is_retried_soon_and_told_to_nobody() {
        let member = MemberName::from("member-a");
        let terminating = kube::Error::Api(Box::new(
            serde_json::from_value(serde_json::json!({
                "code": 403, "reason": "Forbidden",
                "message": "pods \"p\" is forbidden: unable to create new content in namespace tp-a because it is being terminated",
                "details": {"name": "p", "kind": "pods", "causes": [
                    {"reason": "NamespaceTerminating", "message": "namespace tp-a is being terminated", "field": "metadata.namespace"}
                ]}
            }))
            .unwrap(),
        ));
        assert!(namespace_terminating(&terminating));
        assert!(!namespace_terminating(&api(403)), "a plain refusal is not");
        let error = Error::member(&member, "create offload pod", terminating);
        assert!(error.is_transient());
        assert_eq!(error.event_reason(), None);
    }
}
