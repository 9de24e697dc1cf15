//! Services of distributed jobs, the pure part: which training Services are mirrored into a
//! member, what a mirror looks like, and what to write to make the member's mirrors match.
//!
//! A job's pods find each other by Service (a PS's name, `MASTER_ADDR`, a JobSet's headless
//! Service and `<pod>.<subdomain>`). The copies run in the member, so a training Service that
//! selects pods with copies there is mirrored into the member namespace under the same name,
//! with the same ports and an equivalent selector; the member's own EndpointSlice controller
//! then lists the copies and its DNS answers for the name. The I/O is in [`crate::mirror`].
//!
//! Selection without tenant labels. A copy does not carry the training pod's labels (they
//! are credentials in a member: its NetworkPolicies, meshes and monitoring select pods by
//! label across namespaces, see `translate::copied_metadata`). It carries each label `k: v`
//! as `svc.tidepool.io/<hash of k>: v` instead ([`selector_labels`]), and a mirror selects by
//! the same translation of the Service's selector ([`selector_key`]). A mirror therefore
//! selects exactly the copies whose training pods the training Service selects, and nothing
//! the member runs: no selector of the member's uses tidepool's prefix, and a tenant's label
//! `app: frontend` on a pod reaches the member only as `svc.tidepool.io/k-…: frontend`, which
//! no online Service, policy or monitor matches. Services select only in their own
//! namespace, which is tidepool's, so a mirror never selects an online pod either.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest, Sha256};
use tidepool_api::keys;

use tidepool_api::pod::PodAddress;

/// The label key a copy carries for training label key `key`: `svc.tidepool.io/k-<hash>`
/// (16 hex digits of its SHA-256). Fixed length, so any key fits a label name.
pub fn selector_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{}/k-{hex}", keys::SELECTOR_LABEL_PREFIX)
}

/// The selector labels of a copy whose training pod has `labels`.
pub fn selector_labels(labels: Option<&BTreeMap<String, String>>) -> BTreeMap<String, String> {
    labels.into_iter().flatten().map(|(k, v)| (selector_key(k), v.clone())).collect()
}

/// The selector of a training Service tidepool mirrors: one with a non-empty selector (a
/// Service without one has its endpoints written by someone else) that is not an
/// `ExternalName` (only a DNS alias, nothing to select).
pub fn mirrorable(svc: &Service) -> Option<&BTreeMap<String, String>> {
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return None;
    }
    spec.selector.as_ref().filter(|s| !s.is_empty())
}

/// True when a pod with `labels` matches `selector` (every pair present).
pub fn selects(selector: &BTreeMap<String, String>, labels: Option<&BTreeMap<String, String>>) -> bool {
    let Some(labels) = labels else { return selector.is_empty() };
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A training Service: namespace and name.
pub type ServiceKey = (String, String);

/// A native pod of the training cluster: its namespace, labels and address.
#[derive(Debug, Clone, Copy)]
pub struct NativePod<'a> {
    pub namespace: &'a str,
    pub labels: Option<&'a BTreeMap<String, String>>,
    pub address: &'a PodAddress,
}

