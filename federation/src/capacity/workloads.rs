//! What the member's online workloads will still ask for: HPA headroom (how far each HPA
//! may still grow) and replicas to come (asked for, no pod yet), from the HPA, Deployment
//! and StatefulSet views. Pure.

use std::collections::BTreeMap;

use kube::ResourceExt;
use tidepool_api::crd::PoolToleration;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use tidepool_api::Resources;

use crate::capacity::index::PodIndex;
use crate::capacity::{HpaView, ReplicasToCome, pod_requests};
use crate::view_cache::ViewCache;

/// Namespace, kind and name of an HPA's scale target.
pub(crate) type WorkloadKey = (String, String, String);

/// An HPA as the capacity model needs it: its target and how far it may still grow.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HpaRef {
    target: WorkloadKey,
    max_replicas: i32,
    current_replicas: i32,
}

/// A workload's pod template, reduced to what one replica requests and where it may land.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Template {
    per_replica: Resources,
    node_selector: BTreeMap<String, String>,
    tolerations: Vec<PoolToleration>,
    /// `spec.replicas`: replicas asked for, whose pods exist or are about to.
    replicas: i32,
}

pub(crate) fn hpa_view(h: &HorizontalPodAutoscaler) -> Option<(WorkloadKey, HpaRef)> {
    let ns = h.namespace().unwrap_or_default();
    let spec = &h.spec;
    let target = (ns.clone(), spec.scale_target_ref.kind.clone(), spec.scale_target_ref.name.clone());
    let current = h.status.as_ref().and_then(|s| s.current_replicas).unwrap_or(0);
    Some((
        (ns, "HPA".to_owned(), h.name_any()),
        HpaRef { target, max_replicas: spec.max_replicas, current_replicas: current },
    ))
}

pub(crate) fn template_view(
    kind: &str,
    ns: Option<String>,
    name: String,
    template: &PodTemplateSpec,
    replicas: Option<i32>,
) -> Option<(WorkloadKey, Template)> {
    let spec = template.spec.as_ref()?;
    let mut per_replica = pod_requests(spec);
    // `pods` is a count, not part of what a replica requests from a node's resources.
    per_replica.set("pods", 1000);
    Some((
        (ns.unwrap_or_default(), kind.to_owned(), name),
        Template {
            per_replica,
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            tolerations: crate::capacity::tolerations_of(spec),
            replicas: replicas.unwrap_or(1),
        },
    ))
}

pub(crate) fn join_hpas(
    hpas: &ViewCache<WorkloadKey, HpaRef>,
    templates: &ViewCache<WorkloadKey, Template>,
) -> Vec<HpaView> {
    hpas.values()
        .filter_map(|h| {
            let t = templates.get(&h.target)?;
            Some(HpaView {
                max_replicas: h.max_replicas,
                // Replicas already asked for have pods, counted as online or pending online
                // demand, or are about to ([`ReplicasToCome`]): only growth beyond them is
                // headroom. (The HPA's status lags a scale-up by its sync period; counting
                // from it alone held the same replicas back twice.)
                current_replicas: h.current_replicas.max(t.replicas),
                per_replica: t.per_replica.clone(),
                node_selector: t.node_selector.clone(),
                tolerations: t.tolerations.clone(),
            })
        })
        .collect()
}

/// Per workload, the replicas it asks for beyond the pods it has (those not ended, counted
/// in `pods`): pods its controller is about to create, to hold room for before they exist
/// (see [`ReplicasToCome`]).
pub(crate) fn replicas_to_come(templates: &ViewCache<WorkloadKey, Template>, pods: &PodIndex) -> Vec<ReplicasToCome> {
    templates
        .iter()
        .filter_map(|((ns, kind, name), t)| {
            let have = match kind.as_str() {
                "Deployment" => pods.existing(ns, "Deployment", name),
                "StatefulSet" => pods.existing(ns, "StatefulSet", name),
                _ => 0,
            };
            (t.replicas > have).then(|| ReplicasToCome {
                replicas: t.replicas - have,
                per_replica: t.per_replica.clone(),
                node_selector: t.node_selector.clone(),
                tolerations: t.tolerations.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::OnlineParts;
    use crate::capacity::PodView;
    use crate::capacity::priority::offload_ceiling;
    use kube::runtime::watcher;
    use tidepool_api::crd::PoolMode;
    #[test]
    fn hpa_headroom_counts_from_the_replicas_already_asked_for() {
        let target: WorkloadKey = ("ns".into(), "Deployment".into(), "web".into());
        let mut hpas = ViewCache::default();
        let hpa = HpaRef { target: target.clone(), max_replicas: 5, current_replicas: 1 };
        hpas.apply(watcher::Event::Apply((("ns".into(), "HPA".into(), "web".into()), hpa)));
        let mut templates = ViewCache::default();
        let template = |replicas| Template {
            per_replica: Resources::new(),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            replicas,
        };
        templates.apply(watcher::Event::Apply((target.clone(), template(1))));
        // The HPA may still grow by 4 replicas.
        assert_eq!(join_hpas(&hpas, &templates)[0].current_replicas, 1);
        // The Deployment was scaled to 5 before the HPA's status says so: its 4 new pods are
        // pending online demand already (or replicas to come), and no headroom is left to
        // hold back for them again.
        templates.apply(watcher::Event::Apply((target, template(5))));
        assert_eq!(join_hpas(&hpas, &templates)[0].current_replicas, 5);
    }

    #[test]
    fn replicas_to_come_are_those_asked_for_beyond_the_pods_that_exist() {
        let gpu = |n: &str| Resources::from_pairs([("nvidia.com/gpu", n)]).unwrap();
        let mut templates = ViewCache::default();
        let template = |replicas| Template {
            per_replica: gpu("2"),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            replicas,
        };
        let web: WorkloadKey = ("online".into(), "Deployment".into(), "web".into());
        let db: WorkloadKey = ("online".into(), "StatefulSet".into(), "db".into());
        templates.apply(watcher::Event::Apply((web, template(5))));
        templates.apply(watcher::Event::Apply((db, template(2))));
        let pod = |ns: &str, name: &str, workload: Option<(&'static str, &str)>, terminated: bool| {
            let online = OnlineParts::boxed(BTreeMap::new(), Vec::new(), workload.map(|(k, n)| (k, n.into())));
            let view = PodView { online, terminated, ..Default::default() };
            ((ns.to_owned(), name.to_owned()), view)
        };
        let pods = [
            // web: one running, one pending, one ended (its replacement is to come).
            pod("online", "web-1", Some(("Deployment", "web")), false),
            pod("online", "web-2", Some(("Deployment", "web")), false),
            pod("online", "web-3", Some(("Deployment", "web")), true),
            // db has both its pods; a same-named Deployment elsewhere is not it.
            pod("online", "db-0", Some(("StatefulSet", "db")), false),
            pod("online", "db-1", Some(("StatefulSet", "db")), false),
            pod("other", "web-1", Some(("Deployment", "web")), false),
        ];
        let mut index = PodIndex::new([PoolMode::Requests], offload_ceiling());
        for (k, v) in &pods {
            index.change(k, None, Some(v));
        }
        let to_come = replicas_to_come(&templates, &index);
        assert_eq!(to_come.len(), 1);
        assert_eq!((to_come[0].replicas, &to_come[0].per_replica), (3, &gpu("2")));
        // No workloads known: nothing to come.
        assert!(replicas_to_come(&ViewCache::default(), &index).is_empty());
    }
}
