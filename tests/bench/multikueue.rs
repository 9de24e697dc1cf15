//! Benchmark program (not a test): tidepool against its peer MultiKueue and the direct path,
//! for "run my whole job in another cluster". Prints tables; asserts nothing about speed.
//!
//! ```text
//! bash tests/bench/multikueue.sh
//! ```
//! builds and starts what the e2e tests use (the clusters, Kueue v0.17.0 from
//! tests/schedulers/build.sh), runs this program, and stops the clusters.
//!
//! Paths, on the same clusters in one run, each a batch/v1 Job of `n` tiny pods
//! (`BENCH_SIZES` [8,64,256]) on member-a's kwok nodes (`BENCH_NODES` [2] extra ones of 1,000
//! pods each for the run):
//! - **direct**: the Job created in member-a.
//! - **tidepool**: the Job created in the training cluster with `schedulerName: tidepool`, its
//!   pods one gang (`tidepool.io/gang`); tidepool bridges member-a and copies every pod.
//! - **multikueue**: Kueue in the training cluster as MultiKueue's manager (a ClusterQueue whose
//!   admission check is MultiKueue's, naming member-a) and Kueue in member-a as its worker; the
//!   Job, naming its LocalQueue, is created in the training cluster; MultiKueue copies the Job
//!   object to member-a once member-a's Kueue admits its Workload, and member-a's Job
//!   controller makes the pods.
//!
//! Each run times submit → every pod `Running` in member-a (a watch of member-a), and reads
//! the CPU seconds every process involved used meanwhile (etcd, both API servers, both
//! controller-managers, member-a's scheduler and kwok, and tidepool or the two Kueues), the API
//! requests both API servers counted (`apiserver_request_total`), and after it the RSS of
//! tidepool and the Kueues. `BENCH_RUNS` [3] runs per size and path after a warm-up run, the
//! order of the paths rotating; medians.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "cluster.rs"]
mod cluster;
#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "../e2e/operators.rs"]
#[allow(dead_code)]
mod operators;
#[path = "stats.rs"]
mod stats;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::*;
use futures::StreamExt;
use harness::*;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use operators::Operator;
use serde_json::{Value, json};
use stats::*;

const TEST: &str = "bench-mk";
/// Namespaces: the direct path's in member-a, tidepool's in training (copies in member-a's
/// same-named one), MultiKueue's in both (the worker's Job lands in the same-named one).
const DIRECT_NS: &str = "bench-mk-direct";
const TP_NS: &str = "bench-mk-tp";
const MK_NS: &str = "bench-mk";
/// The processes of tests/controlplane/cluster.sh counted (its `pids` file).
const PROCESSES: [&str; 7] = [
    "etcd",
    "training-apiserver",
    "member-a-apiserver",
    "training-kcm",
    "member-a-kcm",
    "member-a-scheduler",
    "member-a-kwok",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Direct,
    Tidepool,
    MultiKueue,
}

impl Path {
    fn label(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Tidepool => "tidepool",
            Path::MultiKueue => "multikueue",
        }
    }

    /// The processes that bridge the clusters on this path (the others idle meanwhile, and are
    /// not added to its total).
    fn bridges(self) -> &'static [&'static str] {
        match self {
            Path::Direct => &[],
            Path::Tidepool => &["tidepool"],
            Path::MultiKueue => &["kueue manager", "kueue worker"],
        }
    }

    /// Where the Job is created, and the namespace of its pods there and in member-a (tidepool's
    /// copies and MultiKueue's Job land in the same-named namespace).
    fn namespaces(self) -> (&'static str, &'static str) {
        match self {
            Path::Direct => ("member-a", DIRECT_NS),
            Path::Tidepool => ("training", TP_NS),
            Path::MultiKueue => ("training", MK_NS),
        }
    }
}

/// One run's numbers.
#[derive(Debug, Clone, Default)]
struct Run {
    wall: f64,
    /// Submit → the Job controller's last pod seen (in the training cluster for tidepool, in
    /// member-a otherwise).
    created: f64,
    /// CPU seconds by process.
    cpu: CpuSpent,
    /// API requests by API server.
    calls: BTreeMap<&'static str, f64>,
}

/// The Job of `n` pods of `path`, named `name`.
fn job(path: Path, name: &str, n: usize) -> Job {
    let mut spec = json!({"containers": [{"name": "main", "image": "example.invalid/trainer:1",
                           "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}}}],
                          "restartPolicy": "Never"});
    let mut meta = json!({});
    let mut labels = json!({});
    match path {
        Path::Direct => {}
        Path::Tidepool => {
            spec["schedulerName"] = json!(scheduler_name(TEST));
            meta = json!({"annotations": {"tidepool.io/gang": name, "tidepool.io/min-member": n.to_string()}});
        }
        Path::MultiKueue => labels = json!({"kueue.x-k8s.io/queue-name": "bench"}),
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"parallelism": n, "completions": n, "backoffLimit": 0,
                 "template": {"metadata": meta, "spec": spec}}
    }))
    .unwrap()
}

