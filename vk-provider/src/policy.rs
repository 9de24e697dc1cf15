//! The offload policy: which training pods may run in a member cluster at all. Pure.
//!
//! A member is somebody's production cluster lending its spare capacity; a tenant of the
//! training cluster must gain no access to its hosts through tidepool. So, unless the bridge
//! config's `policy:` section lifts a rule ([`PolicyAllow`]), the policy refuses
//! - privileged containers and the other ways out of the container sandbox (Unconfined
//!   seccomp or AppArmor, an Unmasked `/proc`, SELinux user/role/type, unsafe sysctls,
//!   Windows HostProcess),
//! - added capabilities (but those the config lists),
//! - the node's network, PID and IPC namespaces, `hostPath` volumes, host ports,
//! - PersistentVolumeClaims and generic ephemeral volumes (tidepool does not carry claims yet),
//!
//! and always refuses
//! - every volume type but the self-contained ones (emptyDir, configMap, secret, downwardAPI,
//!   projected, image): the others are storage drivers that run on the member's hosts with the
//!   member's credentials, and a type added to Kubernetes later is refused until reviewed,
//! - projected sources tidepool does not carry (cluster trust bundles, pod certificates),
//! - dynamic resource claims, `system-*` PriorityClasses, and tolerations of every taint,
//! - environment variables that pick devices (`NVIDIA_*`; see [`crate::harden`]).
//!
//! Every kind of container is checked alike: init containers (sidecars are init containers),
//! app containers, and ephemeral debug containers. The member namespace's PodSecurity
//! `baseline` level would refuse most of this too, but only with an API error at creation;
//! checking first gives the tenant a reason that names the field to change.

use k8s_openapi::api::core::v1::{
    AppArmorProfile, ContainerPort, Pod, PodSpec, SELinuxOptions, SeccompProfile, SecurityContext,
    WindowsSecurityContextOptions,
};
use tidepool_api::bridge::PolicyAllow;

/// Why a pod may not be offloaded: the first offending field, by its path in the pod
/// (`spec.containers[1].securityContext.privileged`), and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct PolicyViolation {
    pub field: String,
    pub reason: String,
}

/// Volume types that keep to the pod: their data comes with the pod (reflected ConfigMaps
/// and Secrets, its own metadata) or lives and dies with it.
const SELF_CONTAINED_VOLUMES: [&str; 6] = ["emptyDir", "configMap", "secret", "downwardAPI", "projected", "image"];
/// Projected sources tidepool carries: reflected ConfigMaps and Secrets, the pod's own
/// metadata, and service-account tokens (which translation drops with their volume).
const CARRIED_PROJECTIONS: [&str; 4] = ["configMap", "secret", "downwardAPI", "serviceAccountToken"];
/// SELinux types the PodSecurity `baseline` level allows: the container runtimes' own.
const SANDBOX_SELINUX_TYPES: [&str; 5] =
    ["", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"];
/// Sysctls the PodSecurity `baseline` level allows: namespaced to the pod, harmless to the node.
const SAFE_SYSCTLS: [&str; 12] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
];
/// Annotation prefix of the pre-1.30 AppArmor setting, still honoured by kubelets.
const APPARMOR_ANNOTATION_PREFIX: &str = "container.apparmor.security.beta.kubernetes.io/";

/// Checks `pod` against the offload policy; the first violation wins, in the order pod
/// fields, volumes, then containers (init, app, ephemeral) in spec order.
pub fn check(pod: &Pod, allow: &PolicyAllow) -> Result<(), PolicyViolation> {
    let annotations = pod.metadata.annotations.iter().flatten();
    for (key, value) in annotations {
        if !allow.privileged && key.starts_with(APPARMOR_ANNOTATION_PREFIX) && value == "unconfined" {
            return deny(format!("metadata.annotations[{key}]"), "runs a container without AppArmor confinement");
        }
    }
    // A pod without spec cannot be translated either; translation reports it.
    let Some(spec) = pod.spec.as_ref() else { return Ok(()) };
    check_pod_fields(spec, allow)?;
    check_volumes(spec, allow)?;
    crate::harden::check_device_env(spec).map_err(|(field, reason)| PolicyViolation { field, reason })?;
    let init = spec.init_containers.iter().flatten().map(|c| (c.security_context.as_ref(), c.ports.as_deref()));
    let app = spec.containers.iter().map(|c| (c.security_context.as_ref(), c.ports.as_deref()));
    let ephemeral =
        spec.ephemeral_containers.iter().flatten().map(|c| (c.security_context.as_ref(), c.ports.as_deref()));
    for (kind, containers) in [
        ("initContainers", init.collect::<Vec<_>>()),
        ("containers", app.collect()),
        ("ephemeralContainers", ephemeral.collect()),
    ] {
        for (i, (security, ports)) in containers.into_iter().enumerate() {
            check_container(&format!("spec.{kind}[{i}]"), security, ports, allow)?;
        }
    }
    Ok(())
}

