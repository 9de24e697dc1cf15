//! The dispatcher's scheduling loop: the I/O around [`crate::round`], [`crate::plan`] and
//! [`crate::order`].
//!
//! One round: (1) read every pending `schedulerName: tidepool` pod and every pod on a
//! virtual node from the cache; (2) group pods into gangs and roll back placed gangs past
//! their timeout; then, only when a gang waits, (3) build each pool's view from federation's
//! capacity, minus the pods bound there but not yet visible in the member ("in flight"), and
//! order the gangs; (4) admit each gang whole on one pool — record the placement on every
//! core pod, then bind — or explain why not; (5) admit elastic pods one by one to their
//! gang's pool. Steps 2–5 are planned first, as a list of [`Write`]s, and committed after.
//! All state is re-derived from the API each round, so a restarted dispatcher continues
//! where the last one stopped.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::keys::{self, Band};
use tidepool_api::metrics::{PlacementLabels, metrics};
use tidepool_api::pod::PodLite;
use tidepool_api::terminal::{Ending, terminal_status};
use tidepool_federation::TrainingPods;
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};

use crate::context::{Context, PreemptRequest, pacing, pod_group_api, publish, requests, workload_api};
use crate::error::{Error, PodGroupRef, Result};
use crate::gang::{self, GangKey, GangSource};
use crate::order::admission_order;
use crate::plan::{Domain, PoolView};
use crate::pod_group_status::{self, Outcome};
use crate::round::{self, GangState, PlannedPod, Stamp, Write};
use crate::workload::{self, WorkloadKind};

/// A round runs at least this often, so capacity that frees up is noticed.
const TICK: Duration = Duration::from_secs(2);
/// Coalesces bursts of pod events into one round.
const COALESCE: Duration = Duration::from_millis(50);
/// Longest wait before a round after a change.
const COALESCE_MAX: Duration = Duration::from_millis(500);
/// Bindings in flight at once (a gang's, or a round's run of pods joining placed gangs).
/// The training API takes a few hundred small writes a second; a gang of 256 is then bound
/// in about a second rather than waiting on each chunk's slowest write.
const BIND_CONCURRENCY: usize = 64;
/// Pods told at once why they wait (a status write and an Event each).
const EXPLAIN_CONCURRENCY: usize = 16;

/// Runs the scheduling loop until the runtime stops.
pub(crate) async fn run(ctx: Arc<Context>, training_pods: TrainingPods) {
    let changed = Arc::new(Notify::new());
    let notify = changed.clone();
    // Any change of any training pod (the cache is shared with the pod sync) starts a round.
    let events = training_pods.subscribe();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while events.next().await.is_some() {
            notify.notify_one();
        }
    });
    training_pods.listed().await;
    let copies = labels_on_binding(&ctx.training).await;
    ctx.labels_on_binding.store(copies, std::sync::atomic::Ordering::Relaxed);
    let (binds, jobs) = futures::channel::mpsc::unbounded();
    // The rounds end only when the members' channel closes; the binder then finishes what
    // they handed it.
    tokio::join!(rounds(ctx.clone(), binds, changed), binder(&ctx, jobs));
}

/// Runs a round after each change (coalesced, see [`pacing`]) and at least every [`TICK`],
/// until the members' channel closes.
async fn rounds(ctx: Arc<Context>, binds: Binds, changed: Arc<Notify>) {
    let mut members = ctx.members.clone();
    let mut remote = ctx.remote.as_ref().map(|r| r.records.clone());
    loop {
        let (started, writes) = (std::time::Instant::now(), ctx.writes());
        if let Err(e) = round(&ctx, &binds).await {
            tracing::error!(error = %e, "dispatch round failed");
        }
        let cost = started.elapsed();
        metrics().observe_sync("dispatch", cost);
        tokio::select! {
            () = changed.notified() => {}
            r = members.changed() => if r.is_err() { return },
            () = remote_changed(&mut remote) => {}
            () = tokio::time::sleep(TICK) => {}
        }
        // A round reads every training pod (see [`pacing`]).
        tokio::time::sleep(pacing(cost, ctx.writes() != writes, COALESCE, COALESCE_MAX)).await;
    }
}

