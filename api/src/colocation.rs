//! Colocation modes of a pool: lending the slack a member's colocation system measures
//! (Koordinator's batch resources, Katalyst's reclaimed resources) rather than the surplus of
//! requests. Tidepool never measures usage itself: the member's agents publish on each node
//! what batch work may use there, and the member's scheduler and node agents place, isolate
//! and evict that work.
//!
//! Pure: each system's names and unit conversions, tested on plain data. Both systems count
//! CPU in milli-cores as whole numbers (`kubernetes.io/batch-cpu: 4000` and
//! `reclaimed_millicpu: 4k` are both 4 cores) and memory in bytes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::Resources;
use crate::crd::PoolMode;
use crate::resources::{format_milli, parse_milli};

/// How one colocation system names batch capacity and recognises batch pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Colocation {
    /// For messages: `Koordinator`.
    pub system: &'static str,
    /// Node allocatable and pod request for CPU, in milli-cores.
    pub cpu: &'static str,
    /// Node allocatable and pod request for memory, in bytes.
    pub memory: &'static str,
    /// The PriorityClass every copy names, which the member's colocation system installs;
    /// `None`: the band's own tidepool class (the system keys on an annotation instead).
    pub priority_class: Option<&'static str>,
    /// Labels every copy carries.
    pub labels: &'static [(&'static str, &'static str)],
    /// Annotations every copy carries.
    pub annotations: &'static [(&'static str, &'static str)],
}

/// Koordinator: koord-manager publishes `kubernetes.io/batch-cpu` and `batch-memory` on the
/// nodes; its scheduler and koordlet treat pods of priority class `koord-batch` (5000–5999)
/// and label `koordinator.sh/qosClass: BE` as batch work.
pub const KOORDINATOR: Colocation = Colocation {
    system: "Koordinator",
    cpu: "kubernetes.io/batch-cpu",
    memory: "kubernetes.io/batch-memory",
    priority_class: Some("koord-batch"),
    labels: &[("koordinator.sh/qosClass", "BE")],
    annotations: &[],
};

/// Katalyst: its agent reports `resource.katalyst.kubewharf.io/reclaimed_millicpu` and
/// `reclaimed_memory`; pods annotated `katalyst.kubewharf.io/qos_level: reclaimed_cores` run
/// on them.
pub const KATALYST: Colocation = Colocation {
    system: "Katalyst",
    cpu: "resource.katalyst.kubewharf.io/reclaimed_millicpu",
    memory: "resource.katalyst.kubewharf.io/reclaimed_memory",
    priority_class: None,
    labels: &[],
    annotations: &[("katalyst.kubewharf.io/qos_level", "reclaimed_cores")],
};

impl PoolMode {
    /// The colocation system of the mode; `None` for `requests`.
    pub fn colocation(self) -> Option<&'static Colocation> {
        match self {
            PoolMode::Requests => None,
            PoolMode::KoordinatorBatch => Some(&KOORDINATOR),
            PoolMode::KatalystReclaimed => Some(&KATALYST),
        }
    }
}

/// Why a pod cannot run as a colocation system's batch work: the offending field and what
/// is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unexpressible {
    pub field: String,
    pub reason: String,
}

impl Colocation {
    /// `resources` (a node's allocatable or a pod's requests) as tidepool counts them in this
    /// mode: the batch CPU and memory become `cpu` and `memory`; the ordinary `cpu` and
    /// `memory` do not count (the agent has already taken what online pods use out of the
    /// batch amounts); every other resource (GPUs, pods, storage) stays request-based.
    pub fn as_plain(&self, resources: &Resources) -> Resources {
        let mut plain = Resources::new();
        for (name, amount) in resources.iter() {
            match name {
                "cpu" | "memory" => {}
                n if n == self.cpu => plain.set("cpu", amount / 1000),
                n if n == self.memory => plain.set("memory", amount),
                n => plain.set(n, amount),
            }
        }
        plain
    }

    /// Whether a node's allocatable carries this system's CPU resource: a node without it
    /// has no agent publishing batch capacity (not installed, down, or reset).
    pub fn advertised_on(&self, allocatable: &Resources) -> bool {
        allocatable.names().any(|n| n == self.cpu)
    }

    /// A resource list of a copy's container: `cpu` as this system's CPU resource in
    /// milli-cores, `memory` as its memory resource, everything else unchanged.
    pub fn to_member(&self, list: &BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
        list.iter()
            .map(|(name, q)| match name.as_str() {
                "cpu" => {
                    (self.cpu.to_owned(), parse_milli(&q.0).map_or_else(|_| q.clone(), |m| Quantity(m.to_string())))
                }
                "memory" => (self.memory.to_owned(), q.clone()),
                _ => (name.clone(), q.clone()),
            })
            .collect()
    }

    /// The inverse of [`Colocation::to_member`], for what comes back up in a copy's status.
    pub fn to_training(&self, list: &BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
        list.iter()
            .map(|(name, q)| match name.as_str() {
                n if n == self.cpu => (
                    "cpu".to_owned(),
                    parse_milli(&q.0).map_or_else(|_| q.clone(), |m| Quantity(format_milli(m / 1000))),
                ),
                n if n == self.memory => ("memory".to_owned(), q.clone()),
                _ => (name.clone(), q.clone()),
            })
            .collect()
    }

