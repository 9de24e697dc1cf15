//! The offloaded pods' resource usage as a kubelet reports it, decided on plain data: what a
//! member's PodMetrics say about which training pod ([`attribute`]), the cumulative CPU
//! counters a kubelet keeps made from the rates a metrics API gives ([`Counters`]), and the
//! two forms it is served in, Prometheus text for `/metrics/resource` ([`render_resource`])
//! and the stats summary's JSON ([`render_summary`]). The requests themselves: [`super::stats`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use jiff::Timestamp;
use serde::Deserialize;
use tidepool_api::keys;

/// A training pod bound to a virtual node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TrainingPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node: String,
    /// When each container last started, from the pod's status (mirrored from its copy).
    pub started: BTreeMap<String, Timestamp>,
}

/// One item of a member's `metrics.k8s.io/v1beta1` PodMetricsList; only what is read.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct PodMetrics {
    pub metadata: MetricsMeta,
    pub timestamp: Option<String>,
    pub window: Option<String>,
    #[serde(default)]
    pub containers: Vec<ContainerMetrics>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct MetricsMeta {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ContainerMetrics {
    pub name: String,
    #[serde(default)]
    pub usage: BTreeMap<String, String>,
}

/// One container's usage as a member measured it: a rate over `window` ending `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Usage {
    pub nano_cores: u64,
    pub memory_bytes: u64,
    pub at: Timestamp,
    pub window: Duration,
}

/// A container's usage attributed to the training pod (index into the pods given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sample {
    pub pod: usize,
    pub container: String,
    pub usage: Usage,
}

/// The samples of the copies among `metrics` whose origin UID is one of `pods`: a copy
/// names its training pod by that label, whatever its name (a same-named pod that is not
/// a copy of one of these is left out). Items without a timestamp, or a usage that does not
/// parse, are skipped.
pub(crate) fn attribute(pods: &[TrainingPod], metrics: &[PodMetrics]) -> Vec<Sample> {
    let by_uid: HashMap<&str, usize> = pods.iter().enumerate().map(|(i, p)| (p.uid.as_str(), i)).collect();
    let mut samples = Vec::new();
    for item in metrics {
        let Some(&pod) = item.metadata.labels.get(keys::LABEL_ORIGIN_UID).and_then(|uid| by_uid.get(uid.as_str()))
        else {
            continue;
        };
        let Some(at) = item.timestamp.as_deref().and_then(|t| t.parse::<Timestamp>().ok()) else { continue };
        let window = item.window.as_deref().and_then(parse_go_duration).unwrap_or_default();
        for c in &item.containers {
            let cpu = c.usage.get("cpu").map(|q| nano_units(q));
            let memory = c.usage.get("memory").map(|q| nano_units(q).map(|n| n / 1_000_000_000));
            if let (Some(Some(nano_cores)), Some(Some(memory_bytes))) = (cpu, memory) {
                let usage = Usage { nano_cores, memory_bytes, at, window };
                samples.push(Sample { pod, container: c.name.clone(), usage });
            }
        }
    }
    samples
}

/// A quantity in billionths of its unit (`250m` cpu is 250000000, `1Ki` is 1024e9), or
/// `None` for a negative or malformed one. Suffixes below milli keep their precision, which
/// [`tidepool_api::resources::parse_milli`] rounds away.
fn nano_units(quantity: &str) -> Option<u64> {
    let q = quantity.trim();
    let (digits, scale) = if let Some(n) = q.strip_suffix('n') {
        (n, 1)
    } else if let Some(u) = q.strip_suffix('u') {
        (u, 1_000)
    } else {
        let milli = tidepool_api::resources::parse_milli(q).ok()?;
        return u64::try_from(milli).ok().map(|m| m.saturating_mul(1_000_000));
    };
    digits.parse::<u64>().ok().map(|n| n.saturating_mul(scale))
}

