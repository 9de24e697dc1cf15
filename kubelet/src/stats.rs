//! `/metrics/resource` (what metrics-server scrapes) and `/stats/summary` for the offloaded
//! pods, from the members' own metrics.k8s.io APIs.
//!
//! Every virtual node shares this server, and a kubelet's paths name no node, so each node
//! carries `metrics.k8s.io/resource-metrics-path: /metrics/resource/<node>` (metrics-server
//! scrapes that path instead), and `/stats/summary/<node>` answers for one node as well. The
//! plain paths answer for the only virtual node, or for all of them together (no node series
//! in the Prometheus form then: metrics-server would give them to whichever node it scraped).
//!
//! Per request: one list of the training pods on the node(s), then per member one list of
//! PodMetrics per offload namespace holding such pods, through the offload role the member
//! identity already has in those namespaces (`metrics.k8s.io` `pods` get/list: no
//! `nodes/proxy` on someone's production cluster). The rest is pure: [`super::usage`].
//!
//! A member whose metrics API is missing, unavailable or refused is reported once when that
//! starts, by a log line and a Warning Event (`MetricsUnavailable`) on its virtual nodes, and
//! once when it ends; meanwhile its pods are left out, `scrape_error` is 1 and the node's
//! totals still answer: a scraper gets a 200, not an error per scrape.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use tidepool_api::sync::Locked;

use bytes::Bytes;
use hyper::{Response, StatusCode};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use tidepool_federation::MemberHandle;
use tracing::{info, warn};

use super::target::Refusal;
use super::usage::{self, Counters, NodeUsage, PodMetrics, TrainingPod};
use super::{Body, Context, full, text};

/// The path metrics-server is pointed at for `node` (the node's annotation).
pub fn resource_metrics_path(node: &str) -> String {
    format!("/metrics/resource/{node}")
}

/// What the usage endpoints keep between requests.
#[derive(Debug, Default)]
pub(crate) struct State {
    counters: Mutex<Counters>,
    /// Per member, why its usage cannot be read, while it cannot: so that is said once.
    unavailable: Mutex<HashMap<String, String>>,
}

/// `GET /metrics/resource[/<node>]`.
pub(super) async fn serve_resource(ctx: &Context, node: Option<&str>) -> Response<Body> {
    match collect(ctx, node).await {
        Ok(report) => {
            let body = usage::render_resource(&report.nodes, report.single, report.scrape_error);
            typed(full(StatusCode::OK, Bytes::from(body)), "text/plain; version=0.0.4")
        }
        Err(Refusal(status, message)) => text(status, &message),
    }
}

/// `GET /stats/summary[/<node>]`.
pub(super) async fn serve_summary(ctx: &Context, node: Option<&str>) -> Response<Body> {
    match collect(ctx, node).await {
        Ok(report) => {
            let node = merged(report.nodes);
            let body = usage::render_summary(&node, jiff::Timestamp::now());
            typed(full(StatusCode::OK, Bytes::from(body.to_string())), "application/json")
        }
        Err(Refusal(status, message)) => text(status, &message),
    }
}

fn typed(mut response: Response<Body>, content_type: &'static str) -> Response<Body> {
    response.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    response
}

/// Several nodes as one (their totals summed, named after none).
fn merged(mut nodes: Vec<NodeUsage>) -> NodeUsage {
    if nodes.len() == 1 {
        return nodes.remove(0);
    }
    let mut all = NodeUsage { name: String::new(), cpu_ns: 0, nano_cores: 0, memory_bytes: 0, at: None, pods: vec![] };
    for n in nodes {
        all.cpu_ns = all.cpu_ns.saturating_add(n.cpu_ns);
        all.nano_cores = all.nano_cores.saturating_add(n.nano_cores);
        all.memory_bytes = all.memory_bytes.saturating_add(n.memory_bytes);
        all.at = all.at.max(n.at);
        all.pods.extend(n.pods);
    }
    all
}

