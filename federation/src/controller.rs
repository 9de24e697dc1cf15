//! The `MemberCluster` controller: turns each object into a connected [`Session`] or into a
//! status condition that says why not.
//!
//! One bad member never affects the others: every failure ends in that member's status and
//! a retry, never in an error that stops the controller.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};
use tidepool_config::crd::MemberClusterStatus;
use tidepool_config::metrics::{MemberLabels, metrics};
use tidepool_config::{BridgeConfig, MemberCluster, MemberName, keys};
use tokio::sync::{mpsc, watch};
use tracing::{info, instrument, warn};

use crate::capacity::PoolCapacity;
use crate::kubeconfig;
use crate::member::{MemberHandle, Session, SessionOptions};
use crate::priority::PriorityConflict;
use crate::{Error, Members};

/// How long a member's API server gets to answer the first request.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a healthy member is re-checked (a rotated Secret takes effect within this).
const RESYNC: Duration = Duration::from_secs(20);
/// How soon a member that is not ready is tried again.
const RETRY: Duration = Duration::from_secs(10);

pub(crate) struct Context {
    pub training: Client,
    /// Events on `MemberCluster` objects.
    pub recorder: Recorder,
    pub config: Arc<BridgeConfig>,
    pub sessions: Mutex<BTreeMap<MemberName, Session>>,
    pub members: watch::Sender<Members>,
    /// Reconciles a member now: its session's health changed.
    pub trigger: mpsc::Sender<ObjectRef<MemberCluster>>,
}

/// Outcome of checking one member, written to its status.
#[derive(Debug)]
struct Verdict {
    credentials: Option<(bool, &'static str, String)>,
    reachable: Option<(bool, &'static str, String)>,
    ready: (bool, &'static str, String),
    /// Describes the health of the running session (rather than a failed attempt to start
    /// one), so it must not be held against that session.
    live: bool,
}

impl Verdict {
    fn not_ready(reason: &'static str, message: String) -> Self {
        Self { credentials: None, reachable: None, ready: (false, reason, message), live: false }
    }
}

pub(crate) async fn run(ctx: Arc<Context>, triggers: mpsc::Receiver<ObjectRef<MemberCluster>>) {
    let api = Api::<MemberCluster>::all(ctx.training.clone());
    let mut cfg = watcher::Config::default();
    if let Some(selector) = &ctx.config.member_selector {
        cfg = cfg.labels(selector);
    }
    let controller = Controller::new(api, cfg);
    let store = controller.store();
    tokio::spawn(sweep(store, ctx.clone()));
    controller
        .reconcile_on(tokio_stream::wrappers::ReceiverStream::new(triggers))
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                // Deleted objects show up here as ObjectNotFound; `sweep` stops their sessions.
                tracing::debug!(error = %e, "member reconcile finished with an error");
            }
        })
        .await;
}

