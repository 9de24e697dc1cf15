//! Tidepool's Prometheus metrics: one process-wide set, registered once, encoded in the
//! OpenMetrics text format by the binary's `/metrics` endpoint.
//!
//! The names here are a contract: the Grafana dashboard in `deploy/grafana/` queries them
//! and a test checks that every name it uses is registered. Components record through
//! [`metrics()`]; nothing here does I/O.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::Resources;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub queue: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberLabels {
    pub member: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub member: String,
    pub pool: String,
    /// `cpu`, `memory`, `gpu`, `pods`.
    pub resource: &'static str,
    /// What the value counts: `cores`, `bytes`, `devices`, `pods` (one metric, several units).
    pub unit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    /// The virtual node (one per member pool).
    pub node: String,
    pub band: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BandLabels {
    pub band: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReclaimLabels {
    pub member: String,
    pub band: &'static str,
    /// How the victim went: `acknowledged`, `deadline` or `exited`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// `training` or the member's name.
    pub cluster: String,
    /// HTTP method in Kubernetes terms: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: &'static str,
    /// Resource plural (`pods`, `leases`, ...), `-` for non-resource paths.
    pub resource: String,
    /// HTTP status class or code: `2xx`, `404`, `409`, `429`, `5xx`, `error` (no answer).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemberTaskLabels {
    pub member: String,
    /// The task of the member's session: `capacity publisher`, `pod watch`, ...
    pub task: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    pub cluster: String,
}

/// Every metric tidepool exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    names: Vec<String>,
    /// Time one reconcile / sync step takes, per controller.
    pub sync_seconds: Family<ControllerLabels, Histogram>,
    /// Work waiting, per queue (`pods`, `gangs`, ...).
    pub queue_depth: Family<QueueLabels, Gauge>,
    /// Member readiness: 1 Ready, 0 not.
    pub member_ready: Family<MemberLabels, Gauge>,
    /// Offload capacity, use and deficit per pool and resource (cores, bytes, devices).
    pub pool_capacity: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub pool_used: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub pool_deficit: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Training pods bound to a virtual node by the dispatcher.
    pub placements: Family<PlacementLabels, Counter>,
    /// Gangs the dispatcher is holding back, and gangs rolled back by the gang timeout.
    pub gangs_waiting: Gauge,
    pub gang_timeouts: Counter,
    /// Checkpoint notices sent and reclaims completed.
    pub reclaim_notices: Family<BandLabels, Counter>,
    pub reclaims: Family<ReclaimLabels, Counter>,
    /// Notice → checkpoint acknowledgement.
    pub checkpoint_ack_seconds: Histogram,
    /// API requests tidepool sent, per cluster, verb, resource and answer.
    pub api_requests: Family<ApiLabels, Counter>,
    /// Time spent waiting for a member's client-side rate limit, and requests that waited.
    pub api_throttle_seconds: Family<ClusterLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub api_throttled: Family<ClusterLabels, Counter>,
    /// 1 while this replica holds the leader Lease.
    pub leader: Gauge,
    /// Panics caught in tasks (each is logged too; a controller's own task ending exits).
    pub panics: Counter,
    /// Tasks of a member's session that ended or panicked while it ran (each replaced the
    /// session).
    pub member_task_stops: Family<MemberTaskLabels, Counter>,
    /// Always 1, labelled with the running version (join on it in dashboards and alerts).
    pub build_info: Family<BuildLabels, Gauge>,
}

