//! Least privilege in members: tidepool's member identity has read-only cluster access and
//! writes only in the offload namespaces it creates. For each of them it binds itself to the
//! member's `tidepool-offload` ClusterRole with a RoleBinding in that namespace alone.

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use sha2::Digest as _;
use tidepool_api::keys;
use tokio::sync::OnceCell;
use tracing::{debug, info, warn};

/// Binds the identity a member session uses to the offload role, namespace by namespace.
pub(crate) struct OffloadAccess {
    client: Client,
    member: String,
    /// Who the session's kubeconfig is, asked once (SelfSubjectReview).
    user: OnceCell<String>,
}

impl OffloadAccess {
    pub(crate) fn new(client: Client, member: &str) -> Self {
        Self { client, member: member.to_owned(), user: OnceCell::new() }
    }

    /// Makes sure this identity is bound to the offload role in `namespace`, with a RoleBinding
    /// named after the identity (so a rotated credential gets its own). Failures are logged,
    /// not returned: an identity with cluster-wide rights (an admin kubeconfig) needs no
    /// binding, and a missing right shows up as the pod's own error.
    pub(crate) async fn bind(&self, namespace: &str) {
        let member = self.member.as_str();
        let user = self
            .user
            .get_or_try_init(|| async {
                let review = Api::<SelfSubjectReview>::all(self.client.clone())
                    .create(&PostParams::default(), &SelfSubjectReview::default())
                    .await?;
                Ok::<_, kube::Error>(
                    review.status.and_then(|s| s.user_info).and_then(|u| u.username).unwrap_or_default(),
                )
            })
            .await;
        let username = match user {
            Ok(u) => u.as_str(),
            Err(e) => {
                warn!(member, error = %e, "cannot tell which identity this member's kubeconfig is");
                return;
            }
        };
        let Some(subject) = subject_of(username) else { return };
        let digest = sha2::Sha256::digest(username.as_bytes());
        let suffix: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        let binding = RoleBinding {
            metadata: ObjectMeta {
                name: Some(format!("{}-{suffix}", keys::OFFLOAD_CLUSTER_ROLE)),
                namespace: Some(namespace.to_owned()),
                labels: Some([(keys::LABEL_MANAGED_BY.to_owned(), keys::MANAGED_BY.to_owned())].into()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: keys::OFFLOAD_CLUSTER_ROLE.into(),
            },
            subjects: Some(vec![subject]),
        };
        let api = Api::<RoleBinding>::namespaced(self.client.clone(), namespace);
        match api.create(&PostParams::default(), &binding).await {
            Ok(_) => {
                info!(member, namespace, user = %username, "offload role bound");
                self.wait_effective(namespace).await;
            }
            Err(e) if tidepool_federation::api_code(&e, &[409]) => {}
            Err(e) if tidepool_federation::api_code(&e, &[403]) => {
                debug!(member, namespace, error = %e, "not allowed to bind the offload role; relying on existing rights")
            }
            Err(e) => warn!(member, namespace, error = %e, "cannot bind the offload role"),
        }
    }
}

impl OffloadAccess {
    /// A new RoleBinding takes a moment to reach the API server's authorizer: asks it
    /// (SelfSubjectAccessReview, allowed to everyone) until the binding counts, for at most
    /// 3 s, so the first list in the namespace is not refused.
    async fn wait_effective(&self, namespace: &str) {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_owned()),
                    verb: Some("list".into()),
                    resource: Some("configmaps".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let api = Api::<SelfSubjectAccessReview>::all(self.client.clone());
        for _ in 0..60 {
            match api.create(&PostParams::default(), &review).await {
                Ok(r) if r.status.as_ref().is_some_and(|s| s.allowed) => return,
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                Err(e) => {
                    debug!(member = %self.member, namespace, error = %e, "cannot check the offload role binding");
                    return;
                }
            }
        }
        warn!(member = %self.member, namespace, "the offload role binding is not effective after 3 s");
    }
}

/// The RBAC subject of an authenticated user name.
fn subject_of(username: &str) -> Option<Subject> {
    if username.is_empty() {
        return None;
    }
    Some(match username.strip_prefix("system:serviceaccount:").and_then(|rest| rest.split_once(':')) {
        Some((namespace, name)) => Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        None => Subject {
            kind: "User".into(),
            name: username.into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_accounts_and_users_become_their_rbac_subjects() {
        let sa = subject_of("system:serviceaccount:tidepool-member:tidepool").unwrap();
        assert_eq!(
            (sa.kind.as_str(), sa.name.as_str(), sa.namespace.as_deref()),
            ("ServiceAccount", "tidepool", Some("tidepool-member"))
        );
        let user = subject_of("tidepool-member").unwrap();
        assert_eq!(
            (user.kind.as_str(), user.name.as_str(), user.api_group.as_deref()),
            ("User", "tidepool-member", Some("rbac.authorization.k8s.io"))
        );
        assert!(subject_of("").is_none());
    }
}