fn error_policy(mc: Arc<MemberCluster>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(member = %mc.name_any(), %error, "member reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

#[instrument(skip_all, fields(member = %mc.name_any()))]
async fn reconcile(mc: Arc<MemberCluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = std::time::Instant::now();
    if mc.metadata.deletion_timestamp.is_some() {
        return crate::drain::reconcile(&mc, &ctx).await;
    }
    let name = MemberName::new(mc.name_any());
    let verdict = connect(&mc, &name, &ctx).await?;
    let requeue = if verdict.ready.0 { RESYNC } else { RETRY };
    let ready = MemberLabels { member: name.as_str().to_owned() };
    metrics().member_ready.get_or_create(&ready).set(i64::from(verdict.ready.0));
    if !verdict.ready.0 && !verdict.live {
        hold(&ctx, &name, &verdict.ready);
    }
    let conflict =
        ctx.sessions.lock().ok().and_then(|s| s.get(&name).map(|s| s.handle.priority_conflict.borrow().clone()));
    write_conditions(&mc, &ctx, verdict, conflict).await?;
    metrics().observe_sync("membercluster", started.elapsed());
    Ok(Action::requeue(requeue))
}

/// Steps 1–7: spec, Secret, kubeconfig, reachability, finalizer, bootstrap, session. Errors of the training cluster's own
/// API are returned (transient, retried); everything about the member becomes a verdict.
async fn connect(mc: &MemberCluster, name: &MemberName, ctx: &Context) -> Result<Verdict, Error> {
    // 1. The spec must be valid before anything is read or dialed.
    let errors = mc.spec.validate(name.as_str());
    if !errors.is_empty() {
        return Ok(Verdict::not_ready("InvalidSpec", tidepool_config::describe(&errors)));
    }

    // 2. The Secret with the kubeconfig.
    let r = &mc.spec.kubeconfig_secret_ref;
    let ns = r.namespace.as_deref().unwrap_or(&ctx.config.namespace);
    let secret = match Api::<Secret>::namespaced(ctx.training.clone(), ns).get_opt(&r.name).await {
        Ok(Some(s)) => s,
        Ok(None) => {
            let msg = format!("Secret {ns}/{} not found", r.name);
            return Ok(Verdict {
                credentials: Some((false, "SecretNotFound", msg.clone())),
                reachable: None,
                ready: (false, "SecretNotFound", msg),
                live: false,
            });
        }
        Err(source) => {
            return Err(Error::Training { what: "read kubeconfig Secret", source: Box::new(source) });
        }
    };
    let key = mc.spec.secret_key();
    let Some(bytes) = secret.data.as_ref().and_then(|d| d.get(key)) else {
        let msg = format!("Secret {ns}/{} has no key {key:?}", r.name);
        return Ok(Verdict {
            credentials: Some((false, "KubeconfigMissing", msg.clone())),
            reachable: None,
            ready: (false, "KubeconfigMissing", msg),
            live: false,
        });
    };

    // 3. Unchanged credentials and spec with a live session: nothing to do.
    let fingerprint = fingerprint(&bytes.0, mc);
    if let Some(handle) = current(ctx, name, &fingerprint) {
        return Ok(live_verdict(&handle, ctx.config.member_loss_timeout_seconds));
    }

    // 4. Vet the kubeconfig and dial the member.
    let config = match kubeconfig::client_config(&bytes.0).await {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("Secret {ns}/{} key {key:?}: {e}", r.name);
            return Ok(Verdict {
                credentials: Some((false, e.reason(), msg.clone())),
                reachable: None,
                ready: (false, e.reason(), msg),
                live: false,
            });
        }
    };
    let server = config.cluster_url.to_string();
    let stats = Arc::new(crate::MemberStats::default());
    let limits = mc.spec.rate_limits.clone().unwrap_or_default();
    let client = match crate::throttle::client(config, name.as_str(), &limits, stats.clone()) {
        Ok(c) => c,
        Err(e) => {
            let msg = format!("cannot build a client: {e}");
            return Ok(Verdict {
                credentials: Some((false, "KubeconfigInvalid", msg.clone())),
                reachable: None,
                ready: (false, "KubeconfigInvalid", msg),
                live: false,
            });
        }
    };
    let credentials_ok = Some((true, "Valid", "kubeconfig accepted".to_owned()));
    match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(version)) => info!(%server, version = %version.git_version, "member reachable"),
        Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => {
            let msg = format!("{server} refused the credentials: {}", status.message);
            return Ok(Verdict {
                credentials: Some((false, "Unauthorized", msg.clone())),
                reachable: Some((true, "Reachable", format!("{server} answered"))),
                ready: (false, "Unauthorized", msg),
                live: false,
            });
        }
        Ok(Err(e)) => {
            let msg = format!("{server}: {e}");
            return Ok(Verdict {
                credentials: credentials_ok,
                reachable: Some((false, "Unreachable", msg.clone())),
                ready: (false, "Unreachable", msg),
                live: false,
            });
        }
        Err(_) => {
            let msg = format!("{server}: no answer within {}s", PROBE_TIMEOUT.as_secs());
            return Ok(Verdict {
                credentials: credentials_ok,
                reachable: Some((false, "Unreachable", msg.clone())),
                ready: (false, "Unreachable", msg),
                live: false,
            });
        }
    }

    // 5. Before the first write to the member: from now on it is drained when deleted. A
    // member never reached has nothing of ours to undo, so its deletion is not held.
    crate::drain::ensure_finalizer(mc, ctx).await?;

    // 6. Member-side objects offload pods rely on.
    if let Err(e) = crate::member::bootstrap(&client).await {
        let msg = format!("{server}: cannot create offload PriorityClasses: {e}");
        return Ok(Verdict {
            credentials: credentials_ok,
            reachable: Some((true, "Reachable", format!("{server} answered"))),
            ready: (false, "BootstrapFailed", msg),
            live: false,
        });
    }

    // 7. Start (or replace) the session and publish it.
    let prefix = mc.spec.effective_namespace_prefix(&ctx.config.namespace_prefix);
    let policy = crate::capacity::CapacityPolicy::from_spec(&mc.spec.capacity);
    let loss_timeout = Duration::from_secs(ctx.config.member_loss_timeout_seconds);
    let options = SessionOptions {
        namespace_prefix: prefix,
        copy_labels: mc.spec.copy_labels.clone(),
        copy_annotations: mc.spec.copy_annotations.clone(),
        max_termination_grace: mc.spec.max_termination_grace_seconds,
        paused: mc.spec.paused,
        loss_timeout,
        stats,
    };
    let session = Session::start(name.clone(), client, &mc.spec.effective_pools(), fingerprint, policy, options);
    if !session.wait_synced(Duration::from_secs(30)).await {
        warn!("member watches not synced after 30 s; offering its pools anyway");
    }
    let handle = session.handle.clone();
    tokio::spawn(publish_capacity(ctx.training.clone(), name.clone(), handle.clone()));
    tokio::spawn(follow_health(handle.clone(), ctx.trigger.clone(), ObjectRef::from_obj(mc)));
    if let Ok(mut sessions) = ctx.sessions.lock() {
        sessions.insert(name.clone(), session);
    }
    publish(ctx);
    Ok(ready_verdict(&handle))
}