impl Metrics {
    fn new() -> Self {
        let mut reg = Reg { registry: Registry::with_prefix("tidepool"), names: Vec::new() };
        let sync_seconds = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        reg.add("sync_duration_seconds", "Time one sync step takes, per controller", sync_seconds.clone());
        let queue_depth = Family::default();
        reg.add("queue_depth", "Items waiting, per queue", queue_depth.clone());
        let member_ready = Family::default();
        reg.add("member_ready", "Member cluster readiness (1 Ready, 0 not)", member_ready.clone());
        let pool_capacity = Family::default();
        reg.add("pool_capacity", "Offload capacity of a pool (cores, bytes, devices)", pool_capacity.clone());
        let pool_used = Family::default();
        reg.add("pool_used", "Requests of offload pods in a pool", pool_used.clone());
        let pool_deficit = Family::default();
        reg.add("pool_deficit", "What online demand needs back from a pool", pool_deficit.clone());
        let placements = Family::default();
        reg.add("placements", "Training pods bound to a virtual node", placements.clone());
        let gangs_waiting = Gauge::default();
        reg.add("gangs_waiting", "Gangs the dispatcher cannot place yet", gangs_waiting.clone());
        let gang_timeouts = Counter::default();
        reg.add("gang_timeouts", "Placed gangs rolled back by the gang timeout", gang_timeouts.clone());
        let reclaim_notices = Family::default();
        reg.add("reclaim_notices", "Checkpoint notices sent to reclaim victims", reclaim_notices.clone());
        let reclaims = Family::default();
        reg.add("reclaims", "Training pods reclaimed for online demand", reclaims.clone());
        let checkpoint_ack_seconds = Histogram::new(exponential_buckets(0.05, 2.0, 14));
        reg.add(
            "checkpoint_ack_seconds",
            "Time from checkpoint notice to acknowledgement",
            checkpoint_ack_seconds.clone(),
        );
        let api_requests = Family::default();
        reg.add("api_requests", "Kubernetes API requests sent, by answer", api_requests.clone());
        let api_throttle_seconds = Family::default();
        reg.add(
            "api_throttle_seconds",
            "Time requests waited for a member's client-side rate limit",
            api_throttle_seconds.clone(),
        );
        let api_throttled = Family::default();
        reg.add("api_throttled", "Requests that waited for a rate limit", api_throttled.clone());
        let leader = Gauge::default();
        reg.add("leader", "1 while this replica holds the leader Lease", leader.clone());
        let panics = Counter::default();
        reg.add("panics", "Panics caught in tasks, each also logged", panics.clone());
        let member_task_stops = Family::default();
        reg.add(
            "member_task_stops",
            "Tasks of a member's session that stopped while it ran (the session is replaced)",
            member_task_stops.clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        reg.add("build_info", "Always 1, labelled with tidepool's version", build_info.clone());
        Self {
            registry: reg.registry,
            names: reg.names,
            sync_seconds,
            queue_depth,
            member_ready,
            pool_capacity,
            pool_used,
            pool_deficit,
            placements,
            gangs_waiting,
            gang_timeouts,
            reclaim_notices,
            reclaims,
            checkpoint_ack_seconds,
            api_requests,
            api_throttle_seconds,
            api_throttled,
            leader,
            panics,
            member_task_stops,
            build_info,
        }
    }

    /// Records how long one step of `controller` took.
    pub fn observe_sync(&self, controller: &'static str, took: Duration) {
        self.sync_seconds.get_or_create(&ControllerLabels { controller }).observe(took.as_secs_f64());
    }

    pub fn set_queue_depth(&self, queue: &'static str, depth: usize) {
        self.queue_depth.get_or_create(&QueueLabels { queue }).set(i64::try_from(depth).unwrap_or(i64::MAX));
    }

    /// Publishes a pool's capacity, use and deficit.
    pub fn set_pool(&self, member: &str, pool: &str, capacity: &Resources, used: &Resources, deficit: &Resources) {
        for (family, value) in [(&self.pool_capacity, capacity), (&self.pool_used, used), (&self.pool_deficit, deficit)]
        {
            for (resource, amount) in resource_values(value) {
                family
                    .get_or_create(&PoolLabels {
                        member: member.into(),
                        pool: pool.into(),
                        resource,
                        unit: unit_of(resource),
                    })
                    .set(amount);
            }
        }
    }

    /// Counts a task of `member`'s session that stopped while the session ran.
    pub fn count_member_task_stop(&self, member: &str, task: &str) {
        self.member_task_stops.get_or_create(&MemberTaskLabels { member: member.into(), task: task.into() }).inc();
    }

    /// Drops a member's readiness series (member deleted): a gone member must not look idle.
    pub fn forget_member(&self, member: &str) {
        self.member_ready.remove(&MemberLabels { member: member.into() });
    }

    /// Drops one pool's capacity series.
    pub fn forget_pool(&self, member: &str, pool: &str) {
        for family in [&self.pool_capacity, &self.pool_used, &self.pool_deficit] {
            for resource in RESOURCES {
                family.remove(&PoolLabels {
                    member: member.into(),
                    pool: pool.into(),
                    resource,
                    unit: unit_of(resource),
                });
            }
        }
    }

    /// Every series name tidepool can expose (`tidepool_reclaims_total`, `..._bucket`), for
    /// checking dashboards and alerts against.
    pub fn series_names(&self) -> &[String] {
        &self.names
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Registers metrics and remembers the series names they expose.
struct Reg {
    registry: Registry,
    names: Vec<String>,
}

impl Reg {
    fn add<M: prometheus_client::registry::Metric + Clone>(&mut self, name: &str, help: &str, metric: M) {
        let full = format!("tidepool_{name}");
        let suffixes: &[&str] = match metric.metric_type() {
            prometheus_client::metrics::MetricType::Counter => &["_total"],
            prometheus_client::metrics::MetricType::Histogram => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        self.names.extend(suffixes.iter().map(|s| format!("{full}{s}")));
        self.registry.register(name, help, metric);
    }
}

const RESOURCES: [&str; 4] = ["cpu", "memory", "gpu", "pods"];

/// The amounts a pool gauge shows: cores, bytes, devices and pod slots.
fn resource_values(r: &Resources) -> [(&'static str, f64); 4] {
    let units = |name: &str| r.get(name) as f64 / 1000.0;
    [("cpu", units("cpu")), ("memory", units("memory")), ("gpu", units("nvidia.com/gpu")), ("pods", units("pods"))]
}

/// The unit a pool gauge's value is in, for its `unit` label.
fn unit_of(resource: &str) -> &'static str {
    match resource {
        "cpu" => "cores",
        "memory" => "bytes",
        "gpu" => "devices",
        _ => "pods",
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// Kubernetes verb of an API request, from its method and whether it is a watch.
pub fn api_verb(method: &str, query: &str, path_has_name: bool) -> &'static str {
    let watch = form_urlencoded::parse(query.as_bytes()).any(|(k, v)| k == "watch" && (v == "true" || v == "1"));
    match method {
        "GET" if watch => "watch",
        "GET" if path_has_name => "get",
        "GET" => "list",
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" => "delete",
        _ => "other",
    }
}

/// The resource plural and whether a name follows it, from an API path
/// (`/api/v1/namespaces/ns/pods/name/status` → `("pods", true)`).
pub fn api_resource(path: &str) -> (String, bool) {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // Skip `api/v1` or `apis/group/version`.
    let rest = match parts.first() {
        Some(&"api") => parts.get(2..),
        Some(&"apis") => parts.get(3..),
        _ => None,
    };
    let Some(mut rest) = rest else { return ("-".into(), false) };
    if rest.first() == Some(&"namespaces") && rest.len() > 2 {
        rest = &rest[2..];
    }
    match rest {
        [] => ("-".into(), false),
        [resource] => ((*resource).into(), false),
        [resource, _name] => ((*resource).into(), true),
        [resource, _name, sub, ..] => (format!("{resource}/{sub}"), true),
    }
}

/// `2xx`, `5xx`, or the exact code for the answers that mean something specific.
pub fn api_code(status: Option<u16>) -> String {
    match status {
        None => "error".into(),
        Some(c @ (404 | 409 | 422 | 429 | 403 | 401)) => c.to_string(),
        Some(c) => format!("{}xx", c / 100),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_paths_become_resources_and_verbs() {
        assert_eq!(api_resource("/api/v1/namespaces/ns/pods"), ("pods".into(), false));
        assert_eq!(api_resource("/api/v1/namespaces/ns/pods/p/status"), ("pods/status".into(), true));
        assert_eq!(api_resource("/api/v1/nodes/n"), ("nodes".into(), true));
        assert_eq!(api_resource("/api/v1/namespaces/ns"), ("namespaces".into(), true));
        assert_eq!(api_resource("/api/v1/namespaces"), ("namespaces".into(), false));
        assert_eq!(
            api_resource("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/x"),
            ("leases".into(), true)
        );
        assert_eq!(api_resource("/version"), ("-".into(), false));
        assert_eq!(api_verb("GET", "watch=true&resourceVersion=1", false), "watch");
        assert_eq!(api_verb("GET", "labelSelector=a%3Db&watch=1", false), "watch");
        assert_eq!(api_verb("GET", "watch=false", false), "list");
        assert_eq!(api_verb("GET", "", true), "get");
        assert_eq!(api_verb("GET", "labelSelector=a", false), "list");
        assert_eq!(api_verb("POST", "", false), "create");
        assert_eq!(api_code(Some(201)), "2xx");
        assert_eq!(api_code(Some(429)), "429");
        assert_eq!(api_code(Some(503)), "5xx");
        assert_eq!(api_code(None), "error");
    }

    #[test]
    fn every_family_is_encoded_with_its_prefix() {
        let m = metrics();
        m.observe_sync("test", Duration::from_millis(3));
        m.set_pool("m", "p", &Resources::default(), &Resources::default(), &Resources::default());
        let text = m.encode();
        for name in ["tidepool_sync_duration_seconds_bucket", "tidepool_pool_capacity{", "tidepool_leader "] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        let names = m.series_names();
        assert!(names.iter().any(|n| n == "tidepool_reclaims_total"), "{names:?}");
        assert!(names.iter().any(|n| n == "tidepool_checkpoint_ack_seconds_bucket"), "{names:?}");
        assert!(names.iter().any(|n| n == "tidepool_pool_deficit"), "{names:?}");
    }
}
