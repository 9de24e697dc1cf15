//! The field's real operators and frameworks across the bridge (issue "Real operators"): the
//! jobs a tenant submits — TFJob, PyTorchJob, MPIJob, PaddleJob, TrainJob over JobSet — made
//! into pods, Services and environment by their real controllers (tests/operators/start.sh),
//! running real framework processes (`tidepool.invalid/frameworks:1`, tests/frameworks/) on
//! the members' real nodes, with default MemberCluster settings. Each job is the upstream
//! example's shape with only `schedulerName` changed; the operators run with their default
//! flags but for `--namespace` (each test its own) and the PyTorch init container's image
//! (theirs cannot be pulled here). Each test prints what it saw.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use tidepool_api::keys;

use crate::harness::*;

/// The framework image every real node imports (tests/images/frameworks.sh).
pub const FRAMEWORKS_IMAGE: &str = "tidepool.invalid/frameworks:1";
/// Bounded waits for a step of a scenario (a placement, a reclaim, a resume); frameworks take
/// tens of seconds to import on two shared cores.
pub const WAIT: Duration = Duration::from_secs(300);

/// One of the field's operators, run by tests/operators/start.sh against the training cluster
/// for one test; stopped (SIGKILL) when dropped.
pub struct Operator {
    child: std::process::Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
    /// `kubectl --kubeconfig <its cluster's>`, and the operator's name: its webhook
    /// configurations go when it stops.
    kubectl: (String, PathBuf),
    name: String,
}

impl Operator {
    /// Starts `operator` (`training-operator`, `mpi-operator`, `jobset`, `trainer`, `volcano`) with
    /// `flags` and waits until it answers on its health port.
    pub async fn start(env: &Env, operator: &str, flags: &[&str]) -> Operator {
        Operator::start_on(env, operator, "training", flags).await
    }

    /// [`Operator::start`] against `cluster` (`training`, `member-a`, `member-b`): its CRDs and
    /// webhooks go there, and its ports are that cluster's.
    pub async fn start_on(env: &Env, operator: &str, cluster: &str, flags: &[&str]) -> Operator {
        Operator::start_on_with(env, operator, cluster, flags, &[]).await
    }

