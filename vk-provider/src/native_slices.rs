//! The names of a job's native pods in a member, the pure part: which endpoints a mirror's
//! EndpointSlice lists, and what to write to make a member's slices match.
//!
//! A job on the native floor runs its core on the training cluster's own nodes and its
//! elastic pods as copies in a member. The copies find their peers by the job's names
//! (`<job>-worker-0`, `MASTER_ADDR`, `<pod>.<subdomain>`), and the member's DNS answers only
//! from the member's EndpointSlices. So a mirror whose training Service selects native pods
//! gets one more EndpointSlice next to the member's own: `<mirror>-native`, listing those
//! pods' IPs (and `<hostname>` under the mirror's name, as the EndpointSlice controller would
//! for a pod in the member), labelled with the mirror's name and managed by tidepool, so the
//! member's controller leaves it alone and its DNS and service proxy read it as one of the
//! mirror's. It is owned by the mirror: when the mirror goes, the member collects it.
//!
//! The pod networks must be routable between the clusters (the admin guide says so); the
//! slice carries no `targetRef` and no `nodeName`: the pods it lists are not the member's.
//! One address family per slice: the family of the first IP of the first pod listed.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tidepool_api::pod::PodAddress;

use crate::services::{NativePod, key_of, mirrorable, selects};

/// The `kubernetes.io/service-name` label: the Service a slice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The `endpointslice.kubernetes.io/managed-by` label: which controller writes a slice. The
/// member's EndpointSlice controller writes only those that carry its own value.
pub const LABEL_SLICE_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
/// Tidepool's value of [`LABEL_SLICE_MANAGED_BY`].
pub const SLICE_MANAGER: &str = "tidepool.io";
/// Suffix of a native slice's name: six letters, where the member's controller appends five
/// random ones to the Service's name, so the two never collide.
pub const SLICE_SUFFIX: &str = "-native";

/// The native slice of `mirror` (as it is in the member, with its UID), made from its
/// training Service `svc`: the `native` pods `svc` selects, or `None` when it selects none.
pub fn native_slice(svc: &Service, mirror: &Service, native: &[NativePod<'_>]) -> Option<EndpointSlice> {
    let (ns, selector) = (svc.metadata.namespace.as_deref()?, mirrorable(svc)?);
    let name = mirror.metadata.name.clone()?;
    let uid = mirror.metadata.uid.clone()?;
    let spec = svc.spec.as_ref()?;
    let publish_not_ready = spec.publish_not_ready_addresses == Some(true);
    let selected: Vec<&PodAddress> =
        native.iter().filter(|p| p.namespace == ns && selects(selector, p.labels)).map(|p| p.address).collect();
    let family = selected.iter().flat_map(|a| a.ips.iter()).find_map(|ip| family_of(ip))?;
    let mut endpoints: Vec<Endpoint> =
        selected.iter().filter_map(|a| endpoint(a, family, &name, publish_not_ready)).collect();
    endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
    let ports: Vec<EndpointPort> = spec.ports.iter().flatten().filter_map(endpoint_port).collect();
    let mut labels = mirror.metadata.labels.clone().unwrap_or_default();
    labels.insert(LABEL_SERVICE_NAME.to_owned(), name.clone());
    labels.insert(LABEL_SLICE_MANAGED_BY.to_owned(), SLICE_MANAGER.to_owned());
    Some(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{name}{SLICE_SUFFIX}")),
            namespace: mirror.metadata.namespace.clone(),
            labels: Some(labels),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Service".to_owned(),
                name,
                uid,
                ..Default::default()
            }]),
            ..Default::default()
        },
        address_type: family.to_owned(),
        endpoints: Some(endpoints),
        ports: Some(ports),
    })
}

/// `IPv4` or `IPv6` for an IP, `None` for anything else.
fn family_of(ip: &str) -> Option<&'static str> {
    match ip.parse::<IpAddr>().ok()? {
        IpAddr::V4(_) => Some("IPv4"),
        IpAddr::V6(_) => Some("IPv6"),
    }
}

/// The endpoint of one native pod: its IP of `family`, its conditions as the EndpointSlice
/// controller derives them, and its hostname when its subdomain is the Service's name.
fn endpoint(address: &PodAddress, family: &str, service: &str, publish_not_ready: bool) -> Option<Endpoint> {
    let ip = address.ips.iter().find(|ip| family_of(ip) == Some(family))?;
    let hostname =
        address.hostname.clone().filter(|h| address.subdomain.as_deref() == Some(service) && is_dns_label(h));
    Some(Endpoint {
        addresses: vec![ip.clone()],
        conditions: Some(EndpointConditions {
            ready: Some(publish_not_ready || (address.ready && !address.terminating)),
            serving: Some(address.ready),
            terminating: Some(address.terminating),
        }),
        hostname,
        ..Default::default()
    })
}