fn ready_verdict(handle: &MemberHandle) -> Verdict {
    Verdict {
        credentials: Some((true, "Valid", "kubeconfig accepted".to_owned())),
        reachable: Some((true, "Reachable", "member API server answers".to_owned())),
        ready: (true, "Connected", format!("{} pool(s) offered as virtual nodes", handle.pools.len())),
        live: true,
    }
}

/// The verdict of a running session: what its prober last found.
fn live_verdict(handle: &MemberHandle, loss_timeout_seconds: u64) -> Verdict {
    let health = handle.health.borrow().clone();
    let valid = Some((true, "Valid", "kubeconfig accepted".to_owned()));
    if let Some(why) = health.unreachable {
        let (reason, message) = if health.lost {
            let msg = format!(
                "member API server unreachable for more than {loss_timeout_seconds}s ({why}); \
                 training pods on its virtual nodes failed with reason {}",
                keys::REASON_MEMBER_LOST
            );
            (keys::REASON_MEMBER_LOST, msg)
        } else {
            let msg = format!("member API server unreachable ({why}); its virtual nodes take no new pods");
            ("Unreachable", msg)
        };
        return Verdict {
            credentials: valid,
            reachable: Some((false, "Unreachable", why)),
            ready: (false, reason, message),
            live: true,
        };
    }
    if let Some(why) = health.refused {
        return Verdict {
            credentials: Some((false, "Unauthorized", why.clone())),
            reachable: Some((true, "Reachable", "member API server answers".to_owned())),
            ready: (false, "Unauthorized", why),
            live: true,
        };
    }
    ready_verdict(handle)
}

/// The running session whose credentials and spec are `fingerprint`, if any. Finding it
/// means the Secret and spec are usable again, so a hold put on the session is lifted.
fn current(ctx: &Context, name: &MemberName, fingerprint: &str) -> Option<Arc<MemberHandle>> {
    let sessions = ctx.sessions.lock().ok()?;
    let session = sessions.get(name).filter(|s| s.fingerprint == fingerprint)?;
    session.health.send_if_modified(|h| h.unusable.take().is_some());
    Some(session.handle.clone())
}