/// Whether training Service `svc` selects one of the `native` pods: then, where the member
/// runs a copy in its namespace, the Service is mirrored for the native pods' sake too.
pub fn selects_native(svc: &Service, native: &[NativePod<'_>]) -> bool {
    let (Some(ns), Some(selector)) = (svc.metadata.namespace.as_deref(), mirrorable(svc)) else { return false };
    native.iter().any(|p| p.namespace == ns && selects(selector, p.labels))
}

/// The training Services to mirror into a member: those that select a training pod with a
/// copy there, and those that select a native pod of a namespace with a copy there (its
/// copies may be the elastic part of a job on the native floor, reaching its core by name:
/// see [`crate::native_slices`]). `copies` holds, for each copy, its training pod's namespace
/// and labels.
pub fn wanted<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    copies: &[(String, Option<BTreeMap<String, String>>)],
    native: &[NativePod<'_>],
) -> BTreeSet<ServiceKey> {
    let mut found = BTreeSet::new();
    for svc in services {
        let (Some(ns), Some(name)) = (svc.metadata.namespace.as_deref(), svc.metadata.name.as_deref()) else {
            continue;
        };
        let Some(selector) = mirrorable(svc) else { continue };
        let in_ns = copies.iter().filter(|(pod_ns, _)| pod_ns == ns);
        let copy_selected = in_ns.clone().any(|(_, labels)| selects(selector, labels.as_ref()));
        if copy_selected || (in_ns.count() > 0 && selects_native(svc, native)) {
            found.insert((ns.to_owned(), name.to_owned()));
        }
    }
    found
}

/// Where a mirror goes: this instance, this member, the member namespace.
#[derive(Debug, Clone, Copy)]
pub struct MirrorTarget<'a> {
    pub cluster: &'a str,
    pub member: &'a str,
    pub namespace: &'a str,
}

/// Label selector of the mirrors one tidepool instance made in one member.
pub fn mirror_selector(cluster: &str, member: &str) -> String {
    format!(
        "{}=true,{}={cluster},{}={member}",
        keys::LABEL_MIRRORED,
        keys::LABEL_ORIGIN_CLUSTER,
        keys::LABEL_ORIGIN_MEMBER
    )
}

/// True when `meta` is a mirror this instance made in this member: anything else of the
/// same name is somebody's, and is never overwritten.
pub fn is_ours(meta: &ObjectMeta, cluster: &str, member: &str) -> bool {
    let Some(labels) = meta.labels.as_ref() else { return false };
    labels.get(keys::LABEL_MIRRORED).map(String::as_str) == Some("true")
        && labels.get(keys::LABEL_ORIGIN_CLUSTER).map(String::as_str) == Some(cluster)
        && labels.get(keys::LABEL_ORIGIN_MEMBER).map(String::as_str) == Some(member)
}

fn is_headless(spec: Option<&ServiceSpec>) -> bool {
    spec.and_then(|s| s.cluster_ip.as_deref()) == Some("None")
}

/// The member mirror of training Service `svc`, or `None` if it is not mirrored. Same name,
/// ports (names, numbers, target ports, protocols) and headlessness, the selector translated
/// ([`selector_key`]), `publishNotReadyAddresses` and session affinity kept. Always of type
/// `ClusterIP`: a NodePort or LoadBalancer would open the member's nodes or cloud to the
/// tenant. The member allocates its own cluster IP.
pub fn mirrored_service(svc: &Service, target: &MirrorTarget<'_>) -> Option<Service> {
    let selector = mirrorable(svc)?;
    let spec = svc.spec.as_ref()?;
    let name = svc.metadata.name.clone()?;
    let labels = [
        (keys::LABEL_MANAGED_BY, keys::MANAGED_BY),
        (keys::LABEL_MIRRORED, "true"),
        (keys::LABEL_ORIGIN_CLUSTER, target.cluster),
        (keys::LABEL_ORIGIN_MEMBER, target.member),
    ];
    let annotations = [
        (keys::ANNOTATION_ORIGIN_NAMESPACE, svc.metadata.namespace.clone().unwrap_or_default()),
        (keys::ANNOTATION_ORIGIN_NAME, name.clone()),
        (keys::ANNOTATION_ORIGIN_RESOURCE_VERSION, svc.metadata.resource_version.clone().unwrap_or_default()),
        (keys::ANNOTATION_ORIGIN_SELECTOR, serde_json::to_string(selector).unwrap_or_default()),
    ];
    let ports: Vec<ServicePort> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| ServicePort {
            name: p.name.clone(),
            port: p.port,
            target_port: p.target_port.clone(),
            protocol: p.protocol.clone(),
            app_protocol: p.app_protocol.clone(),
            node_port: None,
        })
        .collect();
    Some(Service {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(target.namespace.to_owned()),
            labels: Some(labels.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect()),
            annotations: Some(annotations.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            cluster_ip: is_headless(Some(spec)).then(|| "None".to_owned()),
            selector: Some(selector.iter().map(|(k, v)| (selector_key(k), v.clone())).collect()),
            ports: (!ports.is_empty()).then_some(ports),
            publish_not_ready_addresses: spec.publish_not_ready_addresses,
            session_affinity: spec.session_affinity.clone(),
            session_affinity_config: spec.session_affinity_config.clone(),
            ..Default::default()
        }),
        status: None,
    })
}

