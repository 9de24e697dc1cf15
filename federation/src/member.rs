//! One connected member: the session that lives as long as its credentials and spec stay the
//! same, and the [`MemberHandle`] the rest of tidepool sees of it.
//!
//! A [`Session`] starts the member's health probe, its watches and capacity publisher (the
//! capacity model, [`crate::capacity`]) and its eviction-request watch; dropping it stops
//! them all.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kube::{Api, Client};
use tidepool_api::crd::{PoolMode, PoolSpec, PoolToleration};
use tidepool_api::{MemberName, PoolName, VirtualNodeName};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::error;

use tidepool_api::metrics::metrics;

use crate::capacity::pool::PoolModel;
use crate::capacity::priority::PriorityConflict;
use crate::capacity::publisher::{PoolOut, run_publisher};
use crate::capacity::watches::{Caches, Signals};
use crate::capacity::{CapacityPolicy, PoolCapacity};
use crate::health::Health;
use crate::member_tasks::MemberTasks;
use crate::pod_network::PodNetwork;
use crate::view_cache::Wakeups;

/// A connected member as the rest of tidepool sees it.
pub struct MemberHandle {
    pub name: MemberName,
    /// Client for the member's API server, built from the vetted kubeconfig.
    pub client: Client,
    /// How training namespaces map to this member's offload namespaces.
    pub namespaces: Arc<tidepool_api::names::OffloadNamespaces>,
    /// `spec.copyLabels` and `spec.copyAnnotations`: what of a training pod's metadata its
    /// copy carries besides tidepool's own.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`: per-band bounds on the copies' grace.
    pub max_termination_grace: tidepool_api::crd::TerminationGraceLimits,
    /// `spec.gangScheduler` and the `schedulerName` its gangs' copies get, if set.
    pub gang_scheduling: Option<(tidepool_api::crd::GangScheduler, String)>,
    /// `spec.podSecurity`, `spec.userNamespaces`, `spec.networkPolicy`: what its offload
    /// namespaces enforce and its copies are hardened to.
    pub confinement: tidepool_api::crd::Confinement,
    pub pools: Vec<PoolHandle>,
    /// Cancelled when the session ends (member deleted, credentials or spec changed).
    pub cancelled: CancellationToken,
    /// `spec.paused`: no new placements; running offload pods stay.
    pub paused: bool,
    /// Reachability and usability, kept current by the session's prober and the controller.
    /// The session outlives an outage: consumers read this and hold back instead.
    pub health: watch::Receiver<Health>,
    /// Calls made to the member and time spent waiting for its rate limit.
    pub stats: Arc<crate::MemberStats>,
    /// Online pods at or below the offload priorities, if any; set with the first capacity.
    pub priority_conflict: watch::Receiver<Option<PriorityConflict>>,
    /// The pod CIDRs of the member's nodes; set with the first capacity.
    pub pod_network: watch::Receiver<PodNetwork>,
    /// `spec.podCIDRs`: the pod network its admin declares (empty: none declared).
    pub declared_pod_network: PodNetwork,
    /// The capacity publisher's wake-ups, for [`MemberHandle::want_capacity`].
    wakeups: Wakeups,
    /// Set before the session ends because another replica owns the member now: its virtual
    /// nodes stay (the new owner keeps them), only this replica's tasks stop.
    pub handed_over: std::sync::atomic::AtomicBool,
    /// The member's eviction requests, where it serves them (Kubernetes 1.37 with the gate).
    pub eviction_requests: Option<crate::eviction_requests::EvictionAsks>,
    /// The session's tasks: spawn a per-member task here, never detached
    /// ([`crate::member_tasks`]).
    pub tasks: MemberTasks,
}

/// One pool of a member: one virtual node.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    pub name: PoolName,
    pub node: VirtualNodeName,
    pub node_selector: BTreeMap<String, String>,
    /// What every copy in the pool tolerates (`spec.pools[].tolerations`).
    pub tolerations: Vec<PoolToleration>,
    /// RuntimeClasses its offload pods may name (`spec.pools[].runtimeClassNames`).
    pub runtime_class_names: Vec<String>,
    /// Which node resources the pool lends, and so how its copies ask for them
    /// (`spec.pools[].mode`).
    pub mode: PoolMode,
    /// Node label keys of its topology domains, coarse to fine (`spec.pools[].topology`):
    /// the only keys a copy's planned domain may pin (see `ANNOTATION_PLANNED_DOMAIN`).
    pub topology: Vec<String>,
    pub capacity: watch::Receiver<PoolCapacity>,
}

