//! The bridge configuration file read by `tidepool run --config FILE`.
//!
//! Everything has a default, so an empty file is a working configuration for a tidepool
//! running inside the training cluster. Unknown fields are errors: a typo must not silently
//! fall back to a default.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{FieldError, crd::valid_namespace_prefix, is_dns_label, keys};

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct BridgeConfig {
    /// Name of this training cluster, written on every offload pod
    /// (`tidepool.io/origin-cluster`) so several training clusters can share a member.
    pub cluster_name: String,
    /// Namespace of tidepool itself: default namespace of kubeconfig Secrets.
    pub namespace: String,
    /// Kubeconfig of the training cluster. Unset: `$KUBECONFIG`, `~/.kube/config`, or the
    /// in-cluster service account, in that order.
    pub training_kubeconfig: Option<PathBuf>,
    /// Label selector on `MemberCluster` objects: this instance bridges only the matching
    /// ones. Unset: all of them.
    pub member_selector: Option<String>,
    /// Default prefix of offload namespaces in members.
    pub namespace_prefix: String,
    pub kubelet: KubeletConfig,
    /// How often (seconds) the virtual nodes' leases are renewed; their duration is 4×.
    pub lease_renew_seconds: u64,
    /// How long (seconds) a connected member may stay unreachable before the training pods
    /// on its virtual nodes fail with reason `MemberLost`, so their controllers place them
    /// elsewhere. Counted from the first failed probe; until then the pods are left alone,
    /// since a short partition should not cost a running job its progress.
    pub member_loss_timeout_seconds: u64,
    pub dispatcher: DispatcherConfig,
    /// What the offload policy lets through that it denies by default. Unset: nothing.
    pub policy: PolicyAllow,
    /// The training namespaces whose Secrets offloaded pods may take to members. Empty (the
    /// default): every namespace, and tidepool's role reads Secrets cluster-wide. Set: tidepool
    /// watches and reads Secrets only there (the chart grants it nothing more), and a pod of
    /// another namespace that references a Secret fails with `OffloadPolicy`, naming this.
    pub secret_namespaces: Vec<String>,
    pub leader_election: LeaderElectionConfig,
    pub sharding: ShardingConfig,
    pub metrics: MetricsConfig,
}

/// N replicas share the members: each member is bridged by the one replica holding its Lease
/// `tidepool-member-<name>` in the bridge `namespace`; each replica keeps a presence Lease
/// `tidepool-replica-<identity>`, and the owner each member should have is chosen by
/// rendezvous hashing over the live replicas. The dispatcher runs on the replica holding the
/// `leaderElection` Lease. Off: one replica bridges every member (as with leader election).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ShardingConfig {
    pub enabled: bool,
    /// A member or presence Lease not renewed for this long (as seen by the reader) is free:
    /// a dead replica's members are taken over within it.
    pub lease_duration_seconds: u64,
    /// The owner stops writing for a member once it has not renewed its Lease for this long,
    /// well before anybody else may take it (fencing).
    pub renew_deadline_seconds: u64,
    /// How often the Leases are renewed and the ownership reconsidered.
    pub retry_period_seconds: u64,
}

impl Default for ShardingConfig {
    fn default() -> Self {
        Self { enabled: false, lease_duration_seconds: 15, renew_deadline_seconds: 10, retry_period_seconds: 2 }
    }
}

impl ShardingConfig {
    fn validate(&self, errors: &mut Vec<FieldError>) {
        if !(3..=300).contains(&self.lease_duration_seconds) {
            errors.push(FieldError::new("sharding.leaseDurationSeconds", "must be between 3 and 300"));
        }
        if self.renew_deadline_seconds == 0 || self.renew_deadline_seconds >= self.lease_duration_seconds {
            errors.push(FieldError::new(
                "sharding.renewDeadlineSeconds",
                "must be at least 1 and less than leaseDurationSeconds",
            ));
        }
        if self.retry_period_seconds == 0 || self.retry_period_seconds * 2 > self.renew_deadline_seconds {
            errors.push(FieldError::new(
                "sharding.retryPeriodSeconds",
                "must be at least 1 and at most half of renewDeadlineSeconds",
            ));
        }
    }
}