struct Report {
    nodes: Vec<NodeUsage>,
    /// One node asked (or only one there): its node series are served.
    single: bool,
    scrape_error: bool,
}

async fn collect(ctx: &Context, node: Option<&str>) -> Result<Report, Refusal> {
    let nodes = nodes_asked(ctx, node)?;
    let names: BTreeSet<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
    let pods = training_pods(&ctx.training, &names, node).await?;
    let mut metrics: Vec<PodMetrics> = Vec::new();
    let mut scrape_error = false;
    let mut members: Vec<&Arc<MemberHandle>> = nodes.iter().map(|(_, m)| m).collect();
    members.dedup_by(|a, b| a.name == b.name);
    for member in members {
        let member_nodes: Vec<&str> =
            nodes.iter().filter(|(_, m)| m.name == member.name).map(|(n, _)| n.as_str()).collect();
        let theirs: Vec<&TrainingPod> = pods.iter().filter(|p| member_nodes.contains(&p.node.as_str())).collect();
        // Nothing to ask about: nothing learnt about the member's metrics API either.
        if theirs.is_empty() {
            continue;
        }
        let result = member_metrics(member, &theirs).await;
        note_availability(ctx, member, &member_nodes, result.as_ref().err()).await;
        match result {
            Ok(items) => metrics.extend(items),
            Err(_) => scrape_error = true,
        }
    }
    let samples = usage::attribute(&pods, &metrics);
    let mut counters = ctx.usage.counters.recovered("usage counters");
    let usage = nodes.iter().map(|(n, _)| usage::assemble(n, &pods, &samples, &mut counters)).collect();
    Ok(Report { nodes: usage, single: nodes.len() == 1, scrape_error })
}

/// The virtual nodes asked about, each with its member: the one named (404 if it is none of
/// tidepool's), or all of them.
fn nodes_asked(ctx: &Context, node: Option<&str>) -> Result<Vec<(String, Arc<MemberHandle>)>, Refusal> {
    let members = ctx.members.borrow();
    let all = members.values().flat_map(|m| m.pools.iter().map(move |p| (p.node.to_string(), m.clone())));
    match node {
        None => Ok(all.collect()),
        Some(name) => {
            let found: Vec<_> = all.filter(|(n, _)| n == name).collect();
            if found.is_empty() {
                return Err(Refusal(
                    StatusCode::NOT_FOUND,
                    format!("node {name} is not one of tidepool's virtual nodes"),
                ));
            }
            Ok(found)
        }
    }
}

/// The training pods bound to `nodes`: one list (by field selector when one node is named).
async fn training_pods(
    training: &Client,
    nodes: &BTreeSet<&str>,
    named: Option<&str>,
) -> Result<Vec<TrainingPod>, Refusal> {
    let params = match named {
        Some(node) => ListParams::default().fields(&format!("spec.nodeName={node}")),
        None => ListParams::default(),
    };
    let list =
        Api::<Pod>::all(training.clone()).list(&params).await.map_err(|e| Refusal::api("listing training pods", &e))?;
    Ok(list.items.into_iter().filter_map(|p| training_pod(p, nodes)).collect())
}

fn training_pod(pod: Pod, nodes: &BTreeSet<&str>) -> Option<TrainingPod> {
    let node = pod.spec.as_ref()?.node_name.clone().filter(|n| nodes.contains(n.as_str()))?;
    let started = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let at = c.state.as_ref()?.running.as_ref()?.started_at.as_ref()?.0;
            Some((c.name.clone(), at))
        })
        .collect::<BTreeMap<_, _>>();
    Some(TrainingPod {
        namespace: pod.namespace()?,
        name: pod.name_any(),
        uid: pod.metadata.uid.clone()?,
        node,
        started,
    })
}