fn kueue_api(client: &Client, kind: &str, plural: &str, ns: Option<&str>) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind), plural);
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

async fn apply(api: &Api<DynamicObject>, obj: Value) {
    let obj: DynamicObject = serde_json::from_value(obj).unwrap();
    api.patch(&obj.name_any(), &PatchParams::apply("tidepool-bench").force(), &Patch::Apply(&obj)).await.unwrap();
}

/// A namespace whose Jobs Kueue's webhooks see (tests/operators/start.sh).
async fn kueue_namespace(client: &Client, ns: &str) {
    ensure_namespace(client, ns).await;
    let label = Patch::Merge(json!({"metadata": {"labels": {"tidepool.io/e2e-kueue": "true"}}}));
    Api::<Namespace>::all(client.clone()).patch(ns, &PatchParams::default(), &label).await.unwrap();
}

/// The flavor, ClusterQueue (with `checks`) and LocalQueue `bench` of one cluster's Kueue.
async fn queues(client: &Client, checks: Option<&str>) {
    apply(
        &kueue_api(client, "ResourceFlavor", "resourceflavors", None),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "bench-any"}, "spec": {}}),
    )
    .await;
    let mut spec = json!({"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory"],
        "flavors": [{"name": "bench-any", "resources": [{"name": "cpu", "nominalQuota": "100"}, {"name": "memory", "nominalQuota": "100Gi"}]}]}]});
    if let Some(check) = checks {
        spec["admissionChecksStrategy"] = json!({"admissionChecks": [{"name": check}]});
    }
    apply(
        &kueue_api(client, "ClusterQueue", "clusterqueues", None),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "bench-mk"}, "spec": spec}),
    )
    .await;
    apply(
        &kueue_api(client, "LocalQueue", "localqueues", Some(MK_NS)),
        json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "bench"},
               "spec": {"clusterQueue": "bench-mk"}}),
    )
    .await;
}