/// Checks `pod` against what its pool lends: a RuntimeClass the pool does not list
/// (`spec.pools[].runtimeClassNames`) is refused.
///
/// Refused rather than dropped: a RuntimeClass brings the member's scheduling rules for it
/// (its admission adds the class's node selector and tolerations to the pod) and its
/// overhead, so it could carry a copy past the pool's taints; and dropping it would run a
/// workload meant for a sandbox without one.
pub fn check_pool(pod: &Pod, runtime_class_names: &[String]) -> Result<(), PolicyViolation> {
    let class = pod.spec.as_ref().and_then(|s| s.runtime_class_name.as_deref());
    match class {
        Some(class) if !runtime_class_names.iter().any(|c| c == class) => deny(
            "spec.runtimeClassName",
            format!("RuntimeClass {class} is not one this pool lends (spec.pools[].runtimeClassNames)"),
        ),
        _ => Ok(()),
    }
}

/// Checks `pod` against its pool's mode: in a colocation mode it runs as the member's batch
/// work, which some pods cannot be (see [`Colocation::unexpressible`]).
///
/// [`Colocation::unexpressible`]: tidepool_api::colocation::Colocation::unexpressible
pub fn check_mode(pod: &Pod, mode: tidepool_api::crd::PoolMode) -> Result<(), PolicyViolation> {
    let (Some(colocation), Some(spec)) = (mode.colocation(), pod.spec.as_ref()) else { return Ok(()) };
    match colocation.unexpressible(spec) {
        Some(u) => deny(u.field, format!("{} (pool mode {})", u.reason, mode.as_str())),
        None => Ok(()),
    }
}

fn deny(field: impl Into<String>, reason: impl Into<String>) -> Result<(), PolicyViolation> {
    Err(PolicyViolation { field: field.into(), reason: reason.into() })
}

fn check_pod_fields(spec: &PodSpec, allow: &PolicyAllow) -> Result<(), PolicyViolation> {
    if !allow.host_namespaces {
        let namespaces = [
            ("spec.hostNetwork", spec.host_network, "shares the member node's network namespace"),
            ("spec.hostPID", spec.host_pid, "sees the member node's processes"),
            ("spec.hostIPC", spec.host_ipc, "shares the member node's IPC namespace"),
        ];
        for (field, on, reason) in namespaces {
            if on == Some(true) {
                return deny(field, reason);
            }
        }
    }
    if let Some(class) = spec.priority_class_name.as_deref().filter(|c| c.starts_with("system-")) {
        return deny("spec.priorityClassName", format!("{class} is reserved for the cluster's own components"));
    }
    for (i, t) in spec.tolerations.iter().flatten().enumerate() {
        if t.operator.as_deref() == Some("Exists") && t.key.as_deref().unwrap_or_default().is_empty() {
            return deny(format!("spec.tolerations[{i}]"), "tolerates every taint, also those keeping guests away");
        }
    }
    if spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty()) {
        return deny("spec.resourceClaims", "dynamic resource claims are not carried to members yet");
    }
    if let Some(sc) = spec.security_context.as_ref()
        && !allow.privileged
    {
        for (i, sysctl) in sc.sysctls.iter().flatten().enumerate() {
            if !SAFE_SYSCTLS.contains(&sysctl.name.as_str()) {
                return deny(
                    format!("spec.securityContext.sysctls[{i}]"),
                    format!("{} is not a sysctl a pod may set on a member node", sysctl.name),
                );
            }
        }
        check_sandbox(
            "spec.securityContext",
            Sandbox {
                seccomp: sc.seccomp_profile.as_ref(),
                apparmor: sc.app_armor_profile.as_ref(),
                selinux: sc.se_linux_options.as_ref(),
                windows: sc.windows_options.as_ref(),
                proc_mount: None,
            },
        )?;
    }
    Ok(())
}

