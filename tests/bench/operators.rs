//! Benchmark program (not a test): a TFJob and a PyTorchJob as their real operator runs them,
//! through tidepool against the same job submitted to member-a directly. Prints a table;
//! asserts nothing about speed.
//!
//! ```text
//! bash tests/bench/operators.sh
//! ```
//! builds and starts what the e2e tests use (tests/run.sh's builds: the clusters with their
//! real nodes and the frameworks image, the operators), runs this program, and stops the
//! clusters.
//!
//! - **direct**: the Kubeflow training-operator runs against member-a (its CRDs and webhooks
//!   there, tests/operators/start.sh); the job is created in member-a with the default scheduler
//!   and a node selector for member-a's real node.
//! - **tidepool**: the training-operator runs against the training cluster; the job, unchanged
//!   but for `schedulerName`, is created there; tidepool bridges member-a (member-b lends
//!   nothing), the pods run as copies on the same real node.
//!
//! Jobs (`BENCH_TF_WORKERS` [8], `BENCH_PT_WORKERS` [15]): a TFJob of a chief, 2 parameter
//! servers and 8 workers, a PyTorchJob of a master and 15 workers. Each run times submit → every
//! pod `Running` (as the cluster the job was submitted to reports it) and submit → the first
//! step line in the chief's (master's) log, read with `kubectl logs` from that cluster. Then the
//! job is deleted and its pods awaited gone. `BENCH_RUNS` [3] runs per path, alternating which
//! path goes first; medians. A second table splits the wait for "all Running" into its steps,
//! as watches of both clusters saw them: every pod created, every pod bound to a node, (through
//! tidepool) every copy created in the member and every copy `Running` there, every pod `Running`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../e2e/harness.rs"]
#[allow(dead_code)]
mod harness;
#[path = "../e2e/operators.rs"]
#[allow(dead_code)]
mod operators;
#[path = "stats.rs"]
mod stats;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use kube::runtime::watcher;

use harness::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use operators::*;
use serde_json::json;
use stats::*;

const TEST: &str = "bench-operators";
const NS: &str = "bench-operators";
const DIRECT_NS: &str = "bench-operators-direct";
const STEPS: u32 = 400;

/// Makes a job from its name, scheduler name and checkpoint store.
type Build = Box<dyn Fn(&str, &str, &str) -> serde_json::Value>;

/// One of the benchmarked jobs.
struct Job {
    label: String,
    kind: &'static str,
    plural: &'static str,
    /// Pods of one job.
    pods: usize,
    /// Replica type whose pod 0 logs the steps.
    logger: &'static str,
    build: Build,
}

fn jobs() -> Vec<Job> {
    let tf = env_usize("BENCH_TF_WORKERS", 8) as u32;
    let pt = env_usize("BENCH_PT_WORKERS", 15) as u32;
    vec![
        Job {
            label: format!("TFJob 1 chief + 2 PS + {tf} workers"),
            kind: "TFJob",
            plural: "tfjobs",
            pods: 3 + tf as usize,
            logger: "chief",
            build: Box::new(move |name, scheduler, store| tfjob(name, scheduler, store, (2, tf), STEPS)),
        },
        Job {
            label: format!("PyTorchJob 1 master + {pt} workers"),
            kind: "PyTorchJob",
            plural: "pytorchjobs",
            pods: 1 + pt as usize,
            logger: "master",
            build: Box::new(move |name, scheduler, store| pytorchjob(name, scheduler, store, pt, STEPS)),
        },
    ]
}

/// Where a run submits: the cluster, its client and namespace, the scheduler, and what the
/// job's pod template gets besides.
struct Path {
    name: &'static str,
    cluster: &'static str,
    client: Client,
    ns: &'static str,
    scheduler: String,
    /// The direct path's node selector and tolerations: member-a's real node (its taint keeps
    /// the rest of the suite off it; tidepool's pool tolerates it for the copies).
    node: Option<(serde_json::Value, serde_json::Value)>,
    /// The member whose copies to watch (tidepool's path).
    copies: Option<Client>,
}

/// Puts `node` (selector and tolerations, or nothing) and `scheduler` in every replica's pod
/// template of `job`.
fn place(job: &mut serde_json::Value, scheduler: &str, node: Option<&(serde_json::Value, serde_json::Value)>) {
    let specs = job["spec"].as_object_mut().unwrap();
    let replicas = specs.iter_mut().find(|(k, _)| k.ends_with("ReplicaSpecs")).unwrap().1;
    for replica in replicas.as_object_mut().unwrap().values_mut() {
        let spec = &mut replica["template"]["spec"];
        spec["schedulerName"] = json!(scheduler);
        if let Some((selector, tolerations)) = node {
            spec["nodeSelector"] = selector.clone();
            spec["tolerations"] = tolerations.clone();
        }
    }
}