/// One write that brings a member's mirrors to what is wanted.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// No mirror of this name of ours: create it (the member may hold somebody's).
    Create(Service),
    /// Ours and stale: replace its spec and metadata, keeping its cluster IP.
    Update(Service),
    /// Ours, but headless became not, or back: the cluster IP is immutable.
    Recreate(Service),
    /// Ours and no longer wanted: delete (namespace, name).
    Delete(String, String),
}

/// A namespaced object's namespace and name.
pub fn key_of(meta: &ObjectMeta) -> (String, String) {
    (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
}

/// The writes that turn `existing` (this instance's mirrors in the member) into `desired`
/// (the mirrors wanted, from [`mirrored_service`]). A mirror made from the training
/// Service's current version is left alone, so a steady state writes nothing.
pub fn plan(desired: &[Service], existing: &[Service]) -> Vec<Step> {
    let have: BTreeMap<(String, String), &Service> = existing.iter().map(|s| (key_of(&s.metadata), s)).collect();
    let want: BTreeSet<(String, String)> = desired.iter().map(|s| key_of(&s.metadata)).collect();
    let mut steps = Vec::new();
    for svc in desired {
        let version = |s: &Service| {
            s.metadata.annotations.as_ref().and_then(|a| a.get(keys::ANNOTATION_ORIGIN_RESOURCE_VERSION)).cloned()
        };
        match have.get(&key_of(&svc.metadata)) {
            None => steps.push(Step::Create(svc.clone())),
            Some(old) if is_headless(old.spec.as_ref()) != is_headless(svc.spec.as_ref()) => {
                steps.push(Step::Recreate(svc.clone()));
            }
            Some(old) if version(old) != version(svc) => steps.push(Step::Update(svc.clone())),
            Some(_) => {}
        }
    }
    for (ns, name) in have.keys().filter(|k| !want.contains(*k)) {
        steps.push(Step::Delete(ns.clone(), name.clone()));
    }
    steps
}

/// `desired` written over `existing` for an update: tidepool's metadata and spec, with the
/// cluster IPs and address families the member allocated (immutable) and the version read.
pub fn updated(existing: &Service, desired: &Service) -> Service {
    let mut svc = desired.clone();
    svc.metadata.resource_version = existing.metadata.resource_version.clone();
    if let (Some(spec), Some(old)) = (svc.spec.as_mut(), existing.spec.as_ref()) {
        spec.cluster_ip = old.cluster_ip.clone();
        spec.cluster_ips = old.cluster_ips.clone();
        spec.ip_families = old.ip_families.clone();
        spec.ip_family_policy = old.ip_family_policy.clone();
    }
    svc
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(v: serde_json::Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    fn master() -> Service {
        service(json!({
            "metadata": {"name": "job-master", "namespace": "team-a", "resourceVersion": "7", "uid": "s1",
                         "labels": {"app": "x"}},
            "spec": {"type": "NodePort", "clusterIP": "10.0.0.5", "clusterIPs": ["10.0.0.5"],
                     "selector": {"job": "j", "role": "master"},
                     "publishNotReadyAddresses": true,
                     "ports": [{"name": "rdzv", "port": 23456, "targetPort": "rdzv", "protocol": "TCP", "nodePort": 30001}]}
        }))
    }

    fn target() -> MirrorTarget<'static> {
        MirrorTarget { cluster: "training", member: "member-a", namespace: "tp-team-a" }
    }

    fn labels(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
        Some(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
    }

    #[test]
    fn a_mirror_selects_by_translated_labels_exactly_what_the_training_service_selects() {
        let mirror = mirrored_service(&master(), &target()).unwrap();
        let selector = mirror.spec.as_ref().unwrap().selector.clone().unwrap();
        // The copy of a master pod carries the translation of its labels, and more.
        let copy = selector_labels(labels(&[("job", "j"), ("role", "master"), ("extra", "1")]).as_ref());
        assert!(selects(&selector, Some(&copy)));
        // A worker's copy does not match, and no tenant key appears in the member selector.
        let worker = selector_labels(labels(&[("job", "j"), ("role", "worker")]).as_ref());
        assert!(!selects(&selector, Some(&worker)));
        assert!(
            selector.keys().all(|k| k.starts_with("svc.tidepool.io/k-") && k.len() == "svc.tidepool.io/k-".len() + 16)
        );
        assert_eq!(
            selector.values().cloned().collect::<BTreeSet<_>>(),
            BTreeSet::from(["j".to_owned(), "master".to_owned()])
        );
    }

    #[test]
    fn a_tenant_label_never_reaches_the_member_as_itself() {
        // An attacker labels its pod like the member's online frontend: the copy carries only
        // tidepool's prefix, so no selector of the member's matches it.
        let copy = selector_labels(labels(&[("app", "frontend"), ("app.kubernetes.io/name", "frontend")]).as_ref());
        let online = BTreeMap::from([("app".to_owned(), "frontend".to_owned())]);
        assert!(!selects(&online, Some(&copy)));
        assert!(copy.keys().all(|k| k.starts_with("svc.tidepool.io/")));
        assert_ne!(selector_key("app"), selector_key("app.kubernetes.io/name"));
        assert_eq!(selector_key("app"), selector_key("app"), "stable, so copies and mirrors agree");
    }

    #[test]
    fn the_mirror_keeps_name_ports_and_readiness_and_never_opens_node_ports() {
        let m = mirrored_service(&master(), &target()).unwrap();
        assert_eq!(m.metadata.name.as_deref(), Some("job-master"));
        assert_eq!(m.metadata.namespace.as_deref(), Some("tp-team-a"));
        assert!(is_ours(&m.metadata, "training", "member-a"));
        assert!(!is_ours(&m.metadata, "training", "member-b") && !is_ours(&m.metadata, "other", "member-a"));
        assert!(!m.metadata.labels.as_ref().unwrap().contains_key("app"), "the Service's own labels stay");
        let spec = m.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        assert_eq!(spec.cluster_ip, None, "the member allocates its own");
        assert_eq!(spec.publish_not_ready_addresses, Some(true));
        let port = &spec.ports.unwrap()[0];
        assert_eq!((port.name.as_deref(), port.port, port.node_port), (Some("rdzv"), 23456, None));
        assert_eq!(serde_json::to_value(&port.target_port).unwrap(), json!("rdzv"));
        let a = m.metadata.annotations.unwrap();
        assert_eq!(a[keys::ANNOTATION_ORIGIN_RESOURCE_VERSION], "7");
        assert_eq!(a[keys::ANNOTATION_ORIGIN_SELECTOR], r#"{"job":"j","role":"master"}"#);
    }

    #[test]
    fn headless_stays_headless_and_services_without_selector_or_external_names_are_not_mirrored() {
        let headless = service(json!({"metadata": {"name": "workers", "namespace": "team-a"},
                                      "spec": {"clusterIP": "None", "selector": {"job": "j"}}}));
        let m = mirrored_service(&headless, &target()).unwrap();
        assert_eq!(m.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("None"));
        assert_eq!(m.spec.unwrap().ports, None);
        let manual =
            service(json!({"metadata": {"name": "db", "namespace": "team-a"}, "spec": {"ports": [{"port": 5432}]}}));
        let alias = service(json!({"metadata": {"name": "ext", "namespace": "team-a"},
                                   "spec": {"type": "ExternalName", "externalName": "x.example", "selector": {"job": "j"}}}));
        assert_eq!(mirrored_service(&manual, &target()), None);
        assert_eq!(mirrored_service(&alias, &target()), None);
    }

    #[test]
    fn a_service_is_wanted_where_it_selects_a_pod_with_a_copy_in_its_namespace() {
        let worker_svc = service(
            json!({"metadata": {"name": "w", "namespace": "team-a"}, "spec": {"selector": {"role": "worker"}}}),
        );
        let other_ns = service(
            json!({"metadata": {"name": "m", "namespace": "team-b"}, "spec": {"selector": {"role": "master"}}}),
        );
        let services = [master(), worker_svc, other_ns];
        let copies = vec![
            ("team-a".to_owned(), labels(&[("job", "j"), ("role", "master")])),
            ("team-c".to_owned(), labels(&[("role", "worker")])),
        ];
        assert_eq!(wanted(&services, &copies, &[]), BTreeSet::from([("team-a".to_owned(), "job-master".to_owned())]));
        // The last matching copy gone: nothing is wanted any more.
        assert!(wanted(&services, &copies[1..], &[]).is_empty());
    }

    #[test]
    fn a_service_of_native_pods_is_wanted_where_a_copy_runs_in_its_namespace() {
        let worker_svc = service(
            json!({"metadata": {"name": "w", "namespace": "team-a"}, "spec": {"selector": {"role": "worker"}}}),
        );
        let services = [master(), worker_svc];
        let (master_labels, address) = (labels(&[("job", "j"), ("role", "master")]).unwrap(), PodAddress::default());
        let native = [NativePod { namespace: "team-a", labels: Some(&master_labels), address: &address }];
        let worker_copy = vec![("team-a".to_owned(), labels(&[("role", "worker")]))];
        let want = |ns: &str, name: &str| (ns.to_owned(), name.to_owned());
        assert_eq!(
            wanted(&services, &worker_copy, &native),
            BTreeSet::from([want("team-a", "job-master"), want("team-a", "w")])
        );
        // No copy in the namespace: the native pods alone mirror nothing.
        let elsewhere = vec![("team-b".to_owned(), labels(&[("role", "worker")]))];
        assert!(wanted(&services, &elsewhere, &native).is_empty());
    }

    #[test]
    fn the_plan_creates_updates_recreates_and_deletes_only_what_differs() {
        let current = mirrored_service(&master(), &target()).unwrap();
        let mut newer_source = master();
        newer_source.metadata.resource_version = Some("8".into());
        let newer = mirrored_service(&newer_source, &target()).unwrap();
        let mut headless_source = newer_source.clone();
        headless_source.spec.as_mut().unwrap().cluster_ip = Some("None".into());
        let headless = mirrored_service(&headless_source, &target()).unwrap();
        let mut stale = current.clone();
        stale.metadata.name = Some("gone".into());

        let one = std::slice::from_ref;
        assert_eq!(plan(one(&current), one(&current)), vec![], "a steady state writes nothing");
        assert_eq!(plan(one(&current), &[]), vec![Step::Create(current.clone())]);
        assert_eq!(plan(one(&newer), one(&current)), vec![Step::Update(newer.clone())]);
        assert_eq!(plan(one(&headless), one(&current)), vec![Step::Recreate(headless.clone())]);
        assert_eq!(
            plan(&[], &[current.clone(), stale]),
            vec![
                Step::Delete("tp-team-a".into(), "gone".into()),
                Step::Delete("tp-team-a".into(), "job-master".into())
            ]
        );
    }

    #[test]
    fn an_update_keeps_the_ip_the_member_allocated() {
        let mut existing = mirrored_service(&master(), &target()).unwrap();
        existing.metadata.resource_version = Some("m-3".into());
        existing.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.9".into());
        existing.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.9".into()]);
        let desired = mirrored_service(&master(), &target()).unwrap();
        let u = updated(&existing, &desired);
        assert_eq!(u.metadata.resource_version.as_deref(), Some("m-3"));
        assert_eq!(u.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("10.96.0.9"));
        assert_eq!(u.spec.unwrap().selector, desired.spec.unwrap().selector);
    }
}
