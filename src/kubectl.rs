//! `kubectl tidepool`: the CLI as a kubectl plugin. The same binary answers to the name
//! `kubectl-tidepool` (kubectl's plugin lookup runs it with that `argv[0]`), takes kubectl's
//! usual flags, and has views for both users of the bridge:
//!
//! - admins: `members` (each member's pools: capacity, used, held back, deficit) and
//!   `reclaims` (pods under notice);
//! - tenants, with only the RBAC of their namespace: `jobs` (my gangs: where, bands, waiting
//!   and why, under notice) and `why POD` (one pod, explained).
//!
//! The views are built by pure functions from listed objects ([`members`], [`jobs`],
//! [`reclaims`], [`why`]) and printed as text or as stable JSON/YAML lists
//! (`apiVersion: tidepool.io/v1alpha1`, `kind: <View>List`, `items`), documented in
//! deploy/docs/kubectl-plugin.md. Errors go to stderr as `error: …` with exit code 1, as
//! kubectl does.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use serde::Serialize;
use tidepool_api::resources::{format_bytes, format_milli, is_bytes, parse_milli};
use tidepool_api::text::shown;
use tidepool_api::{MemberCluster, keys};

const GPU: &str = "nvidia.com/gpu";
const API_VERSION: &str = "tidepool.io/v1alpha1";

#[derive(Parser, Debug)]
#[command(name = "kubectl-tidepool", version, about = "Tidepool's view of the bridge, as a kubectl plugin")]
pub struct Cli {
    /// Path to the kubeconfig file (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    context: Option<String>,
    /// Namespace of the jobs and pods shown (default: the context's namespace).
    #[arg(short = 'n', long, global = true)]
    namespace: Option<String>,
    /// Jobs and pods of every namespace.
    #[arg(short = 'A', long = "all-namespaces", global = true)]
    all_namespaces: bool,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum)]
    output: Option<Output>,
    /// The scheduler name of the dispatcher (pods it places).
    #[arg(long, global = true, default_value = "tidepool")]
    scheduler_name: String,
    #[command(subcommand)]
    view: View,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Output {
    Wide,
    Json,
    Yaml,
}

#[derive(Subcommand, Debug)]
enum View {
    /// Members and their pools: capacity, used, held back, deficit (admins).
    Members,
    /// Pods under a reclaim notice: band, deadline, acknowledged or not.
    Reclaims,
    /// Gangs: placed where, bands, waiting and why, under notice.
    Jobs,
    /// One pod explained: placement, gang, band, notice, conditions and recent Events.
    Why {
        /// The pod's name (in the namespace of -n or the context).
        pod: String,
    },
}

/// True when the process was started under the plugin's name.
pub fn invoked_as_plugin() -> bool {
    std::env::args_os()
        .next()
        .and_then(|a| PathBuf::from(a).file_name().map(|n| n.to_string_lossy().into_owned()))
        .is_some_and(|n| is_plugin_name(&n))
}

/// `kubectl-tidepool`, with or without an extension (`.exe`).
fn is_plugin_name(file_name: &str) -> bool {
    file_name == "kubectl-tidepool" || file_name.starts_with("kubectl-tidepool.")
}

/// Runs the plugin; returns the process exit code (errors are printed, kubectl-style).
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => return fail(&anyhow::Error::from(e)),
    };
    match runtime.block_on(run(&cli)) {
        Ok(out) => {
            print!("{out}");
            0
        }
        Err(e) => fail(&e),
    }
}

/// `--help` and `--version` print and succeed; a usage error is clap's message (`error: …`)
/// with kubectl's exit code 1, not clap's 2.
fn usage_error(e: &clap::Error) -> i32 {
    // Nothing more to report if stdout or stderr is gone.
    let _ = e.print();
    if e.use_stderr() { 1 } else { 0 }
}

fn fail(e: &anyhow::Error) -> i32 {
    eprintln!("error: {e:#}");
    1
}

