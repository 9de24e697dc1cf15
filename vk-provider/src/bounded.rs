//! What a member's status may say about a copy on its way up to the training pod. The member
//! is trusted to run the copy, not to write anything it likes into the training cluster: its
//! API server (or whoever holds it) could otherwise forge tidepool's own conditions (a reclaim
//! notice that never came), grow the training pod past etcd's object limit, forge lines in
//! `kubectl describe` with control characters, or hand up a pod IP that is not an address.
//! Pure: tested on plain data.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, PodCondition, PodIP, PodStatus};
use tidepool_api::text::{cut, shown};
use tidepool_federation::pod_network::PodNetwork;

/// Conditions kept (a kubelet writes five; a member's gang scheduler or readiness gates a few).
pub const MAX_CONDITIONS: usize = 16;
/// Container statuses kept per list (the API server's own bound on containers is higher, but
/// no training pod a tenant wrote has this many).
pub const MAX_CONTAINERS: usize = 64;
/// Bytes of a reason (a CamelCase word in Kubernetes' own).
pub const MAX_REASON: usize = 128;
/// Bytes of a message.
pub const MAX_MESSAGE: usize = 1024;
/// Bytes of a container's termination message: the kubelet's own bound (a trainer's ack is
/// read from it, so it is cut, never escaped).
pub const MAX_TERMINATION_MESSAGE: usize = 4096;
/// Bytes of an image reference or ID.
pub const MAX_IMAGE: usize = 512;

/// Bounds `s`, a member's status of a copy, in place: tidepool's own condition types dropped
/// (only tidepool writes them, on the training pod), conditions unique by type and at most
/// [`MAX_CONDITIONS`], texts bounded and escaped, container statuses unique by name and
/// at most [`MAX_CONTAINERS`] per list, pod IPs only addresses (at most one per family).
pub fn from_member(s: &mut PodStatus) {
    s.reason = s.reason.as_deref().map(|r| shown(r, MAX_REASON));
    s.message = s.message.as_deref().map(|m| shown(m, MAX_MESSAGE));
    if let Some(conditions) = s.conditions.take() {
        s.conditions = Some(conditions_from_member(conditions));
    }
    for list in [&mut s.container_statuses, &mut s.init_container_statuses, &mut s.ephemeral_container_statuses] {
        if let Some(statuses) = list.take() {
            *list = Some(containers_from_member(statuses));
        }
    }
    let (pod_ip, pod_ips) = ips_from_member(s.pod_ip.as_deref(), s.pod_ips.as_deref().unwrap_or_default());
    s.pod_ip = pod_ip;
    s.pod_ips = (!pod_ips.is_empty()).then_some(pod_ips);
}

fn conditions_from_member(conditions: Vec<PodCondition>) -> Vec<PodCondition> {
    let mut kept: Vec<PodCondition> = Vec::new();
    for mut c in conditions {
        if tidepool_api::pod::is_tidepool_type(&c.type_) || kept.iter().any(|k| k.type_ == c.type_) {
            continue;
        }
        if kept.len() == MAX_CONDITIONS {
            break;
        }
        c.type_ = shown(&c.type_, MAX_REASON);
        c.reason = c.reason.as_deref().map(|r| shown(r, MAX_REASON));
        c.message = c.message.as_deref().map(|m| shown(m, MAX_MESSAGE));
        kept.push(c);
    }
    kept
}

fn containers_from_member(statuses: Vec<ContainerStatus>) -> Vec<ContainerStatus> {
    let mut kept: Vec<ContainerStatus> = Vec::new();
    for mut c in statuses {
        if kept.iter().any(|k| k.name == c.name) {
            continue;
        }
        if kept.len() == MAX_CONTAINERS {
            break;
        }
        c.image = cut(&c.image, MAX_IMAGE).to_owned();
        c.image_id = cut(&c.image_id, MAX_IMAGE).to_owned();
        c.container_id = c.container_id.as_deref().map(|id| cut(id, MAX_IMAGE).to_owned());
        for state in [c.state.as_mut(), c.last_state.as_mut()].into_iter().flatten() {
            bound_state(state);
        }
        kept.push(c);
    }
    kept
}