    /// Requests and limits of every container of a copy, converted with
    /// [`Colocation::to_member`].
    pub fn convert_spec(&self, spec: &mut PodSpec) {
        let convert = |r: &mut ResourceRequirements| {
            r.requests = r.requests.as_ref().map(|l| self.to_member(l));
            r.limits = r.limits.as_ref().map(|l| self.to_member(l));
        };
        for c in spec.containers.iter_mut().chain(spec.init_containers.iter_mut().flatten()) {
            if let Some(r) = c.resources.as_mut() {
                convert(r);
            }
        }
        // Pod-level resources (beta in Kubernetes 1.34) follow the same rule.
        if let Some(r) = spec.resources.as_mut() {
            convert(r);
        }
    }

    /// A copy's status as the training pod takes it: the resources it reports (allocated and
    /// current, per container) under the training pod's names, and no QoS class. The copy
    /// asks for no ordinary `cpu` or `memory`, so the member calls it `BestEffort`, while the
    /// training pod keeps the class it was admitted with (the field is immutable).
    pub fn status_to_training(&self, status: &mut PodStatus) {
        status.qos_class = None;
        let statuses =
            status.container_statuses.iter_mut().flatten().chain(status.init_container_statuses.iter_mut().flatten());
        for cs in statuses {
            cs.allocated_resources = cs.allocated_resources.as_ref().map(|l| self.to_training(l));
            if let Some(r) = cs.resources.as_mut() {
                r.requests = r.requests.as_ref().map(|l| self.to_training(l));
                r.limits = r.limits.as_ref().map(|l| self.to_training(l));
            }
        }
    }

    /// Why `spec` cannot run as this system's batch work, if it cannot: hugepages (batch work
    /// gets no reserved pages), a Guaranteed QoS class (batch work is best effort by
    /// definition, with no exclusive or guaranteed CPU), or batch resources the tenant named
    /// itself (they would be counted twice).
    pub fn unexpressible(&self, spec: &PodSpec) -> Option<Unexpressible> {
        let init = spec.init_containers.iter().flatten().enumerate().map(|(i, c)| (format!("initContainers[{i}]"), c));
        let app = spec.containers.iter().enumerate().map(|(i, c)| (format!("containers[{i}]"), c));
        for (path, c) in init.chain(app) {
            let Some(r) = c.resources.as_ref() else { continue };
            let names = r.requests.iter().chain(r.limits.iter()).flat_map(|l| l.keys());
            for name in names {
                if name.starts_with("hugepages-") {
                    let reason = format!("{} cannot lend hugepages ({name}) to batch work", self.system);
                    return Some(Unexpressible { field: format!("spec.{path}.resources"), reason });
                }
                if name == self.cpu || name == self.memory {
                    let reason = format!("names {name} itself; ask for cpu and memory, tidepool converts them");
                    return Some(Unexpressible { field: format!("spec.{path}.resources"), reason });
                }
            }
        }
        if !spec.containers.is_empty() && spec.containers.iter().all(guaranteed) {
            let reason = format!(
                "asks for Guaranteed QoS (limits equal to requests for cpu and memory in every container), \
                 but {} runs lent capacity as best-effort batch work: drop the limits, or use a pool in mode requests",
                self.system
            );
            return Some(Unexpressible { field: "spec.containers[*].resources".to_owned(), reason });
        }
        None
    }
}