async fn run(cli: &Cli) -> anyhow::Result<String> {
    let options = KubeConfigOptions { context: cli.context.clone(), ..Default::default() };
    let config = match &cli.kubeconfig {
        Some(path) => kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &options).await?,
        None => kube::Config::from_kubeconfig(&options).await?,
    };
    let namespace = cli.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config)?;
    let scope = if cli.all_namespaces { None } else { Some(namespace.as_str()) };
    let pods = || async {
        let api = match scope {
            Some(ns) => Api::<Pod>::namespaced(client.clone(), ns),
            None => Api::<Pod>::all(client.clone()),
        };
        api.list(&ListParams::default()).await.map(|l| l.items)
    };
    let now = jiff::Timestamp::now();
    match &cli.view {
        View::Members => {
            let list = Api::<MemberCluster>::all(client.clone()).list(&ListParams::default()).await?;
            render(cli.output, "MemberList", &members(&list.items), print_members)
        }
        View::Reclaims => render(cli.output, "ReclaimList", &reclaims(&pods().await?, now), print_reclaims),
        View::Jobs => render(cli.output, "JobList", &jobs(&pods().await?, &cli.scheduler_name, now), print_jobs),
        View::Why { pod } => {
            let api = Api::<Pod>::namespaced(client.clone(), &namespace);
            let found = api.get(pod).await?;
            let lp = ListParams::default().fields(&format!("involvedObject.name={pod}"));
            // A tenant without `list events` still gets the pod's own story.
            let events = Api::<Event>::namespaced(client.clone(), &namespace).list(&lp).await.map(|l| l.items);
            let explanation = why(&found, events.as_deref().unwrap_or_default(), now);
            render(cli.output, "PodExplanationList", std::slice::from_ref(&explanation), print_why)
        }
    }
}

fn render<T: Serialize>(
    output: Option<Output>,
    kind: &str,
    items: &[T],
    text: fn(&[T], bool) -> Result<String, std::fmt::Error>,
) -> anyhow::Result<String> {
    let list = serde_json::json!({ "apiVersion": API_VERSION, "kind": kind, "items": items });
    Ok(match output {
        Some(Output::Json) => format!("{}\n", serde_json::to_string_pretty(&list)?),
        Some(Output::Yaml) => serde_saphyr::to_string(&list)?,
        Some(Output::Wide) => text(items, true)?,
        None => text(items, false)?,
    })
}

// ---------------------------------------------------------------------------------------
// members

/// One pool of one member, as `kubectl tidepool members` shows it.
#[derive(Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MemberRow {
    pub member: String,
    /// `Ready`, `NotReady`, `Unknown` (no status yet).
    pub state: String,
    /// The Ready condition's reason and message when not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub paused: bool,
    pub pool: String,
    pub virtual_node: String,
    pub nodes: i32,
    /// Per resource, in the member's units (`cpu` in cores, `memory` in bytes, devices).
    pub capacity: BTreeMap<String, String>,
    pub used: BTreeMap<String, String>,
    pub held_back: BTreeMap<String, String>,
    pub deficit: BTreeMap<String, String>,
    /// The capacity windows of the member's spec (`name: schedule`).
    pub windows: Vec<String>,
}

fn quantities(map: &BTreeMap<String, Quantity>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect()
}

/// The rows of `kubectl tidepool members`, one per pool (a member without pools yet: one row
/// with an empty pool). Pure.
pub fn members(list: &[MemberCluster]) -> Vec<MemberRow> {
    let mut rows = Vec::new();
    for m in list {
        let status = m.status.clone().unwrap_or_default();
        let ready = status.conditions.iter().find(|c| c.type_ == keys::CONDITION_READY);
        let (state, reason) = match ready {
            None => ("Unknown".to_owned(), None),
            Some(c) if c.status == "True" => ("Ready".to_owned(), None),
            Some(c) => ("NotReady".to_owned(), Some(format!("{}: {}", c.reason, c.message))),
        };
        let windows = m.spec.capacity.windows.iter().map(|w| format!("{}: {}", w.name, w.schedule)).collect();
        let base = MemberRow {
            member: m.name_any(),
            state,
            reason,
            paused: m.spec.paused,
            pool: String::new(),
            virtual_node: String::new(),
            nodes: 0,
            capacity: BTreeMap::new(),
            used: BTreeMap::new(),
            held_back: BTreeMap::new(),
            deficit: BTreeMap::new(),
            windows,
        };
        if status.pools.is_empty() {
            rows.push(base);
            continue;
        }
        for p in &status.pools {
            rows.push(MemberRow {
                pool: p.name.clone(),
                virtual_node: p.virtual_node.clone(),
                nodes: p.nodes,
                capacity: quantities(&p.capacity),
                used: quantities(&p.used),
                held_back: quantities(&p.held_back),
                deficit: quantities(&p.deficit),
                ..base.clone()
            });
        }
    }
    rows
}