/// A member whose Secret or spec no longer yields a working connection keeps its running
/// session (and so its virtual nodes and offload pods), marked unusable: its nodes turn
/// NotReady and tainted and nothing new is placed, instead of a node deleted and re-created
/// on every flap of a Secret. Only a deleted or deselected `MemberCluster` ends a session
/// (see [`sweep`]).
pub(crate) fn hold(ctx: &Context, name: &MemberName, ready: &(bool, &'static str, String)) {
    let Ok(sessions) = ctx.sessions.lock() else {
        return;
    };
    if let Some(session) = sessions.get(name) {
        let unusable = Some((ready.1.to_owned(), ready.2.clone()));
        if session.health.send_if_modified(|h| {
            let changed = h.unusable != unusable;
            h.unusable = unusable.clone();
            changed
        }) {
            warn!(reason = ready.1, "member session kept, but unusable until its Secret or spec is fixed");
        }
    }
}

/// Reconciles the member whenever its session's health or priority conflict changes, so its
/// status follows an outage within a probe interval rather than at the next resync.
async fn follow_health(
    handle: Arc<MemberHandle>,
    trigger: mpsc::Sender<ObjectRef<MemberCluster>>,
    member: ObjectRef<MemberCluster>,
) {
    let mut health = handle.health.clone();
    let mut conflict = handle.priority_conflict.clone();
    loop {
        tokio::select! {
            () = handle.cancelled.cancelled() => return,
            res = health.changed() => if res.is_err() { return },
            res = conflict.changed() => if res.is_err() { return },
        }
        if trigger.send(member.clone()).await.is_err() {
            return;
        }
    }
}

fn fingerprint(kubeconfig: &[u8], mc: &MemberCluster) -> String {
    let mut h = Sha256::new();
    h.update(kubeconfig);
    h.update(serde_json::to_vec(&mc.spec).unwrap_or_default());
    format!("{:x}", h.finalize())
}

pub(crate) fn stop(ctx: &Context, name: &MemberName) {
    let removed = ctx.sessions.lock().ok().and_then(|mut s| s.remove(name));
    if removed.is_some() {
        info!(member = %name, "member session stopped");
        publish(ctx);
    }
}

fn publish(ctx: &Context) {
    let Ok(sessions) = ctx.sessions.lock() else {
        return;
    };
    let members: Members = sessions.iter().map(|(k, s)| (k.clone(), s.handle.clone())).collect();
    ctx.members.send_replace(members);
}

/// Stops sessions whose `MemberCluster` is gone (deleted, or no longer selected); a
/// deselected one loses the drain finalizer, undrained (see [`crate::drain`]).
async fn sweep(store: Store<MemberCluster>, ctx: Arc<Context>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let live: std::collections::BTreeSet<String> = store.state().iter().map(|m| m.name_any()).collect();
        let gone: Vec<MemberName> = match ctx.sessions.lock() {
            Ok(s) => s.keys().filter(|k| !live.contains(k.as_str())).cloned().collect(),
            Err(_) => continue,
        };
        for name in gone {
            metrics().forget_member(name.as_str());
            stop(&ctx, &name);
            crate::drain::release(&ctx, &name).await;
        }
    }
}

/// Writes the conditions of `v`, and `OnlinePriorityConflict` when a session runs
/// (`conflict` is `None` without one, `Some(None)` when its online pods are all above the
/// offload priorities).
async fn write_conditions(
    mc: &MemberCluster,
    ctx: &Context,
    v: Verdict,
    conflict: Option<Option<PriorityConflict>>,
) -> Result<(), Error> {
    if !v.ready.0 {
        warn!(reason = v.ready.1, message = %crate::kubeconfig::scrub_urls(&v.ready.2), "member not ready");
    }
    let old = mc.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let generation = mc.metadata.generation;
    let mut conditions = Vec::new();
    for (type_, value) in [
        (keys::CONDITION_READY, Some(v.ready)),
        (keys::CONDITION_CREDENTIALS_VALID, v.credentials),
        (keys::CONDITION_REACHABLE, v.reachable),
    ] {
        if let Some((ok, reason, message)) = value {
            conditions.push(condition(old, type_, ok, reason, message, generation));
        }
    }
    if let Some(conflict) = conflict {
        let (found, reason, message) = match &conflict {
            Some(c) => (true, "OnlinePodsAtOffloadPriority", c.message()),
            None => (false, "NoConflict", "online pods run above the offload priorities".to_owned()),
        };
        let type_ = keys::CONDITION_ONLINE_PRIORITY_CONFLICT;
        let next = condition(old, type_, found, reason, message, generation);
        announce_conflict(mc, ctx, old.iter().find(|c| c.type_ == type_), &next).await;
        conditions.push(next);
    }
    if old == conditions.as_slice() {
        return Ok(());
    }
    let status = json!({ "status": { "conditions": conditions, "observedGeneration": generation } });
    Api::<MemberCluster>::all(ctx.training.clone())
        .patch_status(&mc.name_any(), &PatchParams::default(), &Patch::Merge(status))
        .await
        .map_err(|source| Error::Training { what: "write MemberCluster status", source: Box::new(source) })?;
    Ok(())
}