/// One active replica at a time, chosen through a `coordination.k8s.io` Lease in the training
/// cluster. A standby replica only reads and renews nothing: it writes no object but the Lease.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LeaderElectionConfig {
    /// Off: this process is always active (one replica, or tests).
    pub enabled: bool,
    /// Lease name, in the bridge `namespace`.
    pub lease_name: String,
    /// A leader that has not renewed for this long is replaced.
    pub lease_duration_seconds: u64,
    /// How often the leader renews and a standby retries.
    pub retry_period_seconds: u64,
}

impl Default for LeaderElectionConfig {
    fn default() -> Self {
        Self { enabled: false, lease_name: "tidepool".into(), lease_duration_seconds: 10, retry_period_seconds: 2 }
    }
}

/// The Prometheus endpoint (`/metrics`) and health probes (`/healthz`, `/readyz`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address and port to listen on; unset: no endpoint.
    pub bind_address: Option<std::net::SocketAddr>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { bind_address: Some(std::net::SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9464)) }
    }
}

/// The elastic dispatcher's settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DispatcherConfig {
    /// `spec.schedulerName` of the pods tidepool places.
    pub scheduler_name: String,
    /// How long a pool's deficit must last before reclaim starts, so HPA flapping does not
    /// churn jobs. Also the shortest time between two reclaims of the same job.
    pub deficit_hysteresis_seconds: u64,
    /// Time a reclaim victim gets between the checkpoint notice and its deletion, per band.
    pub reclaim_grace_seconds: BandSeconds,
    /// A placed gang whose `minMember` pods are not all running within this time is rolled
    /// back whole: never a partial gang for longer.
    pub gang_timeout_seconds: u64,
    /// Record each reclaim as an `EvictionRequest` (requester `tidepool.io/reclaim`) in the
    /// training cluster, where it serves them (Kubernetes 1.37): off where an
    /// evictionrequest-controller runs, which would evict the training pod at once.
    pub reclaim_eviction_requests: bool,
    /// Act as Volcano's gang scheduler for the Volcano PodGroups (`scheduling.volcano.sh`) of
    /// jobs whose pod templates all name [`Self::scheduler_name`]: move them through
    /// `Pending`/`Inqueue`/`Running` as Volcano's scheduler would, so Volcano's job controller
    /// (and the training-operator's volcano gang path) makes their pods. Off where Volcano's
    /// own scheduler is to enqueue every group of the training cluster.
    pub volcano_pod_groups: bool,
    /// Keep the `nominalQuota` of lent flavors in the Kueue ClusterQueues and Cohorts
    /// annotated `tidepool.io/lent-quota: "<share>%"` equal to that share of what the members
    /// lend (the flavors' virtual nodes' allocatable), so Kueue admits no more than tidepool
    /// can place. Marked queues only; off where Kueue's quotas are managed otherwise.
    pub kueue_lent_quota: bool,
    /// The training cluster's own nodes offered to the dispatcher as a native pool: pods
    /// that ask for them (`tidepool.io/native: core | all`) are placed there, node by node,
    /// and only their gangs' other pods borrow lent capacity. Unset (the default): no native
    /// pool, and such pods wait, told why.
    pub native_nodes: Option<NativeNodes>,
}

/// Which of the training cluster's own nodes form the native pool.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct NativeNodes {
    /// Labels a node must carry to be offered (empty: every node). Virtual nodes
    /// (`tidepool.io/member`) are never offered, whatever they carry.
    pub node_selector: BTreeMap<String, String>,
}

/// A duration per band, in seconds.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct BandSeconds {
    pub high: u64,
    pub medium: u64,
    pub low: u64,
}

impl Default for BandSeconds {
    fn default() -> Self {
        Self { high: 300, medium: 120, low: 30 }
    }
}

impl BandSeconds {
    pub fn get(&self, band: crate::keys::Band) -> u64 {
        match band {
            crate::keys::Band::High => self.high,
            crate::keys::Band::Medium => self.medium,
            crate::keys::Band::Low => self.low,
        }
    }
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            scheduler_name: "tidepool".to_owned(),
            deficit_hysteresis_seconds: 5,
            reclaim_grace_seconds: BandSeconds::default(),
            gang_timeout_seconds: 300,
            reclaim_eviction_requests: true,
            volcano_pod_groups: true,
            kueue_lent_quota: true,
            native_nodes: None,
        }
    }
}

