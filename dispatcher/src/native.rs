//! The watch of the training cluster's nodes the native pool is made of
//! (`dispatcher.nativeNodes`, see [`crate::native_pool`]): a reflector of the nodes carrying
//! the admin's labels, published in the context for the rounds to read. Off, and never
//! returning, without `dispatcher.nativeNodes`. Runs beside the scheduling loop (on the
//! leader).

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tidepool_api::pod::PodLite;
use tidepool_api::sync::Locked;
use tidepool_federation::capacity::NodeView;
use tracing::{info, warn};

use crate::context::Context;
use crate::error::Result;
use crate::native_pool::NativePool;

/// The loop. Never returns (see `volcano::run`).
pub(crate) async fn run(ctx: Arc<Context>) {
    let Some(native) = ctx.config.dispatcher.native_nodes.clone() else {
        info!("dispatcher.nativeNodes is unset: no native pool; pods that ask for one wait");
        return std::future::pending().await;
    };
    let selector: Vec<String> = native.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    info!(selector = %selector.join(","), "the training cluster's own nodes form the native pool");
    let (store, writer) = reflector::store::<Node>();
    match ctx.native_nodes.locked("native nodes") {
        Ok(mut slot) => *slot = Some(store),
        Err(e) => warn!(error = %e, "cannot publish the native nodes"),
    }
    let config = watcher::Config::default().labels(&selector.join(","));
    let events = watcher(Api::<Node>::all(ctx.training.clone()), config)
        .default_backoff()
        .modify(|n| n.managed_fields_mut().clear())
        .reflect(writer);
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        if let Err(e) = event {
            warn!(error = %e, "native node watch failed; retrying with backoff");
        }
    }
}

/// The native pool for a round over `pods`, when the watch runs and has listed.
pub(crate) fn pool(ctx: &Context, pods: &[Arc<PodLite>]) -> Result<Option<NativePool>> {
    let Some(native) = &ctx.config.dispatcher.native_nodes else { return Ok(None) };
    let Some(store) = ctx.native_nodes.locked("native nodes")?.clone() else { return Ok(None) };
    let nodes = store.state().iter().map(|n| NodeView::from_node(n)).collect::<Vec<_>>();
    Ok(Some(NativePool::new(nodes, &native.node_selector, pods)))
}

/// Ends a pod the dispatcher placed on a native node as a kubelet's own disruptions end one:
/// the `DisruptionTarget` condition (`reason`, `message`) first, so a Job's `podFailurePolicy`
/// or an operator reads why, then a delete with the pod's own grace period, so its kubelet
/// sends SIGTERM and the pod ends as its containers do. (A status write of `Failed`, which ends
/// a pod tidepool runs through a copy, would leave these containers running on the node.)
pub(crate) async fn end(api: &Api<Pod>, name: &str, reason: &str, message: &str) -> kube::Result<()> {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now());
    let condition = tidepool_api::terminal::disruption_target(reason, message, &now);
    let patch = serde_json::json!({"status": {"conditions": [condition]}});
    api.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch)).await?;
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Ok(()),
        Err(e) => Err(e),
    }
}
