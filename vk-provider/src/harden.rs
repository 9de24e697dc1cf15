//! What a copy runs with when its pod says nothing: the hardening the PodSecurity
//! `restricted` level would ask a tenant to write, applied by tidepool so that a pod written
//! for the training cluster does not run looser in somebody's production cluster. Pure.
//!
//! - **seccomp**: a pod that names no profile (neither for the pod nor for every container)
//!   gets `RuntimeDefault` for the pod. A kubelet runs such a pod `Unconfined` (unless its
//!   operator turned `seccompDefault` on, which a member's may not have): every syscall open
//!   to a tenant's process on a member node. A profile the pod names is kept (the policy
//!   refuses `Unconfined` unless `policy.privileged`).
//! - **`NET_RAW`** is dropped from every container that does not add it itself (which the
//!   policy allows only when `policy.capabilities` lists it): container runtimes grant it by
//!   default, and it lets a process forge packets on the member's pod network (ARP and DNS
//!   spoofing of online pods on the same bridge).
//! - **GPUs only through the device plugin**: a container with no GPU limit gets
//!   `NVIDIA_VISIBLE_DEVICES=void`, so an NVIDIA container toolkit that reads the variable
//!   exposes no device to it. A value the tenant sets that asks for devices (anything but
//!   empty, `void` or `none`) is refused by [`check_device_env`] before anything is created; one an `envFrom` source brings is overridden, since `env`
//!   wins over `envFrom` for the same name.
//! - **`restricted`** members ([`PodSecurityLevel::Restricted`]): where the pod says nothing,
//!   `runAsNonRoot: true` for the pod, `allowPrivilegeEscalation: false` and every capability
//!   dropped (`ALL`) in each container. A container that adds capabilities keeps them (the
//!   member's Pod Security admission then judges it); an image that runs as root fails to
//!   start, as the kubelet says.
//! - **user namespaces** (`spec.userNamespaces` of the member): `hostUsers: false`, so root
//!   in the copy is an unprivileged user on the node, whatever the pod says (the member's
//!   choice). A pod in a host namespace keeps the host's users: the kubelet allows no user
//!   namespace with one, and the policy refuses host namespaces unless `policy.privileged`.

use k8s_openapi::api::core::v1::{Capabilities, Container, EnvVar, PodSpec, SeccompProfile};
use tidepool_api::crd::{Confinement, PodSecurityLevel};

/// Resource names of GPUs (and other accelerators) their device plugins hand out.
pub const ACCELERATOR_RESOURCES: [&str; 3] = ["nvidia.com/gpu", "amd.com/gpu", "habana.ai/gaudi"];

/// Environment variables through which container toolkits pick the devices a container sees:
/// the device plugin sets them, a tenant must not. A trailing `*` is a prefix.
const DEVICE_ENV: [&str; 3] = ["NVIDIA_*", "AMD_VISIBLE_DEVICES", "HABANA_VISIBLE_DEVICES"];

/// The capability dropped from every container that does not add it.
const NET_RAW: &str = "NET_RAW";

fn is_device_env(name: &str) -> bool {
    DEVICE_ENV.iter().any(|d| match d.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *d,
    })
}

