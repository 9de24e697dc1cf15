//! From a training pod to its offload pod: the pod's node names the member session (the
//! node is one of that member's pools), and the copy lives under the same name in the
//! member's offload namespace (tidepool-vk's translation), carrying the pod's UID.

use std::sync::Arc;

use hyper::StatusCode;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};
use tidepool_api::keys;
use tidepool_federation::MemberHandle;

use super::Context;

/// The offload pod behind a training pod.
pub(crate) struct Target {
    pub(crate) member: Arc<MemberHandle>,
    /// The offload pod's namespace in the member.
    pub(crate) api: Api<Pod>,
    pub(crate) name: String,
}

/// Why a request names no offload pod: the status and message the API server passes on.
#[derive(Debug)]
pub(crate) struct Refusal(pub(crate) StatusCode, pub(crate) String);

impl Refusal {
    /// A member or training API error: its own status where it has one.
    pub(crate) fn api(what: &str, error: &kube::Error) -> Self {
        match error {
            kube::Error::Api(s) => Refusal(
                StatusCode::from_u16(s.code).unwrap_or(StatusCode::BAD_GATEWAY),
                format!("{what}: {}", s.message),
            ),
            other => Refusal(StatusCode::BAD_GATEWAY, format!("{what}: {other}")),
        }
    }
}

pub(crate) async fn resolve(ctx: &Context, namespace: &str, name: &str) -> Result<Target, Refusal> {
    let pod = Api::<Pod>::namespaced(ctx.training.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|e| Refusal::api("reading the training pod", &e))?
        .ok_or_else(|| Refusal(StatusCode::NOT_FOUND, format!("pod {namespace}/{name} not found")))?;
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| Refusal(StatusCode::NOT_FOUND, format!("pod {namespace}/{name} is not bound to a node")))?;
    let member =
        ctx.members.borrow().values().find(|m| m.pool_for_node(&node).is_some()).cloned().ok_or_else(|| {
            Refusal(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("node {node} of pod {namespace}/{name} has no connected member session"),
            )
        })?;
    let member_ns = member.namespaces.member_ns(namespace);
    let api = Api::<Pod>::namespaced(member.client.clone(), &member_ns);
    let copy = api.get_opt(name).await.map_err(|e| Refusal::api(&format!("member {}", member.name), &e))?;
    // Same name but another pod's copy (another training cluster, or a stale one): never
    // show its logs or run commands in it.
    let origin_uid = copy.as_ref().and_then(|c| c.labels().get(keys::LABEL_ORIGIN_UID));
    if origin_uid.is_none() || origin_uid != pod.metadata.uid.as_ref() {
        return Err(Refusal(
            StatusCode::NOT_FOUND,
            format!("pod {namespace}/{name} has no offload pod in member {} yet", member.name),
        ));
    }
    Ok(Target { member, api, name: name.to_owned() })
}