/// A Go `time.Duration` string (`15.012s`, `1m0.5s`, `500ms`), as metrics-server writes
/// windows.
fn parse_go_duration(s: &str) -> Option<Duration> {
    let mut rest = s.trim();
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let value: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let seconds = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * seconds;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).ok()
}

/// Cumulative CPU time per container and per node, in nanoseconds, made from rates.
///
/// A kubelet's `container_cpu_usage_seconds_total` only grows; metrics-server takes the
/// difference of two scrapes over their time apart. A member's metrics API gives a rate
/// over a window instead, so each new sample (a later `at`) adds `rate × (at − last at)`,
/// and a repeated one (the member has not measured again) adds nothing. A container's first
/// sample starts its counter at `rate × window`, at least 1 ns: metrics-server drops a pod
/// whose counter reads zero. A node's counter adds what its containers' counters add, so it
/// never goes back when a pod leaves.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    containers: HashMap<(String, String), Counter>,
    nodes: HashMap<String, u64>,
}

#[derive(Debug, Clone)]
struct Counter {
    node: String,
    at: Timestamp,
    cpu_ns: u64,
}

impl Counters {
    /// The container's counter after `usage`.
    pub(crate) fn advance(&mut self, node: &str, uid: &str, container: &str, usage: &Usage) -> u64 {
        let key = (uid.to_owned(), container.to_owned());
        let cpu_over = |d: Duration| {
            let ns = u128::from(usage.nano_cores) * d.as_nanos() / 1_000_000_000;
            u64::try_from(ns).unwrap_or(u64::MAX)
        };
        let (added, counter) = match self.containers.get(&key) {
            Some(c) if usage.at > c.at => {
                let elapsed = Duration::try_from(usage.at.duration_since(c.at)).unwrap_or_default();
                let added = cpu_over(elapsed);
                (added, Counter { node: node.to_owned(), at: usage.at, cpu_ns: c.cpu_ns.saturating_add(added) })
            }
            Some(c) => (0, c.clone()),
            None => {
                let first = cpu_over(usage.window).max(1);
                (first, Counter { node: node.to_owned(), at: usage.at, cpu_ns: first })
            }
        };
        let total = counter.cpu_ns;
        self.containers.insert(key, counter);
        let node_total = self.nodes.entry(node.to_owned()).or_default();
        *node_total = node_total.saturating_add(added);
        total
    }

    pub(crate) fn node_total(&self, node: &str) -> u64 {
        self.nodes.get(node).copied().unwrap_or(0)
    }

    /// Forgets the containers of `node` whose pod is not among `live` (UIDs): the pod left.
    pub(crate) fn retain_live(&mut self, node: &str, live: &HashSet<&str>) {
        self.containers.retain(|(uid, _), c| c.node != node || live.contains(uid.as_str()));
    }
}

