//! What the `MemberCluster` controller and the drain share: the [`Context`] with the running
//! sessions, the session bookkeeping both act on ([`hold`], [`stop`]), and the condition
//! builder. A module of its own so that neither of the two imports the other's internals.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::ListParams;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client};
use tidepool_api::sync::Locked;
use tidepool_api::{BridgeConfig, MemberCluster, MemberName};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::member::Session;
use crate::pod_network::PodNetwork;

/// How long the training cluster's pod network, once read, is taken as current.
const TRAINING_NETWORK_TTL: std::time::Duration = std::time::Duration::from_secs(300);
use crate::{Error, Members, Ownership};

pub(crate) struct Context {
    pub training: Client,
    /// Events on `MemberCluster` objects.
    pub recorder: Recorder,
    pub config: Arc<BridgeConfig>,
    pub sessions: Mutex<BTreeMap<MemberName, Session>>,
    pub members: watch::Sender<Members>,
    /// Reconciles a member now: its session's health changed.
    pub trigger: mpsc::Sender<ObjectRef<MemberCluster>>,
    pub ownership: Ownership,
    /// The training cluster's pod network and when it was read ([`Context::training_pod_network`]).
    pub training_network: tokio::sync::Mutex<Option<(std::time::Instant, PodNetwork)>>,
}

impl Context {
    /// The running sessions. A poisoned lock (a panic while it was held) is an error: the
    /// map may be half-updated, and carrying on would hide that.
    pub fn sessions(&self) -> Result<MutexGuard<'_, BTreeMap<MemberName, Session>>, Error> {
        Ok(self.sessions.locked("member sessions")?)
    }

    /// The pod CIDRs of the training cluster's nodes, read at most every
    /// [`TRAINING_NETWORK_TTL`] (nodes get their CIDRs when they join, so a few minutes late is
    /// soon enough for a warning). A failed read keeps the last one.
    pub async fn training_pod_network(&self) -> PodNetwork {
        let mut cached = self.training_network.lock().await;
        if let Some((read, network)) = cached.as_ref()
            && read.elapsed() < TRAINING_NETWORK_TTL
        {
            return network.clone();
        }
        let nodes = Api::<Node>::all(self.training.clone());
        let mut cidrs = Vec::new();
        let mut params = ListParams::default().limit(500);
        loop {
            let page = match nodes.list(&params).await {
                Ok(page) => page,
                Err(e) => {
                    warn!(error = %e, "cannot read the training cluster's pod CIDRs");
                    return cached.as_ref().map(|(_, n)| n.clone()).unwrap_or_default();
                }
            };
            cidrs.extend(page.items.iter().flat_map(crate::pod_network::node_cidrs));
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => break,
            }
        }
        let network = PodNetwork::new(cidrs);
        *cached = Some((std::time::Instant::now(), network.clone()));
        network
    }

    /// Whether this replica bridges member `name` now (always, without sharding).
    pub fn owns(&self, name: &MemberName) -> bool {
        self.ownership.owned.as_ref().is_none_or(|owned| owned.contains(name))
    }
}

/// The value of one status condition: whether it holds, its reason and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cond {
    pub ok: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Cond {
    pub fn new(ok: bool, reason: &'static str, message: impl Into<String>) -> Self {
        Self { ok, reason, message: message.into() }
    }
}

/// A member whose Secret or spec no longer yields a working connection keeps its running
/// session (and so its virtual nodes and offload pods), marked unusable: its nodes turn
/// NotReady and tainted and nothing new is placed, instead of a node deleted and re-created
/// on every flap of a Secret. Only a deleted or deselected `MemberCluster` ends a session
/// (see `controller::sweep`).
pub(crate) fn hold(ctx: &Context, name: &MemberName, ready: &Cond) -> Result<(), Error> {
    let sessions = ctx.sessions()?;
    if let Some(session) = sessions.get(name) {
        let unusable = Some((ready.reason.to_owned(), ready.message.clone()));
        if session.health.send_if_modified(|h| {
            let changed = h.unusable != unusable;
            h.unusable = unusable.clone();
            changed
        }) {
            warn!(reason = ready.reason, "member session kept, but unusable until its Secret or spec is fixed");
        }
    }
    Ok(())
}

/// Ends the member's session (its watches stop) and publishes the members without it.
pub(crate) fn stop(ctx: &Context, name: &MemberName) -> Result<(), Error> {
    let removed = ctx.sessions()?.remove(name);
    if removed.is_some() {
        info!(member = %name, "member session stopped");
        publish(ctx)?;
    }
    Ok(())
}

/// Ends the session of a member another replica owns now: its client is fenced first (no
/// call of ours reaches the member any more), and its virtual nodes are left to the new owner.
pub(crate) fn hand_over(ctx: &Context, name: &MemberName) -> Result<(), Error> {
    let removed = ctx.sessions()?.remove(name);
    if let Some(session) = removed {
        session.fence.cancel();
        session.handle.handed_over.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(session);
        info!(member = %name, "member handed over: this replica no longer owns it");
        publish(ctx)?;
    }
    Ok(())
}

/// Tells the consumers the connected members as they are now.
pub(crate) fn publish(ctx: &Context) -> Result<(), Error> {
    let members: Members = ctx.sessions()?.iter().map(|(k, s)| (k.clone(), s.handle.clone())).collect();
    ctx.members.send_replace(members);
    Ok(())
}

/// A condition that keeps its transition time while its status does not change.
pub(crate) fn condition(old: &[Condition], type_: &str, value: Cond, generation: Option<i64>) -> Condition {
    let status = if value.ok { "True" } else { "False" };
    let since = old
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(jiff::Timestamp::now()));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: value.reason.to_owned(),
        // Errors of the member's client can quote its server or proxy URL.
        message: crate::kubeconfig::scrub_urls(&value.message),
        last_transition_time: since,
        observed_generation: generation,
    }
}