fn milli(map: &BTreeMap<String, String>, name: &str) -> i64 {
    map.get(name).and_then(|q| parse_milli(q).ok()).unwrap_or(0)
}

/// `used/capacity [bar]` of one resource, or `-` when the pool has none of it.
fn usage(row: &MemberRow, name: &str) -> String {
    let (cap, used) = (milli(&row.capacity, name), milli(&row.used, name));
    if cap == 0 && used == 0 {
        return "-".to_owned();
    }
    format!("{}/{} [{}]", format_milli(used), format_milli(cap), bar(used, cap, 10))
}

fn listed(map: &BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "-".to_owned();
    }
    let shown = |k: &str, v: &str| match parse_milli(v) {
        Ok(m) if is_bytes(k) => format_bytes(m),
        _ => v.to_owned(),
    };
    map.iter().map(|(k, v)| format!("{k}={}", shown(k, v))).collect::<Vec<_>>().join(",")
}

fn print_members(rows: &[MemberRow], wide: bool) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    let mut header = vec!["MEMBER", "STATE", "POOL", "NODES", "GPU", "CPU", "HELD BACK", "DEFICIT"];
    if wide {
        header.extend(["VIRTUAL NODE", "WINDOWS", "REASON"]);
    }
    let mut table = vec![header.into_iter().map(str::to_owned).collect::<Vec<_>>()];
    for r in rows {
        let state = if r.paused { format!("{},Paused", r.state) } else { r.state.clone() };
        let mut line = vec![
            r.member.clone(),
            state,
            r.pool.clone(),
            r.nodes.to_string(),
            usage(r, GPU),
            usage(r, "cpu"),
            listed(&r.held_back),
            listed(&r.deficit),
        ];
        if wide {
            let windows = if r.windows.is_empty() { "-".to_owned() } else { r.windows.join("; ") };
            line.extend([r.virtual_node.clone(), windows, r.reason.clone().unwrap_or_else(|| "-".to_owned())]);
        }
        table.push(line);
    }
    write_table(&mut out, &table)?;
    Ok(out)
}

/// Columns padded to their widest cell, as kubectl prints them.
fn write_table(out: &mut String, rows: &[Vec<String>]) -> std::fmt::Result {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                write!(line, "{cell:<width$}   ", width = widths[i])?;
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// A bar of `width` cells filled in proportion to `used` of `total`; a pool using more than
/// it may lend ends in `!` (the deficit is printed next to it).
pub fn bar(used: i64, total: i64, width: usize) -> String {
    if total <= 0 {
        return if used > 0 { "!".repeat(width) } else { ".".repeat(width) };
    }
    let filled = ((used.clamp(0, total) as i128 * width as i128) / total as i128) as usize;
    let mut cells: Vec<char> = "#".repeat(filled).chars().chain(".".repeat(width - filled).chars()).collect();
    if used > total
        && let Some(last) = cells.last_mut()
    {
        *last = '!';
    }
    cells.into_iter().collect()
}

// ---------------------------------------------------------------------------------------
// reclaims, jobs, why

/// A pod under a reclaim notice.
#[derive(Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimRow {
    pub namespace: String,
    pub pod: String,
    pub band: String,
    pub node: String,
    pub deadline: String,
    /// Seconds until the deadline (negative once passed).
    pub seconds_left: Option<i64>,
    pub acknowledged: bool,
}

