//! The `MemberCluster` controller: turns each object into a connected [`Session`] or into a
//! status condition that says why not.
//!
//! One bad member never affects the others: every failure ends in that member's status and
//! a retry, never in an error that stops the controller. [`connect`] says why a member is
//! not ready with a typed [`NotReady`]; [`verdict`] (pure) maps what it found to the
//! member's conditions.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};
use tidepool_api::crd::MemberClusterStatus;
use tidepool_api::metrics::{MemberLabels, metrics};
use tidepool_api::names::OffloadNamespaces;
use tidepool_api::{MemberCluster, MemberName, keys};
use tokio::sync::mpsc;
use tracing::{error, info, instrument, warn};

use crate::capacity::PoolCapacity;
use crate::capacity::priority::PriorityConflict;
use crate::context::{Cond, Context, condition, hand_over, hold, publish, stop};
use crate::health::Health;
use crate::kubeconfig::{self, KubeconfigError};
use crate::member::{MemberHandle, Session, SessionOptions};
use crate::pod_network::{PodNetwork, overlap_message};
use crate::{Error, MemberStats};

/// How long a member's API server gets to answer the first request.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a healthy member is re-checked (a rotated Secret takes effect within this).
const RESYNC: Duration = Duration::from_secs(20);
/// How soon a member that is not ready is tried again.
const RETRY: Duration = Duration::from_secs(10);
/// How long a new session's watches get to list everything before its pools are offered.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a member cannot be connected: one variant per `Ready` reason. Its message is the
/// condition's message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotReady {
    #[error("{0}")]
    InvalidSpec(String),
    #[error("Secret {secret} not found")]
    SecretNotFound { secret: String },
    #[error("Secret {secret} has no key {key:?}")]
    KubeconfigMissing { secret: String, key: String },
    #[error("Secret {secret} key {key:?}: {source}")]
    Kubeconfig {
        secret: String,
        key: String,
        #[source]
        source: KubeconfigError,
    },
    #[error("cannot build a client: {0}")]
    Client(String),
    #[error("{server} refused the credentials: {message}")]
    Unauthorized { server: String, message: String },
    #[error("{server}: {error}")]
    Unreachable { server: String, error: String },
    #[error("{server}: no answer within {}s", PROBE_TIMEOUT.as_secs())]
    NoAnswer { server: String },
    #[error("{server}: cannot create offload PriorityClasses: {error}")]
    Bootstrap { server: String, error: String },
    /// `spec.gangScheduler` is set but the member does not serve its PodGroups.
    #[error("{server}: spec.gangScheduler is {scheduler} but the member does not serve {api} (is its CRD installed?)")]
    GangSchedulerMissing { server: String, scheduler: &'static str, api: String },
}

impl NotReady {
    /// The `Ready` condition's reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidSpec(_) => keys::REASON_INVALID_SPEC,
            Self::SecretNotFound { .. } => keys::REASON_SECRET_NOT_FOUND,
            Self::KubeconfigMissing { .. } => keys::REASON_KUBECONFIG_MISSING,
            Self::Kubeconfig { source, .. } => source.reason(),
            Self::Client(_) => keys::REASON_KUBECONFIG_INVALID,
            Self::Unauthorized { .. } => keys::REASON_UNAUTHORIZED,
            Self::Unreachable { .. } | Self::NoAnswer { .. } => keys::REASON_UNREACHABLE,
            Self::Bootstrap { .. } => keys::REASON_BOOTSTRAP_FAILED,
            Self::GangSchedulerMissing { .. } => keys::REASON_GANG_SCHEDULER_MISSING,
        }
    }
}

/// A failed [`connect`]: the training cluster's own API failed (transient, retried by the
/// controller), or the member is not ready (written to its status).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error(transparent)]
    Training(#[from] Error),
    #[error(transparent)]
    NotReady(#[from] NotReady),
}

/// What a connection attempt found, as plain data for [`verdict`].
#[derive(Debug)]
pub(crate) enum Outcome {
    /// A session was started now with this many pools.
    Started {
        pools: usize,
    },
    /// The running session was kept (credentials and spec unchanged): what its prober found.
    Running {
        pools: usize,
        health: Health,
    },
    NotReady(NotReady),
}

/// Outcome of checking one member, written to its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    credentials: Option<Cond>,
    reachable: Option<Cond>,
    ready: Cond,
    /// Describes the health of the running session (rather than a failed attempt to start
    /// one), so it must not be held against that session.
    live: bool,
}

impl Verdict {
    /// When the member is checked again.
    fn requeue(&self) -> Duration {
        if self.ready.ok { RESYNC } else { RETRY }
    }

    /// A failed attempt to connect marks the running session, if any, unusable ([`hold`]);
    /// the running session's own health does not.
    fn holds_session(&self) -> bool {
        !self.ready.ok && !self.live
    }
}