fn check_volumes(spec: &PodSpec, allow: &PolicyAllow) -> Result<(), PolicyViolation> {
    for (i, volume) in spec.volumes.iter().flatten().enumerate() {
        let path = format!("spec.volumes[{i}]");
        // The volume's JSON keys are its source types: a type this code has never heard of
        // is seen (and refused) too.
        let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(volume) else {
            return deny(path, "cannot be inspected");
        };
        for (source, value) in fields.iter().filter(|(k, _)| k.as_str() != "name") {
            match source.as_str() {
                "hostPath" if !allow.host_path => {
                    return deny(format!("{path}.hostPath"), "mounts a directory of the member node");
                }
                "persistentVolumeClaim" | "ephemeral" if !allow.persistent_volume_claims => {
                    return deny(format!("{path}.{source}"), "volume claims are not carried to members yet");
                }
                "hostPath" | "persistentVolumeClaim" | "ephemeral" => {}
                "projected" => {
                    let sources = value.get("sources").and_then(|s| s.as_array()).into_iter().flatten();
                    for (j, projection) in sources.enumerate() {
                        let mut kinds = projection.as_object().into_iter().flat_map(|o| o.keys());
                        if let Some(kind) = kinds.find(|k| !CARRIED_PROJECTIONS.contains(&k.as_str())) {
                            return deny(
                                format!("{path}.projected.sources[{j}].{kind}"),
                                format!("{kind} projections are not carried to members"),
                            );
                        }
                    }
                }
                t if SELF_CONTAINED_VOLUMES.contains(&t) => {}
                other => {
                    return deny(
                        format!("{path}.{other}"),
                        format!("{other} volumes reach storage through the member's hosts and credentials"),
                    );
                }
            }
        }
    }
    Ok(())
}

fn check_container(
    path: &str,
    sc: Option<&SecurityContext>,
    ports: Option<&[ContainerPort]>,
    allow: &PolicyAllow,
) -> Result<(), PolicyViolation> {
    if let Some(sc) = sc {
        if sc.privileged == Some(true) && !allow.privileged {
            return deny(
                format!("{path}.securityContext.privileged"),
                "privileged containers hold the member node's devices and kernel",
            );
        }
        let added = sc.capabilities.as_ref().and_then(|c| c.add.as_ref()).into_iter().flatten();
        for (j, cap) in added.enumerate() {
            // Runtimes accept `CAP_NET_ADMIN` and `NET_ADMIN` alike; the config has the bare form.
            let bare = cap.strip_prefix("CAP_").unwrap_or(cap).to_ascii_uppercase();
            if !allow.capabilities.contains(&bare) {
                return deny(format!("{path}.securityContext.capabilities.add[{j}]"), format!("adds capability {cap}"));
            }
        }
        if !allow.privileged {
            check_sandbox(
                &format!("{path}.securityContext"),
                Sandbox {
                    seccomp: sc.seccomp_profile.as_ref(),
                    apparmor: sc.app_armor_profile.as_ref(),
                    selinux: sc.se_linux_options.as_ref(),
                    windows: sc.windows_options.as_ref(),
                    proc_mount: sc.proc_mount.as_deref(),
                },
            )?;
        }
    }
    if !allow.host_ports {
        for (j, port) in ports.into_iter().flatten().enumerate() {
            if port.host_port.is_some_and(|p| p != 0) {
                return deny(format!("{path}.ports[{j}].hostPort"), "binds a port of the member node");
            }
        }
    }
    Ok(())
}

/// The sandbox settings pod and container security contexts share.
struct Sandbox<'a> {
    seccomp: Option<&'a SeccompProfile>,
    apparmor: Option<&'a AppArmorProfile>,
    selinux: Option<&'a SELinuxOptions>,
    windows: Option<&'a WindowsSecurityContextOptions>,
    proc_mount: Option<&'a str>,
}