impl std::fmt::Debug for MemberHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberHandle").field("name", &self.name).field("pools", &self.pools).finish_non_exhaustive()
    }
}

impl MemberHandle {
    /// The member's pod network: the one its admin declares (`spec.podCIDRs`), else its
    /// nodes' pod CIDRs as last seen. What `PodNetworkOverlap` compares.
    pub fn effective_pod_network(&self) -> PodNetwork {
        if self.declared_pod_network.is_empty() {
            self.pod_network.borrow().clone()
        } else {
            self.declared_pod_network.clone()
        }
    }

    /// Told by the dispatcher after each round: whether a gang waits for capacity. While one
    /// does, a pool whose room grows publishes at once (see [`publication`]); a drift held
    /// back when the wait begins goes out now.
    pub fn want_capacity(&self, wanted: bool) {
        if !self.wakeups.wanted.swap(wanted, Ordering::Relaxed) && wanted {
            self.wakeups.changed.notify_one();
        }
    }

    pub fn pool_for_node(&self, node: &str) -> Option<&PoolHandle> {
        self.pools.iter().find(|p| p.node.as_str() == node)
    }
}

/// Settings of a session that come from its `MemberCluster` and the bridge config.
#[derive(Debug, Clone)]
pub(crate) struct SessionOptions {
    /// How training namespaces map to the member's offload namespaces.
    pub namespaces: Arc<tidepool_api::names::OffloadNamespaces>,
    /// `spec.copyLabels`, `spec.copyAnnotations`.
    pub copy_labels: Vec<String>,
    pub copy_annotations: Vec<String>,
    /// `spec.maxTerminationGraceSeconds`.
    pub max_termination_grace: tidepool_api::crd::TerminationGraceLimits,
    /// `spec.gangScheduler`, with the scheduler name.
    pub gang_scheduling: Option<(tidepool_api::crd::GangScheduler, String)>,
    /// `spec.podSecurity`, `spec.userNamespaces`, `spec.networkPolicy`.
    pub confinement: tidepool_api::crd::Confinement,
    /// `spec.podCIDRs`.
    pub declared_pod_network: PodNetwork,
    /// `spec.paused`.
    pub paused: bool,
    /// `memberLossTimeoutSeconds`: unreachable this long, the member counts as lost.
    pub loss_timeout: Duration,
    /// Counters of the client's throttle layer.
    pub stats: Arc<crate::MemberStats>,
    /// The fence of the session's client (see [`crate::fence`]).
    pub fence: CancellationToken,
    /// The member serves eviction requests: watch them.
    pub eviction_requests: bool,
}

/// Owns the watch tasks of one member; dropping it stops them.
#[derive(Debug)]
pub(crate) struct Session {
    pub handle: Arc<MemberHandle>,
    pub fingerprint: String,
    pub health: watch::Sender<Health>,
    /// Cancelled when the member is handed over: its client stops at once.
    pub fence: CancellationToken,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.handle.cancelled.cancel();
    }
}