/// Not deleted and not ended (`Succeeded` or `Failed`).
pub(crate) fn live(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

fn node_of(p: &Pod) -> Option<String> {
    p.spec.as_ref().and_then(|s| s.node_name.clone())
}

fn notice(p: &Pod, now: jiff::Timestamp) -> Option<(String, Option<i64>, bool)> {
    let deadline = p.annotations().get(keys::ANNOTATION_RECLAIM_DEADLINE)?;
    let left = deadline.parse::<jiff::Timestamp>().ok().map(|d| d.duration_since(now).as_secs());
    Some((deadline.clone(), left, p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE)))
}

/// The rows of `kubectl tidepool reclaims`. Pure.
pub fn reclaims(pods: &[Pod], now: jiff::Timestamp) -> Vec<ReclaimRow> {
    pods.iter()
        .filter(|p| live(p))
        .filter_map(|p| {
            let (deadline, seconds_left, acknowledged) = notice(p, now)?;
            Some(ReclaimRow {
                namespace: p.namespace().unwrap_or_default(),
                pod: p.name_any(),
                band: p.labels().get(keys::LABEL_BAND).cloned().unwrap_or_default(),
                node: node_of(p).unwrap_or_default(),
                deadline,
                seconds_left,
                acknowledged,
            })
        })
        .collect()
}

fn left(seconds: Option<i64>) -> String {
    match seconds {
        Some(s) if s > 0 => format!("{s}s"),
        Some(_) => "passed".to_owned(),
        None => "?".to_owned(),
    }
}

fn print_reclaims(rows: &[ReclaimRow], _wide: bool) -> Result<String, std::fmt::Error> {
    let mut table = vec![["NAMESPACE", "POD", "BAND", "NODE", "DEADLINE", "LEFT", "ACKED"].map(str::to_owned).to_vec()];
    for r in rows {
        table.push(vec![
            r.namespace.clone(),
            r.pod.clone(),
            r.band.clone(),
            r.node.clone(),
            r.deadline.clone(),
            left(r.seconds_left),
            if r.acknowledged { "yes" } else { "no" }.to_owned(),
        ]);
    }
    let mut out = String::new();
    write_table(&mut out, &table)?;
    Ok(out)
}

/// One gang of `kubectl tidepool jobs`.
#[derive(Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JobRow {
    pub namespace: String,
    /// The gang's key as the dispatcher names it (`<namespace>/<kind>/<name>`).
    pub gang: String,
    /// `Placed`, `Partial` (some pods wait: elastic ones beyond minMember), `Waiting`,
    /// `Reclaiming` (some pods under notice).
    pub state: String,
    pub pods: usize,
    pub placed: usize,
    /// The virtual nodes its placed pods are on (one, as a gang is pinned to one member).
    pub nodes: Vec<String>,
    /// Placed pods per band.
    pub bands: BTreeMap<String, usize>,
    /// Why pods wait: the dispatcher's last message on them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    pub under_notice: usize,
    /// The earliest reclaim deadline among its pods.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

fn scheduled_false(p: &Pod) -> Option<String> {
    let conditions = p.status.as_ref()?.conditions.as_ref()?;
    let c = conditions.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    Some(c.message.clone().or_else(|| c.reason.clone()).unwrap_or_default())
}

/// The gangs of `kubectl tidepool jobs`: live pods of the dispatcher's scheduler and pods
/// bound to virtual nodes, grouped by gang. Pure.
pub fn jobs(pods: &[Pod], scheduler_name: &str, now: jiff::Timestamp) -> Vec<JobRow> {
    let ours = pods.iter().filter(|p| {
        let spec = p.spec.as_ref();
        live(p)
            && (spec.and_then(|s| s.scheduler_name.as_deref()) == Some(scheduler_name)
                || p.labels().contains_key(keys::LABEL_BAND))
    });
    gangs(ours, now)
}