fn bound_state(state: &mut ContainerState) {
    if let Some(w) = state.waiting.as_mut() {
        w.reason = w.reason.as_deref().map(|r| shown(r, MAX_REASON));
        w.message = w.message.as_deref().map(|m| shown(m, MAX_MESSAGE));
    }
    if let Some(t) = state.terminated.as_mut() {
        t.reason = t.reason.as_deref().map(|r| shown(r, MAX_REASON));
        t.message = t.message.as_deref().map(|m| cut(m, MAX_TERMINATION_MESSAGE).to_owned());
    }
}

/// Drops the pod IPs of `s` outside `declared`, the member's pod network as its admin
/// declares it (`spec.podCIDRs`; empty: nothing declared, nothing dropped); `host_network`
/// pods report their node's address, which no pod network holds. `pod_ip` is the first kept.
pub fn within_pod_network(s: &mut PodStatus, declared: &PodNetwork, host_network: bool) {
    if declared.is_empty() || host_network {
        return;
    }
    let inside = |ip: &str| ip.parse::<IpAddr>().is_ok_and(|ip| declared.contains(ip));
    let kept: Vec<PodIP> = s.pod_ips.take().into_iter().flatten().filter(|p| inside(&p.ip)).collect();
    s.pod_ip = s.pod_ip.take().filter(|ip| inside(ip)).or_else(|| kept.first().map(|p| p.ip.clone()));
    s.pod_ips = (!kept.is_empty()).then_some(kept);
}