impl Session {
    /// Starts the member's watches and its capacity publisher. The caller has already
    /// checked that it answers.
    pub fn start(
        name: MemberName,
        client: Client,
        pools: &[PoolSpec],
        fingerprint: String,
        policy: CapacityPolicy,
        options: SessionOptions,
    ) -> Session {
        let cancelled = CancellationToken::new();
        let (health_tx, health) = watch::channel(Health::default());
        let tasks = MemberTasks::new(name.clone(), health_tx.clone(), cancelled.clone());
        tasks.spawn(
            "health probe",
            crate::health::run(client.clone(), health_tx.clone(), options.loss_timeout, cancelled.clone()),
        );
        let modes: Vec<PoolMode> = pools.iter().map(|p| p.mode).collect();
        let caches = Caches::watch(&client, &modes, policy.hpa_percent > 0, &tasks);
        let (handles, outs): (Vec<_>, Vec<_>) = pools.iter().map(|pool| pool_channel(&name, pool)).unzip();
        let mut models: Vec<PoolModel> = pools
            .iter()
            .map(|p| PoolModel::new(p.node_selector.clone(), p.tolerations.clone(), p.mode, p.topology.clone()))
            .collect();
        let (conflict, conflict_rx) = watch::channel(None);
        let (pod_network, network_rx) = watch::channel(PodNetwork::default());
        let signals = Signals { conflict, pod_network };
        // Windows open and close with the clock, not with events.
        let clock = if policy.windows.is_empty() { Duration::from_secs(3600) } else { Duration::from_secs(1) };
        let eviction_requests =
            options.eviction_requests.then(|| crate::eviction_requests::EvictionAsks::watch(&client, &tasks));
        let (member, stop, wakeups) = (name.clone(), cancelled.clone(), caches.wakeups.clone());
        // Stopping with an error (a poisoned cache) marks the member: its pools would keep
        // their last capacity (see `crate::member_tasks`).
        tasks.spawn("capacity publisher", async move {
            let compute = || caches.compute(&mut models, &policy, &signals);
            if let Err(e) = run_publisher(&member, compute, &outs, &caches.wakeups, clock, &stop).await {
                error!(error = %e, "capacity publisher stopped");
            }
            for pool in &outs {
                metrics().forget_pool(member.as_str(), &pool.name);
            }
        });
        let handle = MemberHandle {
            name,
            client,
            namespaces: options.namespaces,
            copy_labels: options.copy_labels,
            copy_annotations: options.copy_annotations,
            max_termination_grace: options.max_termination_grace,
            gang_scheduling: options.gang_scheduling,
            confinement: options.confinement,
            pools: handles,
            cancelled,
            paused: options.paused,
            health,
            stats: options.stats,
            priority_conflict: conflict_rx,
            pod_network: network_rx,
            declared_pod_network: options.declared_pod_network,
            wakeups,
            handed_over: std::sync::atomic::AtomicBool::new(false),
            eviction_requests,
            tasks,
        };
        Session { handle: Arc::new(handle), fingerprint, health: health_tx, fence: options.fence }
    }
}

/// A pool's handle for consumers, and the sending side of its capacity.
fn pool_channel(member: &MemberName, pool: &PoolSpec) -> (PoolHandle, PoolOut) {
    let (tx, rx) = watch::channel(PoolCapacity::default());
    let pool_name = PoolName::new(pool.name.clone());
    let handle = PoolHandle {
        node: VirtualNodeName::for_pool(member, &pool_name),
        name: pool_name,
        node_selector: pool.node_selector.clone(),
        tolerations: pool.tolerations.clone(),
        runtime_class_names: pool.runtime_class_names.clone(),
        mode: pool.mode,
        topology: pool.topology.clone(),
        capacity: rx,
    };
    (handle, PoolOut { name: pool.name.clone(), tx })
}

impl Session {
    /// Waits until every pool's capacity has been computed once from complete watches, so
    /// nobody sees a member with an empty pool that is merely not synced yet.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let all = futures::future::join_all(self.handle.pools.iter().map(|p| {
            let mut rx = p.capacity.clone();
            async move { rx.changed().await.is_ok() }
        }));
        tokio::time::timeout(timeout, all).await.is_ok_and(|r| r.into_iter().all(|ok| ok))
    }
}

/// Creates the member PriorityClasses of the bands (below every online priority, never
/// preempting). Existing ones are left as they are: a PriorityClass value is immutable.
pub async fn bootstrap(client: &Client) -> Result<(), kube::Error> {
    use k8s_openapi::api::scheduling::v1::PriorityClass;
    use tidepool_api::keys::{self, Band};
    let api = Api::<PriorityClass>::all(client.clone());
    for band in Band::ALL {
        let pc = PriorityClass {
            metadata: kube::api::ObjectMeta {
                name: Some(band.priority_class()),
                labels: Some(BTreeMap::from([(keys::LABEL_MANAGED_BY.to_owned(), keys::MANAGED_BY.to_owned())])),
                ..Default::default()
            },
            value: Some(band.priority_value()),
            preemption_policy: Some("Never".to_owned()),
            global_default: Some(false),
            description: Some(format!(
                "tidepool offload pods of band {}: below online pods, never preempting",
                band.as_str()
            )),
        };
        match api.create(&kube::api::PostParams::default(), &pc).await {
            Ok(_) => {}
            Err(e) if crate::api_code(&e, &[409]) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