/// MultiKueue: member-a as the worker of the training cluster's Kueue (its kubeconfig in a
/// Secret of Kueue's namespace), one MultiKueueConfig, the admission check, the queues of both.
async fn multikueue(env: &Env, training: &Client, member: &Client) {
    for c in [training, member] {
        kueue_namespace(c, MK_NS).await;
    }
    let kubeconfig = std::fs::read_to_string(env.kubeconfig_path("member-a")).unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "bench-member-a", "namespace": "kueue-system"},
        "stringData": {"kubeconfig": kubeconfig}
    }))
    .unwrap();
    Api::<Secret>::namespaced(training.clone(), "kueue-system")
        .patch("bench-member-a", &PatchParams::apply("tidepool-bench").force(), &Patch::Apply(&secret))
        .await
        .unwrap();
    let objects = [
        (
            "MultiKueueCluster",
            "multikueueclusters",
            json!({"clusterSource": {"kubeConfig": {"locationType": "Secret", "location": "bench-member-a"}}}),
        ),
        ("MultiKueueConfig", "multikueueconfigs", json!({"clusters": ["bench-member-a"]})),
        (
            "AdmissionCheck",
            "admissionchecks",
            json!({"controllerName": "kueue.x-k8s.io/multikueue",
            "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "MultiKueueConfig", "name": "bench-member-a"}}),
        ),
    ];
    for (kind, plural, spec) in objects {
        apply(
            &kueue_api(training, kind, plural, None),
            json!({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": kind, "metadata": {"name": "bench-member-a"}, "spec": spec}),
        )
        .await;
    }
    queues(member, None).await;
    queues(training, Some("bench-member-a")).await;
    let checks = kueue_api(training, "AdmissionCheck", "admissionchecks", None);
    wait_for(Duration::from_secs(120), "MultiKueue's admission check Active", || async {
        let c = checks.get("bench-member-a").await.ok()?;
        let active =
            c.data["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Active" && c["status"] == "True");
        active.then_some(())
    })
    .await;
}

/// When a watch first saw each pod of one namespace, and first saw it Running; the watch
/// stops when this is dropped.
/// First seen, and first seen Running, by pod name.
type FirstSeen = (HashMap<String, Instant>, HashMap<String, Instant>);

struct Seen {
    times: Arc<Mutex<FirstSeen>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Seen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Seen {
    fn watch(client: Client, ns: &str) -> Seen {
        let times = Arc::new(Mutex::new((HashMap::new(), HashMap::new())));
        let t = times.clone();
        let api = Api::<Pod>::namespaced(client, ns);
        let task = tokio::spawn(async move {
            let mut events =
                std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
            while let Some(Ok(p)) = events.next().await {
                let mut t = t.lock().unwrap();
                let now = Instant::now();
                t.0.entry(p.name_any()).or_insert(now);
                if p.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Running") {
                    t.1.entry(p.name_any()).or_insert(now);
                }
            }
        });
        Seen { times, task }
    }

    /// How many pods named `prefix…` were seen Running.
    fn running(&self, prefix: &str) -> usize {
        self.times.lock().unwrap().1.keys().filter(|p| p.starts_with(prefix)).count()
    }

    /// When the last of the pods named `prefix…` was first seen.
    fn all_created(&self, prefix: &str) -> Option<Instant> {
        self.times.lock().unwrap().0.iter().filter(|(p, _)| p.starts_with(prefix)).map(|(_, t)| *t).max()
    }
}

/// Processes counted: the clusters' and the bridge's (tidepool or the Kueues).
fn processes(env: &Env, bridge: &[(&str, u32)]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> =
        cluster_processes(env).into_iter().filter(|(name, _)| PROCESSES.contains(&name.as_str())).collect();
    out.extend(bridge.iter().map(|(n, p)| ((*n).to_owned(), *p)));
    out
}

/// Every request `cluster`'s API server counted on a resource.
fn calls(env: &Env, cluster: &str) -> f64 {
    request_counts(env, cluster).values().sum()
}

struct Bench<'a> {
    env: &'a Env,
    training: Client,
    member: Client,
    /// tidepool's and the Kueues' processes.
    bridges: Vec<(&'static str, u32)>,
}

impl Bench<'_> {
    fn client(&self, cluster: &str) -> Client {
        if cluster == "training" { self.training.clone() } else { self.member.clone() }
    }

    async fn run(&self, path: Path, n: usize, id: &str) -> Run {
        let (cluster, member_ns) = path.namespaces();
        let name = format!("{}-{n}-{id}", path.label());
        // Where the Job controller makes the pods (the training cluster for tidepool), and
        // member-a, where they run.
        let made = (path == Path::Tidepool).then(|| Seen::watch(self.training.clone(), member_ns));
        let member = Seen::watch(self.member.clone(), member_ns);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let procs = processes(self.env, &self.bridges);
        let cpu = CpuMeter::start(&procs);
        let calls0 = (calls(self.env, "training"), calls(self.env, "member-a"));
        let jobs = Api::<Job>::namespaced(self.client(cluster), member_ns);
        let t0 = Instant::now();
        jobs.create(&PostParams::default(), &job(path, &name, n)).await.unwrap();
        let prefix = format!("{name}-");
        let what = format!("{} {n} pods Running in member-a", path.label());
        wait_for(Duration::from_secs(600), &what, || async { (member.running(&prefix) >= n).then_some(()) }).await;
        let created =
            made.as_ref().unwrap_or(&member).all_created(&prefix).map_or(f64::NAN, |t| (t - t0).as_secs_f64());
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu.spent();
        let calls = BTreeMap::from([
            ("training", calls(self.env, "training") - calls0.0),
            ("member-a", calls(self.env, "member-a") - calls0.1),
        ]);
        self.clean(path, &jobs).await;
        Run { wall, created, cpu, calls }
    }

    /// The Job deleted, and every pod of the path gone from both clusters (and MultiKueue's
    /// Workloads), so the next run counts its own work only.
    async fn clean(&self, path: Path, jobs: &Api<Job>) {
        jobs.delete_collection(&DeleteParams::background(), &ListParams::default()).await.unwrap();
        let (_, member_ns) = path.namespaces();
        let mut gone = vec![Api::<Pod>::namespaced(self.member.clone(), member_ns)];
        if path != Path::Direct {
            gone.push(Api::<Pod>::namespaced(self.training.clone(), member_ns));
        }
        for api in gone {
            wait_for(Duration::from_secs(300), "the run's pods gone", || async {
                api.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(())
            })
            .await;
        }
        if path == Path::MultiKueue {
            for c in [&self.training, &self.member] {
                let w = kueue_api(c, "Workload", "workloads", Some(MK_NS));
                w.delete_collection(&DeleteParams::background(), &ListParams::default()).await.unwrap();
            }
        }
    }
}

/// The peak resident memory (VmHWM) of `pid` in MiB; NaN if unreadable.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse::<f64>().ok());
    kib.map_or(f64::NAN, |k| k / 1024.0)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    pct(&xs, 0.5)
}

fn print(results: &BTreeMap<(usize, Path), Vec<Run>>, rss: &[(&str, f64, f64)]) {
    println!("\n## Jobs of n pods: submit → all Running in member-a (median of the runs)\n");
    println!(
        "| n | path | wall s | all pods made s | CPU s per pod (clusters + the path's bridge) | API calls per pod (training + member-a) | bridge CPU s per pod |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: |");
    for ((n, path), runs) in results {
        let per = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect()) / *n as f64;
        let wall = median(runs.iter().map(|r| r.wall).collect());
        let created = median(runs.iter().map(|r| r.created).collect());
        let own = |p: &str| PROCESSES.contains(&p) || path.bridges().contains(&p);
        let cpu = per(&|r| r.cpu.iter().filter(|(p, _)| own(p)).map(|(_, c)| c).sum());
        let api = per(&|r| r.calls.values().sum());
        let bridge = per(&|r| r.cpu.iter().filter(|(p, _)| path.bridges().contains(&p.as_str())).map(|(_, c)| c).sum());
        let bridge = if path.bridges().is_empty() { "—".to_owned() } else { format!("{bridge:.4}") };
        println!("| {n} | {} | {wall:.2} | {created:.2} | {cpu:.4} | {api:.1} | {bridge} |", path.label());
    }
    println!("\n## CPU seconds per pod by process (median of the runs)\n");
    let names: BTreeSet<&String> = results.values().flatten().flat_map(|r| r.cpu.keys()).collect();
    println!("| n | path | {} |", names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" | "));
    println!("| ---: | --- |{}", " ---: |".repeat(names.len()));
    for ((n, path), runs) in results {
        let cells: Vec<String> = names
            .iter()
            .map(|p| {
                format!(
                    "{:.4}",
                    median(runs.iter().map(|r| r.cpu.get(*p).copied().unwrap_or(0.0)).collect()) / *n as f64
                )
            })
            .collect();
        println!("| {n} | {} | {} |", path.label(), cells.join(" | "));
    }
    println!("\n## Resident memory after the runs (MiB): now, and the peak (VmHWM)\n");
    for (what, now, peak) in rss {
        println!("- {what}: {now:.1}, peak {peak:.1}");
    }
}