/// Refuses a container environment variable (or `envFrom` prefix) that names devices: the
/// refused field's path and why (the offload policy reports it as its violation).
pub fn check_device_env(spec: &PodSpec) -> Result<(), (String, String)> {
    let kinds =
        [("initContainers", spec.init_containers.as_deref().unwrap_or_default()), ("containers", &spec.containers)];
    for (kind, containers) in kinds {
        for (i, c) in containers.iter().enumerate() {
            for (j, var) in c.env.iter().flatten().enumerate() {
                if is_device_env(&var.name) && !hides_devices(var) {
                    return Err(violation(
                        format!("spec.{kind}[{i}].env[{j}].name"),
                        format!("{} picks devices: GPUs come only through a resource limit (nvidia.com/gpu)", var.name),
                    ));
                }
            }
            for (j, from) in c.env_from.iter().flatten().enumerate() {
                if from
                    .prefix
                    .as_deref()
                    .is_some_and(|p| !p.is_empty() && (is_device_env(p) || "NVIDIA_".starts_with(p)))
                {
                    return Err(violation(
                        format!("spec.{kind}[{i}].envFrom[{j}].prefix"),
                        "the prefix can name device variables: GPUs come only through a resource limit",
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Whether a device variable a tenant sets asks for no device: empty, `void` or `none`, as
/// mpi-operator sets `NVIDIA_VISIBLE_DEVICES` and `NVIDIA_DRIVER_CAPABILITIES` empty on an
/// MPIJob's launcher so it sees no GPU. A value from a reference is not known here: refused.
fn hides_devices(var: &EnvVar) -> bool {
    var.value_from.is_none() && matches!(var.value.as_deref().unwrap_or_default(), "" | "void" | "none")
}

fn violation(field: String, reason: impl Into<String>) -> (String, String) {
    (field, reason.into())
}

/// Hardens the copy's spec `s` as its member asks (see the module's header).
pub fn harden(s: &mut PodSpec, member: &Confinement) {
    let host_namespace = [s.host_network, s.host_pid, s.host_ipc].contains(&Some(true));
    if member.user_namespaces && !host_namespace {
        s.host_users = Some(false);
    }
    let every_container_names_one = s
        .containers
        .iter()
        .chain(s.init_containers.iter().flatten())
        .all(|c| c.security_context.as_ref().is_some_and(|sc| sc.seccomp_profile.is_some()));
    let pod = s.security_context.get_or_insert_with(Default::default);
    if pod.seccomp_profile.is_none() && !every_container_names_one {
        pod.seccomp_profile = Some(SeccompProfile { type_: "RuntimeDefault".to_owned(), localhost_profile: None });
    }
    let restricted = member.pod_security == PodSecurityLevel::Restricted;
    if restricted && pod.run_as_non_root.is_none() {
        pod.run_as_non_root = Some(true);
    }
    for c in s.containers.iter_mut().chain(s.init_containers.iter_mut().flatten()) {
        if restricted {
            restrict(c);
        }
        drop_net_raw(c);
        hide_devices(c);
    }
}

/// What the `restricted` level asks of a container, where it says nothing.
fn restrict(c: &mut Container) {
    let sc = c.security_context.get_or_insert_with(Default::default);
    if sc.privileged == Some(true) {
        return;
    }
    sc.allow_privilege_escalation.get_or_insert(false);
    let caps = sc.capabilities.get_or_insert_with(Capabilities::default);
    let drop = caps.drop.get_or_insert_with(Vec::new);
    if !drop.iter().any(|d| d.eq_ignore_ascii_case("ALL")) {
        drop.push("ALL".to_owned());
    }
}

fn drop_net_raw(c: &mut Container) {
    let sc = c.security_context.get_or_insert_with(Default::default);
    if sc.privileged == Some(true) {
        return;
    }
    let caps = sc.capabilities.get_or_insert_with(Capabilities::default);
    let named = |list: &Option<Vec<String>>, cap: &str| {
        list.iter().flatten().any(|c| c.strip_prefix("CAP_").unwrap_or(c).eq_ignore_ascii_case(cap))
    };
    if named(&caps.add, NET_RAW) || named(&caps.drop, NET_RAW) || named(&caps.drop, "ALL") {
        return;
    }
    caps.drop.get_or_insert_with(Vec::new).push(NET_RAW.to_owned());
}

fn hide_devices(c: &mut Container) {
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
    let has_accelerator = ACCELERATOR_RESOURCES.iter().any(|r| limits.is_some_and(|l| l.contains_key(*r)));
    if has_accelerator {
        return;
    }
    let env = c.env.get_or_insert_with(Vec::new);
    env.retain(|e| e.name != "NVIDIA_VISIBLE_DEVICES");
    env.push(EnvVar { name: "NVIDIA_VISIBLE_DEVICES".to_owned(), value: Some("void".to_owned()), value_from: None });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    fn hardened(v: serde_json::Value) -> serde_json::Value {
        let mut s = spec(v);
        harden(&mut s, &Confinement::default());
        serde_json::to_value(s).unwrap()
    }

    fn restricted() -> Confinement {
        Confinement { pod_security: PodSecurityLevel::Restricted, ..Default::default() }
    }

    #[test]
    fn a_pod_naming_no_seccomp_profile_gets_runtime_default() {
        let s = hardened(json!({"containers": [{"name": "a"}]}));
        assert_eq!(s["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
        let named = hardened(
            json!({"securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}},
            "containers": [{"name": "a"}]}),
        );
        assert_eq!(named["securityContext"]["seccompProfile"]["type"], "Localhost", "the pod's own profile stays");
        let per_container = hardened(json!({"containers": [
            {"name": "a", "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}}]}));
        assert!(per_container["securityContext"]["seccompProfile"].is_null(), "every container named one");
        let some = hardened(json!({"containers": [
            {"name": "a", "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}},
            {"name": "b"}]}));
        assert_eq!(some["securityContext"]["seccompProfile"]["type"], "RuntimeDefault", "for b; a's own wins for a");
        assert_eq!(some["containers"][0]["securityContext"]["seccompProfile"]["type"], "Localhost");
    }

    #[test]
    fn net_raw_is_dropped_unless_the_container_adds_it() {
        let s = hardened(json!({"initContainers": [{"name": "i"}], "containers": [
            {"name": "a"},
            {"name": "b", "securityContext": {"capabilities": {"add": ["NET_RAW"]}}},
            {"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"]}}},
            {"name": "d", "securityContext": {"capabilities": {"drop": ["CHOWN"]}}},
            {"name": "e", "securityContext": {"privileged": true}}]}));
        let drops = |c: &serde_json::Value| c["securityContext"]["capabilities"]["drop"].clone();
        assert_eq!(drops(&s["initContainers"][0]), json!(["NET_RAW"]));
        assert_eq!(drops(&s["containers"][0]), json!(["NET_RAW"]));
        assert!(drops(&s["containers"][1]).is_null(), "added, so the policy allowed it");
        assert_eq!(drops(&s["containers"][2]), json!(["ALL"]));
        assert_eq!(drops(&s["containers"][3]), json!(["CHOWN", "NET_RAW"]));
        assert!(drops(&s["containers"][4]).is_null(), "privileged (allowed by the policy) holds everything anyway");
    }

    #[test]
    fn containers_without_a_gpu_limit_see_no_device() {
        let s = hardened(json!({"containers": [
            {"name": "cpu", "envFrom": [{"configMapRef": {"name": "m"}}]},
            {"name": "gpu", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}));
        assert_eq!(s["containers"][0]["env"], json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]));
        assert!(s["containers"][1]["env"].is_null(), "the device plugin sets it for a GPU container");
    }

    #[test]
    fn device_variables_a_tenant_sets_are_refused() {
        for name in
            ["NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "HABANA_VISIBLE_DEVICES", "AMD_VISIBLE_DEVICES"]
        {
            let s = spec(
                json!({"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": name, "value": "all"}]}]}),
            );
            let (field, _) = check_device_env(&s).unwrap_err();
            assert_eq!(field, "spec.containers[0].env[1].name", "{name}");
        }
        for prefix in ["NVIDIA_", "NV", "HABANA_VISIBLE_DEVICES"] {
            let s = spec(
                json!({"initContainers": [{"name": "i", "envFrom": [{"prefix": prefix, "configMapRef": {"name": "m"}}]}], "containers": []}),
            );
            assert_eq!(check_device_env(&s).unwrap_err().0, "spec.initContainers[0].envFrom[0].prefix", "{prefix}");
        }
        let fine = spec(json!({"containers": [{"name": "a", "env": [{"name": "CUDA_HOME", "value": "/x"}],
            "envFrom": [{"prefix": "APP_", "configMapRef": {"name": "m"}}]}]}));
        assert_eq!(check_device_env(&fine), Ok(()));
        // mpi-operator's launcher: told to see no GPU.
        let launcher = spec(json!({"containers": [{"name": "l", "env": [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": ""}, {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": ""},
            {"name": "HABANA_VISIBLE_DEVICES", "value": "none"}, {"name": "AMD_VISIBLE_DEVICES", "value": "void"}]}]}));
        assert_eq!(check_device_env(&launcher), Ok(()));
        let referenced = spec(json!({"containers": [{"name": "a", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"configMapKeyRef": {"name": "m", "key": "k"}}}]}]}));
        assert!(check_device_env(&referenced).is_err(), "a value not known here");
    }

    #[test]
    fn a_restricted_member_runs_copies_as_non_root_without_escalation_or_capabilities() {
        let mut s = spec(json!({"containers": [
            {"name": "plain"},
            {"name": "own", "securityContext": {"allowPrivilegeEscalation": true,
                                                "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["all"]}}}]}));
        harden(&mut s, &restricted());
        let s = serde_json::to_value(s).unwrap();
        assert_eq!(s["securityContext"]["runAsNonRoot"], true);
        assert_eq!(s["containers"][0]["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(s["containers"][0]["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(s["containers"][1]["securityContext"]["allowPrivilegeEscalation"], true, "what the pod says stays");
        assert_eq!(s["containers"][1]["securityContext"]["capabilities"]["drop"], json!(["all"]));
        let said = spec(json!({"securityContext": {"runAsNonRoot": false}, "containers": [{"name": "a"}]}));
        let mut kept = said.clone();
        harden(&mut kept, &restricted());
        assert_eq!(kept.security_context.unwrap().run_as_non_root, Some(false), "the member's admission judges it");
        let baseline = hardened(json!({"containers": [{"name": "a"}]}));
        assert!(baseline["securityContext"]["runAsNonRoot"].is_null());
        assert!(baseline["containers"][0]["securityContext"]["allowPrivilegeEscalation"].is_null());
    }

    #[test]
    fn a_member_with_user_namespaces_runs_every_copy_in_one_unless_it_uses_a_host_namespace() {
        let member = Confinement { user_namespaces: true, ..Default::default() };
        for said in [json!(null), json!(true), json!(false)] {
            let mut s = spec(json!({"hostUsers": said, "containers": [{"name": "a"}]}));
            harden(&mut s, &member);
            assert_eq!(s.host_users, Some(false), "the pod said {said}: the member's choice wins");
        }
        let mut host = spec(json!({"hostNetwork": true, "containers": [{"name": "a"}]}));
        harden(&mut host, &member);
        assert_eq!(host.host_users, None, "a host namespace keeps the host's users");
        let mut off = spec(json!({"containers": [{"name": "a"}]}));
        harden(&mut off, &Confinement::default());
        assert_eq!(off.host_users, None, "not asked for");
    }
}
