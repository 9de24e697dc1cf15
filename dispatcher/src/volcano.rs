//! Tidepool as Volcano's gang scheduler for its own jobs: watches the training cluster's
//! Volcano PodGroups, and writes on those of jobs whose pod templates all name tidepool's
//! scheduler the phase, counts and condition [`crate::volcano_group`] decides, with an Event
//! at each change of phase. Waits, checking discovery, until the training cluster serves
//! Volcano's PodGroups; off with `dispatcher.volcanoPodGroups: false`. Runs beside the
//! scheduling loop (on the leader, sharded): one writer of the groups' status.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use tidepool_api::crd::GangScheduler;
use tidepool_api::keys;
use tidepool_api::pod::PodLite;
use tidepool_federation::training::{PodEvent, TrainingPods};
use tracing::{debug, info, warn};

use crate::context::{Context, publish_on};
use crate::volcano_group::{self as vg, Group, Next, Tally};

/// How often discovery is asked again while Volcano's PodGroups are not served.
const DISCOVERY_EVERY: Duration = Duration::from_secs(30);
/// A pass at least this often, so a pool that grows enqueues a waiting group.
const PASS_EVERY: Duration = Duration::from_secs(10);
/// Changes that arrive this close together make one pass.
const SETTLE: Duration = Duration::from_millis(200);
/// How long a job whose owner could not be read (or was not tidepool's) is left before its
/// owner is read again.
const RECHECK_AFTER: Duration = Duration::from_secs(60);

/// The loop. Never returns: turned off, it idles (its end would end the scheduling loop beside
/// it, see `Dispatcher::schedule`).
pub(crate) async fn run(ctx: std::sync::Arc<Context>, pods: TrainingPods) {
    if !ctx.config.dispatcher.volcano_pod_groups {
        info!("dispatcher.volcanoPodGroups is off: Volcano PodGroups are left to Volcano's scheduler");
        return std::future::pending().await;
    }
    served(&ctx).await;
    info!("the training cluster serves Volcano PodGroups: tidepool schedules those of its jobs");
    let ar = GangScheduler::Volcano.pod_group_resource();
    let writer = reflector::store::Writer::new(ar.clone());
    let groups = writer.as_reader();
    let watch = watcher(Api::<DynamicObject>::all_with(ctx.training.clone(), &ar), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .map(|e| {
            if let Err(e) = e {
                warn!(error = %e, "Volcano PodGroup watch failed; retrying with backoff");
            }
        });
    let pod_changes = pods.subscribe().filter_map(|e| async move { in_a_volcano_group(&e).then_some(()) });
    let ticks = futures::stream::unfold((), |()| async {
        tokio::time::sleep(PASS_EVERY).await;
        Some(((), ()))
    });
    let mut changes = std::pin::pin!(futures::stream::select(futures::stream::select(watch, pod_changes), ticks));
    let mut state = State::default();
    let pod_store = pods.store();
    while changes.next().await.is_some() {
        tokio::time::sleep(SETTLE).await;
        while let Some(Some(())) = changes.next().now_or_never() {}
        pass(&ctx, &groups, &pod_store, &mut state).await;
    }
}

/// What the loop remembers between passes.
#[derive(Debug, Default)]
struct State {
    claims: Claims,
    /// Group UID → the resourceVersion a write of ours was made over: until the watch brings
    /// a newer one, the cached group is older than what we wrote, and is left alone.
    written_over: HashMap<String, String>,
}

fn in_a_volcano_group(e: &PodEvent) -> bool {
    match e {
        PodEvent::Applied(p) | PodEvent::Deleted(p) => p.annotations().contains_key(keys::ANNOTATION_VOLCANO_GROUP),
        PodEvent::Relisted | PodEvent::Lagged => true,
    }
}

/// Until the training cluster serves Volcano's PodGroups.
async fn served(ctx: &Context) {
    loop {
        match tidepool_federation::discovery::serves_pod_groups(&ctx.training, GangScheduler::Volcano).await {
            Ok(true) => return,
            Ok(false) => debug!("the training cluster serves no Volcano PodGroups (yet)"),
            Err(e) => warn!(error = %e, "cannot ask the training cluster whether it serves Volcano PodGroups"),
        }
        tokio::time::sleep(DISCOVERY_EVERY).await;
    }
}

/// The pods of one Volcano group.
#[derive(Debug, Default)]
struct Members {
    tally: Tally,
    /// Pods that name another scheduler.
    foreign: u32,
}

/// Every Volcano group's pods, by `namespace/group`.
fn members(pods: &Store<PodLite>, scheduler: &str) -> HashMap<String, Members> {
    let mut by_group: HashMap<String, Members> = HashMap::new();
    for p in pods.state() {
        let Some(group) = p.annotations().get(keys::ANNOTATION_VOLCANO_GROUP) else { continue };
        let m = by_group.entry(format!("{}/{group}", p.namespace().unwrap_or_default())).or_default();
        m.tally.add(&p);
        m.foreign += u32::from(p.spec.scheduler_name.as_deref() != Some(scheduler));
    }
    by_group
}

async fn pass(ctx: &Context, groups: &Store<DynamicObject>, pods: &Store<PodLite>, state: &mut State) {
    let objects = groups.state();
    if objects.is_empty() {
        return;
    }
    let scheduler = ctx.config.dispatcher.scheduler_name.as_str();
    let members = members(pods, scheduler);
    let pools = ctx.pools();
    let mut seen = HashSet::with_capacity(objects.len());
    for obj in objects {
        let Some(g) = serde_json::to_value(&*obj).ok().as_ref().and_then(Group::read) else { continue };
        seen.insert(g.uid.clone());
        if state.written_over.get(&g.uid) == Some(&g.resource_version) {
            continue;
        }
        state.written_over.remove(&g.uid);
        let of_group = members.get(&g.key());
        if !state.claims.ours(ctx, &g, of_group).await {
            continue;
        }
        let n = vg::next(&g, of_group.map(|m| m.tally).unwrap_or_default(), &vg::room(&g.min_resources, &pools));
        if !vg::shows(&g, &n) && write(ctx, &g, &n).await {
            state.written_over.insert(g.uid.clone(), g.resource_version.clone());
        }
    }
    state.claims.keep(&seen);
    state.written_over.retain(|uid, _| seen.contains(uid));
}

/// Which groups are tidepool's, by group UID: read from the job that controls the group (its
/// pod templates), or, for a group no job controls, from its pods.
#[derive(Debug, Default)]
struct Claims(HashMap<String, (bool, Instant)>);

impl Claims {
    async fn ours(&mut self, ctx: &Context, g: &Group, pods: Option<&Members>) -> bool {
        let Some(owner) = &g.owner else {
            return pods.is_some_and(|m| m.foreign == 0 && m.tally != Tally::default());
        };
        if let Some((ours, at)) = self.0.get(&g.uid)
            && (*ours || at.elapsed() < RECHECK_AFTER)
        {
            return *ours;
        }
        let ours = match owner_schedulers(ctx, &g.namespace, owner).await {
            Ok(names) => vg::claimed(&names, &ctx.config.dispatcher.scheduler_name),
            Err(e) => {
                warn!(group = %g.key(), owner = %format!("{}/{}", owner.kind, owner.name), error = %e,
                    "cannot read the job of a Volcano PodGroup; it is left alone for now");
                false
            }
        };
        if ours {
            info!(group = %g.key(), owner = %format!("{}/{}", owner.kind, owner.name), "a Volcano PodGroup of tidepool's");
        }
        self.0.insert(g.uid.clone(), (ours, Instant::now()));
        ours
    }

    /// Forgets the groups not in `uids` (deleted).
    fn keep(&mut self, uids: &HashSet<String>) {
        self.0.retain(|uid, _| uids.contains(uid));
    }
}

/// The schedulers the pod templates of the group's job name.
async fn owner_schedulers(ctx: &Context, ns: &str, o: &vg::Owner) -> Result<Vec<String>, kube::Error> {
    let (group, version) = o.api_version.split_once('/').unwrap_or(("", o.api_version.as_str()));
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &o.kind));
    let job = Api::<DynamicObject>::namespaced_with(ctx.training.clone(), ns, &ar).get(&o.name).await?;
    Ok(vg::template_schedulers(&job.data))
}