/// The member's conditions, given what [`connect`] found. Pure.
pub(crate) fn verdict(outcome: &Outcome, loss_timeout_seconds: u64) -> Verdict {
    match outcome {
        Outcome::Started { pools } => ready_verdict(*pools),
        Outcome::Running { pools, health } => live_verdict(health, *pools, loss_timeout_seconds),
        Outcome::NotReady(why) => not_ready_verdict(why),
    }
}

/// How far the attempt got decides which conditions it can speak for: nothing is known of
/// the member's reachability before it is dialed, nor of the credentials before the Secret
/// is read.
fn not_ready_verdict(why: &NotReady) -> Verdict {
    let ready = Cond::new(false, why.reason(), why.to_string());
    let valid = || Some(Cond::new(true, keys::REASON_VALID, "kubeconfig accepted"));
    let answered = |server: &str| Some(Cond::new(true, keys::REASON_REACHABLE, format!("{server} answered")));
    let (credentials, reachable) = match why {
        NotReady::InvalidSpec(_) => (None, None),
        NotReady::SecretNotFound { .. }
        | NotReady::KubeconfigMissing { .. }
        | NotReady::Kubeconfig { .. }
        | NotReady::Client(_) => (Some(ready.clone()), None),
        NotReady::Unauthorized { server, .. } => (Some(ready.clone()), answered(server)),
        NotReady::Unreachable { .. } | NotReady::NoAnswer { .. } => (valid(), Some(ready.clone())),
        NotReady::Bootstrap { server, .. } | NotReady::GangSchedulerMissing { server, .. } => {
            (valid(), answered(server))
        }
    };
    Verdict { credentials, reachable, ready, live: false }
}

fn ready_verdict(pools: usize) -> Verdict {
    Verdict {
        credentials: Some(Cond::new(true, keys::REASON_VALID, "kubeconfig accepted")),
        reachable: Some(Cond::new(true, keys::REASON_REACHABLE, "member API server answers")),
        ready: Cond::new(true, keys::REASON_CONNECTED, format!("{pools} pool(s) offered as virtual nodes")),
        live: true,
    }
}

/// The verdict of a running session: what its prober last found.
fn live_verdict(health: &Health, pools: usize, loss_timeout_seconds: u64) -> Verdict {
    let valid = Some(Cond::new(true, keys::REASON_VALID, "kubeconfig accepted"));
    if let Some(why) = &health.unreachable {
        let ready = if health.lost {
            let msg = format!(
                "member API server unreachable for more than {loss_timeout_seconds}s ({why}); \
                 training pods on its virtual nodes failed with reason {}",
                keys::REASON_MEMBER_LOST
            );
            Cond::new(false, keys::REASON_MEMBER_LOST, msg)
        } else {
            let msg = format!("member API server unreachable ({why}); its virtual nodes take no new pods");
            Cond::new(false, keys::REASON_UNREACHABLE, msg)
        };
        let reachable = Some(Cond::new(false, keys::REASON_UNREACHABLE, why.clone()));
        return Verdict { credentials: valid, reachable, ready, live: true };
    }
    if let Some(why) = &health.refused {
        return Verdict {
            credentials: Some(Cond::new(false, keys::REASON_UNAUTHORIZED, why.clone())),
            reachable: Some(Cond::new(true, keys::REASON_REACHABLE, "member API server answers")),
            ready: Cond::new(false, keys::REASON_UNAUTHORIZED, why.clone()),
            live: true,
        };
    }
    if let Some(why) = &health.stopped {
        let mut v = ready_verdict(pools);
        v.ready = Cond::new(false, keys::REASON_MEMBER_TASK_STOPPED, why.clone());
        return v;
    }
    ready_verdict(pools)
}

/// What a running session found out about its member, for its conditions.
struct Findings {
    conflict: Option<PriorityConflict>,
    /// Why its pod network overlaps another's ([`crate::pod_network::overlap_message`]).
    overlap: Option<String>,
}

/// The findings of member `name`'s session, if it runs here. Its pod network is compared with
/// the training cluster's and with the members this replica bridges.
async fn findings(ctx: &Context, name: &MemberName) -> Result<Option<Findings>, Error> {
    let (conflict, ours, others) = {
        let sessions = ctx.sessions()?;
        let Some(session) = sessions.get(name) else { return Ok(None) };
        let others: Vec<(String, PodNetwork)> = sessions
            .iter()
            .filter(|(other, _)| *other != name)
            .map(|(other, s)| (format!("member {other}"), s.handle.effective_pod_network()))
            .collect();
        (session.handle.priority_conflict.borrow().clone(), session.handle.effective_pod_network(), others)
    };
    let training = if ours.is_empty() { PodNetwork::default() } else { ctx.training_pod_network().await };
    let named = std::iter::once(("the training cluster", &training)).chain(others.iter().map(|(w, n)| (w.as_str(), n)));
    Ok(Some(Findings { conflict, overlap: overlap_message(&ours, named) }))
}