/// Where the training cluster's API server reaches tidepool's kubelet API, and how that API
/// gets its TLS (see [`KubeletServing`]).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct KubeletConfig {
    /// `InternalIP` address of every virtual node.
    pub node_address: IpAddr,
    /// `daemonEndpoints.kubeletEndpoint.Port` of every virtual node.
    pub port: u16,
    /// Where the serving certificate and client CA come from. Unset: `files` when the three
    /// files are set, `csr` when none is (see [`KubeletConfig::serving_mode`]).
    pub serving: Option<KubeletServing>,
    /// `csr`: the request's subject is `O=system:nodes, CN=system:node:<servingNodeName>`,
    /// the subject the `kubernetes.io/kubelet-serving` signer requires.
    pub serving_node_name: String,
    /// `csr`: DNS names asked for in the certificate's SAN besides `nodeAddress`.
    pub serving_dns_names: Vec<String>,
    /// PEM serving certificate of the kubelet API; its SAN must hold `nodeAddress`, since
    /// the API server checks it against the address it dials. The three files are set
    /// together, or none of them.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tlsCertFile`.
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA bundle that signs the API server's kubelet client certificate
    /// (`--kubelet-client-certificate`): a caller without a certificate from it is refused
    /// at the TLS handshake.
    pub client_ca_file: Option<PathBuf>,
}

/// How the kubelet API gets its serving certificate and the CA of its callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum KubeletServing {
    /// `tlsCertFile`, `tlsKeyFile` and `clientCaFile`, read once at start.
    Files,
    /// As a kubelet with `serverTLSBootstrap`: a key made in memory, its certificate asked
    /// for with a `kubernetes.io/kubelet-serving` CertificateSigningRequest (approved by an
    /// admin or an approver, never by tidepool) and renewed before it expires; the client CA
    /// read from ConfigMap `kube-system/extension-apiserver-authentication` and followed.
    Csr,
    /// No kubelet API: `kubectl logs`/`exec`/`attach` on offloaded pods fail.
    Off,
}

impl KubeletConfig {
    /// Where the kubelet API's TLS comes from: `serving` if set, otherwise the files when
    /// they are set, otherwise a CSR. Files configured by hand always win over the default.
    pub fn serving_mode(&self) -> KubeletServing {
        match self.serving {
            Some(mode) => mode,
            None if self.files_set() > 0 => KubeletServing::Files,
            None => KubeletServing::Csr,
        }
    }

    /// Whether the kubelet API is to be served.
    pub fn serves(&self) -> bool {
        self.serving_mode() != KubeletServing::Off
    }