/// Writes `n` on `g` (a merge patch: Volcano's PodGroups have no status subresource) and, when
/// the phase changes, an Event on the group as Volcano's scheduler records them. Whether the
/// write went through.
async fn write(ctx: &Context, g: &Group, n: &Next) -> bool {
    let ar = GangScheduler::Volcano.pod_group_resource();
    let api = Api::<DynamicObject>::namespaced_with(ctx.training.clone(), &g.namespace, &ar);
    let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let patch = vg::patch(g, n, &now);
    ctx.wrote();
    let params =
        PatchParams { field_manager: Some(ctx.config.dispatcher.scheduler_name.clone()), ..PatchParams::default() };
    if let Err(e) = api.patch(&g.name, &params, &Patch::Merge(&patch)).await {
        warn!(group = %g.key(), error = %e, "cannot write a Volcano PodGroup's status; retried at the next pass");
        return false;
    }
    info!(group = %g.key(), from = %g.phase, to = n.phase, counts = ?n.counts, "Volcano PodGroup");
    if g.phase == n.phase {
        return true;
    }
    let on = ObjectReference {
        api_version: Some(ar.api_version.clone()),
        kind: Some(ar.kind.clone()),
        namespace: Some(g.namespace.clone()),
        name: Some(g.name.clone()),
        uid: Some(g.uid.clone()),
        ..ObjectReference::default()
    };
    let (type_, reason, note) = match &n.condition {
        Some((vg::UNSCHEDULABLE, _, why)) => (EventType::Warning, vg::UNSCHEDULABLE, why.clone()),
        _ if n.phase == vg::RUNNING => (EventType::Normal, vg::SCHEDULED, vg::READY.to_owned()),
        _ => (EventType::Normal, vg::INQUEUE, inqueue_note(n)),
    };
    publish_on(ctx, &on, type_, reason, &note).await;
    true
}

fn inqueue_note(n: &Next) -> String {
    format!("some member pool can hold the gang: its pods may be made ({} running)", n.counts.0)
}