#[tokio::main]
async fn main() {
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    prepare(&env, &training, TEST, TP_NS).await;
    ensure_namespace(&member, DIRECT_NS).await;
    let bench_nodes = add_bench_nodes(&member, env_usize("BENCH_NODES", 2)).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path("member-a")).unwrap();
    put_kubeconfig_secret(&training, TP_NS, "member-a", &kubeconfig).await;
    apply_member(&training, "bench-mk-a", TEST, TP_NS, "member-a").await;
    set_member_qps(&training, "bench-mk-a").await;
    let tp = Tidepool::start(&env, TEST, TP_NS);
    // The manager with the batch/v1 Job integration only: MultiKueue watches every integration's
    // objects in its workers, and member-a serves no JobSet or PyTorchJob.
    let manager =
        Operator::start_on_with(&env, "kueue", "training", &[], &[("KUEUE_FRAMEWORKS", "\"batch/job\"")]).await;
    let worker = Operator::start_on(&env, "kueue", "member-a", &[]).await;
    multikueue(&env, &training, &member).await;
    let bench = Bench {
        env: &env,
        training,
        member,
        bridges: vec![("tidepool", tp.pid()), ("kueue manager", manager.pid()), ("kueue worker", worker.pid())],
    };
    let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| "8,64,256".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let runs = env_usize("BENCH_RUNS", 3).max(1);
    let mut results: BTreeMap<(usize, Path), Vec<Run>> = BTreeMap::new();
    let paths = [Path::Direct, Path::Tidepool, Path::MultiKueue];
    for &n in &sizes {
        for round in 0..=runs {
            for i in 0..paths.len() {
                let path = paths[(i + round) % paths.len()];
                let run = bench.run(path, n, &format!("{round}{}", run_id())).await;
                eprintln!(
                    "n={n} round {round}{} {}: {:.2} s",
                    if round == 0 { " (warm-up)" } else { "" },
                    path.label(),
                    run.wall
                );
                if round > 0 {
                    results.entry((n, path)).or_default().push(run);
                }
            }
        }
    }
    let rss = [
        ("tidepool", rss_mib(tp.pid()), peak_rss_mib(tp.pid())),
        ("kueue manager (training)", rss_mib(manager.pid()), peak_rss_mib(manager.pid())),
        ("kueue worker (member-a)", rss_mib(worker.pid()), peak_rss_mib(worker.pid())),
    ];
    print(&results, &rss);
    remove_bench_nodes(&bench.member, &bench_nodes).await;
}