    fn files(&self) -> [(&'static str, &Option<PathBuf>); 3] {
        [
            ("kubelet.tlsCertFile", &self.tls_cert_file),
            ("kubelet.tlsKeyFile", &self.tls_key_file),
            ("kubelet.clientCaFile", &self.client_ca_file),
        ]
    }

    fn files_set(&self) -> usize {
        self.files().iter().filter(|(_, f)| f.is_some()).count()
    }

    fn validate(&self, errors: &mut Vec<FieldError>) {
        if self.port == 0 {
            errors.push(FieldError::new("kubelet.port", "must not be 0"));
        }
        if self.node_address.is_unspecified() {
            errors.push(FieldError::new("kubelet.nodeAddress", "must be an address the API server can dial"));
        }
        let set = self.files_set();
        for (path, file) in self.files() {
            match file {
                Some(f) if f.as_os_str().is_empty() => errors.push(FieldError::new(path, "must not be empty")),
                None if set > 0 => errors.push(FieldError::new(
                    path,
                    "must be set too: tlsCertFile, tlsKeyFile and clientCaFile go together",
                )),
                _ => {}
            }
        }
        match (self.serving, set) {
            (Some(KubeletServing::Files), 0) => {
                errors.push(FieldError::new("kubelet.serving", "files needs tlsCertFile, tlsKeyFile and clientCaFile"))
            }
            (Some(mode @ (KubeletServing::Csr | KubeletServing::Off)), 1..) => {
                let mode = if mode == KubeletServing::Csr { "csr" } else { "off" };
                errors.push(FieldError::new(
                    "kubelet.serving",
                    format!("{mode} does not read tlsCertFile, tlsKeyFile or clientCaFile: remove them, or use files"),
                ));
            }
            _ => {}
        }
        // Part of a certificate subject (CN=system:node:<name>), as a kubelet's node name is.
        if !crate::is_dns_subdomain(&self.serving_node_name) {
            errors.push(FieldError::new("kubelet.servingNodeName", "must be a DNS-1123 subdomain"));
        }
        for (i, name) in self.serving_dns_names.iter().enumerate() {
            if !crate::is_dns_subdomain(name) {
                errors.push(FieldError::new(format!("kubelet.servingDnsNames[{i}]"), "must be a DNS-1123 subdomain"));
            }
        }
    }
}

/// Exceptions to the offload policy, which denies by default every way a pod could reach past
/// its sandbox onto a member's hosts (see `tidepool_vk::policy`). Each switch lifts one rule
/// for every pod this instance offloads; all are off by default.
///
/// Lifting a rule here is not enough on its own: offload namespaces are created with the
/// PodSecurity `baseline` level, which refuses most of the same things, so the member's admin
/// has to relax that namespace too. Both sides of the federation must agree to host access.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PolicyAllow {
    /// Privileged containers and the other ways out of the container sandbox: Unconfined
    /// seccomp or AppArmor profiles, an Unmasked `/proc`, SELinux user/role/type options,
    /// unsafe sysctls, Windows HostProcess.
    pub privileged: bool,
    /// Linux capabilities containers may add (`IPC_LOCK` for RDMA, say), written as the
    /// kernel names them without the `CAP_` prefix. Empty: none.
    pub capabilities: Vec<String>,
    /// `hostNetwork`, `hostPID` and `hostIPC`.
    pub host_namespaces: bool,
    /// `hostPath` volumes.
    pub host_path: bool,
    /// Container ports with a `hostPort`.
    pub host_ports: bool,
    /// PersistentVolumeClaim and generic ephemeral volumes. Tidepool does not provision claims
    /// in members: with this on, the claims must already exist in the offload namespace.
    pub persistent_volume_claims: bool,
}

impl PolicyAllow {
    fn validate(&self, errors: &mut Vec<FieldError>) {
        for (i, cap) in self.capabilities.iter().enumerate() {
            let path = format!("policy.capabilities[{i}]");
            if cap.eq_ignore_ascii_case("ALL") {
                errors.push(FieldError::new(path, "ALL is every capability: list the ones pods need"));
            } else if let Some(bare) = cap.strip_prefix("CAP_") {
                errors.push(FieldError::new(path, format!("write {bare}, without the CAP_ prefix, as pod specs do")));
            } else if cap.is_empty() || !cap.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            {
                errors.push(FieldError::new(path, "must be a capability name in upper case, like NET_ADMIN"));
            }
        }
    }
}

impl Default for BridgeConfig {
    fn default() -> Self {
        Self {
            cluster_name: "training".to_owned(),
            namespace: "tidepool-system".to_owned(),
            training_kubeconfig: None,
            member_selector: None,
            namespace_prefix: keys::DEFAULT_NAMESPACE_PREFIX.to_owned(),
            kubelet: KubeletConfig::default(),
            lease_renew_seconds: 10,
            member_loss_timeout_seconds: 300,
            dispatcher: DispatcherConfig::default(),
            policy: PolicyAllow::default(),
            secret_namespaces: Vec::new(),
            leader_election: LeaderElectionConfig::default(),
            sharding: ShardingConfig::default(),
            metrics: MetricsConfig::default(),
        }
    }
}

impl Default for KubeletConfig {
    fn default() -> Self {
        Self {
            node_address: IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)),
            port: 10250,
            serving: None,
            serving_node_name: "tidepool".to_owned(),
            serving_dns_names: Vec::new(),
            tls_cert_file: None,
            tls_key_file: None,
            client_ca_file: None,
        }
    }
}

/// A YAML error as `line L column C: what` and a snippet pointing at it under `path:L:C`.
fn yaml_message(error: &serde_saphyr::Error, path: &std::path::Path) -> String {
    let name = path.display().to_string();
    let text = error.render_with_options(serde_saphyr::render_options! { source_name: Some(name.as_str()) });
    text.strip_prefix("error: ").map(str::to_owned).unwrap_or(text)
}

