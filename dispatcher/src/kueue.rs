//! Kueue's quota over lent capacity, kept equal to what the members lend (the rules are
//! [`crate::kueue_quota`]): watches the virtual nodes, and on each change of what they
//! offer (not their heartbeats; and every [`PASS_EVERY`], for edited flavors and queues)
//! writes the `nominalQuota`
//! of the lent flavors of every ClusterQueue and Cohort carrying
//! [`ANNOTATION`](crate::kueue_quota::ANNOTATION), with an Event on the queue. Waits, checking
//! discovery, until the training cluster serves Kueue's API; off with
//! `dispatcher.kueueLentQuota: false`. Runs beside the scheduling loop (on the leader).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use serde_json::json;
use tidepool_api::{Resources, keys};
use tidepool_federation::capacity::NodeView;
use tracing::{debug, info, warn};

use crate::context::{Context, publish_on};
use crate::kueue_quota::{self as kq, ANNOTATION, Change, Share};

const GROUP: &str = "kueue.x-k8s.io";
const VERSION: &str = "v1beta2";
/// How often discovery is asked again while Kueue's API is not served.
const DISCOVERY_EVERY: Duration = Duration::from_secs(30);
/// A pass at least this often: flavors and queues are read at each pass, not watched.
const PASS_EVERY: Duration = Duration::from_secs(10);
/// Changes that arrive this close together make one pass.
const SETTLE: Duration = Duration::from_millis(500);

/// The Event reasons on a queue.
const REASON_SET: &str = "LentQuota";
const REASON_INVALID: &str = "LentQuotaInvalid";