/// `pods` grouped by gang, each gang's row of `kubectl tidepool jobs` (`tidepool status`
/// shows the same rows). Pure.
pub(crate) fn gangs<'a>(pods: impl Iterator<Item = &'a Pod>, now: jiff::Timestamp) -> Vec<JobRow> {
    let mut gangs: BTreeMap<String, JobRow> = BTreeMap::new();
    for p in pods {
        let key = tidepool_dispatcher::gang::gang_of_pod(p).to_string();
        let row = gangs.entry(key.clone()).or_insert_with(|| JobRow {
            namespace: p.namespace().unwrap_or_default(),
            gang: key,
            ..Default::default()
        });
        row.pods += 1;
        match node_of(p) {
            Some(node) => {
                row.placed += 1;
                if !row.nodes.contains(&node) {
                    row.nodes.push(node);
                }
                let band = p.labels().get(keys::LABEL_BAND).cloned().unwrap_or_else(|| "-".to_owned());
                *row.bands.entry(band).or_default() += 1;
            }
            None => row.waiting = scheduled_false(p).or(row.waiting.take()),
        }
        if let Some((deadline, _, _)) = notice(p, now) {
            row.under_notice += 1;
            if row.deadline.as_ref().is_none_or(|d| deadline < *d) {
                row.deadline = Some(deadline);
            }
        }
    }
    let mut rows: Vec<JobRow> = gangs.into_values().collect();
    for r in &mut rows {
        r.nodes.sort();
        r.state = if r.under_notice > 0 {
            "Reclaiming"
        } else if r.placed == 0 {
            "Waiting"
        } else if r.placed < r.pods {
            "Partial"
        } else {
            "Placed"
        }
        .to_owned();
    }
    rows
}

fn print_jobs(rows: &[JobRow], wide: bool) -> Result<String, std::fmt::Error> {
    let mut header = vec!["NAMESPACE", "GANG", "STATE", "PLACED", "NODE", "BANDS", "NOTICE"];
    if wide {
        header.push("WAITING");
    }
    let mut table = vec![header.into_iter().map(str::to_owned).collect::<Vec<_>>()];
    for r in rows {
        let bands = if r.bands.is_empty() {
            "-".to_owned()
        } else {
            r.bands.iter().map(|(b, n)| format!("{n} {b}")).collect::<Vec<_>>().join(",")
        };
        let notice = match &r.deadline {
            Some(d) => format!("{} until {d}", r.under_notice),
            None => "-".to_owned(),
        };
        let nodes = if r.nodes.is_empty() { "-".to_owned() } else { r.nodes.join(",") };
        let mut line = vec![
            r.namespace.clone(),
            r.gang.clone(),
            r.state.clone(),
            format!("{}/{}", r.placed, r.pods),
            nodes,
            bands,
            notice,
        ];
        if wide {
            line.push(r.waiting.clone().unwrap_or_else(|| "-".to_owned()));
        }
        table.push(line);
    }
    let mut out = String::new();
    write_table(&mut out, &table)?;
    if !wide && let Some(r) = rows.iter().find(|r| r.waiting.is_some()) {
        writeln!(out, "\n{}: {}", r.gang, r.waiting.as_deref().unwrap_or_default())?;
    }
    Ok(out)
}

/// `kubectl tidepool why POD`: everything tidepool knows of one pod.
#[derive(Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodExplanation {
    pub namespace: String,
    pub pod: String,
    pub phase: String,
    pub gang: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_member: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub band: Option<String>,
    /// What the dispatcher recorded when it placed the pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// One sentence: placed, waiting (why), under notice (until), reclaimed.
    pub summary: String,
    /// The pod's conditions that tell the story (`type=status reason: message`).
    pub conditions: Vec<String>,
    /// Recent Events of the pod, oldest first (`reason (×count): message`).
    pub events: Vec<String>,
}