/// Why a configuration file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The parser's message once (not again as a cause), with the line and column and the
    /// lines around them, headed by the file's path.
    #[error("{path}: not a valid tidepool config: {}", yaml_message(.error, .path))]
    Parse { path: PathBuf, error: Box<serde_saphyr::Error> },
    #[error("{path}: {}", crate::describe(.errors))]
    Invalid { path: PathBuf, errors: Vec<FieldError> },
}

impl BridgeConfig {
    /// Parses and validates the text of config file `path` (read by the caller: this crate
    /// does no I/O); every problem is reported with the path.
    pub fn from_file(path: &std::path::Path, text: &str) -> Result<Self, ConfigError> {
        Self::parse(text).map_err(|e| match e {
            ParseError::Yaml(error) => ConfigError::Parse { path: path.into(), error },
            ParseError::Invalid(errors) => ConfigError::Invalid { path: path.into(), errors },
        })
    }

    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let config: BridgeConfig = if text.trim().is_empty() {
            Self::default()
        } else {
            serde_saphyr::from_str(text).map_err(|e| ParseError::Yaml(Box::new(e)))?
        };
        let errors = config.validate();
        if errors.is_empty() { Ok(config) } else { Err(ParseError::Invalid(errors)) }
    }

    /// Whether tidepool reads the Secrets of training namespace `namespace`
    /// ([`BridgeConfig::secret_namespaces`]).
    pub fn reads_secrets_in(&self, namespace: &str) -> bool {
        self.secret_namespaces.is_empty() || self.secret_namespaces.iter().any(|n| n == namespace)
    }

    pub fn validate(&self) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if !is_dns_label(&self.cluster_name) {
            errors.push(FieldError::new("clusterName", "must be a DNS-1123 label (it is a label value)"));
        }
        if !is_dns_label(&self.namespace) {
            errors.push(FieldError::new("namespace", "must be a namespace name"));
        }
        if !valid_namespace_prefix(&self.namespace_prefix) {
            errors.push(FieldError::new("namespacePrefix", crate::crd::NAMESPACE_PREFIX_RULE));
        }
        for (i, ns) in self.secret_namespaces.iter().enumerate() {
            if !is_dns_label(ns) {
                errors.push(FieldError::new(format!("secretNamespaces[{i}]"), "must be a namespace name"));
            }
        }
        self.kubelet.validate(&mut errors);
        self.sharding.validate(&mut errors);
        let le = &self.leader_election;
        if !crate::is_dns_subdomain(&le.lease_name) {
            errors.push(FieldError::new("leaderElection.leaseName", "must be a DNS-1123 subdomain"));
        }
        if !(2..=300).contains(&le.lease_duration_seconds) {
            errors.push(FieldError::new("leaderElection.leaseDurationSeconds", "must be between 2 and 300"));
        }
        if le.retry_period_seconds == 0 || le.retry_period_seconds * 2 > le.lease_duration_seconds {
            errors.push(FieldError::new(
                "leaderElection.retryPeriodSeconds",
                "must be at least 1 and at most half of leaseDurationSeconds",
            ));
        }
        if !crate::is_dns_subdomain(&self.dispatcher.scheduler_name) {
            errors.push(FieldError::new("dispatcher.schedulerName", "must be a DNS-1123 subdomain"));
        }
        if !(1..=86_400).contains(&self.dispatcher.gang_timeout_seconds) {
            errors.push(FieldError::new("dispatcher.gangTimeoutSeconds", "must be between 1 and 86400"));
        }
        if let Some(native) = &self.dispatcher.native_nodes
            && native.node_selector.keys().any(|k| k.is_empty())
        {
            errors.push(FieldError::new("dispatcher.nativeNodes.nodeSelector", "label keys must not be empty"));
        }
        if self.dispatcher.deficit_hysteresis_seconds > 3600 {
            errors.push(FieldError::new("dispatcher.deficitHysteresisSeconds", "must be at most 3600"));
        }
        for (band, secs) in [
            ("high", self.dispatcher.reclaim_grace_seconds.high),
            ("medium", self.dispatcher.reclaim_grace_seconds.medium),
            ("low", self.dispatcher.reclaim_grace_seconds.low),
        ] {
            if secs > 86_400 {
                errors.push(FieldError::new(format!("dispatcher.reclaimGraceSeconds.{band}"), "must be at most 86400"));
            }
        }
        if !(1..=60).contains(&self.lease_renew_seconds) {
            errors.push(FieldError::new("leaseRenewSeconds", "must be between 1 and 60"));
        }
        if !(1..=86_400).contains(&self.member_loss_timeout_seconds) {
            errors.push(FieldError::new("memberLossTimeoutSeconds", "must be between 1 and 86400"));
        }
        self.policy.validate(&mut errors);
        errors
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error(transparent)]
    Yaml(Box<serde_saphyr::Error>),
    #[error("{}", crate::describe(.0))]
    Invalid(Vec<FieldError>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_default() {
        assert_eq!(BridgeConfig::parse("").unwrap(), BridgeConfig::default());
    }

    #[test]
    fn a_yaml_error_names_the_file_line_and_column_once() {
        let path = std::path::Path::new("/etc/tidepool/tidepool.yaml");
        let err = BridgeConfig::from_file(path, "clusterName: x\nleaseRenewSeconds: abc\n").unwrap_err();
        assert!(std::error::Error::source(&err).is_none(), "the message would be printed twice: {err:?}");
        let text = err.to_string();
        let first = text.lines().next().unwrap();
        assert_eq!(first, format!("{}: not a valid tidepool config: line 2 column 20: invalid u64", path.display()));
        assert!(text.contains(&format!("{}:2:20", path.display())), "{text}");
        assert!(text.contains("leaseRenewSeconds: abc"), "the snippet shows the line: {text}");
    }

    #[test]
    fn a_typo_is_an_error_not_a_default() {
        let err = BridgeConfig::parse("clustername: x\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `clustername`"), "{err}");
    }

    #[test]
    fn every_invalid_field_is_reported_with_its_path() {
        let err = BridgeConfig::parse(
            "clusterName: Bad\nkubelet: {port: 0}\nleaseRenewSeconds: 0\nmemberLossTimeoutSeconds: 0\n",
        )
        .unwrap_err();
        let ParseError::Invalid(errors) = err else { panic!("expected validation errors") };
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["clusterName", "kubelet.port", "leaseRenewSeconds", "memberLossTimeoutSeconds"]);
    }

    #[test]
    fn sharding_timings_must_leave_the_owner_time_to_stop_before_another_takes_over() {
        let ok = BridgeConfig::parse("sharding: {enabled: true, leaseDurationSeconds: 15, renewDeadlineSeconds: 10}\n");
        assert!(ok.unwrap().sharding.enabled);
        let err = BridgeConfig::parse(
            "sharding: {enabled: true, leaseDurationSeconds: 10, renewDeadlineSeconds: 10, retryPeriodSeconds: 6}\n",
        )
        .unwrap_err();
        let ParseError::Invalid(errors) = err else { panic!("expected validation errors") };
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["sharding.renewDeadlineSeconds", "sharding.retryPeriodSeconds"]);
    }

    #[test]
    fn the_policy_section_is_optional_and_denies_everything_by_default() {
        let c = BridgeConfig::parse("clusterName: train-1\n").unwrap();
        assert_eq!(c.policy, PolicyAllow::default());
        assert!(!c.policy.privileged && !c.policy.host_namespaces && !c.policy.host_path);
        assert!(!c.policy.host_ports && !c.policy.persistent_volume_claims && c.policy.capabilities.is_empty());
    }

    #[test]
    fn the_policy_section_lifts_single_rules() {
        let c = BridgeConfig::parse("policy: {persistentVolumeClaims: true, capabilities: [IPC_LOCK]}\n").unwrap();
        assert!(c.policy.persistent_volume_claims);
        assert_eq!(c.policy.capabilities, ["IPC_LOCK"]);
        assert!(!c.policy.privileged);
    }

    #[test]
    fn a_typo_in_the_policy_section_is_an_error() {
        let err = BridgeConfig::parse("policy: {hostPaths: true}\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `hostPaths`"), "{err}");
    }

    #[test]
    fn capabilities_must_be_named_as_pod_specs_name_them() {
        let err = BridgeConfig::parse("policy: {capabilities: [NET_ADMIN, ALL, CAP_SYS_ADMIN, net_raw, \"\"]}\n")
            .unwrap_err();
        let ParseError::Invalid(errors) = err else { panic!("expected validation errors") };
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            ["policy.capabilities[1]", "policy.capabilities[2]", "policy.capabilities[3]", "policy.capabilities[4]"]
        );
        assert!(errors[1].message.contains("write SYS_ADMIN"), "{}", errors[1]);
    }

    #[test]
    fn the_kubelet_tls_files_go_together() {
        let Err(ParseError::Invalid(errors)) = BridgeConfig::parse("kubelet: {tlsCertFile: /c.pem, tlsKeyFile: ''}\n")
        else {
            panic!("accepted");
        };
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["kubelet.tlsKeyFile", "kubelet.clientCaFile"]);
        let c = BridgeConfig::parse("kubelet: {tlsCertFile: /c, tlsKeyFile: /k, clientCaFile: /ca}\n").unwrap();
        assert!(c.kubelet.serves());
    }

    #[test]
    fn the_kubelet_api_serves_files_when_given_and_a_csr_certificate_otherwise() {
        let cases = [
            ("no files and no mode: a certificate from a CSR", "kubelet: {}", KubeletServing::Csr),
            (
                "the three files and no mode: the files",
                "kubelet: {tlsCertFile: /c, tlsKeyFile: /k, clientCaFile: /ca}",
                KubeletServing::Files,
            ),
            (
                "an explicit files mode with the files",
                "kubelet: {serving: files, tlsCertFile: /c, tlsKeyFile: /k, clientCaFile: /ca}",
                KubeletServing::Files,
            ),
            ("an explicit csr mode", "kubelet: {serving: csr}", KubeletServing::Csr),
            ("off serves nothing", "kubelet: {serving: off}", KubeletServing::Off),
        ];
        for (case, yaml, want) in cases {
            let c = BridgeConfig::parse(yaml).unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(c.kubelet.serving_mode(), want, "{case}");
            assert_eq!(c.kubelet.serves(), want != KubeletServing::Off, "{case}");
        }
        assert_eq!(BridgeConfig::default().kubelet.serving_mode(), KubeletServing::Csr);
    }

    #[test]
    fn a_kubelet_serving_mode_that_contradicts_the_files_is_an_error() {
        let cases = [
            ("files without files", "kubelet: {serving: files}"),
            ("csr with files", "kubelet: {serving: csr, tlsCertFile: /c, tlsKeyFile: /k, clientCaFile: /ca}"),
            ("off with files", "kubelet: {serving: off, tlsCertFile: /c, tlsKeyFile: /k, clientCaFile: /ca}"),
        ];
        for (case, yaml) in cases {
            let Err(ParseError::Invalid(errors)) = BridgeConfig::parse(yaml) else { panic!("{case}: accepted") };
            let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
            assert_eq!(paths, ["kubelet.serving"], "{case}");
        }
        assert!(BridgeConfig::parse("kubelet: {serving: sometimes}").is_err());
    }

    #[test]
    fn the_csr_subject_and_dns_names_must_be_dns_names() {
        let Err(ParseError::Invalid(errors)) =
            BridgeConfig::parse("kubelet: {servingNodeName: 'Bad Name', servingDnsNames: [ok.example, '-x']}")
        else {
            panic!("accepted");
        };
        let paths: Vec<_> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["kubelet.servingNodeName", "kubelet.servingDnsNames[1]"]);
        let c = BridgeConfig::parse("kubelet: {servingNodeName: vk-1, servingDnsNames: [tidepool.example]}").unwrap();
        assert_eq!(c.kubelet.serving_node_name, "vk-1");
        assert_eq!(BridgeConfig::default().kubelet.serving_node_name, "tidepool");
    }

    #[test]
    fn fields_override_defaults() {
        let c = BridgeConfig::parse("clusterName: train-1\nkubelet: {nodeAddress: 127.0.0.9}\n").unwrap();
        assert_eq!(c.cluster_name, "train-1");
        assert_eq!(c.kubelet.node_address.to_string(), "127.0.0.9");
        assert_eq!(c.kubelet.port, 10250);
    }
}