/// A binding a round hands the binder: the pod, its virtual node, its band (for the
/// placements metric) and what the binding records.
type BindJob = (Arc<PodLite>, String, Band, Stamp);

/// Makes the bindings the rounds hand it, [`BIND_CONCURRENCY`] at a time, while the rounds
/// go on: a pod handed over is assumed bound ([`Context::with_assumed`]), so the next round
/// neither binds it again nor gives its room away, and a gang whose pods keep arriving is
/// bound as fast as the training API takes bindings, not a round's batch at a time.
async fn binder(ctx: &Context, jobs: futures::channel::mpsc::UnboundedReceiver<BindJob>) {
    jobs.for_each_concurrent(BIND_CONCURRENCY, |(pod, node, band, stamp)| async move {
        if let Err(e) = bind(ctx, &pod, &node, band, &stamp).await {
            tracing::error!(error = %e, "binding skipped");
        }
    })
    .await;
}

/// Whether the training API server copies a Binding's labels onto its pod: since 1.35
/// (`PodTopologyLabelsAdmission`, beta and on by default). Older servers, or one that does
/// not answer, get the labels in a patch before the binding.
async fn labels_on_binding(training: &Client) -> bool {
    let version = match training.apiserver_version().await {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, "cannot read the training API server's version; labelling pods before binding them");
            return false;
        }
    };
    let copies = round::copies_binding_labels(&version.major, &version.minor);
    info!(version = %version.git_version, labels_on_binding = copies, "bindings record the placement");
    copies
}