    /// [`Operator::start_on`] with `vars` in start.sh's environment (e.g. `KUEUE_FRAMEWORKS`).
    pub async fn start_on_with(
        env: &Env,
        operator: &str,
        cluster: &str,
        flags: &[&str],
        vars: &[(&str, &str)],
    ) -> Operator {
        for needed in ["TIDEPOOL_OPERATORS_BIN", "TIDEPOOL_GANG_CRDS", "TIDEPOOL_SCHEDULERS"] {
            assert!(
                std::env::var(needed).is_ok(),
                "{needed} is not set: tests/run.sh builds the operators and exports it"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(format!("{operator}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/operators/start.sh");
        let child = std::process::Command::new("bash")
            .arg(script)
            .args([operator, env.var("CP_STATE_DIR"), cluster, "--"])
            .args(flags)
            .envs(vars.iter().copied())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let kubectl = (env.var("KUBECTL").to_owned(), env.kubeconfig_path(cluster));
        let op = Operator { child, log, _dir: dir, kubectl, name: operator.to_owned() };
        let offset: u16 = env.var("CP_PORT_OFFSET").parse().unwrap();
        // tests/operators/start.sh: one port apart per cluster.
        let k = ["training", "member-a", "member-b"].iter().position(|c| *c == cluster).unwrap() as u16;
        let port = offset
            + k
            + match operator {
                "training-operator" => 22250,
                "mpi-operator" => 23250,
                "jobset" => 27250,
                "volcano" => 32250,
                "coscheduling" => 12250,
                "volcano-scheduler" => 24250,
                "kueue" => 8250,
                _ => 30250,
            };
        let path = if matches!(operator, "mpi-operator" | "volcano" | "volcano-scheduler" | "coscheduling") {
            "healthz"
        } else {
            "readyz"
        };
        // A kube-scheduler serves its health over HTTPS only, with its own certificate.
        let scheme = if operator == "coscheduling" { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{port}/{path}");
        let ready = async {
            loop {
                let answer =
                    tokio::process::Command::new("curl").args(["-fsSk", "--max-time", "2", &url]).output().await;
                if answer.is_ok_and(|o| o.status.success()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(120), ready).await.is_err() {
            panic!("{operator} not ready within 120 s:\n{}", op.log_tail());
        }
        let client = env.client(cluster).await;
        if tokio::time::timeout(Duration::from_secs(120), webhooks_served(&client, operator)).await.is_err() {
            panic!("{operator}'s webhook paths not served within 120 s:\n{}", op.log_tail());
        }
        op
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

/// Waits until every webhook start.sh configured for `operator` is served at its path.
///
/// Ready is not enough: the training-operator reports ready once its webhook server listens,
/// then registers one validating path per scheme as each controller starts; until then the
/// API server gets a 404 and refuses the kind ("could not find the requested resource").
/// Each path is asked with an empty body where the API server would call it (the address in
/// its Service's EndpointSlice): anything but a 404 means a handler is registered there.
async fn webhooks_served(client: &Client, operator: &str) {
    for (ns, svc, path) in webhook_targets(client, operator).await {
        let slices = Api::<EndpointSlice>::namespaced(client.clone(), &ns);
        let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={svc}"));
        let list = slices.list(&lp).await.unwrap_or_else(|e| panic!("EndpointSlices of {ns}/{svc}: {e}"));
        let slice = list.items.first().unwrap_or_else(|| panic!("{ns}/{svc} has no EndpointSlice"));
        let port = slice.ports.iter().flatten().find_map(|p| p.port).expect("the webhook slice's port");
        let ip =
            slice.endpoints.iter().flatten().find_map(|e| e.addresses.first()).expect("the webhook slice's address");
        let url = format!("https://{ip}:{port}{path}");
        loop {
            let answer = tokio::process::Command::new("curl")
                .args(["-sk", "--max-time", "2", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
                .args(["-H", "Content-Type: application/json", "-d", "{}", &url])
                .output()
                .await;
            let code = answer.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
            if !matches!(code.as_str(), "" | "000" | "404") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// (namespace, Service, path) of every webhook in the configurations labelled with `operator`.
async fn webhook_targets(client: &Client, operator: &str) -> Vec<(String, String, String)> {
    let lp = ListParams::default().labels(&format!("tidepool.io/operator={operator}"));
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone()).list(&lp).await.unwrap();
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone()).list(&lp).await.unwrap();
    let refs = validating
        .items
        .into_iter()
        .flat_map(|c| c.webhooks.unwrap_or_default().into_iter().map(|w| w.client_config))
        .chain(
            mutating
                .items
                .into_iter()
                .flat_map(|c| c.webhooks.unwrap_or_default().into_iter().map(|w| w.client_config)),
        );
    refs.filter_map(|c| c.service).map(|s| (s.namespace, s.name, s.path.unwrap_or_else(|| "/".to_owned()))).collect()
}

impl Operator {
    /// The operator's process (start.sh execs it): the benchmarks time it.
    #[allow(dead_code)] // the e2e tests do not read it
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Its webhooks fail closed: left behind, they would refuse other tests' objects (the
        // JobSet pod webhook every pod labelled with a JobSet name).
        let (kubectl, kubeconfig) = &self.kubectl;
        let _ = std::process::Command::new(kubectl)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["delete", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "--ignore-not-found"])
            .arg(format!("--selector=tidepool.io/operator={}", self.name))
            .output();
        if std::thread::panicking() {
            eprintln!("--- operator log ({}) ---\n{}", self.log.display(), self.log_tail());
        }
    }
}

/// A test's bridge: member-a and member-b, each lending its real node (MemberClusters with
/// default settings but the real pool), and a tidepool answering to the test's scheduler
/// name. Member `i` can be made to lend less with [`Bridge::lend`], as online demand would.
pub struct Bridge {
    pub env: Env,
    pub training: Client,
    pub members: Vec<Client>,
    pub ns: String,
    pub test: String,
    _tidepool: Tidepool,
}

/// The MemberClusters of a test and the clusters they bridge.
fn member_names(test: &str) -> [(String, &'static str); 2] {
    [(format!("{test}-a"), "member-a"), (format!("{test}-b"), "member-b")]
}

/// The virtual node of member `i`'s real pool.
pub fn real_node(test: &str, i: usize) -> String {
    format!("tidepool-{}-real", member_names(test)[i].0)
}

impl Bridge {
    pub async fn start(test: &str, ns: &str) -> Bridge {
        Bridge::start_with(test, ns, "").await
    }

    /// [`Bridge::start`] with `dispatcher` (more of the dispatcher's config, as
    /// `, key: value`) after the reclaim settings.
    pub async fn start_with(test: &str, ns: &str, dispatcher: &str) -> Bridge {
        let env = Env::load();
        assert_eq!(env.var("CP_REAL_NODES"), "1", "these tests need the real nodes (CP_REAL_NODES=1)");
        let training = env.client("training").await;
        prepare(&env, &training, test, ns).await;
        let mut members = Vec::new();
        for (name, cluster) in member_names(test) {
            members.push(env.client(cluster).await);
            let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
            put_kubeconfig_secret(&training, ns, cluster, &kubeconfig).await;
            let mut mc = member_cluster(&name, test, ns, cluster);
            mc.spec.pools = vec![real_pool(&env)];
            apply_member_cluster(&training, &mc).await;
        }
        let dispatcher = format!(
            "deficitHysteresisSeconds: 1, reclaimGraceSeconds: {{high: 180, medium: 180, low: 180}}{dispatcher}"
        );
        let tidepool = Tidepool::start_config(&env, test, ns, &dispatcher, &kubelet_config(&env));
        let b = Bridge { env, training, members, ns: ns.to_owned(), test: test.to_owned(), _tidepool: tidepool };
        for i in 0..2 {
            b.lend(i, None).await;
            let nodes = Api::<Node>::all(b.training.clone());
            let node = real_node(test, i);
            wait_for(Duration::from_secs(90), &format!("virtual node {node} Ready"), || {
                let (nodes, node) = (nodes.clone(), node.clone());
                async move {
                    let n = nodes.get_opt(&node).await.ok().flatten()?;
                    n.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(())
                }
            })
            .await;
        }
        b
    }

    /// Lets member `i`'s real pool lend `milli` CPU (see [`lend_real_cpu`]); a smaller loan is
    /// waited for until the virtual node shows it, so nothing placed next is placed against
    /// the larger one.
    pub async fn lend(&self, i: usize, milli: Option<u32>) {
        let (name, cluster) = &member_names(&self.test)[i];
        lend_real_cpu(&self.env, (&self.training, &self.members[i]), (name, cluster), milli).await;
        let Some(m) = milli else { return };
        let node = real_node(&self.test, i);
        wait_for(Duration::from_secs(60), &format!("{node} lending at most {m}m CPU"), || async {
            lendable_cpu(&self.training, &node).await.filter(|cpu| *cpu <= i64::from(m)).map(|_| ())
        })
        .await;
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), &self.ns)
    }

    /// Every version of the pods labelled `selector` a watch sees from now on (an operator
    /// deletes a failed pod as soon as it has read it: the list would miss it).
    pub fn watch(&self, selector: &str) -> Seen {
        use futures::StreamExt;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let config = kube::runtime::watcher::Config::default().labels(selector);
        let (api, sink) = (self.pods(), seen.clone());
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(kube::runtime::watcher(api, config));
            while let Some(event) = stream.next().await {
                if let Ok(kube::runtime::watcher::Event::Apply(p) | kube::runtime::watcher::Event::InitApply(p)) = event
                {
                    sink.lock().unwrap().push(p);
                }
            }
        });
        Seen { pods: seen, task }
    }

    /// The API of an operator's jobs in the test's namespace.
    pub fn jobs(&self, group: &str, version: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
        Api::namespaced_with(self.training.clone(), &self.ns, &ar)
    }

    /// Creates `job` (JSON with apiVersion and kind) through `api`.
    pub async fn submit(&self, api: &Api<DynamicObject>, job: serde_json::Value) {
        let obj: DynamicObject = serde_json::from_value(job).unwrap();
        api.create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", obj.name_any()));
    }

    /// The live (not ended, not being deleted) pods labelled `selector`, by name.
    pub async fn live(&self, selector: &str) -> Vec<Pod> {
        let list = self.pods().list(&ListParams::default().labels(selector)).await.map(|l| l.items).unwrap_or_default();
        let mut live: Vec<Pod> = list
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && !matches!(phase(p), "Failed" | "Succeeded"))
            .collect();
        live.sort_by_key(ResourceExt::name_any);
        live
    }

    /// Waits until `n` pods labelled `selector` run, all on virtual node `node`.
    pub async fn await_running(&self, selector: &str, n: usize, node: &str) -> Vec<Pod> {
        let what = format!("{n} pods {selector} running on {node}");
        wait_for(WAIT, &what, || async move {
            let pods = self.live(selector).await;
            let running = pods.iter().filter(|p| phase(p) == "Running" && node_of(p) == node).count();
            (pods.len() == n && running == n).then_some(pods)
        })
        .await
    }

    pub async fn log(&self, pod: &str, container: Option<&str>) -> String {
        let mut args = vec!["-n", &self.ns, "logs", pod];
        if let Some(c) = container {
            args.extend(["-c", c]);
        }
        kubectl(&self.env, "training", &args, None).await.1
    }

    /// Waits until `pod`'s log holds at least `n` lines with a step and a loss; returns them.
    pub async fn await_steps(&self, pod: &str, container: Option<&str>, n: usize) -> Vec<(u64, f64)> {
        wait_for(WAIT, &format!("{n} step lines in {pod}'s log"), || async move {
            let steps = steps(&self.log(pod, container).await);
            (steps.len() >= n).then_some(steps)
        })
        .await
    }

    /// The job object `name`'s condition `type_` status ("True", "False") once it has one.
    pub async fn condition(&self, api: &Api<DynamicObject>, name: &str, type_: &str) -> Option<String> {
        let job = api.get_opt(name).await.ok()??;
        let conditions = job.data.get("status")?.get("conditions")?.as_array()?;
        let c = conditions.iter().find(|c| c.get("type").and_then(|t| t.as_str()) == Some(type_))?;
        c.get("status")?.as_str().map(str::to_owned)
    }

    /// Waits until job `name` has condition `type_` True.
    pub async fn await_condition(&self, api: &Api<DynamicObject>, name: &str, type_: &str, within: Duration) {
        let started = Instant::now();
        wait_for(within, &format!("{name} {type_}"), || async move {
            (self.condition(api, name, type_).await.as_deref() == Some("True")).then_some(())
        })
        .await;
        println!("{name}: {type_} after {:.0} s", started.elapsed().as_secs_f64());
    }

    /// Deletes job `name` and waits until every pod of the test's namespace is gone through
    /// tidepool, copies included: a job whose pods outlive the test (a TFJob succeeds with its
    /// chief, workers still Running) would hold a member's CPU for the tests after it on the
    /// same clusters. Call it while the operator and tidepool still run.
    pub async fn remove_job(&self, api: &Api<DynamicObject>, name: &str) {
        api.delete(name, &kube::api::DeleteParams::background()).await.unwrap();
        drain_pods(&self.training, &self.ns).await;
    }
}

/// What [`Bridge::watch`] saw; the watch stops when this is dropped.
pub struct Seen {
    pods: Arc<Mutex<Vec<Pod>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Seen {
    /// The last version seen of each pod of `uids` that ended `Failed` with `reason`.
    pub fn ended(&self, uids: &[String], reason_: &str) -> Vec<Pod> {
        let pods = self.pods.lock().unwrap();
        let mut last: BTreeMap<String, Pod> = BTreeMap::new();
        for p in pods.iter().filter(|p| p.metadata.uid.as_ref().is_some_and(|u| uids.contains(u))) {
            if phase(p) == "Failed" && reason(p) == reason_ {
                last.insert(p.metadata.uid.clone().unwrap_or_default(), p.clone());
            }
        }
        last.into_values().collect()
    }

    /// Waits until every pod of `uids` was seen `Failed` with `reason`.
    pub async fn await_ended(&self, uids: &[String], reason_: &str, what: &str) -> Vec<Pod> {
        wait_for(WAIT, what, || async move {
            let ended = self.ended(uids, reason_);
            (ended.len() == uids.len()).then_some(ended)
        })
        .await
    }
}

impl Drop for Seen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn phase(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("")
}

pub fn node_of(p: &Pod) -> &str {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("")
}

pub fn reason(p: &Pod) -> &str {
    p.status.as_ref().and_then(|s| s.reason.as_deref()).unwrap_or("")
}

/// The true condition `type_` of `p`, with its reason.
pub fn condition_reason(p: &Pod, type_: &str) -> Option<String> {
    let c = p.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_ && c.status == "True")?;
    Some(c.reason.clone().unwrap_or_default())
}

/// `(step, loss)` of every line of `log` that has both (`step=N loss=X`).
pub fn steps(log: &str) -> Vec<(u64, f64)> {
    log.lines()
        .filter_map(|l| {
            let field = |k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k).map(str::to_owned));
            Some((field("step=")?.parse().ok()?, field("loss=")?.parse().ok()?))
        })
        .collect()
}

/// The step a process's log says it resumed at (`… resumed at step N …`), if it resumed.
pub fn resumed_at(log: &str) -> Option<u64> {
    log.lines().find_map(|l| l.split_once("resumed at step ")?.1.split_whitespace().next()?.parse().ok())
}

/// The step of the ack in a terminated container of `p` (its termination message).
pub fn acked_step(p: &Pod) -> Option<u64> {
    let statuses = p.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|c| {
        let message = c.state.as_ref()?.terminated.as_ref()?.message.clone()?;
        message
            .strip_prefix(keys::TERMINATION_ACK_PREFIX)?
            .split_whitespace()
            .find_map(|w| w.strip_prefix("step="))?
            .parse()
            .ok()
    })
}

/// A container of the frameworks image running `program` (under /opt/tidepool) with `env`,
/// checkpointing under `store` (the clusters' S3 store, a prefix of the run's own).
pub fn framework_container(name: &str, program: &str, store: &str, env: serde_json::Value) -> serde_json::Value {
    let mut vars = vec![json!({"name": "TP_STORE", "value": store}), json!({"name": "PYTHONUNBUFFERED", "value": "1"})];
    vars.extend(env.as_array().cloned().unwrap_or_default());
    json!({
        "name": name, "image": FRAMEWORKS_IMAGE, "imagePullPolicy": "Never",
        "command": ["python3", format!("/opt/tidepool/{program}")], "env": vars,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}
    })
}

/// Labels of a pod, for messages.
pub fn labels_of(p: &Pod) -> BTreeMap<String, String> {
    p.labels().clone()
}

/// A TFJob of a chief, `ps` parameter servers and `workers` workers (tests/frameworks/tf_ps.py,
/// `steps` steps of 100 ms), restart policy `ExitCode`, as Kubeflow's example writes one.
pub fn tfjob(name: &str, scheduler: &str, store: &str, (ps, workers): (u32, u32), steps: u32) -> serde_json::Value {
    let replica = |count: u32| {
        let env = json!([
            {"name": "TP_STEPS", "value": steps.to_string()},
            {"name": "TP_STEP_DELAY_MS", "value": "100"},
            {"name": "TP_LOG_EVERY", "value": "10"},
        ]);
        json!({
            "replicas": count,
            "restartPolicy": "ExitCode",
            "template": {"spec": {
                "schedulerName": scheduler,
                "terminationGracePeriodSeconds": 20,
                "containers": [framework_container("tensorflow", "tf_ps.py", store, env)]
            }}
        })
    };
    json!({
        "apiVersion": "kubeflow.org/v1", "kind": "TFJob",
        "metadata": {"name": name},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running"},
            "tfReplicaSpecs": {"Chief": replica(1), "PS": replica(ps), "Worker": replica(workers)}
        }
    })
}

/// A PyTorchJob of a master and `workers` workers, DDP over gloo
/// (tests/frameworks/torch_ddp.py, `steps` steps of 50 ms), restart policy `OnFailure`.
pub fn pytorchjob(name: &str, scheduler: &str, store: &str, workers: u32, steps: u32) -> serde_json::Value {
    let replica = |count: u32| {
        let env = json!([
            {"name": "TP_STEPS", "value": steps.to_string()},
            {"name": "TP_STEP_DELAY_MS", "value": "50"},
            {"name": "TP_LOG_EVERY", "value": "10"},
        ]);
        json!({
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {
                "schedulerName": scheduler,
                "containers": [framework_container("pytorch", "torch_ddp.py", store, env)]
            }}
        })
    };
    json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(workers)}
        }
    })
}