/// The `PodNetworkOverlap` condition of a running session. Pure.
fn overlap_condition(overlap: Option<&String>) -> Cond {
    match overlap {
        Some(why) => Cond::new(true, keys::REASON_POD_NETWORK_OVERLAPS, why.clone()),
        None => Cond::new(
            false,
            keys::REASON_POD_NETWORKS_DISJOINT,
            "the member's pod CIDRs overlap neither the training cluster's nor another member's",
        ),
    }
}

/// The `OnlinePriorityConflict` condition of a running session. Pure.
fn conflict_condition(conflict: Option<&PriorityConflict>) -> Cond {
    match conflict {
        Some(c) => Cond::new(true, keys::REASON_ONLINE_PODS_AT_OFFLOAD_PRIORITY, c.message()),
        None => Cond::new(false, keys::REASON_NO_CONFLICT, "online pods run above the offload priorities"),
    }
}

/// The Event to publish when the `OnlinePriorityConflict` condition goes from `old` to
/// `next`: a warning when a conflict appears or its message changes, a normal Event when it
/// clears, nothing otherwise. Pure.
fn conflict_event(old: Option<&Condition>, next: &Condition) -> Option<Event> {
    let was = old.is_some_and(|c| c.status == "True");
    let (type_, reason) = match (was, next.status == "True") {
        (_, true) if old.is_some_and(|c| c.message == next.message) => return None,
        (_, true) => (EventType::Warning, keys::REASON_ONLINE_PRIORITY_CONFLICT),
        (true, false) => (EventType::Normal, keys::REASON_ONLINE_PRIORITY_CONFLICT_RESOLVED),
        (false, false) => return None,
    };
    Some(Event {
        type_,
        reason: reason.to_owned(),
        note: Some(next.message.clone()),
        action: "CheckPriorities".to_owned(),
        secondary: None,
    })
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
    if let Some(owned) = ctx.ownership.owned.as_ref().map(crate::fence::Owned::members) {
        tokio::spawn(follow_ownership(owned, ctx.clone()));
    }
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
    let name = MemberName::new(mc.name_any());
    // Another replica's member: nothing of it is ours to write (see `follow_ownership`).
    if !ctx.owns(&name) {
        hand_over(&ctx, &name)?;
        return Ok(Action::await_change());
    }
    if mc.metadata.deletion_timestamp.is_some() {
        return crate::drain::reconcile(&mc, &ctx).await;
    }
    let outcome = match connect(&mc, &name, &ctx).await {
        Ok(outcome) => outcome,
        Err(ConnectError::NotReady(why)) => Outcome::NotReady(why),
        Err(ConnectError::Training(e)) => return Err(e),
    };
    let verdict = verdict(&outcome, ctx.config.member_loss_timeout_seconds);
    let ready = MemberLabels { member: name.as_str().to_owned() };
    metrics().member_ready.get_or_create(&ready).set(i64::from(verdict.ready.ok));
    if verdict.holds_session() {
        hold(&ctx, &name, &verdict.ready)?;
    }
    if !ctx.owns(&name) {
        return Ok(Action::await_change());
    }
    let findings = findings(&ctx, &name).await?;
    let requeue = verdict.requeue();
    write_conditions(&mc, &ctx, verdict, findings).await?;
    metrics().observe_sync("membercluster", started.elapsed());
    Ok(Action::requeue(requeue))
}

/// Steps 1–7: spec, Secret, kubeconfig, reachability, finalizer, bootstrap, session. Errors
/// of the training cluster's own API are [`ConnectError::Training`]; everything about the
/// member is [`NotReady`].
async fn connect(mc: &MemberCluster, name: &MemberName, ctx: &Context) -> Result<Outcome, ConnectError> {
    // 1. The spec must be valid before anything is read or dialed.
    let errors = mc.spec.validate(name.as_str());
    if !errors.is_empty() {
        return Err(NotReady::InvalidSpec(tidepool_api::describe(&errors)).into());
    }

    // 2. The Secret with the kubeconfig.
    let kubeconfig = read_kubeconfig(mc, ctx).await?;

    // 3. Unchanged credentials and spec with a live session: nothing to do.
    let fingerprint = fingerprint(&kubeconfig.bytes, mc);
    if let Some(handle) = current(ctx, name, &fingerprint)? {
        let health = handle.health.borrow().clone();
        return Ok(Outcome::Running { pools: handle.pools.len(), health });
    }

    // 4. Vet the kubeconfig and dial the member.
    let dialed = dial(mc, name, &kubeconfig, &ctx.ownership).await?;

    // 5. Before the first write to the member: from now on it is drained when deleted. A
    // member never reached has nothing of ours to undo, so its deletion is not held.
    crate::drain::ensure_finalizer(mc, ctx).await?;

    // 6. Member-side objects offload pods rely on.
    if let Err(e) = crate::member::bootstrap(&dialed.client).await {
        return Err(NotReady::Bootstrap { server: dialed.server, error: e.to_string() }.into());
    }
    check_gang_scheduler(mc, &dialed).await?;
    let namespaces = match offload_namespaces(mc, name, ctx, &dialed.client).await {
        Ok(n) => n,
        Err(e) => return Err(NotReady::Bootstrap { server: dialed.server, error: e.to_string() }.into()),
    };

    // 7. Start (or replace) the session and publish it.
    let handle = start_session(mc, name, ctx, (dialed, namespaces), fingerprint).await?;
    Ok(Outcome::Started { pools: handle.pools.len() })
}