fn check_sandbox(path: &str, s: Sandbox<'_>) -> Result<(), PolicyViolation> {
    if s.seccomp.is_some_and(|p| p.type_ == "Unconfined") {
        return deny(format!("{path}.seccompProfile.type"), "runs without a seccomp filter");
    }
    if s.apparmor.is_some_and(|p| p.type_ == "Unconfined") {
        return deny(format!("{path}.appArmorProfile.type"), "runs without AppArmor confinement");
    }
    if let Some(se) = s.selinux {
        if se.user.as_deref().is_some_and(|u| !u.is_empty()) {
            return deny(format!("{path}.seLinuxOptions.user"), "picks its own SELinux user");
        }
        if se.role.as_deref().is_some_and(|r| !r.is_empty()) {
            return deny(format!("{path}.seLinuxOptions.role"), "picks its own SELinux role");
        }
        if let Some(t) = se.type_.as_deref().filter(|t| !SANDBOX_SELINUX_TYPES.contains(t)) {
            return deny(format!("{path}.seLinuxOptions.type"), format!("SELinux type {t} is not a container type"));
        }
    }
    if s.windows.and_then(|w| w.host_process) == Some(true) {
        return deny(format!("{path}.windowsOptions.hostProcess"), "runs as a process of the member node");
    }
    if s.proc_mount == Some("Unmasked") {
        return deny(format!("{path}.procMount"), "sees the member node's unmasked /proc");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A pod that passes: one container, an emptyDir, a ConfigMap, the token volume every
    /// pod gets, a debug container, and a specific toleration.
    fn base() -> Value {
        json!({
            "metadata": {"name": "trainer-0", "namespace": "team-a", "uid": "uid-1"},
            "spec": {
                "containers": [{"name": "main", "image": "trainer:1", "ports": [{"containerPort": 8080}],
                                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
                "volumes": [
                    {"name": "scratch", "emptyDir": {"medium": "Memory"}},
                    {"name": "cfg", "configMap": {"name": "trainer-config"}},
                    {"name": "kube-api-access-x", "projected": {"sources": [
                        {"serviceAccountToken": {"path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt"}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}
                ],
                "tolerations": [{"key": "tidepool.io/virtual", "operator": "Exists", "effect": "NoSchedule"}],
                "securityContext": {"sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}],
                                    "seccompProfile": {"type": "RuntimeDefault"}}
            }
        })
    }

    /// The base pod with some of its `spec` (and `metadata`) keys replaced.
    fn pod(changes: Value) -> Pod {
        let mut p = base();
        for part in ["metadata", "spec"] {
            if let Some(Value::Object(fields)) = changes.get(part) {
                for (k, v) in fields {
                    p[part][k] = v.clone();
                }
            }
        }
        serde_json::from_value(p).unwrap()
    }

    fn container(extra: Value) -> Value {
        let mut c = json!({"name": "c", "image": "img:1"});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn allow(changes: Value) -> PolicyAllow {
        serde_json::from_value(changes).unwrap()
    }

    #[test]
    fn the_offload_policy_table() {
        let plain = || container(json!({}));
        let privileged = || container(json!({"securityContext": {"privileged": true}}));
        #[rustfmt::skip]
        let cases: Vec<(&str, Pod, PolicyAllow, Option<&str>)> = vec![
            ("an ordinary training pod passes", pod(json!({})), allow(json!({})), None),
            ("a privileged app container is named by its index",
                pod(json!({"spec": {"containers": [plain(), privileged()]}})), allow(json!({})),
                Some("spec.containers[1].securityContext.privileged")),
            ("a privileged init container is refused too",
                pod(json!({"spec": {"initContainers": [privileged()]}})), allow(json!({})),
                Some("spec.initContainers[0].securityContext.privileged")),
            ("a privileged sidecar is refused like any init container",
                pod(json!({"spec": {"initContainers": [plain(), container(json!({"restartPolicy": "Always", "securityContext": {"privileged": true}}))]}})),
                allow(json!({})), Some("spec.initContainers[1].securityContext.privileged")),
            ("a privileged debug container is refused too",
                pod(json!({"spec": {"ephemeralContainers": [privileged()]}})), allow(json!({})),
                Some("spec.ephemeralContainers[0].securityContext.privileged")),
            ("privileged containers pass where the config allows them",
                pod(json!({"spec": {"containers": [privileged()]}})), allow(json!({"privileged": true})), None),
            ("an added capability is refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"capabilities": {"add": ["NET_RAW"]}}}))]}})),
                allow(json!({})), Some("spec.containers[0].securityContext.capabilities.add[0]")),
            ("a capability the config lists passes, with or without its CAP_ prefix",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"capabilities": {"add": ["IPC_LOCK", "CAP_IPC_LOCK"]}}}))]}})),
                allow(json!({"capabilities": ["IPC_LOCK"]})), None),
            ("a capability the config does not list is still refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"capabilities": {"add": ["IPC_LOCK", "SYS_ADMIN"]}}}))]}})),
                allow(json!({"capabilities": ["IPC_LOCK"]})), Some("spec.containers[0].securityContext.capabilities.add[1]")),
            ("the host network is refused", pod(json!({"spec": {"hostNetwork": true}})), allow(json!({})), Some("spec.hostNetwork")),
            ("the host PID namespace is refused", pod(json!({"spec": {"hostPID": true}})), allow(json!({})), Some("spec.hostPID")),
            ("the host IPC namespace is refused", pod(json!({"spec": {"hostIPC": true}})), allow(json!({})), Some("spec.hostIPC")),
            ("host namespaces explicitly off are fine", pod(json!({"spec": {"hostNetwork": false, "hostPID": false}})), allow(json!({})), None),
            ("host namespaces pass where the config allows them",
                pod(json!({"spec": {"hostNetwork": true, "hostIPC": true}})), allow(json!({"hostNamespaces": true})), None),
            ("a hostPath volume is refused",
                pod(json!({"spec": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/var/run"}}]}})),
                allow(json!({})), Some("spec.volumes[1].hostPath")),
            ("a hostPath volume passes where the config allows it",
                pod(json!({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/data"}}]}})), allow(json!({"hostPath": true})), None),
            ("a host port is refused",
                pod(json!({"spec": {"containers": [container(json!({"ports": [{"containerPort": 80}, {"containerPort": 443, "hostPort": 443}]}))]}})),
                allow(json!({})), Some("spec.containers[0].ports[1].hostPort")),
            ("a host port passes where the config allows it",
                pod(json!({"spec": {"containers": [container(json!({"ports": [{"containerPort": 443, "hostPort": 443}]}))]}})),
                allow(json!({"hostPorts": true})), None),
            ("a PersistentVolumeClaim is refused until claims are carried",
                pod(json!({"spec": {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]}})),
                allow(json!({})), Some("spec.volumes[0].persistentVolumeClaim")),
            ("a generic ephemeral volume is refused like a claim",
                pod(json!({"spec": {"volumes": [{"name": "d", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}}]}})),
                allow(json!({})), Some("spec.volumes[0].ephemeral")),
            ("a claim passes where the config allows claims",
                pod(json!({"spec": {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]}})),
                allow(json!({"persistentVolumeClaims": true})), None),
            ("an NFS volume is refused: it mounts through the member's hosts",
                pod(json!({"spec": {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]}})),
                allow(json!({})), Some("spec.volumes[0].nfs")),
            ("a CSI inline volume is refused even where everything else is allowed",
                pod(json!({"spec": {"volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}})),
                allow(json!({"privileged": true, "hostNamespaces": true, "hostPath": true, "hostPorts": true, "persistentVolumeClaims": true})),
                Some("spec.volumes[0].csi")),
            ("a projected cluster trust bundle is refused",
                pod(json!({"spec": {"volumes": [{"name": "p", "projected": {"sources": [{"configMap": {"name": "x"}}, {"clusterTrustBundle": {"signerName": "a/b", "path": "ca"}}]}}]}})),
                allow(json!({})), Some("spec.volumes[0].projected.sources[1].clusterTrustBundle")),
            ("a system PriorityClass is refused",
                pod(json!({"spec": {"priorityClassName": "system-node-critical"}})), allow(json!({})), Some("spec.priorityClassName")),
            ("an ordinary PriorityClass passes", pod(json!({"spec": {"priorityClassName": "training-high"}})), allow(json!({})), None),
            ("a toleration of every taint is refused",
                pod(json!({"spec": {"tolerations": [{"key": "tidepool.io/virtual", "operator": "Exists"}, {"operator": "Exists"}]}})),
                allow(json!({})), Some("spec.tolerations[1]")),
            ("a toleration of every NoExecute taint is refused too",
                pod(json!({"spec": {"tolerations": [{"operator": "Exists", "effect": "NoExecute"}]}})), allow(json!({})), Some("spec.tolerations[0]")),
            ("an Unconfined seccomp profile on the pod is refused",
                pod(json!({"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}})), allow(json!({})),
                Some("spec.securityContext.seccompProfile.type")),
            ("an Unconfined AppArmor profile on a container is refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}))]}})),
                allow(json!({})), Some("spec.containers[0].securityContext.appArmorProfile.type")),
            ("the old AppArmor annotation saying unconfined is refused",
                pod(json!({"metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/main": "unconfined"}}})),
                allow(json!({})), Some("metadata.annotations[container.apparmor.security.beta.kubernetes.io/main]")),
            ("an unmasked /proc is refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"procMount": "Unmasked"}}))]}})),
                allow(json!({})), Some("spec.containers[0].securityContext.procMount")),
            ("an SELinux type outside the container types is refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"seLinuxOptions": {"type": "spc_t"}}}))]}})),
                allow(json!({})), Some("spec.containers[0].securityContext.seLinuxOptions.type")),
            ("an SELinux level alone is fine",
                pod(json!({"spec": {"securityContext": {"seLinuxOptions": {"level": "s0:c1,c2", "type": "container_t"}}}})), allow(json!({})), None),
            ("an unsafe sysctl is refused",
                pod(json!({"spec": {"securityContext": {"sysctls": [{"name": "net.ipv4.tcp_syncookies", "value": "1"}, {"name": "kernel.msgmax", "value": "1"}]}}})),
                allow(json!({})), Some("spec.securityContext.sysctls[1]")),
            ("a Windows HostProcess container is refused",
                pod(json!({"spec": {"containers": [container(json!({"securityContext": {"windowsOptions": {"hostProcess": true}}}))]}})),
                allow(json!({})), Some("spec.containers[0].securityContext.windowsOptions.hostProcess")),
            ("dynamic resource claims are refused until carried",
                pod(json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]}})),
                allow(json!({})), Some("spec.resourceClaims")),
            ("pod fields are reported before containers",
                pod(json!({"spec": {"hostPID": true, "containers": [privileged()]}})), allow(json!({})), Some("spec.hostPID")),
        ];
        assert!(cases.len() >= 15);
        for (name, pod, allow, want) in cases {
            let got = check(&pod, &allow);
            assert_eq!(got.as_ref().err().map(|v| v.field.as_str()), want, "{name}: {got:?}");
        }
    }

    #[test]
    fn a_runtime_class_must_be_one_the_pool_lends() {
        let with = |class: Option<&str>| pod(json!({"spec": {"runtimeClassName": class}}));
        let none: &[String] = &[];
        let gvisor = ["gvisor".to_owned()];
        let field = |r: Result<(), PolicyViolation>| r.err().map(|v| v.field);
        assert_eq!(field(check_pool(&with(Some("nvidia")), none)), Some("spec.runtimeClassName".to_owned()));
        assert_eq!(field(check_pool(&with(Some("nvidia")), &gvisor)), Some("spec.runtimeClassName".to_owned()));
        assert_eq!(field(check_pool(&with(Some("gvisor")), &gvisor)), None);
        assert_eq!(field(check_pool(&with(None), none)), None, "the member's default runtime is always fine");
    }

    #[test]
    fn a_violation_reads_as_field_then_reason() {
        let p = pod(json!({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}));
        let v = check(&p, &PolicyAllow::default()).unwrap_err();
        assert_eq!(v.to_string(), "spec.volumes[0].hostPath: mounts a directory of the member node");
    }
}