/// The PodMetrics of the member's offload namespaces that hold `pods`' copies; an error
/// says why the member's metrics cannot be read.
async fn member_metrics(member: &MemberHandle, pods: &[&TrainingPod]) -> Result<Vec<PodMetrics>, String> {
    let namespaces: BTreeSet<String> = pods.iter().map(|p| member.namespaces.member_ns(&p.namespace)).collect();
    let resource = ApiResource {
        group: "metrics.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "metrics.k8s.io/v1beta1".into(),
        kind: "PodMetrics".into(),
        plural: "pods".into(),
    };
    let mut items = Vec::new();
    for ns in namespaces {
        let api = Api::<DynamicObject>::namespaced_with(member.client.clone(), &ns, &resource);
        let list = api.list(&ListParams::default()).await.map_err(|e| unavailable_reason(&e))?;
        for object in list.items {
            match serde_json::to_value(&object).and_then(serde_json::from_value::<PodMetrics>) {
                Ok(item) => items.push(item),
                Err(error) => warn!(member = %member.name, %ns, %error, "unreadable PodMetrics item skipped"),
            }
        }
    }
    Ok(items)
}

/// Why a PodMetrics list failed, in words an admin can act on.
fn unavailable_reason(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(s) if s.code == 404 => {
            "the member serves no metrics.k8s.io API (is metrics-server installed there?)".to_owned()
        }
        kube::Error::Api(s) if s.code == 403 => format!(
            "tidepool may not read metrics.k8s.io pods in the member's offload namespaces (the member role lacks it?): {}",
            s.message
        ),
        kube::Error::Api(s) if s.code == 503 => {
            format!("the member's metrics.k8s.io API is unavailable: {}", s.message)
        }
        other => format!("reading the member's metrics.k8s.io API failed: {other}"),
    }
}

/// Says once when a member's usage stops (or starts again) being readable.
async fn note_availability(ctx: &Context, member: &MemberHandle, nodes: &[&str], error: Option<&String>) {
    let name = member.name.to_string();
    let changed = {
        let mut unavailable = ctx.usage.unavailable.recovered("usage unavailable");
        match error {
            Some(reason) if unavailable.get(&name) != Some(reason) => {
                unavailable.insert(name.clone(), reason.clone()).is_none()
            }
            Some(_) => false,
            None => unavailable.remove(&name).is_some(),
        }
    };
    if !changed {
        return;
    }
    match error {
        Some(reason) => {
            warn!(member = %name, %reason, "no resource usage of this member's offloaded pods until it answers; \
                `kubectl top` and HPAs see none of them");
            for node in nodes {
                let note = format!("member {name}: {reason}; its offloaded pods show no CPU or memory usage");
                node_event(&ctx.training, node, "Warning", "MetricsUnavailable", &note).await;
            }
        }
        None => {
            info!(member = %name, "member's metrics.k8s.io API answers again: offloaded pods' usage is served");
            for node in nodes {
                let note = format!("member {name}: offloaded pods' usage is read from its metrics.k8s.io API again");
                node_event(&ctx.training, node, "Normal", "MetricsAvailable", &note).await;
            }
        }
    }
}

/// An Event about a virtual node (Node Events live in `default`, as the kubelet's do).
async fn node_event(training: &Client, node: &str, type_: &str, reason: &str, note: &str) {
    let now = jiff::Timestamp::now();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{node}.{:x}", now.as_nanosecond())),
            namespace: Some("default".into()),
            ..Default::default()
        },
        event_time: Some(MicroTime(now)),
        type_: Some(type_.into()),
        reason: Some(reason.into()),
        note: Some(note.into()),
        action: Some("ReadUsage".into()),
        regarding: Some(ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            ..Default::default()
        }),
        reporting_controller: Some("tidepool.io/kubelet-api".into()),
        reporting_instance: Some(node.into()),
        ..Default::default()
    };
    if let Err(error) =
        Api::<Event>::namespaced(training.clone(), "default").create(&PostParams::default(), &event).await
    {
        warn!(%error, %node, reason, "cannot publish node event");
    }
}