/// Resolves when another replica publishes a change (never, unsharded).
async fn remote_changed(remote: &mut Option<watch::Receiver<tidepool_federation::published::Remote>>) {
    let Some(r) = remote else { return std::future::pending().await };
    if r.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One round (see the module docs): plans its writes, then commits them in order.
async fn round(ctx: &Context, binds: &Binds) -> Result<()> {
    // 1. The pods, with those this dispatcher bound taken as bound until the cache shows it.
    let all = ctx.with_assumed(ctx.pods.state())?;
    // 2. Gangs of our pods; a placed gang whose core is not running within its timeout is
    //    rolled back whole.
    let mut gangs = round::gangs_of(&all, &ctx.scheduler_name);
    let now = jiff::Timestamp::now();
    let mut writes = relabels(ctx, &all);
    writes.extend(roll_backs(ctx, &gangs, now).await);
    let now = now.as_second();
    // A gang whose core pod failed is stopped whole; its new pods wait until it has stopped.
    let restarting = crate::restart::run(ctx, &all).await;
    gangs.retain(|key, _| !restarting.contains(key));
    gangs.retain(|_, g| g.pods.iter().any(|p| p.node_name().is_none()));
    metrics().gangs_waiting.set(i64::try_from(gangs.len()).unwrap_or(i64::MAX));
    if gangs.is_empty() {
        want_capacity(ctx, false);
        return commit(ctx, binds, writes).await;
    }
    // 3. Pool views, with in-flight pods simulated onto them: built only when a gang waits
    //    (each copies every member node of every pool).
    let mut pools = pool_views(ctx, &all);
    let mut native = crate::native::pool(ctx, &all)?;
    let apart = match &native {
        Some(n) => crate::native_pool::apart(&ctx.pod_networks(), &n.network()),
        None => Default::default(),
    };
    let mut offer = round::Offer { lent: &mut pools, native: native.as_mut(), apart };
    let mut queue = Vec::new();
    let mut mins = HashMap::new();
    for (key, g) in &gangs {
        match min_member(ctx, key, &g.pods).await {
            Ok(min) => {
                mins.insert(key.clone(), min);
                queue.push(round::queue_entry(key, g, min, &ctx.ranges));
            }
            Err(e) => {
                let pods = g.pods.iter().filter(|p| p.node_name().is_none()).cloned().collect();
                writes.push(Write::Explain { pods, message: e.to_string() });
            }
        }
    }
    admission_order(&mut queue);
    metrics().set_queue_depth("gangs", queue.len());
    // 4–5. Admit in order.
    let (mut preempt, mut waiting) = (Vec::new(), false);
    for entry in queue {
        let Some(g) = gangs.get(&entry.key) else { continue };
        let min = mins.get(&entry.key).copied().unwrap_or(1) as usize;
        let admission = round::admit(&entry.key, g, min, &mut offer, (&ctx.ranges, now));
        writes.extend(admission.writes);
        waiting |= admission.unplaced.is_some();
        if let Some(demand) = admission.unplaced
            && entry.band > Band::Low
        {
            preempt.push(PreemptRequest { gang: entry.key.clone(), band: entry.band, demand });
        }
    }
    want_capacity(ctx, waiting);
    commit(ctx, binds, writes).await?;
    ctx.set_preempt(preempt)
}

/// Tells every member whether a gang waits for capacity, so room that frees up reaches the
/// next round at once (sharded, every member: see [`crate::RemotePools::wanted`]).
fn want_capacity(ctx: &Context, waiting: bool) {
    for m in ctx.members.borrow().values() {
        m.want_capacity(waiting);
    }
    // Sharded: the owners of the others hear it through the training cluster.
    if let Some(remote) = &ctx.remote {
        remote.wanted.send_if_modified(|w| std::mem::replace(w, waiting) != waiting);
    }
}

/// Where bindings were to record a pod's band and role but the training API server dropped
/// them (its `PodTopologyLabelsAdmission` is off): from now on pods are labelled before they
/// are bound, and those bound already are labelled now (a core pod is one whose binding
/// recorded its core's size).
fn relabels(ctx: &Context, all: &[Arc<PodLite>]) -> Vec<Write> {
    use std::sync::atomic::Ordering::Relaxed;
    if !ctx.labels_on_binding.load(Relaxed) {
        return Vec::new();
    }
    let unlabelled = round::unlabelled(all, &ctx.scheduler_name);
    if unlabelled.is_empty() {
        return Vec::new();
    }
    warn!(
        pods = unlabelled.len(),
        "the training API server does not copy Binding labels; labelling pods before binding them"
    );
    ctx.labels_on_binding.store(false, Relaxed);
    unlabelled
        .into_iter()
        .map(|pod| {
            let core = pod.annotations().contains_key(keys::ANNOTATION_GANG_CORE);
            let band = gang::band_for(pod.spec.priority, core, &ctx.ranges);
            Write::Relabel { pod, band, role: if core { keys::ROLE_CORE } else { keys::ROLE_ELASTIC } }
        })
        .collect()
}

/// The roll-backs of placed gangs that waited past the gang timeout with too few pods
/// running ([`round::overdue`], [`round::timed_out`]).
async fn roll_backs(
    ctx: &Context,
    gangs: &std::collections::BTreeMap<GangKey, GangState>,
    now: jiff::Timestamp,
) -> Vec<Write> {
    let timeout = ctx.config.dispatcher.gang_timeout_seconds;
    let mut writes = Vec::new();
    for (key, g) in gangs {
        let Some(waited) = round::overdue(g, timeout, now) else { continue };
        let Ok(min) = min_member(ctx, key, &g.pods).await else { continue };
        if let Some(message) = round::timed_out(key, g, min as usize, waited, timeout) {
            writes.push(Write::RollBack { pods: g.pods.clone(), message });
        }
    }
    writes
}

/// Where a round hands its bindings (see [`binder`]).
type Binds = futures::channel::mpsc::UnboundedSender<BindJob>;

/// Makes the planned writes, in order; bindings are handed to the [`binder`].
async fn commit(ctx: &Context, binds: &Binds, writes: Vec<Write>) -> Result<()> {
    for write in writes {
        match write {
            Write::Explain { pods, message } => explain(ctx, pods, &message).await?,
            Write::RollBack { pods, message } => roll_back(ctx, &pods, &message).await,
            Write::Relabel { pod, band, role } => relabel(ctx, &pod, band, role).await,
            Write::Bind { pod, target, band, role, domain } => {
                let stamp = Stamp::new(target.placement(), band, &role, &domain, &now_rfc3339());
                hand_over(ctx, binds, (pod, target.node().to_owned(), band, stamp))?;
            }
            Write::Place { gang, node, member, pods, domain, note } => {
                place(ctx, binds, &gang, (&node, &member), &pods, &domain, note.as_deref()).await?
            }
        }
    }
    Ok(())
}

/// Hands one binding to the [`binder`], the pod assumed bound from now on.
fn hand_over(ctx: &Context, binds: &Binds, job: BindJob) -> Result<()> {
    let (pod, node, _, stamp) = &job;
    ctx.assume_bound(stamp.bound(pod, node))?;
    ctx.wrote();
    if binds.unbounded_send(job).is_err() {
        // Only at shutdown: the pod is bound by the next dispatcher.
        warn!("the binder has stopped; binding skipped");
    }
    Ok(())
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Builds the view of every offered pool: federation's capacity (or the owner's published
/// record, sharded) minus the pods bound to its virtual node that the member does not show
/// yet. The pods are grouped by node once, so a round costs the pods plus the pools, not the
/// pods times the pools.
fn pool_views(ctx: &Context, all: &[Arc<PodLite>]) -> Vec<PoolView> {
    let mut by_node: HashMap<&str, Vec<&Arc<PodLite>>> = HashMap::new();
    for p in all.iter().filter(|p| p.is_live()) {
        if let Some(node) = p.node_name() {
            by_node.entry(node).or_default().push(p);
        }
    }
    let mut views = Vec::new();
    for pool in ctx.pools() {
        let cap = &pool.capacity;
        // A paused member takes no new pods; nor does one that is unreachable or whose
        // credentials are broken (its session lives on for the pods it runs).
        let schedulable = cap.nodes > 0 && !pool.paused && pool.healthy;
        let mut view = PoolView::from_capacity(pool.node.clone(), pool.member, pool.name, cap, schedulable);
        for p in by_node.get(pool.node.as_str()).into_iter().flatten() {
            let in_flight = p.metadata.uid.as_deref().is_some_and(|u| !cap.placed.contains_key(u));
            if in_flight {
                round::assume(&mut view, &requests(p));
            }
        }
        views.push(view);
    }
    views
}

async fn min_member(ctx: &Context, key: &GangKey, pods: &[Arc<PodLite>]) -> Result<u32> {
    if let Some(why) = pods.iter().find_map(|p| workload::refused(&p.metadata)) {
        return Err(Error::Refused(why));
    }
    match &key.source {
        GangSource::Single(_) => Ok(1),
        GangSource::Annotation(name) => {
            let mut min = None;
            for p in pods {
                if let Some(m) = gang::annotated_min_member(p)? {
                    min = Some(min.map_or(m, |x: u32| x.max(m)));
                }
            }
            min.ok_or_else(|| Error::MinMemberMissing { gang: name.clone() })
        }
        GangSource::Workload(kind, name) => {
            let cache_key = (key.source.clone(), key.namespace.clone());
            let training = ctx.training.clone();
            let (kind, ns, name) = (*kind, key.namespace.clone(), name.clone());
            let shape = ctx
                .workloads
                .get_with(cache_key, async move { fetch_workload(training, kind, &ns, &name).await })
                .await?;
            let live: BTreeSet<String> =
                pods.iter().filter(|p| p.is_live()).filter_map(|p| workload::part_of(&p.metadata)).collect();
            Ok(workload::min_member(&shape, &live))
        }
        GangSource::Native(name) | GangSource::PodGroup(name) | GangSource::Volcano(name) => {
            let cache_key = (key.source.clone(), key.namespace.clone());
            let training = ctx.training.clone();
            let (source, ns, name) = (key.source.clone(), key.namespace.clone(), name.clone());
            ctx.pod_groups
                .get_with(cache_key, async move { fetch_pod_group_min(training, &source, &ns, &name).await })
                .await
        }
    }
}

async fn fetch_pod_group_min(training: Client, source: &GangSource, ns: &str, name: &str) -> Result<u32> {
    let (api, gvk) = pod_group_api(training, source, ns);
    let group = PodGroupRef { kind: gvk.kind, group: gvk.group, namespace: ns.to_owned(), name: name.to_owned() };
    match api.get_opt(name).await {
        Ok(Some(pg)) => gang::pod_group_min(source, &pg.data).ok_or(Error::PodGroupInvalid(group)),
        Ok(None) => Err(Error::PodGroupNotFound(group)),
        // No such CRD installed reads as 404 too; anything else is worth saying.
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Err(Error::PodGroupKindNotFound(group)),
        Err(e) => Err(Error::PodGroupRead { group, source: Arc::new(e) }),
    }
}

async fn fetch_workload(training: Client, kind: WorkloadKind, ns: &str, name: &str) -> Result<workload::Shape> {
    let (api, gvk) = workload_api(training, kind, ns);
    let job = PodGroupRef { kind: gvk.kind, group: gvk.group, namespace: ns.to_owned(), name: name.to_owned() };
    match api.get_opt(name).await {
        Ok(Some(obj)) => workload::shape(kind, &obj.data).ok_or(Error::WorkloadInvalid(job)),
        Ok(None) => Err(Error::PodGroupNotFound(job)),
        Err(e) if tidepool_federation::api_code(&e, &[404]) => Err(Error::PodGroupKindNotFound(job)),
        Err(e) => Err(Error::PodGroupRead { group: job, source: Arc::new(e) }),
    }
}

/// Places a new gang on `node` of `member`: hands the binder a binding for each of its core
/// pods, each recording the placement (band, planned node and domain, the core's size), then
/// says `Placed`, with how the gang was kept together. The first pod bound pins the gang to
/// `node`: a restarted dispatcher binds the rest there.
async fn place(
    ctx: &Context,
    binds: &Binds,
    key: &GangKey,
    (node, member): (&str, &str),
    pods: &[PlannedPod],
    domain: &Domain,
    note: Option<&str>,
) -> Result<()> {
    let core = pods.len();
    info!(gang = %key, node, core, domain = %domain.to_annotation(), "gang placed");
    let placed_at = now_rfc3339();
    for p in pods {
        let target = p.target(node);
        let role = round::Role::Core { size: core, planned_node: Some(p.member_node.clone()) };
        let stamp = Stamp::new(target.placement(), p.band, &role, domain, &placed_at);
        hand_over(ctx, binds, (p.pod.clone(), target.node().to_owned(), p.band, stamp))?;
    }
    if let Some(first) = pods.first() {
        let how = note.map(|n| format!(": {n}")).unwrap_or_default();
        let native = pods.iter().filter(|p| p.native).count();
        let at = match (native, core - native) {
            (_, 0) => "on the training cluster's own nodes".to_owned(),
            (0, _) => format!("on {node} (member {member})"),
            (n, lent) => format!("{n} on the training cluster's own nodes, {lent} on {node} (member {member})"),
        };
        let note = format!("gang {key} ({core} pods) placed {at}{how}");
        pod_group_status::report(ctx, key, Outcome::Scheduled(&note)).await?;
        publish(ctx, &first.pod, EventType::Normal, keys::REASON_PLACED, &note).await;
    }
    Ok(())
}

/// Fails every live pod of the gang (reason `GangTimeout`, a disruption: the member could not
/// start the gang, which is nothing the job did); vk-provider then removes their offload
/// copies, and the owning controller (Job, PyTorchJob, …) creates fresh pods that form the
/// gang again.
async fn roll_back(ctx: &Context, pods: &[Arc<PodLite>], message: &str) {
    warn!(message, "gang timed out");
    metrics().gang_timeouts.inc();
    let end = Ending { reason: keys::REASON_GANG_TIMEOUT, message, disruption: Some(keys::REASON_GANG_TIMEOUT) };
    for p in pods {
        let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
        let current = match api.get_opt(&p.name_any()).await {
            Ok(Some(pod)) if pod.metadata.uid == p.metadata.uid => pod,
            Ok(_) => continue,
            Err(e) => {
                warn!(pod = %p.name_any(), error = %e, "cannot read gang pod to roll it back");
                continue;
            }
        };
        let written = if tidepool_api::pod::placed_natively(&current.metadata, p.node_name()) {
            crate::native::end(&api, &p.name_any(), keys::REASON_GANG_TIMEOUT, message).await
        } else {
            let status = terminal_status(current.status.as_ref(), &end, &[], &Time(jiff::Timestamp::now()));
            let patch =
                json!({ "metadata": { "resourceVersion": current.metadata.resource_version }, "status": status });
            api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await.map(|_| ())
        };
        match written {
            Ok(_) => publish(ctx, p, EventType::Warning, keys::REASON_GANG_TIMEOUT, message).await,
            Err(e) => warn!(pod = %p.name_any(), error = %e, "cannot roll back gang pod"),
        }
    }
}

/// Labels a pod a binding left without its band and role (see [`relabels`]).
async fn relabel(ctx: &Context, pod: &PodLite, band: Band, role: &str) {
    ctx.wrote();
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let patch = json!({ "metadata": { "labels": { keys::LABEL_BAND: band.as_str(), keys::LABEL_ROLE: role } } });
    if let Err(e) = api.patch(&pod.name_any(), &PatchParams::default(), &Patch::Merge(patch)).await {
        warn!(pod = %pod.name_any(), error = %e, "cannot label a bound pod; will retry");
    }
}

/// Binds `pod` to virtual node `node`, the Binding carrying `stamp` (where the API server
/// does not copy a Binding's labels, they are patched onto the pod first). The pod is then
/// the virtual node's (and vk-provider's). A failed bind is logged and retried next round;
/// only a poisoned lock is an error.
async fn bind(ctx: &Context, pod: &PodLite, node: &str, band: Band, stamp: &Stamp) -> Result<()> {
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &pod.namespace().unwrap_or_default());
    let name = pod.name_any();
    let (first, binding) = stamp.writes(&name, node, ctx.labels_on_binding.load(std::sync::atomic::Ordering::Relaxed));
    if let Some(patch) = first {
        ctx.wrote();
        if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await {
            warn!(pod = %name, error = %e, "cannot label pod before binding; will retry");
            return forget(ctx, pod);
        }
    }
    match api.create_subresource::<_, serde_json::Value>("binding", &name, &PostParams::default(), &binding).await {
        Ok(_) => {
            debug!(pod = %name, node, "bound");
            metrics().placements.get_or_create(&PlacementLabels { node: node.to_owned(), band: band.as_str() }).inc();
            if let Some(uid) = pod.metadata.uid.as_deref() {
                ctx.explained_bound(uid)?;
            }
        }
        // Bound already (by an earlier round whose binding the cache does not show yet).
        Err(e) if tidepool_federation::api_code(&e, &[409]) => {}
        Err(e) => {
            warn!(pod = %name, error = %e, "bind failed; will retry");
            return forget(ctx, pod);
        }
    }
    Ok(())
}

/// Ends the assumption that `pod` is bound: its binding failed, and the next round takes it
/// up again.
fn forget(ctx: &Context, pod: &PodLite) -> Result<()> {
    pod.metadata.uid.as_deref().map_or(Ok(()), |uid| ctx.forget_bound(uid))
}

/// Says why pods wait: `PodScheduled=False`, reason `Unschedulable`, and an Event, written
/// only when the reason changes.
async fn explain(ctx: &Context, pods: Vec<Arc<PodLite>>, message: &str) -> Result<()> {
    let groups: BTreeSet<GangKey> =
        pods.iter().filter(|p| p.spec.pod_group.is_some()).map(|p| gang::gang_of(p)).collect();
    for key in &groups {
        pod_group_status::report(ctx, key, Outcome::Unschedulable(message)).await?;
    }
    let mut fresh = Vec::new();
    for p in pods {
        if let Some(uid) = p.metadata.uid.as_deref()
            && ctx.explain_fresh(uid, message)?
        {
            fresh.push(p);
        }
    }
    futures::stream::iter(fresh)
        .for_each_concurrent(EXPLAIN_CONCURRENCY, |p| async move { explain_one(ctx, &p, message).await })
        .await;
    Ok(())
}

/// Writes one pod's `PodScheduled=False` with `message`, and its Event.
async fn explain_one(ctx: &Context, p: &PodLite, message: &str) {
    debug!(pod = %p.name_any(), message, "unschedulable");
    let api = Api::<Pod>::namespaced(ctx.training.clone(), &p.namespace().unwrap_or_default());
    let status = json!({ "status": { "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": keys::REASON_UNSCHEDULABLE, "message": message,
        "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    }]}});
    if let Err(e) = api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Strategic(status)).await {
        warn!(pod = %p.name_any(), error = %e, "cannot write Unschedulable condition");
    }
    publish(ctx, p, EventType::Warning, keys::REASON_UNPLACEABLE, message).await;
}