/// The loop. Never returns (see `volcano::run`).
pub(crate) async fn run(ctx: Arc<Context>) {
    if !ctx.config.dispatcher.kueue_lent_quota {
        info!("dispatcher.kueueLentQuota is off: Kueue's quotas are left as written");
        return std::future::pending().await;
    }
    served(&ctx).await;
    info!(annotation = ANNOTATION, "the training cluster serves Kueue: tidepool keeps the lent quota of marked queues");
    let writer = reflector::store::Writer::default();
    let nodes = writer.as_reader();
    let virtual_nodes = watcher::Config::default().labels(keys::LABEL_MEMBER);
    let watch = watcher(Api::<Node>::all(ctx.training.clone()), virtual_nodes)
        .default_backoff()
        .modify(|n| n.managed_fields_mut().clear())
        .reflect(writer)
        .map(|e| {
            if let Err(e) = e {
                warn!(error = %e, "virtual node watch (Kueue quota) failed; retrying with backoff");
            }
        });
    let ticks = futures::stream::unfold((), |()| async {
        tokio::time::sleep(PASS_EVERY).await;
        Some((Trigger::Tick, ()))
    });
    let mut changes = std::pin::pin!(futures::stream::select(watch.map(|()| Trigger::Node), ticks));
    let (mut told, mut last) = (Told::default(), Vec::new());
    while let Some(first) = changes.next().await {
        tokio::time::sleep(SETTLE).await;
        let mut tick = first == Trigger::Tick;
        while let Some(Some(t)) = changes.next().now_or_never() {
            tick |= t == Trigger::Tick;
        }
        if nodes.wait_until_ready().now_or_never().is_none() {
            continue;
        }
        // A node's heartbeat changes nothing the quota reads: only a change of what the
        // virtual nodes offer, or the tick (for edited flavors and queues), makes a pass.
        let views = views(&nodes);
        if tick || views != last {
            pass(&ctx, &views, &mut told).await;
            last = views;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    Node,
    Tick,
}

/// The virtual nodes as the quota reads them, in a stable order.
fn views(nodes: &Store<Node>) -> Vec<NodeView> {
    let mut views: Vec<NodeView> = nodes.state().iter().map(|n| NodeView::from_node(n)).collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    views
}

/// Until the training cluster serves Kueue's ClusterQueues.
async fn served(ctx: &Context) {
    loop {
        match tidepool_federation::discovery::serves(&ctx.training, &format!("{GROUP}/{VERSION}"), "clusterqueues")
            .await
        {
            Ok(true) => return,
            Ok(false) => debug!("the training cluster serves no Kueue API (yet)"),
            Err(e) => warn!(error = %e, "cannot ask the training cluster whether it serves Kueue"),
        }
        tokio::time::sleep(DISCOVERY_EVERY).await;
    }
}

fn api(ctx: &Context, kind: &str, plural: &str) -> (Api<DynamicObject>, ApiResource) {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural);
    (Api::all_with(ctx.training.clone(), &ar), ar)
}

/// What the loop last said in an Event per queue UID, so a queue is not told the same twice.
#[derive(Debug, Default)]
struct Told(HashMap<String, String>);

async fn pass(ctx: &Context, views: &[NodeView], told: &mut Told) {
    let (flavors, _) = api(ctx, "ResourceFlavor", "resourceflavors");
    let flavors = match flavors.list(&ListParams::default()).await {
        Ok(list) => list.items,
        Err(e) => return warn!(error = %e, "cannot list Kueue's ResourceFlavors; the quotas are kept"),
    };
    let lent: BTreeMap<String, Resources> = flavors
        .iter()
        .filter_map(|f| {
            let labels: BTreeMap<String, String> = serde_json::from_value(f.data["spec"]["nodeLabels"].clone()).ok()?;
            kq::is_lent(&labels).then(|| (f.name_any(), kq::lent(&labels, views)))
        })
        .collect();
    let mut marked = Vec::new();
    for (kind, plural) in [("ClusterQueue", "clusterqueues"), ("Cohort", "cohorts")] {
        let (queues, ar) = api(ctx, kind, plural);
        match queues.list(&ListParams::default()).await {
            Ok(list) => {
                for q in list.items.iter().filter(|q| q.annotations().contains_key(ANNOTATION)) {
                    marked.push(q.uid().unwrap_or_default());
                    keep(ctx, &queues, &ar, q, &lent, told).await;
                }
            }
            // Not all told: what was said of a queue not listed stays remembered.
            Err(e) => return warn!(kind, error = %e, "cannot list Kueue's queues; their quotas are kept"),
        }
    }
    told.0.retain(|uid, _| marked.contains(uid));
}

/// Brings one marked queue's lent quota to what is lent now, or says why it cannot.
async fn keep(
    ctx: &Context,
    api: &Api<DynamicObject>,
    ar: &ApiResource,
    q: &DynamicObject,
    lent: &BTreeMap<String, Resources>,
    told: &mut Told,
) {
    let name = q.name_any();
    let decided = Share::parse(&q.annotations()[ANNOTATION])
        .and_then(|share| kq::resource_groups(&q.data["spec"]["resourceGroups"], lent, share));
    let (groups, changes) = match decided {
        Ok(Some(new)) => new,
        Ok(None) => return,
        Err(why) => return tell(ctx, ar, q, EventType::Warning, REASON_INVALID, &why, told).await,
    };
    // The queue as read, or nothing: an admin's edit in between is not written over.
    let patch = json!({"metadata": {"resourceVersion": q.resource_version()}, "spec": {"resourceGroups": groups}});
    let params =
        PatchParams { field_manager: Some(ctx.config.dispatcher.scheduler_name.clone()), ..Default::default() };
    ctx.wrote();
    match api.patch(&name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => {
            let said = said(&changes);
            info!(kind = %ar.kind, queue = %name, quota = %said, "Kueue quota follows what is lent");
            tell(ctx, ar, q, EventType::Normal, REASON_SET, &format!("quota over lent capacity: {said}"), told).await;
        }
        Err(e) if tidepool_federation::api_code(&e, &[409]) => debug!(queue = %name, "changed since read; next pass"),
        Err(e) => {
            warn!(kind = %ar.kind, queue = %name, error = %e, "cannot write a Kueue queue's lent quota");
            let why = format!("cannot set the quota over lent capacity ({}): {e}", said(&changes));
            tell(ctx, ar, q, EventType::Warning, REASON_INVALID, &why, told).await;
        }
    }
}

fn said(changes: &[Change]) -> String {
    let each = changes.iter().map(|c| format!("{}/{} {} → {}", c.flavor, c.resource, or_none(&c.from), c.to));
    each.collect::<Vec<_>>().join(", ")
}

fn or_none(q: &str) -> &str {
    if q.is_empty() { "none" } else { q }
}

/// An Event on the queue, unless the same was said last.
async fn tell(
    ctx: &Context,
    ar: &ApiResource,
    q: &DynamicObject,
    type_: EventType,
    reason: &str,
    note: &str,
    told: &mut Told,
) {
    let uid = q.uid().unwrap_or_default();
    if told.0.get(&uid).is_some_and(|last| last == note) {
        return;
    }
    told.0.insert(uid.clone(), note.to_owned());
    let on = ObjectReference {
        api_version: Some(ar.api_version.clone()),
        kind: Some(ar.kind.clone()),
        name: Some(q.name_any()),
        uid: Some(uid),
        ..ObjectReference::default()
    };
    publish_on(ctx, &on, type_, reason, note).await;
}