/// Step 6, for a member with `spec.gangScheduler`: its PodGroup API must be served, or
/// nothing is placed there (a gang's copies would have no group to join).
async fn check_gang_scheduler(mc: &MemberCluster, dialed: &Dialed) -> Result<(), NotReady> {
    let Some(scheduler) = mc.spec.gang_scheduler else { return Ok(()) };
    let (group, version, plural) = scheduler.pod_group_api();
    let missing = || NotReady::GangSchedulerMissing {
        server: dialed.server.clone(),
        scheduler: scheduler.as_str(),
        api: format!("{plural}.{group}/{version}"),
    };
    match crate::discovery::serves_pod_groups(&dialed.client, scheduler).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(missing()),
        Err(e) => Err(NotReady::Unreachable { server: dialed.server.clone(), error: format!("discovery: {e}") }),
    }
}

/// The kubeconfig a `MemberCluster` points at.
struct SecretKubeconfig {
    /// `namespace/name` of the Secret.
    secret: String,
    key: String,
    bytes: Vec<u8>,
}

/// Step 2: reads the Secret and the kubeconfig key in it.
async fn read_kubeconfig(mc: &MemberCluster, ctx: &Context) -> Result<SecretKubeconfig, ConnectError> {
    let r = &mc.spec.kubeconfig_secret_ref;
    let ns = r.namespace.as_deref().unwrap_or(&ctx.config.namespace);
    let secret_name = format!("{ns}/{}", r.name);
    let secret = match Api::<Secret>::namespaced(ctx.training.clone(), ns).get_opt(&r.name).await {
        Ok(Some(s)) => s,
        Ok(None) => return Err(NotReady::SecretNotFound { secret: secret_name }.into()),
        Err(source) => {
            return Err(Error::Training { what: "read kubeconfig Secret", source: Box::new(source) }.into());
        }
    };
    let key = mc.spec.secret_key();
    let Some(bytes) = secret.data.and_then(|mut d| d.remove(key)) else {
        return Err(NotReady::KubeconfigMissing { secret: secret_name, key: key.to_owned() }.into());
    };
    Ok(SecretKubeconfig { secret: secret_name, key: key.to_owned(), bytes: bytes.0 })
}

/// A member that answered with the vetted credentials.
struct Dialed {
    client: Client,
    /// Its client's fence, cancelled when the member is handed over.
    fence: tokio_util::sync::CancellationToken,
    /// The API server's URL, for messages.
    server: String,
    stats: Arc<MemberStats>,
}

/// Step 4: vets the kubeconfig, builds the member's client and asks for its version.
async fn dial(
    mc: &MemberCluster,
    name: &MemberName,
    kubeconfig: &SecretKubeconfig,
    ownership: &crate::Ownership,
) -> Result<Dialed, NotReady> {
    let config = kubeconfig::client_config(&kubeconfig.bytes).await.map_err(|source| NotReady::Kubeconfig {
        secret: kubeconfig.secret.clone(),
        key: kubeconfig.key.clone(),
        source,
    })?;
    let server = config.cluster_url.to_string();
    let stats = Arc::new(MemberStats::default());
    let limits = mc.spec.rate_limits.clone().unwrap_or_default();
    let guard = ownership.guard(name);
    let client = crate::throttle::client_with(config, name.as_str(), &limits, stats.clone(), &guard)
        .map_err(|e| NotReady::Client(e.to_string()))?;
    match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(version)) => info!(%server, version = %version.git_version, "member reachable"),
        Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => {
            return Err(NotReady::Unauthorized { server, message: status.message.clone() });
        }
        Ok(Err(e)) => return Err(NotReady::Unreachable { server, error: e.to_string() }),
        Err(_) => return Err(NotReady::NoAnswer { server }),
    }
    Ok(Dialed { client, fence: guard.fence, server, stats })
}

/// The `User-Agent` of this replica's member clients: `tidepool/<version> (<identity>)`, so a
/// member's audit log names the replica behind every call.
pub fn user_agent(identity: &str) -> String {
    let identity = if identity.is_empty() { "tidepool" } else { identity };
    format!("tidepool/{} ({identity})", env!("CARGO_PKG_VERSION"))
}