/// An Event on the `MemberCluster` when a priority conflict appears, changes or clears.
async fn announce_conflict(mc: &MemberCluster, ctx: &Context, old: Option<&Condition>, next: &Condition) {
    let was = old.is_some_and(|c| c.status == "True");
    let event = match (was, next.status == "True") {
        (_, true) if old.is_some_and(|c| c.message == next.message) => return,
        (_, true) => {
            warn!(message = %next.message, "online pods at or below the offload priorities");
            Event {
                type_: EventType::Warning,
                reason: keys::CONDITION_ONLINE_PRIORITY_CONFLICT.to_owned(),
                note: Some(next.message.clone()),
                action: "CheckPriorities".to_owned(),
                secondary: None,
            }
        }
        (true, false) => Event {
            type_: EventType::Normal,
            reason: "OnlinePriorityConflictResolved".to_owned(),
            note: Some(next.message.clone()),
            action: "CheckPriorities".to_owned(),
            secondary: None,
        },
        (false, false) => return,
    };
    if let Err(e) = ctx.recorder.publish(&event, &mc.object_ref(&())).await {
        warn!(error = %e, "cannot publish event");
    }
}

/// A condition that keeps its transition time while its status does not change.
pub(crate) fn condition(
    old: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = old
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(jiff::Timestamp::now()));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        // Errors of the member's client can quote its server or proxy URL.
        message: crate::kubeconfig::scrub_urls(&message),
        last_transition_time: since,
        observed_generation: generation,
    }
}

/// Mirrors the pools' capacity into `MemberCluster.status` while the session lives.
async fn publish_capacity(training: Client, name: MemberName, handle: Arc<MemberHandle>) {
    let api = Api::<MemberCluster>::all(training);
    let mut receivers: Vec<_> = handle.pools.iter().map(|p| p.capacity.clone()).collect();
    loop {
        let pools: Vec<(String, String, PoolCapacity)> = handle
            .pools
            .iter()
            .zip(receivers.iter_mut())
            .map(|(p, rx)| (p.name.to_string(), p.node.to_string(), rx.borrow_and_update().clone()))
            .collect();
        let status = capacity_status(&pools);
        let patch = json!({ "status": {
            "pools": status.pools, "cpuSurplus": status.cpu_surplus, "gpuSurplus": status.gpu_surplus,
            "lastSyncTime": Time(jiff::Timestamp::now()),
        }});
        if let Err(e) = api.patch_status(name.as_str(), &PatchParams::default(), &Patch::Merge(patch)).await {
            warn!(member = %name, error = %e, "cannot write pool capacity to MemberCluster status");
        }
        // Coalesce bursts: at most one status write per second per member.
        let changed = futures::future::select_all(receivers.iter_mut().map(|r| Box::pin(r.changed())));
        tokio::select! {
            () = handle.cancelled.cancelled() => return,
            (res, _, _) = changed => if res.is_err() { return },
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn capacity_status(pools: &[(String, String, PoolCapacity)]) -> MemberClusterStatus {
    let mut total = tidepool_config::Resources::new();
    let pools = pools
        .iter()
        .map(|(name, node, c)| {
            total.add(&c.capacity);
            tidepool_config::crd::PoolStatus {
                name: name.clone(),
                virtual_node: node.clone(),
                nodes: i32::try_from(c.nodes).unwrap_or(i32::MAX),
                capacity: c.capacity.to_quantities(),
                used: c.used.nonzero().to_quantities(),
                deficit: c.deficit().nonzero().to_quantities(),
                held_back: c.held_back.nonzero().to_quantities(),
            }
        })
        .collect();
    MemberClusterStatus {
        pools,
        cpu_surplus: Some(tidepool_config::resources::format_milli(total.get("cpu"))),
        gpu_surplus: Some(tidepool_config::resources::format_milli(total.get("nvidia.com/gpu"))),
        ..Default::default()
    }
}
