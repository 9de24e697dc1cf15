//! The names of a job's native pods in a member, the I/O: after each mirror pass, the native
//! slices of the member's mirrors are brought to what [`native_slices::native_slice`] says,
//! from the shared training pod cache (no API call to decide), with one list per offload
//! namespace that has or had one, and nothing at all where no job uses the native floor.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use tidepool_api::pod::PodLite;
use tracing::{debug, info, warn};

use crate::context::{Context, OffloadWatch};
use crate::native_slices::{self, SliceStep};
use crate::services::{self, NativePod, key_of};

/// The training pods the dispatcher placed natively that have an address.
pub(crate) fn native_pods(ctx: &Context) -> Vec<Arc<PodLite>> {
    ctx.pods.state().into_iter().filter(|p| p.status.address.is_some() && p.is_live()).collect()
}

/// A native pod as the pure part reads it.
pub(crate) fn as_native(pod: &PodLite) -> Option<NativePod<'_>> {
    Some(NativePod {
        namespace: pod.metadata.namespace.as_deref()?,
        labels: pod.metadata.labels.as_ref(),
        address: pod.status.address.as_deref()?,
    })
}

/// Brings the member's native slices to those of the mirrors `present` (the member's, by
/// key) for the `desired` mirrors and their training Services. `holding` is the offload
/// namespaces that held slices after the last pass (`None` before the first).
pub(crate) async fn pass(
    ctx: &Context,
    watch: &OffloadWatch,
    desired: &[(Service, Arc<Service>)],
    present: &BTreeMap<(String, String), Service>,
    holding: &mut Option<BTreeSet<String>>,
) -> Result<(), kube::Error> {
    let pods = native_pods(ctx);
    let native: Vec<NativePod<'_>> = pods.iter().filter_map(|p| as_native(p)).collect();
    let wanted: Vec<EndpointSlice> = desired
        .iter()
        .filter_map(|(mirror, source)| {
            let there = present.get(&key_of(&mirror.metadata))?;
            native_slices::native_slice(source, there, &native)
        })
        .collect();
    let mut namespaces: BTreeSet<String> = wanted.iter().filter_map(|s| s.metadata.namespace.clone()).collect();
    match holding {
        Some(known) => namespaces.extend(known.iter().cloned()),
        // A slice lives only beside its mirror (its owner): the first pass looks there.
        None => namespaces.extend(present.keys().map(|(ns, _)| ns.clone())),
    }
    let existing = slices_in(ctx, watch, &namespaces).await?;
    for step in native_slices::plan(&wanted, &existing) {
        let _slot = watch.writes.acquire().await;
        if let Err(e) = execute(watch, &step).await {
            warn!(error = %e, "native slice write failed; tried again on the next pass");
        }
    }
    let mut now: BTreeSet<String> = wanted.iter().filter_map(|s| s.metadata.namespace.clone()).collect();
    now.extend(existing.iter().filter_map(|s| s.metadata.namespace.clone()));
    *holding = Some(now);
    Ok(())
}

/// This instance's native slices in `namespaces` of the member (one list each).
async fn slices_in(
    ctx: &Context,
    watch: &OffloadWatch,
    namespaces: &BTreeSet<String>,
) -> Result<Vec<EndpointSlice>, kube::Error> {
    let member = &watch.member;
    let selector = format!(
        "{},{}={}",
        services::mirror_selector(&ctx.config.cluster_name, member.name.as_str()),
        native_slices::LABEL_SLICE_MANAGED_BY,
        native_slices::SLICE_MANAGER
    );
    let mut existing = Vec::new();
    for ns in namespaces {
        match Api::<EndpointSlice>::namespaced(member.client.clone(), ns)
            .list(&ListParams::default().labels(&selector))
            .await
        {
            Ok(list) => existing.extend(list.items),
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 404 => {
                debug!(namespace = ns, "no native slices readable");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(existing)
}

async fn execute(watch: &OffloadWatch, step: &SliceStep) -> Result<(), kube::Error> {
    let member = &watch.member;
    let api = |ns: &str| Api::<EndpointSlice>::namespaced(member.client.clone(), ns);
    match step {
        SliceStep::Create(slice) => {
            let (ns, name) = key_of(&slice.metadata);
            match api(&ns).create(&PostParams::default(), slice).await {
                Ok(_) => info!(member = %member.name, namespace = ns, slice = name, "native pods listed in the member"),
                // Not ours (ours would have been listed): left alone.
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    warn!(member = %member.name, namespace = ns, slice = name, "an EndpointSlice not ours has the name");
                }
                Err(e) => return Err(e),
            }
        }
        SliceStep::Update(slice) => {
            let (ns, name) = key_of(&slice.metadata);
            api(&ns).replace(&name, &PostParams::default(), slice).await?;
            debug!(member = %member.name, namespace = ns, slice = name, "native slice updated");
        }
        SliceStep::Delete(ns, name) => match api(ns).delete(name, &DeleteParams::default()).await {
            Ok(_) => info!(member = %member.name, namespace = ns, slice = name, "native slice removed"),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        },
    }
    Ok(())
}