/// Step 6, last: how this member names its offload namespaces, with the fallbacks its
/// namespaces record (a training namespace whose own name the member had taken keeps its
/// prefixed namespace across restarts). Read before any copy is made: a fallback missed would
/// put a pod's second copy in the other namespace.
async fn offload_namespaces(
    mc: &MemberCluster,
    name: &MemberName,
    ctx: &Context,
    client: &Client,
) -> Result<OffloadNamespaces, kube::Error> {
    let prefix = mc.spec.effective_namespace_prefix(&ctx.config.namespace_prefix);
    let namespaces = OffloadNamespaces::new(prefix, mc.spec.same_name_namespaces());
    if !namespaces.same_name() {
        return Ok(namespaces);
    }
    let selector = format!(
        "{}={},{}={},{}={name}",
        keys::LABEL_MANAGED_BY,
        keys::MANAGED_BY,
        keys::LABEL_ORIGIN_CLUSTER,
        ctx.config.cluster_name,
        keys::LABEL_ORIGIN_MEMBER
    );
    let lp = kube::api::ListParams::default().labels(&selector);
    for ns in Api::<Namespace>::all(client.clone()).list_metadata(&lp).await?.items {
        if let Some(origin) = ns.labels().get(keys::LABEL_ORIGIN_NAMESPACE) {
            namespaces.learn(&ns.name_any(), origin);
        }
    }
    Ok(namespaces)
}

/// Step 7: starts the member's session, waits for its first capacity and publishes it.
async fn start_session(
    mc: &MemberCluster,
    name: &MemberName,
    ctx: &Context,
    (dialed, namespaces): (Dialed, OffloadNamespaces),
    fingerprint: String,
) -> Result<Arc<MemberHandle>, Error> {
    // A member that does not serve them (older than 1.37, or the gate off) has no requests
    // to answer; its actors evict copies the older ways, which tidepool also turns into a
    // disruption of the training pod.
    let eviction_requests = crate::eviction_requests::served(&dialed.client).await.unwrap_or_else(|e| {
        warn!(error = %e, "discovery of eviction requests failed; not answering them this session");
        false
    });
    let options = SessionOptions {
        namespaces: Arc::new(namespaces),
        copy_labels: mc.spec.copy_labels.clone(),
        copy_annotations: mc.spec.copy_annotations.clone(),
        max_termination_grace: mc.spec.max_termination_grace_seconds,
        gang_scheduling: mc.spec.gang_scheduling(),
        confinement: mc.spec.confinement(),
        declared_pod_network: crate::pod_network::PodNetwork::new(
            mc.spec.pod_cidrs.iter().filter_map(|c| c.parse().ok()),
        ),
        paused: mc.spec.paused,
        loss_timeout: Duration::from_secs(ctx.config.member_loss_timeout_seconds),
        stats: dialed.stats,
        fence: dialed.fence,
        eviction_requests,
    };
    let policy = crate::capacity::CapacityPolicy::from_spec(&mc.spec.capacity);
    let pools = mc.spec.effective_pools();
    let session = Session::start(name.clone(), dialed.client, &pools, fingerprint, policy, options);
    if !session.wait_synced(SYNC_TIMEOUT).await {
        warn!("member watches not synced after 30 s; offering its pools anyway");
    }
    let handle = session.handle.clone();
    // Handed over while it connected: it never starts.
    if !ctx.owns(name) {
        session.fence.cancel();
        return Ok(handle);
    }
    handle
        .tasks
        .spawn("MemberCluster capacity status", publish_capacity(ctx.training.clone(), name.clone(), handle.clone()));
    handle.tasks.spawn("status follower", follow_health(handle.clone(), ctx.trigger.clone(), ObjectRef::from_obj(mc)));
    ctx.sessions()?.insert(name.clone(), session);
    publish(ctx)?;
    Ok(handle)
}

/// The running session whose credentials and spec are `fingerprint` and whose tasks all run,
/// if any. Finding it means the Secret and spec are usable again, so a hold put on the
/// session is lifted.
fn current(ctx: &Context, name: &MemberName, fingerprint: &str) -> Result<Option<Arc<MemberHandle>>, Error> {
    let sessions = ctx.sessions()?;
    // A session one of whose tasks stopped is replaced too (see `crate::member_tasks`).
    let live = |s: &&Session| s.fingerprint == fingerprint && s.handle.health.borrow().stopped.is_none();
    let Some(session) = sessions.get(name).filter(live) else {
        return Ok(None);
    };
    session.health.send_if_modified(|h| h.unusable.take().is_some());
    Ok(Some(session.handle.clone()))
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
    let mut network = handle.pod_network.clone();
    loop {
        tokio::select! {
            () = handle.cancelled.cancelled() => return,
            res = health.changed() => if res.is_err() { return },
            res = conflict.changed() => if res.is_err() { return },
            res = network.changed() => if res.is_err() { return },
        }
        if trigger.send(member.clone()).await.is_err() {
            return;
        }
    }
}

