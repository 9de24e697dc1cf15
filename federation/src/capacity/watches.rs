//! A member's watches feeding the capacity model: nodes, pods (summed per node as they
//! change), HPAs and workloads, each into its [`super::cache::ViewCache`], and the
//! computation of every pool's capacity from them.

use std::sync::{Arc, Mutex};

use kube::{Client, ResourceExt};
use tidepool_api::crd::PoolMode;
use tidepool_api::sync::Locked;
use tokio::sync::watch;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;

use crate::capacity::index::PodIndex;
use crate::capacity::index::Touched;
use crate::capacity::pool::PoolModel;
use crate::capacity::priority::{PriorityConflict, offload_ceiling};
use crate::capacity::wire::{MemberNode, MemberPod};
use crate::capacity::workloads::{HpaRef, Template, WorkloadKey, hpa_view, join_hpas, replicas_to_come, template_view};
use crate::capacity::{CapacityPolicy, NodeView, OnlineDemand, PodCapacityKey, PodView, PoolCapacity};
use crate::member_tasks::MemberTasks;
use crate::pod_network::PodNetwork;
use crate::view_cache::{ViewCache, Wakeups, spawn_cache, watch_all};

/// The trimmed views of one member's watches, and how the watches wake the capacity
/// publisher.
#[derive(Clone)]
pub(crate) struct Caches {
    /// Noting which nodes changed for the pool models ([`Touched`]).
    pub(crate) nodes: Arc<Mutex<ViewCache<String, NodeView, Touched>>>,
    /// With the pods summed per node ([`PodIndex`]), kept up to date event by event.
    pub(crate) pods: Arc<Mutex<ViewCache<PodCapacityKey, PodView, PodIndex>>>,
    /// HPAs and the pod templates of their targets, for the HPA headroom (watched only when
    /// the policy keeps any).
    pub(crate) hpas: Arc<Mutex<ViewCache<WorkloadKey, HpaRef>>>,
    pub(crate) templates: Arc<Mutex<ViewCache<WorkloadKey, Template>>>,
    pub(crate) wakeups: Wakeups,
}

impl Caches {
    /// Starts the member's watches as tasks of its session, each keeping one cache.
    pub(crate) fn watch(client: &Client, modes: &[PoolMode], hpa: bool, tasks: &MemberTasks) -> Caches {
        let index = PodIndex::new(modes.iter().copied(), offload_ceiling());
        let caches = Caches {
            nodes: Arc::default(),
            pods: Arc::new(Mutex::new(ViewCache::with(index))),
            hpas: Arc::default(),
            templates: Arc::default(),
            wakeups: Wakeups::default(),
        };
        let wake = &caches.wakeups;
        // Nodes and pods are many and change often: decoded lean (see `super::wire`).
        let node_view = |n: &MemberNode| Some((n.0.name_any(), NodeView::from_node(&n.0)));
        spawn_cache(watch_all::<MemberNode>(client), &caches.nodes, (node_view, |_| false), wake, tasks, "node watch");
        let pod_view =
            |p: &MemberPod| Some(((p.0.namespace().unwrap_or_default(), p.0.name_any()), PodView::from_pod(&p.0)));
        let pods = watch_all::<MemberPod>(client);
        spawn_cache(pods, &caches.pods, (pod_view, PodView::pending_online), wake, tasks, "pod watch");
        if !hpa {
            return caches;
        }
        let hpas = watch_all::<HorizontalPodAutoscaler>(client);
        spawn_cache(hpas, &caches.hpas, (hpa_view, |_| true), wake, tasks, "HPA watch");
        let deployment = |d: &Deployment| {
            template_view("Deployment", d.namespace(), d.name_any(), &d.spec.template, d.spec.replicas)
        };
        let deployments = watch_all::<Deployment>(client);
        spawn_cache(deployments, &caches.templates, (deployment, |_| true), wake, tasks, "Deployment watch");
        let set = |d: &StatefulSet| {
            template_view("StatefulSet", d.namespace(), d.name_any(), &d.spec.template, d.spec.replicas)
        };
        let sets = watch_all::<StatefulSet>(client);
        spawn_cache(sets, &caches.templates, (set, |_| true), wake, tasks, "StatefulSet watch");
        caches
    }

    /// Every pool's capacity from the views, or `None` while the node or pod watch has not
    /// listed everything yet; updates the priority conflict on the way. Computed under the
    /// caches' locks: each pool's model redoes the nodes whose view or pods changed since the
    /// last computation, and no pod is walked for it.
    pub(crate) fn compute(
        &self,
        pools: &mut [PoolModel],
        policy: &CapacityPolicy,
        signals: &Signals,
    ) -> Result<Option<Vec<PoolCapacity>>, crate::Error> {
        let hpa_views = join_hpas(&*self.hpas.locked("HPA view")?, &*self.templates.locked("workload view")?);
        let mut nodes = self.nodes.locked("node view")?;
        let mut pods = self.pods.locked("pod view")?;
        if !(nodes.synced && pods.synced) {
            return Ok(None);
        }
        let nodes_touched = nodes.derived.take();
        if !nodes_touched.is_empty() {
            let network = PodNetwork::new(nodes.views().values().flat_map(|v| v.pod_cidrs.iter().copied()));
            signals.pod_network.send_if_modified(|cur| {
                let changed = *cur != network;
                *cur = network;
                changed
            });
        }
        let touched = nodes_touched.joined(pods.derived.take_touched());
        let to_come = replicas_to_come(&*self.templates.locked("workload view")?, &pods.derived);
        let demand = OnlineDemand { policy, hpas: &hpa_views, to_come: &to_come, now: jiff::Timestamp::now() };
        let found = pods.derived.priority_conflict();
        signals.conflict.send_if_modified(|cur| {
            let changed = *cur != found;
            *cur = found;
            changed
        });
        let capacity = |model: &mut PoolModel| {
            model.catch_up(&touched, nodes.views(), &pods.derived);
            model.capacity(&demand, nodes.views(), &pods.derived)
        };
        Ok(Some(pools.iter_mut().map(capacity).collect()))
    }
}

/// What the capacity computation finds out about the member besides capacity, for its
/// `MemberCluster` conditions.
pub(crate) struct Signals {
    pub(crate) conflict: watch::Sender<Option<PriorityConflict>>,
    /// The pod network of the member's nodes ([`crate::pod_network`]).
    pub(crate) pod_network: watch::Sender<PodNetwork>,
}