/// Whether `c` alone would make its pod Guaranteed: cpu and memory limits, and requests equal
/// to them (absent requests default to the limits).
fn guaranteed(c: &Container) -> bool {
    let Some(r) = c.resources.as_ref() else { return false };
    let Some(limits) = r.limits.as_ref() else { return false };
    ["cpu", "memory"].iter().all(|name| {
        let Some(limit) = limits.get(*name) else { return false };
        let request = r.requests.as_ref().and_then(|l| l.get(*name)).unwrap_or(limit);
        parse_milli(&request.0).ok() == parse_milli(&limit.0).ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned()))).collect()
    }

    fn r(pairs: &[(&str, &str)]) -> Resources {
        Resources::from_pairs(pairs.iter().copied()).unwrap()
    }

    fn container(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> Container {
        Container {
            name: "c".into(),
            resources: Some(ResourceRequirements {
                requests: (!requests.is_empty()).then(|| list(requests)),
                limits: (!limits.is_empty()).then(|| list(limits)),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn batch_cpu_counts_in_milli_cores_and_ordinary_cpu_and_memory_do_not_count() {
        // A node of 32 cores whose agent lends 12.5 cores and 40 Gi; 2 GPUs stay as they are.
        let node = r(&[
            ("cpu", "32"),
            ("memory", "128Gi"),
            ("kubernetes.io/batch-cpu", "12500"),
            ("kubernetes.io/batch-memory", "40Gi"),
            ("nvidia.com/gpu", "2"),
        ]);
        assert_eq!(KOORDINATOR.as_plain(&node), r(&[("cpu", "12500m"), ("memory", "40Gi"), ("nvidia.com/gpu", "2")]));
        // Katalyst's `4k` milli-cores are 4 cores.
        let node = r(&[("cpu", "8"), ("resource.katalyst.kubewharf.io/reclaimed_millicpu", "4k")]);
        assert_eq!(KATALYST.as_plain(&node), r(&[("cpu", "4")]));
        // An online pod's ordinary requests use none of the batch capacity.
        assert_eq!(KOORDINATOR.as_plain(&r(&[("cpu", "6"), ("memory", "1Gi")])), Resources::new());
    }

    #[test]
    fn only_a_node_carrying_the_systems_cpu_resource_is_advertised() {
        assert!(KOORDINATOR.advertised_on(&r(&[("kubernetes.io/batch-cpu", "0")])));
        assert!(!KOORDINATOR.advertised_on(&r(&[("cpu", "8")])));
        assert!(!KATALYST.advertised_on(&r(&[("kubernetes.io/batch-cpu", "8000")])));
    }

    #[test]
    fn a_copy_asks_for_the_batch_names_in_milli_cores_and_its_status_comes_back_under_cpu() {
        let asked = list(&[("cpu", "1500m"), ("memory", "2Gi"), ("nvidia.com/gpu", "1")]);
        let member = KOORDINATOR.to_member(&asked);
        assert_eq!(
            member,
            list(&[
                ("kubernetes.io/batch-cpu", "1500"),
                ("kubernetes.io/batch-memory", "2Gi"),
                ("nvidia.com/gpu", "1")
            ])
        );
        let katalyst = KATALYST.to_member(&list(&[("cpu", "2")]));
        assert_eq!(katalyst, list(&[("resource.katalyst.kubewharf.io/reclaimed_millicpu", "2000")]));
        assert_eq!(
            KOORDINATOR.to_training(&member),
            list(&[("cpu", "1500m"), ("memory", "2Gi"), ("nvidia.com/gpu", "1")])
        );
        let mut status: PodStatus = serde_json::from_value(serde_json::json!({
            "qosClass": "BestEffort",
            "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                                   "allocatedResources": {"kubernetes.io/batch-cpu": "1k"}}]
        }))
        .unwrap();
        KOORDINATOR.status_to_training(&mut status);
        assert_eq!(status.qos_class, None);
        let allocated = status.container_statuses.unwrap()[0].allocated_resources.clone();
        assert_eq!(allocated, Some(list(&[("cpu", "1")])));
    }

    #[test]
    fn limits_and_init_containers_are_converted_too() {
        let mut spec = PodSpec {
            containers: vec![container(&[("cpu", "1")], &[("cpu", "2")])],
            init_containers: Some(vec![container(&[("memory", "1Gi")], &[])]),
            ..Default::default()
        };
        KOORDINATOR.convert_spec(&mut spec);
        let app = spec.containers[0].resources.clone().unwrap();
        assert_eq!(app.requests, Some(list(&[("kubernetes.io/batch-cpu", "1000")])));
        assert_eq!(app.limits, Some(list(&[("kubernetes.io/batch-cpu", "2000")])));
        let init = spec.init_containers.unwrap()[0].resources.clone().unwrap();
        assert_eq!(init.requests, Some(list(&[("kubernetes.io/batch-memory", "1Gi")])));
    }

    #[test]
    fn pods_batch_work_cannot_express_are_refused_with_the_field() {
        let spec = |containers: Vec<Container>| PodSpec { containers, ..Default::default() };
        let field = |s: &PodSpec| KOORDINATOR.unexpressible(s).map(|u| u.field);
        // Requests below limits: burstable, fine.
        assert_eq!(field(&spec(vec![container(&[("cpu", "1"), ("memory", "1Gi")], &[("cpu", "2")])])), None);
        // No resources at all: fine.
        assert_eq!(field(&spec(vec![Container::default()])), None);
        // Limits equal to requests for cpu and memory in every container: Guaranteed.
        let whole = container(&[("cpu", "2"), ("memory", "1Gi")], &[("cpu", "2"), ("memory", "1Gi")]);
        assert_eq!(field(&spec(vec![whole.clone()])), Some("spec.containers[*].resources".to_owned()));
        // Limits only: requests default to them, Guaranteed too.
        assert!(field(&spec(vec![container(&[], &[("cpu", "2"), ("memory", "1Gi")])])).is_some());
        // One burstable container makes the pod burstable.
        assert_eq!(field(&spec(vec![whole, container(&[("cpu", "1")], &[])])), None);
        let pages = container(&[("hugepages-2Mi", "64Mi")], &[("hugepages-2Mi", "64Mi")]);
        assert_eq!(field(&spec(vec![pages])), Some("spec.containers[0].resources".to_owned()));
        let own = container(&[("kubernetes.io/batch-cpu", "1000")], &[]);
        assert_eq!(field(&spec(vec![own])), Some("spec.containers[0].resources".to_owned()));
    }
}