/// The member's pod IPs that are addresses, at most one IPv4 and one IPv6, `pod_ip` the
/// first of them (as the API server keeps it).
fn ips_from_member(pod_ip: Option<&str>, pod_ips: &[PodIP]) -> (Option<String>, Vec<PodIP>) {
    let mut kept: Vec<IpAddr> = Vec::new();
    for ip in pod_ip.into_iter().chain(pod_ips.iter().map(|p| p.ip.as_str())) {
        let Ok(ip) = ip.parse::<IpAddr>() else { continue };
        if !kept.iter().any(|k| k.is_ipv4() == ip.is_ipv4()) {
            kept.push(ip);
        }
    }
    let first = kept.first().map(IpAddr::to_string);
    (first, kept.into_iter().map(|ip| PodIP { ip: ip.to_string() }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status(v: serde_json::Value) -> PodStatus {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_member_cannot_write_tidepools_own_conditions() {
        let mut s = status(json!({"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "tidepool.io/ReclaimRequested", "status": "True", "reason": "Forged"},
            {"type": "Ready", "status": "False"},
        ]}));
        from_member(&mut s);
        let conditions = s.conditions.unwrap();
        assert_eq!(conditions.len(), 1, "{conditions:?}");
        assert_eq!((conditions[0].type_.as_str(), conditions[0].status.as_str()), ("Ready", "True"));
    }

    #[test]
    fn conditions_and_containers_are_bounded_in_number_and_size() {
        let many: Vec<_> = (0..100).map(|i| json!({"type": format!("c{i}"), "status": "True"})).collect();
        let containers: Vec<_> = (0..100)
            .map(|i| {
                json!({"name": format!("c{i}"), "image": "x".repeat(10_000), "imageID": "", "ready": false,
                            "restartCount": 0,
                            "state": {"terminated": {"exitCode": 1, "message": "m".repeat(100_000),
                                                     "reason": "r".repeat(10_000)}}})
            })
            .collect();
        let mut s = status(json!({"conditions": many, "containerStatuses": containers,
                                  "message": "\x1b[2J".repeat(10_000)}));
        from_member(&mut s);
        assert_eq!(s.conditions.unwrap().len(), MAX_CONDITIONS);
        let containers = s.container_statuses.unwrap();
        assert_eq!(containers.len(), MAX_CONTAINERS);
        let terminated = containers[0].state.as_ref().unwrap().terminated.as_ref().unwrap();
        assert_eq!(terminated.message.as_ref().unwrap().len(), MAX_TERMINATION_MESSAGE);
        assert!(terminated.reason.as_ref().unwrap().len() <= MAX_REASON);
        assert!(containers[0].image.len() <= MAX_IMAGE);
        let message = s.message.unwrap();
        assert!(message.len() <= MAX_MESSAGE && !message.contains('\x1b'), "{message}");
    }

    #[test]
    fn a_trainers_ack_comes_up_whole() {
        let ack = "tidepool-ack step=120 path=/ckpt/step-120\n";
        let mut s = status(json!({"containerStatuses": [{"name": "main", "image": "t", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 143, "message": ack}}}]}));
        from_member(&mut s);
        let c = &s.container_statuses.unwrap()[0];
        assert_eq!(c.state.as_ref().unwrap().terminated.as_ref().unwrap().message.as_deref(), Some(ack));
    }

    #[test]
    fn pod_ips_outside_the_declared_pod_network_never_come_up() {
        let declared = PodNetwork::new(["10.244.0.0/16".parse().unwrap(), "fd00::/64".parse().unwrap()]);
        let forged = || status(json!({"podIP": "10.96.0.10", "podIPs": [{"ip": "10.96.0.10"}, {"ip": "fd00::7"}]}));
        let mut s = forged();
        within_pod_network(&mut s, &declared, false);
        assert_eq!(s.pod_ip.as_deref(), Some("fd00::7"), "the training cluster's DNS address is dropped");
        assert_eq!(s.pod_ips.unwrap().len(), 1);
        let mut host = forged();
        within_pod_network(&mut host, &declared, true);
        assert_eq!(host.pod_ip.as_deref(), Some("10.96.0.10"), "a hostNetwork pod reports its node's address");
        let mut undeclared = forged();
        within_pod_network(&mut undeclared, &PodNetwork::new([]), false);
        assert_eq!(undeclared, forged(), "nothing declared: nothing dropped");
        let mut outside = status(json!({"podIP": "192.168.0.1", "podIPs": [{"ip": "192.168.0.1"}]}));
        within_pod_network(&mut outside, &declared, false);
        assert_eq!((outside.pod_ip, outside.pod_ips), (None, None));
    }

    #[test]
    fn only_addresses_come_up_as_pod_ips_one_per_family() {
        let mut s = status(json!({"podIP": "not-an-ip", "podIPs": [
            {"ip": "not-an-ip"}, {"ip": "10.244.1.7"}, {"ip": "10.244.1.8"}, {"ip": "fd00::7"}, {"ip": "fd00::8"}]}));
        from_member(&mut s);
        assert_eq!(s.pod_ip.as_deref(), Some("10.244.1.7"));
        let ips: Vec<_> = s.pod_ips.unwrap().into_iter().map(|p| p.ip).collect();
        assert_eq!(ips, ["10.244.1.7", "fd00::7"]);
        let mut none = status(json!({"podIP": "evil\n"}));
        from_member(&mut none);
        assert_eq!((none.pod_ip, none.pod_ips), (None, None));
    }

    #[test]
    fn a_plain_status_comes_up_unchanged() {
        let plain = status(json!({"phase": "Running", "podIP": "10.244.0.7", "podIPs": [{"ip": "10.244.0.7"}],
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "DisruptionTarget", "status": "True",
                            "reason": "PreemptionByScheduler", "message": "preempted by online/web"}],
            "containerStatuses": [{"name": "main", "ready": true, "restartCount": 2, "image": "trainer:1",
                                   "imageID": "", "state": {"running": {"startedAt": "2026-11-29T10:00:01Z"}}}]}));
        let mut s = plain.clone();
        from_member(&mut s);
        assert_eq!(s, plain);
    }
}