/// Explains one pod from its object and its Events. Pure.
pub fn why(pod: &Pod, events: &[Event], now: jiff::Timestamp) -> PodExplanation {
    let status = pod.status.clone().unwrap_or_default();
    let conditions: Vec<String> = status
        .conditions
        .unwrap_or_default()
        .iter()
        .filter(|c| {
            c.status == "False" && c.type_ == "PodScheduled"
                || c.type_ == keys::CONDITION_RECLAIM_REQUESTED
                || c.type_ == keys::CONDITION_DISRUPTION_TARGET
        })
        .map(|c| {
            let reason = c.reason.clone().unwrap_or_default();
            let message = c.message.clone().unwrap_or_default();
            format!("{}={} {reason}: {message}", c.type_, c.status)
        })
        .collect();
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0).or(e.event_time.as_ref().map(|t| t.0)));
    let events = sorted
        .iter()
        .map(|e| {
            let count = e.count.unwrap_or(1);
            let times = if count > 1 { format!(" (x{count})") } else { String::new() };
            format!("{}{times}: {}", e.reason.clone().unwrap_or_default(), e.message.clone().unwrap_or_default())
        })
        .collect();
    let node = node_of(pod);
    let phase = status.phase.unwrap_or_default();
    let summary = match (notice(pod, now), &node, scheduled_false(pod)) {
        _ if phase == "Failed" && status.reason.as_deref() == Some(keys::REASON_RECLAIMED) => {
            format!("reclaimed: {}", status.message.clone().unwrap_or_default())
        }
        (Some((deadline, left_s, acked)), _, _) => format!(
            "under reclaim notice until {deadline} ({} left){}",
            left(left_s),
            if acked { ", checkpoint acknowledged" } else { "" }
        ),
        (None, Some(n), _) => format!("placed on {n}"),
        (None, None, Some(why)) => format!("waiting: {why}"),
        (None, None, None) => "waiting: not yet considered by the dispatcher".to_owned(),
    };
    PodExplanation {
        namespace: pod.namespace().unwrap_or_default(),
        pod: pod.name_any(),
        phase,
        gang: tidepool_dispatcher::gang::gang_of_pod(pod).to_string(),
        min_member: pod.annotations().get(keys::ANNOTATION_MIN_MEMBER).cloned(),
        node,
        band: pod.labels().get(keys::LABEL_BAND).cloned(),
        placement: pod.annotations().get(keys::ANNOTATION_PLACEMENT).cloned(),
        summary,
        conditions,
        events,
    }
}