/// A Service port as an endpoint port: the number the pod listens on. A named target port
/// would need the pod's container ports, which the cache does not keep: left out (the name
/// still resolves, only the SRV record of that port is missing).
fn endpoint_port(p: &k8s_openapi::api::core::v1::ServicePort) -> Option<EndpointPort> {
    let port = match &p.target_port {
        None => p.port,
        Some(IntOrString::Int(n)) => *n,
        Some(IntOrString::String(_)) => return None,
    };
    Some(EndpointPort {
        name: Some(p.name.clone().unwrap_or_default()),
        port: Some(port),
        protocol: p.protocol.clone().or_else(|| Some("TCP".to_owned())),
        app_protocol: p.app_protocol.clone(),
    })
}

/// An RFC 1123 label: what the API server takes as an endpoint's hostname.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// One write that brings a member's native slices to what is wanted.
#[derive(Debug, Clone, PartialEq)]
pub enum SliceStep {
    Create(EndpointSlice),
    /// Replace with this (the version read kept).
    Update(EndpointSlice),
    /// Delete (namespace, name).
    Delete(String, String),
}

/// The writes that turn `existing` (this instance's native slices in the member) into
/// `desired`: a slice whose endpoints, ports, labels and owner are as wanted is left alone.
pub fn plan(desired: &[EndpointSlice], existing: &[EndpointSlice]) -> Vec<SliceStep> {
    let have: BTreeMap<(String, String), &EndpointSlice> = existing.iter().map(|s| (key_of(&s.metadata), s)).collect();
    let mut steps = Vec::new();
    for slice in desired {
        match have.get(&key_of(&slice.metadata)) {
            None => steps.push(SliceStep::Create(slice.clone())),
            Some(old) if !same(old, slice) => {
                let mut new = slice.clone();
                new.metadata.resource_version = old.metadata.resource_version.clone();
                steps.push(SliceStep::Update(new));
            }
            Some(_) => {}
        }
    }
    let want: std::collections::BTreeSet<(String, String)> = desired.iter().map(|s| key_of(&s.metadata)).collect();
    for (ns, name) in have.keys().filter(|k| !want.contains(*k)) {
        steps.push(SliceStep::Delete(ns.clone(), name.clone()));
    }
    steps
}