/// What one virtual node reports: its totals and its pods' containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeUsage {
    pub name: String,
    pub cpu_ns: u64,
    pub nano_cores: u64,
    pub memory_bytes: u64,
    /// The latest measurement among its containers; `None` with none.
    pub at: Option<Timestamp>,
    pub pods: Vec<PodUsage>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodUsage {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub containers: Vec<ContainerUsage>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContainerUsage {
    pub name: String,
    pub cpu_ns: u64,
    pub nano_cores: u64,
    pub memory_bytes: u64,
    pub at: Timestamp,
    pub started: Option<Timestamp>,
}

/// The usage of `node` from the samples of its pods, advancing the counters (and forgetting
/// those of pods no longer on it).
pub(crate) fn assemble(node: &str, pods: &[TrainingPod], samples: &[Sample], counters: &mut Counters) -> NodeUsage {
    let live: HashSet<&str> = pods.iter().filter(|p| p.node == node).map(|p| p.uid.as_str()).collect();
    counters.retain_live(node, &live);
    let mut by_pod: BTreeMap<usize, Vec<ContainerUsage>> = BTreeMap::new();
    for s in samples.iter().filter(|s| pods[s.pod].node == node) {
        let pod = &pods[s.pod];
        let cpu_ns = counters.advance(node, &pod.uid, &s.container, &s.usage);
        by_pod.entry(s.pod).or_default().push(ContainerUsage {
            name: s.container.clone(),
            cpu_ns,
            nano_cores: s.usage.nano_cores,
            memory_bytes: s.usage.memory_bytes,
            at: s.usage.at,
            started: pod.started.get(&s.container).copied(),
        });
    }
    let all = by_pod.values().flatten();
    let (nano_cores, memory_bytes, at) = all.fold((0u64, 0u64, None), |(cpu, mem, at), c| {
        (cpu.saturating_add(c.nano_cores), mem.saturating_add(c.memory_bytes), at.max(Some(c.at)))
    });
    let pods = by_pod
        .into_iter()
        .map(|(i, containers)| {
            let p = &pods[i];
            PodUsage { namespace: p.namespace.clone(), name: p.name.clone(), uid: p.uid.clone(), containers }
        })
        .collect();
    NodeUsage { name: node.to_owned(), cpu_ns: counters.node_total(node), nano_cores, memory_bytes, at, pods }
}

/// Prometheus text exposition as a kubelet's `/metrics/resource` serves it, with
/// millisecond timestamps. Node series only for a single node (`with_node`): metrics-server
/// gives them to the node it scraped. `scrape_error` is 1 when some member's usage could
/// not be read (its pods are missing).
pub(crate) fn render_resource(nodes: &[NodeUsage], with_node: bool, scrape_error: bool) -> String {
    let mut out = String::new();
    let containers = || nodes.iter().flat_map(|n| n.pods.iter()).flat_map(|p| p.containers.iter().map(move |c| (p, c)));
    let labels = |p: &PodUsage, c: &ContainerUsage| {
        format!("container=\"{}\",namespace=\"{}\",pod=\"{}\"", escape(&c.name), escape(&p.namespace), escape(&p.name))
    };
    header(
        &mut out,
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed by the container in core-seconds",
        "counter",
    );
    for (p, c) in containers() {
        let _ = writeln!(
            out,
            "container_cpu_usage_seconds_total{{{}}} {} {}",
            labels(p, c),
            seconds(c.cpu_ns),
            c.at.as_millisecond()
        );
    }
    header(&mut out, "container_memory_working_set_bytes", "Current working set of the container in bytes", "gauge");
    for (p, c) in containers() {
        let _ = writeln!(
            out,
            "container_memory_working_set_bytes{{{}}} {} {}",
            labels(p, c),
            c.memory_bytes,
            c.at.as_millisecond()
        );
    }
    header(
        &mut out,
        "container_start_time_seconds",
        "Start time of the container since unix epoch in seconds",
        "gauge",
    );
    for (p, c) in containers() {
        if let Some(started) = c.started {
            let _ = writeln!(
                out,
                "container_start_time_seconds{{{}}} {} {}",
                labels(p, c),
                started.as_second(),
                c.at.as_millisecond()
            );
        }
    }
    if with_node
        && let [node] = nodes
        && let Some(at) = node.at
    {
        header(
            &mut out,
            "node_cpu_usage_seconds_total",
            "Cumulative cpu time consumed by the node in core-seconds",
            "counter",
        );
        let _ = writeln!(out, "node_cpu_usage_seconds_total {} {}", seconds(node.cpu_ns), at.as_millisecond());
        header(&mut out, "node_memory_working_set_bytes", "Current working set of the node in bytes", "gauge");
        let _ = writeln!(out, "node_memory_working_set_bytes {} {}", node.memory_bytes, at.as_millisecond());
    }
    render_pods(&mut out, nodes);
    header(&mut out, "scrape_error", "1 if there was an error while getting container metrics, 0 otherwise", "gauge");
    let _ = writeln!(out, "scrape_error {}", u8::from(scrape_error));
    out
}

fn render_pods(out: &mut String, nodes: &[NodeUsage]) {
    let pods = || nodes.iter().flat_map(|n| n.pods.iter()).filter(|p| !p.containers.is_empty());
    let labels = |p: &PodUsage| format!("namespace=\"{}\",pod=\"{}\"", escape(&p.namespace), escape(&p.name));
    let at = |p: &PodUsage| p.containers.iter().map(|c| c.at).max().map_or(0, |t| t.as_millisecond());
    header(out, "pod_cpu_usage_seconds_total", "Cumulative cpu time consumed by the pod in core-seconds", "counter");
    for p in pods() {
        let cpu = p.containers.iter().fold(0u64, |sum, c| sum.saturating_add(c.cpu_ns));
        let _ = writeln!(out, "pod_cpu_usage_seconds_total{{{}}} {} {}", labels(p), seconds(cpu), at(p));
    }
    header(out, "pod_memory_working_set_bytes", "Current working set of the pod in bytes", "gauge");
    for p in pods() {
        let memory = p.containers.iter().fold(0u64, |sum, c| sum.saturating_add(c.memory_bytes));
        let _ = writeln!(out, "pod_memory_working_set_bytes{{{}}} {} {}", labels(p), memory, at(p));
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Nanoseconds as seconds with all nine decimals (no float rounding).
fn seconds(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

/// A label value as the exposition format escapes it.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The kubelet stats summary (`/stats/summary`) of `node`: its totals and its pods, with
/// the fields `kubectl top`-era consumers read (cpu `usageNanoCores` and
/// `usageCoreNanoSeconds`, memory `workingSetBytes`).
pub(crate) fn render_summary(node: &NodeUsage, now: Timestamp) -> serde_json::Value {
    let cpu = |at: Timestamp, nano_cores: u64, cpu_ns: u64| serde_json::json!({"time": at.to_string(), "usageNanoCores": nano_cores, "usageCoreNanoSeconds": cpu_ns});
    let memory = |at: Timestamp, bytes: u64| serde_json::json!({"time": at.to_string(), "workingSetBytes": bytes});
    let pods: Vec<serde_json::Value> = node
        .pods
        .iter()
        .map(|p| {
            let at = p.containers.iter().map(|c| c.at).max().unwrap_or(now);
            let (cores, cpu_ns, bytes) = p.containers.iter().fold((0u64, 0u64, 0u64), |(a, b, m), c| {
                (a.saturating_add(c.nano_cores), b.saturating_add(c.cpu_ns), m.saturating_add(c.memory_bytes))
            });
            let containers: Vec<serde_json::Value> = p
                .containers
                .iter()
                .map(|c| {
                    let mut v = serde_json::json!({"name": c.name, "cpu": cpu(c.at, c.nano_cores, c.cpu_ns),
                        "memory": memory(c.at, c.memory_bytes)});
                    if let Some(started) = c.started {
                        v["startTime"] = serde_json::json!(started.to_string());
                    }
                    v
                })
                .collect();
            serde_json::json!({
                "podRef": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
                "containers": containers,
                "cpu": cpu(at, cores, cpu_ns),
                "memory": memory(at, bytes),
            })
        })
        .collect();
    let at = node.at.unwrap_or(now);
    serde_json::json!({
        "node": {"nodeName": node.name, "cpu": cpu(at, node.nano_cores, node.cpu_ns), "memory": memory(at, node.memory_bytes)},
        "pods": pods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    fn training(namespace: &str, name: &str, uid: &str, node: &str) -> TrainingPod {
        TrainingPod {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
            node: node.into(),
            started: BTreeMap::new(),
        }
    }

    fn copy(uid: Option<&str>, at: Option<&str>, containers: &[(&str, &str, &str)]) -> PodMetrics {
        let labels = uid.map(|u| BTreeMap::from([(keys::LABEL_ORIGIN_UID.to_owned(), u.to_owned())]));
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "same-name", "namespace": "tp-team", "labels": labels.unwrap_or_default()},
            "timestamp": at,
            "window": "15.012s",
            "containers": containers.iter().map(|(n, cpu, mem)| serde_json::json!({"name": n, "usage": {"cpu": cpu, "memory": mem}}))
                .collect::<Vec<_>>(),
        }))
        .expect("PodMetrics")
    }

    #[test]
    fn copies_map_to_their_training_pods_by_origin_uid_only() {
        let pods = [training("team", "a", "uid-a", "vn"), training("team", "b", "uid-b", "vn")];
        let metrics = [
            copy(Some("uid-b"), Some("2026-12-01T10:00:15Z"), &[("main", "250123456n", "12Ki"), ("side", "2m", "1Mi")]),
            copy(Some("uid-someone-else"), Some("2026-12-01T10:00:15Z"), &[("main", "1", "1Gi")]),
            copy(None, Some("2026-12-01T10:00:15Z"), &[("main", "1", "1Gi")]),
            copy(Some("uid-a"), None, &[("main", "1", "1Gi")]),
            copy(Some("uid-a"), Some("2026-12-01T10:00:15Z"), &[("bad", "lots", "1Gi")]),
        ];
        let samples = attribute(&pods, &metrics);
        let at = ts("2026-12-01T10:00:15Z");
        let window = Duration::from_millis(15_012);
        assert_eq!(
            samples,
            [
                Sample {
                    pod: 1,
                    container: "main".into(),
                    usage: Usage { nano_cores: 250_123_456, memory_bytes: 12 * 1024, at, window }
                },
                Sample {
                    pod: 1,
                    container: "side".into(),
                    usage: Usage { nano_cores: 2_000_000, memory_bytes: 1 << 20, at, window }
                },
            ]
        );
    }

    #[test]
    fn go_durations_parse_as_metrics_server_writes_them() {
        assert_eq!(parse_go_duration("15.012s"), Some(Duration::from_millis(15_012)));
        assert_eq!(parse_go_duration("1m0.5s"), Some(Duration::from_millis(60_500)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("1h"), Some(Duration::from_secs(3600)));
        for bad in ["", "s", "15", "15x", "-1s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }

    fn usage(milli_cores: u64, at: &str) -> Usage {
        Usage {
            nano_cores: milli_cores * 1_000_000,
            memory_bytes: 1 << 20,
            at: ts(at),
            window: Duration::from_secs(15),
        }
    }

    #[test]
    fn counters_integrate_rates_so_the_rate_of_two_scrapes_is_the_members() {
        let mut c = Counters::default();
        let first = c.advance("vn", "uid", "main", &usage(200, "2026-12-01T10:00:15Z"));
        assert_eq!(first, 3_000_000_000, "200m over the 15 s window");
        let repeated = c.advance("vn", "uid", "main", &usage(200, "2026-12-01T10:00:15Z"));
        assert_eq!(repeated, first, "the member has not measured again: nothing added");
        let second = c.advance("vn", "uid", "main", &usage(400, "2026-12-01T10:00:25Z"));
        // metrics-server: (second - first) / 10 s = 0.4 cores, the member's latest rate.
        assert_eq!(second - first, 4_000_000_000);
        let older = c.advance("vn", "uid", "main", &usage(900, "2026-12-01T10:00:20Z"));
        assert_eq!(older, second, "an older sample never moves a counter back or on");
        assert_eq!(c.node_total("vn"), second);
        assert_eq!(c.advance("vn", "idle", "main", &usage(0, "2026-12-01T10:00:25Z")), 1, "never zero");
    }

    #[test]
    fn a_node_counter_keeps_what_departed_pods_added_and_their_counters_are_forgotten() {
        let mut c = Counters::default();
        c.advance("vn", "gone", "main", &usage(100, "2026-12-01T10:00:15Z"));
        c.advance("other", "elsewhere", "main", &usage(100, "2026-12-01T10:00:15Z"));
        let before = c.node_total("vn");
        c.retain_live("vn", &HashSet::new());
        assert_eq!(c.node_total("vn"), before);
        // Forgotten: the same UID would start again from its window.
        assert_eq!(c.advance("vn", "gone", "main", &usage(100, "2026-12-01T10:01:00Z")), 1_500_000_000);
        // Another node's containers stay.
        assert_eq!(c.advance("other", "elsewhere", "main", &usage(100, "2026-12-01T10:00:15Z")), 1_500_000_000);
        assert_eq!(c.containers.len(), 2);
    }

    fn node_with_one_pod() -> NodeUsage {
        let mut pods = [training("team", "trainer-0", "uid-0", "tidepool-a")];
        pods[0].started.insert("main".into(), ts("2026-12-01T09:59:00Z"));
        let samples = [Sample { pod: 0, container: "main".into(), usage: usage(250, "2026-12-01T10:00:15Z") }];
        assemble("tidepool-a", &pods, &samples, &mut Counters::default())
    }

    #[test]
    fn resource_metrics_read_as_a_kubelets() {
        let text = render_resource(&[node_with_one_pod()], true, false);
        let series: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        let labels = r#"{container="main",namespace="team",pod="trainer-0"}"#;
        assert_eq!(
            series,
            [
                format!("container_cpu_usage_seconds_total{labels} 3.750000000 1796119215000"),
                format!("container_memory_working_set_bytes{labels} 1048576 1796119215000"),
                format!("container_start_time_seconds{labels} 1796119140 1796119215000"),
                "node_cpu_usage_seconds_total 3.750000000 1796119215000".to_owned(),
                "node_memory_working_set_bytes 1048576 1796119215000".to_owned(),
                r#"pod_cpu_usage_seconds_total{namespace="team",pod="trainer-0"} 3.750000000 1796119215000"#.to_owned(),
                r#"pod_memory_working_set_bytes{namespace="team",pod="trainer-0"} 1048576 1796119215000"#.to_owned(),
                "scrape_error 0".to_owned(),
            ]
        );
        assert!(text.contains("# TYPE container_cpu_usage_seconds_total counter\n"));
        assert!(text.contains("# TYPE node_memory_working_set_bytes gauge\n"));
    }

    #[test]
    fn several_nodes_together_have_no_node_series_and_an_error_is_flagged() {
        let text = render_resource(&[node_with_one_pod(), node_with_one_pod()], false, true);
        assert!(!text.lines().any(|l| l.starts_with("node_")), "{text}");
        assert_eq!(text.lines().filter(|l| l.starts_with("container_cpu")).count(), 2);
        assert!(text.ends_with("scrape_error 1\n"));
        let empty = NodeUsage { name: "vn".into(), cpu_ns: 0, nano_cores: 0, memory_bytes: 0, at: None, pods: vec![] };
        let text = render_resource(&[empty], true, true);
        assert!(!text.lines().any(|l| l.starts_with("node_")), "nothing measured yet: no node series\n{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape(r#"a"b\c"#.to_owned().as_str()), r#"a\"b\\c"#);
        assert_eq!(escape("x\ny"), r"x\ny");
    }

    #[test]
    fn the_summary_has_node_and_pod_totals() {
        let summary = render_summary(&node_with_one_pod(), ts("2026-12-01T10:00:20Z"));
        assert_eq!(summary["node"]["nodeName"], "tidepool-a");
        assert_eq!(summary["node"]["cpu"]["usageNanoCores"], 250_000_000);
        assert_eq!(summary["node"]["cpu"]["usageCoreNanoSeconds"], 3_750_000_000u64);
        let pod = &summary["pods"][0];
        assert_eq!(pod["podRef"], serde_json::json!({"name": "trainer-0", "namespace": "team", "uid": "uid-0"}));
        assert_eq!(pod["memory"]["workingSetBytes"], 1 << 20);
        assert_eq!(pod["containers"][0]["startTime"], "2026-12-01T09:59:00Z");
        assert_eq!(pod["containers"][0]["cpu"]["time"], "2026-12-01T10:00:15Z");
    }
}