/// Follows this replica's share of the members: a member given to another replica is handed
/// over at once (its client fenced, its tasks stopped), a member given to this one is
/// reconciled at once rather than at its next resync.
async fn follow_ownership(
    mut owned: tokio::sync::watch::Receiver<std::collections::BTreeSet<MemberName>>,
    ctx: Arc<Context>,
) {
    loop {
        let now = owned.borrow_and_update().clone();
        let running: Vec<MemberName> = match ctx.sessions() {
            Ok(s) => s.keys().cloned().collect(),
            Err(e) => return error!(error = %e, "cannot follow member ownership"),
        };
        for name in running.iter().filter(|n| !now.contains(*n)) {
            if let Err(e) = hand_over(&ctx, name) {
                error!(member = %name, error = %e, "cannot hand a member over");
            }
        }
        for name in now.iter().filter(|n| !running.contains(*n)) {
            if ctx.trigger.send(ObjectRef::new(name.as_str())).await.is_err() {
                return;
            }
        }
        if owned.changed().await.is_err() {
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

/// Stops sessions whose `MemberCluster` is gone (deleted, or no longer selected); a
/// deselected one loses the drain finalizer, undrained (see [`crate::drain`]).
async fn sweep(store: Store<MemberCluster>, ctx: Arc<Context>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let live: BTreeSet<String> = store.state().iter().map(|m| m.name_any()).collect();
        let gone: Vec<MemberName> = match ctx.sessions() {
            Ok(s) => s.keys().filter(|k| !live.contains(k.as_str())).cloned().collect(),
            Err(e) => {
                error!(error = %e, "cannot sweep member sessions");
                continue;
            }
        };
        for name in gone {
            metrics().forget_member(name.as_str());
            if let Err(e) = stop(&ctx, &name) {
                error!(member = %name, error = %e, "cannot stop the session of a removed member");
            }
            crate::drain::release(&ctx, &name).await;
        }
    }
}

/// Writes the conditions of `v`, and `OnlinePriorityConflict` and `PodNetworkOverlap` when a
/// session runs (`findings` is `None` without one).
async fn write_conditions(
    mc: &MemberCluster,
    ctx: &Context,
    v: Verdict,
    findings: Option<Findings>,
) -> Result<(), Error> {
    if !v.ready.ok {
        warn!(reason = v.ready.reason, message = %kubeconfig::scrub_urls(&v.ready.message), "member not ready");
    }
    let old = mc.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let generation = mc.metadata.generation;
    let mut conditions = Vec::new();
    for (type_, value) in [
        (keys::CONDITION_READY, Some(v.ready)),
        (keys::CONDITION_CREDENTIALS_VALID, v.credentials),
        (keys::CONDITION_REACHABLE, v.reachable),
    ] {
        if let Some(value) = value {
            conditions.push(condition(old, type_, value, generation));
        }
    }
    if let Some(findings) = findings {
        let type_ = keys::CONDITION_ONLINE_PRIORITY_CONFLICT;
        let next = condition(old, type_, conflict_condition(findings.conflict.as_ref()), generation);
        if let Some(event) = conflict_event(old.iter().find(|c| c.type_ == type_), &next) {
            announce(mc, ctx, &event).await;
        }
        conditions.push(next);
        let type_ = keys::CONDITION_POD_NETWORK_OVERLAP;
        conditions.push(condition(old, type_, overlap_condition(findings.overlap.as_ref()), generation));
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

/// Publishes `event` on the `MemberCluster`.
async fn announce(mc: &MemberCluster, ctx: &Context, event: &Event) {
    if event.type_ == EventType::Warning {
        warn!(message = event.note.as_deref().unwrap_or_default(), "online pods at or below the offload priorities");
    }
    if let Err(e) = ctx.recorder.publish(event, &mc.object_ref(&())).await {
        warn!(error = %e, "cannot publish event");
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
    let mut total = tidepool_api::Resources::new();
    let pools = pools
        .iter()
        .map(|(name, node, c)| {
            total.add(&c.capacity);
            tidepool_api::crd::PoolStatus {
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
        cpu_surplus: Some(tidepool_api::resources::format_milli(total.get("cpu"))),
        gpu_surplus: Some(tidepool_api::resources::format_milli(total.get("nvidia.com/gpu"))),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no(reason: &'static str, message: &str) -> Option<Cond> {
        Some(Cond::new(false, reason, message))
    }

    fn yes(reason: &'static str, message: &str) -> Option<Cond> {
        Some(Cond::new(true, reason, message))
    }

    #[test]
    fn a_failed_connection_speaks_only_for_the_conditions_it_got_to() {
        let server = || "https://member:6443/".to_owned();
        let exec = KubeconfigError::ExecPlugin { user: "admin".into() };
        let secret = || "tidepool/member-a".to_owned();
        let valid = yes("Valid", "kubeconfig accepted");
        let cases = [
            (
                "an invalid spec says nothing of credentials or reachability",
                NotReady::InvalidSpec("spec.pools[0].name: empty".into()),
                (None, None, no("InvalidSpec", "spec.pools[0].name: empty")),
            ),
            (
                "a missing Secret makes the credentials invalid",
                NotReady::SecretNotFound { secret: secret() },
                (
                    no("SecretNotFound", "Secret tidepool/member-a not found"),
                    None,
                    no("SecretNotFound", "Secret tidepool/member-a not found"),
                ),
            ),
            (
                "so does a Secret without the key",
                NotReady::KubeconfigMissing { secret: secret(), key: "kubeconfig".into() },
                (
                    no("KubeconfigMissing", "Secret tidepool/member-a has no key \"kubeconfig\""),
                    None,
                    no("KubeconfigMissing", "Secret tidepool/member-a has no key \"kubeconfig\""),
                ),
            ),
            (
                "a refused kubeconfig gives the vetting's reason",
                NotReady::Kubeconfig { secret: secret(), key: "kubeconfig".into(), source: exec },
                (
                    no(
                        "KubeconfigRejected",
                        "Secret tidepool/member-a key \"kubeconfig\": kubeconfig user \"admin\" uses an exec plugin; \
                         only certificate, token or basic credentials are accepted",
                    ),
                    None,
                    no(
                        "KubeconfigRejected",
                        "Secret tidepool/member-a key \"kubeconfig\": kubeconfig user \"admin\" uses an exec plugin; \
                         only certificate, token or basic credentials are accepted",
                    ),
                ),
            ),
            (
                "a kubeconfig no client can be built from is invalid",
                NotReady::Client("bad proxy".into()),
                (
                    no("KubeconfigInvalid", "cannot build a client: bad proxy"),
                    None,
                    no("KubeconfigInvalid", "cannot build a client: bad proxy"),
                ),
            ),
            (
                "refused credentials: the member answered",
                NotReady::Unauthorized { server: server(), message: "Unauthorized".into() },
                (
                    no("Unauthorized", "https://member:6443/ refused the credentials: Unauthorized"),
                    yes("Reachable", "https://member:6443/ answered"),
                    no("Unauthorized", "https://member:6443/ refused the credentials: Unauthorized"),
                ),
            ),
            (
                "an error dialing: the credentials were fine, the member is unreachable",
                NotReady::Unreachable { server: server(), error: "connection refused".into() },
                (
                    valid.clone(),
                    no("Unreachable", "https://member:6443/: connection refused"),
                    no("Unreachable", "https://member:6443/: connection refused"),
                ),
            ),
            (
                "no answer at all is unreachable too",
                NotReady::NoAnswer { server: server() },
                (
                    valid.clone(),
                    no("Unreachable", "https://member:6443/: no answer within 10s"),
                    no("Unreachable", "https://member:6443/: no answer within 10s"),
                ),
            ),
            (
                "PriorityClasses refused: reachable and valid, not ready",
                NotReady::Bootstrap { server: server(), error: "forbidden".into() },
                (
                    valid.clone(),
                    yes("Reachable", "https://member:6443/ answered"),
                    no("BootstrapFailed", "https://member:6443/: cannot create offload PriorityClasses: forbidden"),
                ),
            ),
            (
                "a gang scheduler whose PodGroups the member does not serve: reachable and valid, not ready",
                NotReady::GangSchedulerMissing {
                    server: server(),
                    scheduler: "volcano",
                    api: "podgroups.scheduling.volcano.sh/v1beta1".into(),
                },
                (
                    valid.clone(),
                    yes("Reachable", "https://member:6443/ answered"),
                    no(
                        "GangSchedulerMissing",
                        "https://member:6443/: spec.gangScheduler is volcano but the member does not serve \
                         podgroups.scheduling.volcano.sh/v1beta1 (is its CRD installed?)",
                    ),
                ),
            ),
        ];
        for (name, why, (credentials, reachable, ready)) in cases {
            let v = verdict(&Outcome::NotReady(why), 300);
            assert_eq!((v.credentials, v.reachable, Some(v.ready)), (credentials, reachable, ready), "{name}");
            assert!(!v.live, "{name}: a failed attempt is not the session's health");
        }
    }

    #[test]
    fn a_running_session_reports_what_its_prober_found() {
        let unreachable = || Some("timeout".to_owned());
        let valid = yes("Valid", "kubeconfig accepted");
        let answers = yes("Reachable", "member API server answers");
        let cases = [
            (
                "healthy: connected, with its pools counted",
                Health::default(),
                (valid.clone(), answers.clone(), yes("Connected", "2 pool(s) offered as virtual nodes")),
            ),
            (
                "unreachable: its nodes take no new pods",
                Health { unreachable: unreachable(), ..Default::default() },
                (
                    valid.clone(),
                    no("Unreachable", "timeout"),
                    no("Unreachable", "member API server unreachable (timeout); its virtual nodes take no new pods"),
                ),
            ),
            (
                "unreachable past the loss timeout: lost",
                Health { unreachable: unreachable(), lost: true, ..Default::default() },
                (
                    valid.clone(),
                    no("Unreachable", "timeout"),
                    no(
                        "MemberLost",
                        "member API server unreachable for more than 300s (timeout); training pods on its \
                         virtual nodes failed with reason MemberLost",
                    ),
                ),
            ),
            (
                "credentials refused while running",
                Health { refused: Some("401".into()), ..Default::default() },
                (no("Unauthorized", "401"), answers.clone(), no("Unauthorized", "401")),
            ),
            (
                "a task of the session stopped: not ready until the session is replaced",
                Health { stopped: Some("pod watch ended".into()), ..Default::default() },
                (valid.clone(), answers.clone(), no("MemberTaskStopped", "pod watch ended")),
            ),
            (
                "unreachable wins over refused: nothing answers to refuse",
                Health { unreachable: unreachable(), refused: Some("401".into()), ..Default::default() },
                (
                    valid.clone(),
                    no("Unreachable", "timeout"),
                    no("Unreachable", "member API server unreachable (timeout); its virtual nodes take no new pods"),
                ),
            ),
        ];
        for (name, health, (credentials, reachable, ready)) in cases {
            let v = verdict(&Outcome::Running { pools: 2, health }, 300);
            assert_eq!((v.credentials, v.reachable, Some(v.ready)), (credentials, reachable, ready), "{name}");
            assert!(v.live, "{name}");
        }
        let started = verdict(&Outcome::Started { pools: 1 }, 300);
        assert_eq!(Some(started.ready), yes("Connected", "1 pool(s) offered as virtual nodes"));
    }

    #[test]
    fn only_a_failed_attempt_holds_the_session_and_not_ready_is_retried_sooner() {
        let failed = verdict(&Outcome::NotReady(NotReady::Client("x".into())), 300);
        assert!(failed.holds_session(), "a Secret that no longer works holds the running session");
        assert_eq!(failed.requeue(), RETRY);
        let down = Health { unreachable: Some("timeout".into()), ..Default::default() };
        let outage = verdict(&Outcome::Running { pools: 1, health: down }, 300);
        assert!(!outage.holds_session(), "an outage of the session itself is not held against it");
        assert_eq!(outage.requeue(), RETRY);
        let ready = verdict(&Outcome::Running { pools: 1, health: Health::default() }, 300);
        assert!(!ready.holds_session());
        assert_eq!(ready.requeue(), RESYNC);
    }

    fn conflict(status: &str, message: &str) -> Condition {
        Condition {
            type_: keys::CONDITION_ONLINE_PRIORITY_CONFLICT.to_owned(),
            status: status.to_owned(),
            reason: String::new(),
            message: message.to_owned(),
            last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
            observed_generation: None,
        }
    }

    #[test]
    fn a_priority_conflict_is_announced_when_it_appears_changes_or_clears() {
        let on = |m| conflict("True", m);
        let off = || conflict("False", "online pods run above the offload priorities");
        let warning = Some((EventType::Warning, "OnlinePriorityConflict"));
        let cases = [
            ("a first conflict", None, on("2 pods"), warning),
            ("a conflict where there was none", Some(off()), on("2 pods"), warning),
            ("the same conflict again: quiet", Some(on("2 pods")), on("2 pods"), None),
            ("a conflict that changed", Some(on("2 pods")), on("3 pods"), warning),
            (
                "a conflict that cleared",
                Some(on("2 pods")),
                off(),
                Some((EventType::Normal, "OnlinePriorityConflictResolved")),
            ),
            ("no conflict, as before: quiet", Some(off()), off(), None),
            ("no conflict from the start: quiet", None, off(), None),
        ];
        for (name, old, next, want) in cases {
            let event = conflict_event(old.as_ref(), &next);
            let got = event.as_ref().map(|e| (e.type_, e.reason.as_str()));
            assert_eq!(got, want, "{name}");
            if let Some(e) = event {
                assert_eq!(e.note.as_deref(), Some(next.message.as_str()), "{name}");
            }
        }
    }

    #[test]
    fn the_conflict_condition_names_the_pods_or_says_there_are_none() {
        let found = PriorityConflict { count: 1, examples: vec![("online/web-0".into(), -5000)], ceiling: -1000 };
        let c = conflict_condition(Some(&found));
        assert_eq!((c.ok, c.reason), (true, "OnlinePodsAtOffloadPriority"));
        assert!(c.message.contains("online/web-0 (-5000)"), "{}", c.message);
        assert_eq!(
            conflict_condition(None),
            Cond::new(false, "NoConflict", "online pods run above the offload priorities")
        );
    }
}