/// When a watch first saw all `n` pods created, bound and `Running` (seconds from `started`).
#[derive(Debug, Default, Clone, Copy)]
struct Milestones {
    created: Option<f64>,
    bound: Option<f64>,
    running: Option<f64>,
}

/// Watches the pods of `api` that `keep` accepts (by name) and records their [`Milestones`].
fn milestones(
    api: Api<Pod>,
    config: watcher::Config,
    keep: impl Fn(&str) -> bool + Send + 'static,
    n: usize,
    started: Instant,
) -> (Arc<Mutex<Milestones>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Milestones::default()));
    let sink = seen.clone();
    let task = tokio::spawn(async move {
        let mut pods: BTreeMap<String, (bool, bool)> = BTreeMap::new();
        let mut stream = std::pin::pin!(watcher(api, config));
        while let Some(event) = stream.next().await {
            let Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) = event else { continue };
            let name = p.metadata.name.clone().unwrap_or_default();
            if !keep(&name) {
                continue;
            }
            let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            pods.insert(name, (bound, phase(&p) == "Running"));
            let now = started.elapsed().as_secs_f64();
            let mut m = sink.lock().unwrap();
            let all = |f: fn(&(bool, bool)) -> bool| pods.len() >= n && pods.values().filter(|v| f(v)).count() >= n;
            if pods.len() >= n {
                m.created.get_or_insert(now);
            }
            if all(|v| v.0) {
                m.bound.get_or_insert(now);
            }
            if all(|v| v.1) {
                m.running.get_or_insert(now);
            }
        }
    });
    (seen, task)
}

/// One run: `(all Running, first step)` in seconds from the submit, and the steps of the first.
struct Run {
    running: f64,
    first_step: f64,
    /// The job's pods in the cluster it was submitted to.
    pods: Milestones,
    /// Their copies in the member (tidepool's path only).
    copies: Option<Milestones>,
}

