//! Each reclaim as an `EvictionRequest` in the training cluster (Kubernetes 1.37,
//! `lifecycle.k8s.io/v1alpha1`, where served): a tenant tool that watches eviction requests
//! sees tidepool's reclaims as it sees anyone's. Requester `tidepool.io/reclaim`, target the
//! training pod, owned by it (gone with it); its status follows the notice
//! ([`keys::CONDITION_CHECKPOINT_NOTICE`]) and the end (`TargetEvicted`, reason `PodTerminal`:
//! the pod ends `Failed`, it is not deleted).
//!
//! A record, not the mechanism: the notice, its deadline and the pod's end are tidepool's own
//! ([`crate::reclaim`]). Kubernetes 1.37 runs nothing that acts on eviction requests; a
//! cluster that runs an evictionrequest-controller would evict the training pod at once (its
//! default evictor), so such a cluster turns these records off
//! (`dispatcher.reclaimEvictionRequests: false`). Pods in a native PodGroup get none: the
//! API does not take them as targets.

use k8s_openapi::api::lifecycle::v1alpha1::EvictionRequest;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tracing::warn;

use crate::context::Context;
use crate::eviction_status;
use crate::reclaim_end::ReclaimEnd;

/// `spec.requester` of tidepool's requests.
pub(crate) const REQUESTER: &str = "tidepool.io/reclaim";

/// The request's name for pod `p`: by UID, so a pod of the same name later gets its own.
fn name_of(p: &PodLite) -> Option<String> {
    p.metadata.uid.as_deref().map(|uid| format!("tidepool-reclaim-{uid}"))
}

/// Whether reclaims of `p` are recorded: configured, served, and `p` not in a native group.
async fn recorded(ctx: &Context, p: &PodLite) -> bool {
    if !ctx.config.dispatcher.reclaim_eviction_requests || p.spec.pod_group.is_some() {
        return false;
    }
    *ctx.training_eviction_requests
        .get_or_init(|| async {
            tidepool_federation::eviction_requests::served(&ctx.training).await.unwrap_or_else(|e| {
                warn!(error = %e, "discovery of eviction requests failed; reclaims are not recorded as such");
                false
            })
        })
        .await
}

/// The notice went out on `p` with `message`: the request, with intent `Eviction` (again, for
/// a pod noticed before).
pub(crate) async fn noticed(ctx: &Context, p: &PodLite, message: &str) {
    if !recorded(ctx, p).await {
        return;
    }
    let (Some(name), Some(uid)) = (name_of(p), p.metadata.uid.clone()) else { return };
    let ns = p.namespace().unwrap_or_default();
    let api = Api::<EvictionRequest>::namespaced(ctx.training.clone(), &ns);
    let request: Result<EvictionRequest, _> = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": { keys::LABEL_MANAGED_BY: keys::MANAGED_BY },
            "ownerReferences": [{ "apiVersion": "v1", "kind": "Pod", "name": p.name_any(), "uid": uid }],
        },
        "spec": { "target": { "pod": { "name": p.name_any(), "uid": uid } }, "requester": REQUESTER, "intent": "Eviction" },
    }));
    let Ok(request) = request else { return };
    ctx.wrote();
    let made = match api.create(&PostParams::default(), &request).await {
        Err(e) if tidepool_federation::api_code(&e, &[409]) => {
            let intent = Patch::Merge(json!({ "spec": { "intent": "Eviction" } }));
            api.patch(&name, &PatchParams::default(), &intent).await.map(|_| ())
        }
        other => other.map(|_| ()),
    };
    if let Err(e) = made {
        warn!(pod = %p.name_any(), error = %e, "cannot record the reclaim as an eviction request");
        return;
    }
    write_status(ctx, p, eviction_status::awaiting(message, &Time(jiff::Timestamp::now()))).await;
}

/// `p` ended `Failed` with `message`, its reclaim as `end` says.
pub(crate) async fn ended(ctx: &Context, p: &PodLite, end: &ReclaimEnd, message: &str) {
    if !recorded(ctx, p).await {
        return;
    }
    write_status(ctx, p, eviction_status::ended("PodTerminal", message, end, &Time(jiff::Timestamp::now()))).await;
}

/// `p`'s notice was withdrawn: so is the request.
pub(crate) async fn withdrawn(ctx: &Context, p: &PodLite, message: &str) {
    if !recorded(ctx, p).await {
        return;
    }
    let Some(name) = name_of(p) else { return };
    let api = Api::<EvictionRequest>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    let intent = Patch::Merge(json!({ "spec": { "intent": "Withdrawn" } }));
    if let Err(e) = api.patch(&name, &PatchParams::default(), &intent).await {
        if !tidepool_federation::api_code(&e, &[404]) {
            warn!(pod = %p.name_any(), error = %e, "cannot withdraw the reclaim's eviction request");
        }
        return;
    }
    write_status(ctx, p, eviction_status::canceled(message, &Time(jiff::Timestamp::now()))).await;
}

async fn write_status(ctx: &Context, p: &PodLite, conditions: serde_json::Value) {
    let Some(name) = name_of(p) else { return };
    ctx.wrote();
    let api = Api::<EvictionRequest>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    if let Err(e) = eviction_status::write_request_status(&api, &name, conditions).await {
        warn!(pod = %p.name_any(), error = %e, "cannot write the reclaim's eviction request status");
    }
}