fn print_why(items: &[PodExplanation], _wide: bool) -> Result<String, std::fmt::Error> {
    // Conditions and Events carry what members and tenants wrote: shown, never obeyed.
    let t = |text: &str| shown(text, 2048);
    let mut out = String::new();
    for e in items {
        writeln!(out, "Pod:        {}/{}", t(&e.namespace), t(&e.pod))?;
        writeln!(out, "Phase:      {}", t(&e.phase))?;
        writeln!(out, "Summary:    {}", t(&e.summary))?;
        writeln!(out, "Gang:       {}", t(&e.gang))?;
        if let Some(m) = &e.min_member {
            writeln!(out, "MinMember:  {m}")?;
        }
        writeln!(out, "Node:       {}", t(e.node.as_deref().unwrap_or("-")))?;
        writeln!(out, "Band:       {}", t(e.band.as_deref().unwrap_or("-")))?;
        if let Some(p) = &e.placement {
            writeln!(out, "Placement:  {}", t(p))?;
        }
        for (title, lines) in [("Conditions", &e.conditions), ("Events", &e.events)] {
            writeln!(out, "{title}:")?;
            if lines.is_empty() {
                writeln!(out, "  <none>")?;
            }
            for l in lines {
                writeln!(out, "  {}", t(l))?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_show_use_and_overuse() {
        assert_eq!(bar(0, 16, 8), "........");
        assert_eq!(bar(8, 16, 8), "####....");
        assert_eq!(bar(16, 16, 8), "########");
        assert_eq!(bar(20, 16, 8), "#######!");
        assert_eq!(bar(2, 0, 4), "!!!!");
        assert_eq!(bar(0, 0, 4), "....");
    }

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    fn now() -> jiff::Timestamp {
        "2026-12-01T12:00:00Z".parse().unwrap()
    }

    fn gang_pod(name: &str, node: Option<&str>, band: Option<&str>) -> Pod {
        let mut labels = serde_json::Map::new();
        if let Some(b) = band {
            labels.insert(keys::LABEL_BAND.to_owned(), b.into());
        }
        pod(serde_json::json!({
            "metadata": {"name": name, "namespace": "team", "labels": labels,
                         "annotations": {keys::ANNOTATION_GANG: "job-1", keys::ANNOTATION_MIN_MEMBER: "2"}},
            "spec": {"schedulerName": "tidepool", "nodeName": node, "containers": []},
            "status": {"phase": if node.is_some() { "Running" } else { "Pending" }}
        }))
    }

    #[test]
    fn a_gang_is_one_row_with_its_node_bands_and_why_the_rest_waits() {
        let mut waiting = gang_pod("w-2", None, None);
        waiting.status.as_mut().unwrap().conditions = Some(vec![k8s_openapi::api::core::v1::PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            message: Some("no pool has room for 1 elastic pod".into()),
            ..Default::default()
        }]);
        let other_scheduler = pod(serde_json::json!({
            "metadata": {"name": "web", "namespace": "team"},
            "spec": {"containers": []}, "status": {"phase": "Running"}
        }));
        let pods = [
            gang_pod("w-0", Some("tidepool-a"), Some("high")),
            gang_pod("w-1", Some("tidepool-a"), Some("low")),
            waiting,
            other_scheduler,
        ];
        let rows = jobs(&pods, "tidepool", now());
        assert_eq!(rows.len(), 1, "{rows:?}");
        let r = &rows[0];
        assert_eq!((r.pods, r.placed, r.state.as_str()), (3, 2, "Partial"));
        assert_eq!(r.nodes, vec!["tidepool-a".to_owned()]);
        assert_eq!(r.bands, BTreeMap::from([("high".to_owned(), 1), ("low".to_owned(), 1)]));
        assert_eq!(r.waiting.as_deref(), Some("no pool has room for 1 elastic pod"));
        let text = print_jobs(&rows, false).unwrap();
        assert!(text.contains("team/annotation/job-1") || text.contains("job-1"), "{text}");
        assert!(text.contains("2/3"), "{text}");
    }

    #[test]
    fn a_notice_makes_the_gang_reclaiming_with_its_earliest_deadline() {
        let mut a = gang_pod("w-0", Some("tidepool-a"), Some("low"));
        let mut b = gang_pod("w-1", Some("tidepool-a"), Some("low"));
        for (p, d) in [(&mut a, "2026-12-01T12:05:00Z"), (&mut b, "2026-12-01T12:01:00Z")] {
            p.metadata.annotations.as_mut().unwrap().insert(keys::ANNOTATION_RECLAIM_DEADLINE.into(), d.into());
        }
        b.metadata.annotations.as_mut().unwrap().insert(keys::ANNOTATION_CHECKPOINT_DONE.into(), "x".into());
        let rows = jobs(&[a.clone(), b.clone()], "tidepool", now());
        assert_eq!(rows[0].state, "Reclaiming");
        assert_eq!(rows[0].under_notice, 2);
        assert_eq!(rows[0].deadline.as_deref(), Some("2026-12-01T12:01:00Z"));
        let r = reclaims(&[a, b], now());
        assert_eq!(r.len(), 2);
        assert_eq!((r[1].seconds_left, r[1].acknowledged), (Some(60), true));
        assert_eq!((r[0].seconds_left, r[0].acknowledged), (Some(300), false));
    }

    #[test]
    fn finished_pods_are_no_job_and_no_reclaim() {
        let mut done = gang_pod("w-0", Some("tidepool-a"), Some("low"));
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        done.metadata.annotations.as_mut().unwrap().insert(keys::ANNOTATION_RECLAIM_DEADLINE.into(), "x".into());
        assert!(jobs(std::slice::from_ref(&done), "tidepool", now()).is_empty());
        assert!(reclaims(&[done], now()).is_empty());
    }

    #[test]
    fn members_show_one_row_per_pool_and_why_a_member_is_not_ready() {
        let mc: MemberCluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "tidepool.io/v1alpha1", "kind": "MemberCluster",
            "metadata": {"name": "member-a"},
            "spec": {"kubeconfigSecretRef": {"name": "k"}, "paused": true},
            "status": {
                "conditions": [{"type": "Ready", "status": "False", "reason": "Unreachable", "message": "no answer",
                                "lastTransitionTime": "2026-12-01T11:00:00Z"}],
                "pools": [
                    {"name": "gpu", "virtualNode": "tidepool-member-a-gpu", "nodes": 4,
                     "capacity": {"nvidia.com/gpu": "16", "cpu": "64"}, "used": {"nvidia.com/gpu": "12"},
                     "heldBack": {"nvidia.com/gpu": "2", "memory": "17179869184"}},
                    {"name": "cpu", "virtualNode": "tidepool-member-a-cpu", "nodes": 2, "capacity": {"cpu": "8"},
                     "deficit": {"cpu": "2"}}
                ]
            }
        }))
        .unwrap();
        let rows = members(&[mc]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].state, "NotReady");
        assert_eq!(rows[0].reason.as_deref(), Some("Unreachable: no answer"));
        assert!(rows[0].paused);
        assert_eq!(rows[0].held_back.get(GPU).map(String::as_str), Some("2"));
        assert_eq!(rows[1].deficit.get("cpu").map(String::as_str), Some("2"));
        let text = print_members(&rows, false).unwrap();
        assert!(text.contains("12/16 [#######...]"), "{text}");
        assert!(text.contains("NotReady,Paused"), "{text}");
        assert!(text.contains("cpu=2"), "{text}");
        assert!(text.contains("memory=16Gi,nvidia.com/gpu=2"), "sizes in kubectl's units: {text}");
        let json = render(Some(Output::Json), "MemberList", &rows, print_members).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["kind"], "MemberList");
        assert_eq!(v["items"][0]["virtualNode"], "tidepool-member-a-gpu");
        assert_eq!(v["items"][0]["heldBack"]["nvidia.com/gpu"], "2");
        assert_eq!(v["items"][0]["heldBack"]["memory"], "17179869184", "JSON keeps the status's quantity");
    }

    #[test]
    fn why_tells_waiting_placed_notice_and_lists_events_oldest_first() {
        let waiting = gang_pod("w-0", None, None);
        assert!(why(&waiting, &[], now()).summary.starts_with("waiting"));
        let placed = gang_pod("w-1", Some("tidepool-a"), Some("high"));
        let ev = |reason: &str, at: &str, count: i32| -> Event {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": reason}, "involvedObject": {}, "reason": reason, "message": "m",
                "lastTimestamp": at, "count": count
            }))
            .unwrap()
        };
        let events = [ev("Started", "2026-12-01T11:59:00Z", 1), ev("Pulled", "2026-12-01T11:58:00Z", 3)];
        let e = why(&placed, &events, now());
        assert_eq!(e.summary, "placed on tidepool-a");
        assert_eq!(e.events, vec!["Pulled (x3): m".to_owned(), "Started: m".to_owned()]);
        assert_eq!(e.band.as_deref(), Some("high"));
        assert_eq!(e.min_member.as_deref(), Some("2"));
        let text = print_why(std::slice::from_ref(&e), false).unwrap();
        assert!(text.contains("Summary:    placed on tidepool-a"), "{text}");
    }

    #[test]
    fn why_shows_control_characters_in_conditions_and_events_without_obeying_them() {
        let placed = gang_pod("w-1", Some("tidepool-a"), Some("high"));
        let forged: Event = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "e"}, "involvedObject": {}, "reason": "Pulled",
            "message": "ok\x1b[2J\n  Normal  Reclaimed  forged", "lastTimestamp": "2026-12-01T11:59:00Z"
        }))
        .unwrap();
        let text = print_why(&[why(&placed, &[forged], now())], false).unwrap();
        assert!(!text.contains('\x1b') && text.contains("ok\\u{1b}[2J\\n  Normal  Reclaimed  forged"), "{text}");
        assert!(!text.lines().any(|l| l.trim_start().starts_with("Normal")), "no forged line: {text}");
    }

    #[test]
    fn the_plugin_name_is_recognised_with_or_without_an_extension() {
        for (name, yes) in [
            ("kubectl-tidepool", true),
            ("kubectl-tidepool.exe", true),
            ("tidepool", false),
            ("kubectl-tidepoolx", false),
        ] {
            assert_eq!(is_plugin_name(name), yes, "{name}");
        }
    }
}