fn same(a: &EndpointSlice, b: &EndpointSlice) -> bool {
    let owners =
        |s: &EndpointSlice| s.metadata.owner_references.iter().flatten().map(|o| o.uid.clone()).collect::<Vec<_>>();
    a.address_type == b.address_type
        && a.endpoints.clone().unwrap_or_default() == b.endpoints.clone().unwrap_or_default()
        && a.ports.clone().unwrap_or_default() == b.ports.clone().unwrap_or_default()
        && a.metadata.labels == b.metadata.labels
        && owners(a) == owners(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::{MirrorTarget, mirrored_service, selects_native};
    use serde_json::json;

    fn worker0() -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "job-worker-0", "namespace": "team-a", "resourceVersion": "3"},
            "spec": {"clusterIP": "None", "selector": {"job": "j", "index": "0"},
                     "ports": [{"name": "rdzv", "port": 29400}, {"name": "named", "port": 80, "targetPort": "http"}]}
        }))
        .unwrap()
    }

    fn mirror_of(svc: &Service) -> Service {
        let target = MirrorTarget { cluster: "training", member: "member-a", namespace: "tp-team-a" };
        let mut m = mirrored_service(svc, &target).unwrap();
        m.metadata.uid = Some("mirror-uid".into());
        m
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn address(ip: &str, ready: bool) -> PodAddress {
        PodAddress {
            ips: vec![ip.to_owned()],
            hostname: Some("job-worker-0".into()),
            subdomain: Some("job-worker-0".into()),
            ready,
            terminating: false,
        }
    }

    #[test]
    fn a_slice_lists_the_native_pods_the_training_service_selects_and_belongs_to_the_mirror() {
        let (w0, w1) = (labels(&[("job", "j"), ("index", "0")]), labels(&[("job", "j"), ("index", "1")]));
        let (a0, a1) = (address("10.1.0.7", true), address("10.1.0.8", true));
        let native = [
            NativePod { namespace: "team-a", labels: Some(&w0), address: &a0 },
            NativePod { namespace: "team-a", labels: Some(&w1), address: &a1 },
            NativePod { namespace: "team-b", labels: Some(&w0), address: &a1 },
        ];
        let svc = worker0();
        assert!(selects_native(&svc, &native));
        let slice = native_slice(&svc, &mirror_of(&svc), &native).unwrap();
        assert_eq!(slice.metadata.name.as_deref(), Some("job-worker-0-native"));
        assert_eq!(slice.metadata.namespace.as_deref(), Some("tp-team-a"));
        let l = slice.metadata.labels.as_ref().unwrap();
        assert_eq!(l[LABEL_SERVICE_NAME], "job-worker-0");
        assert_eq!(l[LABEL_SLICE_MANAGED_BY], SLICE_MANAGER);
        assert!(crate::services::is_ours(&slice.metadata, "training", "member-a"));
        assert_eq!(slice.metadata.owner_references.as_ref().unwrap()[0].uid, "mirror-uid");
        assert_eq!(slice.address_type, "IPv4");
        let endpoints = slice.endpoints.clone().unwrap();
        assert_eq!(endpoints.len(), 1, "only the selected pod of the Service's namespace");
        let e = &endpoints[0];
        assert_eq!(e.addresses, ["10.1.0.7"]);
        assert_eq!(e.hostname.as_deref(), Some("job-worker-0"));
        assert_eq!((e.target_ref.as_ref(), e.node_name.as_ref()), (None, None), "not the member's pods");
        let ports = slice.ports.unwrap();
        assert_eq!(ports.len(), 1, "a named target port is left out");
        assert_eq!((ports[0].port, ports[0].protocol.as_deref()), (Some(29400), Some("TCP")));
    }

    #[test]
    fn readiness_follows_the_pod_unless_the_service_publishes_not_ready_addresses() {
        let w0 = labels(&[("job", "j"), ("index", "0")]);
        let starting = address("10.1.0.7", false);
        let native = [NativePod { namespace: "team-a", labels: Some(&w0), address: &starting }];
        let mut svc = worker0();
        let ready = |svc: &Service| {
            let endpoints = native_slice(svc, &mirror_of(svc), &native).unwrap().endpoints.unwrap();
            endpoints[0].conditions.clone().unwrap().ready
        };
        assert_eq!(ready(&svc), Some(false));
        svc.spec.as_mut().unwrap().publish_not_ready_addresses = Some(true);
        assert_eq!(ready(&svc), Some(true));
    }

    #[test]
    fn no_selected_pod_or_a_bad_hostname_gives_no_slice_or_no_name() {
        let other = labels(&[("job", "k")]);
        let a = address("10.1.0.7", true);
        let svc = worker0();
        let unselected = [NativePod { namespace: "team-a", labels: Some(&other), address: &a }];
        assert!(!selects_native(&svc, &unselected));
        assert_eq!(native_slice(&svc, &mirror_of(&svc), &unselected), None);
        let w0 = labels(&[("job", "j"), ("index", "0")]);
        let mut odd = address("10.1.0.7", true);
        odd.hostname = Some("Not_A_Label".into());
        let native = [NativePod { namespace: "team-a", labels: Some(&w0), address: &odd }];
        let endpoints = native_slice(&svc, &mirror_of(&svc), &native).unwrap().endpoints.unwrap();
        assert_eq!(endpoints[0].hostname, None);
    }

    #[test]
    fn the_plan_writes_only_what_differs() {
        let w0 = labels(&[("job", "j"), ("index", "0")]);
        let (a, moved) = (address("10.1.0.7", true), address("10.1.0.9", true));
        let svc = worker0();
        let slice = |addr: &PodAddress| {
            native_slice(&svc, &mirror_of(&svc), &[NativePod { namespace: "team-a", labels: Some(&w0), address: addr }])
                .unwrap()
        };
        let mut current = slice(&a);
        current.metadata.resource_version = Some("41".into());
        let one = std::slice::from_ref;
        assert_eq!(plan(one(&slice(&a)), one(&current)), vec![], "a steady state writes nothing");
        assert_eq!(plan(one(&slice(&a)), &[]), vec![SliceStep::Create(slice(&a))]);
        let SliceStep::Update(updated) = &plan(one(&slice(&moved)), one(&current))[0] else { panic!("an update") };
        assert_eq!(updated.metadata.resource_version.as_deref(), Some("41"));
        assert_eq!(updated.endpoints.as_ref().unwrap()[0].addresses, ["10.1.0.9"]);
        assert_eq!(plan(&[], one(&current)), vec![SliceStep::Delete("tp-team-a".into(), "job-worker-0-native".into())]);
    }
}