async fn run_once(env: &Env, path: &Path, job: &Job) -> Run {
    let name = format!("{}-{}", job.kind.to_lowercase(), run_id());
    let store = format!("{}/ckpt/{name}", env.var("CHECKPOINT_STORE"));
    let mut obj = (job.build)(&name, &path.scheduler, &store);
    place(&mut obj, &path.scheduler, path.node.as_ref());
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("kubeflow.org", "v1", job.kind), job.plural);
    let api = Api::<DynamicObject>::namespaced_with(path.client.clone(), path.ns, &ar);
    let pods = Api::<Pod>::namespaced(path.client.clone(), path.ns);
    let selector = format!("training.kubeflow.org/job-name={name}");
    let started = Instant::now();
    let config = watcher::Config::default().labels(&selector);
    let (pods_seen, pods_task) = milestones(pods.clone(), config, |_| true, job.pods, started);
    // Copies carry tidepool's labels, not the operator's: the offload namespace's pods of this job.
    let copies = path.copies.as_ref().map(|member| {
        let prefix = format!("{name}-");
        let api = Api::<Pod>::namespaced(member.clone(), &offload_ns(path.ns));
        milestones(api, watcher::Config::default(), move |n| n.starts_with(&prefix), job.pods, started)
    });
    api.create(&PostParams::default(), &serde_json::from_value(obj).unwrap()).await.unwrap();
    wait_for(WAIT, &format!("{} pods of {name} Running ({})", job.pods, path.name), || {
        let (pods, selector) = (pods.clone(), selector.clone());
        async move {
            let list = pods.list(&ListParams::default().labels(&selector)).await.ok()?;
            let running = list.items.iter().filter(|p| phase(p) == "Running").count();
            (running == job.pods).then_some(())
        }
    })
    .await;
    let running = started.elapsed().as_secs_f64();
    // The watches report what the polls saw (at most one poll interval, 250 ms, earlier).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    pods_task.abort();
    let copies = copies.map(|(seen, task)| {
        task.abort();
        *seen.lock().unwrap()
    });
    let pods_seen = *pods_seen.lock().unwrap();
    let logger = format!("{name}-{}-0", job.logger);
    wait_for(WAIT, &format!("a step line in {logger}'s log ({})", path.name), || {
        let logger = logger.clone();
        async move {
            let (_, out, _) = kubectl(env, path.cluster, &["-n", path.ns, "logs", &logger], None).await;
            (!steps(&out).is_empty()).then_some(())
        }
    })
    .await;
    let first_step = started.elapsed().as_secs_f64();
    api.delete(&name, &DeleteParams::foreground()).await.unwrap();
    wait_for(WAIT, &format!("{name}'s pods gone ({})", path.name), || {
        let (pods, selector) = (pods.clone(), selector.clone());
        async move { pods.list(&ListParams::default().labels(&selector)).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    Run { running, first_step, pods: pods_seen, copies }
}

/// The main table's two rows of one job: direct, then tidepool with its ratios.
fn print_row(label: &str, times: &[Vec<Run>; 2]) {
    let row = |i: usize| {
        let running = median(times[i].iter().map(|t| t.running).collect());
        let step = median(times[i].iter().map(|t| t.first_step).collect());
        let all: Vec<String> = times[i].iter().map(|t| format!("{:.1}/{:.1}", t.running, t.first_step)).collect();
        (running, step, all.join(" "))
    };
    let (direct, tidepool) = (row(0), row(1));
    println!("| {label} | direct | {:.1} | {:.1} | {} |", direct.0, direct.1, direct.2);
    println!(
        "| {label} | tidepool | {:.1} ({:.2}×) | {:.1} ({:.2}×) | {} |",
        tidepool.0,
        tidepool.0 / direct.0,
        tidepool.1,
        tidepool.1 / direct.1,
        tidepool.2
    );
}

/// Where the wait for "all Running" goes: medians of when each step was done for every pod.
fn print_steps(jobs: &[(String, [Vec<Run>; 2])]) {
    println!();
    println!("| job | path | all created | all bound | all copies created | all copies Running | all Running |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let at = |runs: &[Run], f: &dyn Fn(&Run) -> Option<f64>| {
        let v: Vec<f64> = runs.iter().filter_map(f).collect();
        if v.is_empty() { "–".to_owned() } else { format!("{:.2}", median(v)) }
    };
    for (label, times) in jobs {
        for (i, path) in ["direct", "tidepool"].iter().enumerate() {
            let runs = &times[i];
            println!(
                "| {label} | {path} | {} | {} | {} | {} | {} |",
                at(runs, &|r| r.pods.created),
                at(runs, &|r| r.pods.bound),
                at(runs, &|r| r.copies.and_then(|c| c.created)),
                at(runs, &|r| r.copies.and_then(|c| c.running)),
                at(runs, &|r| r.pods.running),
            );
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    pct(&v, 0.5)
}

#[tokio::main]
async fn main() {
    let runs = env_usize("BENCH_RUNS", 3);
    let b = Bridge::start(TEST, NS).await;
    b.lend(1, Some(0)).await;
    let member = b.members[0].clone();
    ensure_namespace(&member, DIRECT_NS).await;
    let real = b.env.var("MEMBER_A_REAL_NODE").to_owned();
    let _direct_operator =
        Operator::start_on(&b.env, "training-operator", "member-a", &[&format!("--namespace={DIRECT_NS}")]).await;
    let _bridged_operator =
        Operator::start_on(&b.env, "training-operator", "training", &[&format!("--namespace={NS}")]).await;
    let paths = [
        Path {
            name: "direct",
            cluster: "member-a",
            client: member,
            ns: DIRECT_NS,
            scheduler: "default-scheduler".to_owned(),
            node: Some((
                json!({"kubernetes.io/hostname": real}),
                json!([{"key": b.env.var("REAL_NODE_TAINT"), "operator": "Exists", "effect": "NoSchedule"}]),
            )),
            copies: None,
        },
        Path {
            name: "tidepool",
            cluster: "training",
            client: b.training.clone(),
            ns: NS,
            scheduler: scheduler_name(TEST),
            node: None,
            copies: Some(b.members[0].clone()),
        },
    ];
    let mut steps = Vec::new();
    println!("| job | path | submit → all Running (s), median | submit → first step (s), median | runs |");
    println!("|---|---|---:|---:|---|");
    for job in jobs() {
        let mut times: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
        for round in 0..runs {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let t = run_once(&b.env, &paths[i], &job).await;
                eprintln!(
                    "{} {} run {round}: running {:.1} s, first step {:.1} s; pods {:?}, copies {:?}",
                    job.label, paths[i].name, t.running, t.first_step, t.pods, t.copies
                );
                times[i].push(t);
            }
        }
        print_row(&job.label, &times);
        steps.push((job.label.clone(), times));
    }
    print_steps(&steps);
    b.lend(1, None).await;
}
