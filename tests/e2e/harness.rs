//! Shared pieces of the end-to-end tests: the local clusters started by
//! `tests/controlplane/cluster.sh`, a real `tidepool` process per test, and polling helpers.
//!
//! The clusters are found through `TIDEPOOL_CLUSTER_ENV` (the `cluster.env` file that
//! `cluster.sh up` writes). Without it every test fails with instructions: e2e tests never
//! skip silently.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tidepool_api::MemberCluster;
use tidepool_api::crd::{MemberClusterSpec, PoolSpec, PoolToleration, SecretKeyRef};

/// The local clusters, as written by `cluster.sh up`.
pub struct Env {
    vars: BTreeMap<String, String>,
}

impl Env {
    pub fn load() -> Env {
        let path = std::env::var("TIDEPOOL_CLUSTER_ENV").unwrap_or_else(|_| {
            panic!(
                "TIDEPOOL_CLUSTER_ENV is not set: the end-to-end tests need the local clusters. \
                 Run the README's test command (bash tests/run.sh), or start them with \
                 `tests/controlplane/cluster.sh up DIR` and export TIDEPOOL_CLUSTER_ENV=DIR/cluster.env"
            )
        });
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {path}: {e}; are the local clusters up?"));
        let vars = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.trim_matches(['"', '\'']).to_owned()))
            .collect();
        Env { vars }
    }

    pub fn var(&self, key: &str) -> &str {
        self.vars.get(key).map(String::as_str).unwrap_or_else(|| panic!("cluster.env has no {key}"))
    }

    /// A variable cluster.sh writes only in some set-ups (the skew member's).
    pub fn var_opt(&self, key: &str) -> Option<&str> {
        self.vars.get(key).map(String::as_str)
    }

    pub fn kubeconfig_path(&self, cluster: &str) -> PathBuf {
        let key = format!("{}_KUBECONFIG", cluster.to_uppercase().replace('-', "_"));
        PathBuf::from(self.var(&key))
    }

    pub async fn client(&self, cluster: &str) -> Client {
        let path = self.kubeconfig_path(cluster);
        let kubeconfig = Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
        let client = Client::try_from(config).unwrap();
        client
            .apiserver_version()
            .await
            .unwrap_or_else(|e| panic!("cluster {cluster} does not answer ({e}); are the local clusters up?"));
        client
    }

    /// Installs the MemberCluster CRD from the Rust types and waits until it is served.
    pub async fn install_crds(&self, training: &Client) {
        let api = Api::<CustomResourceDefinition>::all(training.clone());
        let crd = tidepool_api::schema::member_cluster_crd();
        let name = crd.metadata.name.clone().unwrap();
        api.patch(&name, &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&crd)).await.unwrap();
        wait_for(Duration::from_secs(30), "CRD established", || {
            let api = api.clone();
            let name = name.clone();
            async move {
                let crd = api.get(&name).await.ok()?;
                crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
            }
        })
        .await;
    }
}

/// A suffix unique to this test run, so objects a failed earlier run left behind never
/// collide with this run's.
/// The member namespace that holds the copies of training namespace `ns` under a
/// `MemberCluster`'s defaults: its own name (`namespaceMode: SameName`), so the FQDNs the
/// operators write (`<svc>.<ns>.svc`) resolve in the member too.
pub fn offload_ns(ns: &str) -> String {
    ns.to_owned()
}

pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    // The low bits: they change every nanosecond (the high ones only every 4 s, and two
    // tidepools started together would share a log file).
    format!("{:08x}", (nanos as u32) ^ std::process::id())
}

/// One write of tidepool (user agent `tidepool/…`) to a member, from the member's audit log
/// (`tests/controlplane/cluster.sh`: every write, metadata only): what the API server saw,
/// not what tidepool counted.
#[derive(Debug, Clone)]
pub struct AuditedWrite {
    pub agent: String,
    pub verb: String,
    pub resource: String,
    /// The namespace it touched (a namespace's own name for namespaces).
    pub namespace: String,
    pub name: String,
    /// The HTTP status the API server answered.
    pub code: u16,
    pub received: jiff::Timestamp,
    pub completed: jiff::Timestamp,
}

impl AuditedWrite {
    /// `verb resource/name -> code`, for failure messages.
    pub fn what(&self) -> String {
        format!("{} {}/{} -> {}", self.verb, self.resource, self.name, self.code)
    }
}

/// Tidepool's writes since `since` in `cluster`'s audit log.
pub fn audited_writes(env: &Env, cluster: &str, since: jiff::Timestamp) -> Vec<AuditedWrite> {
    let key = format!("{}_AUDIT_LOG", cluster.to_uppercase().replace('-', "_"));
    let text = std::fs::read_to_string(env.var(&key)).unwrap_or_else(|e| panic!("audit log of {cluster}: {e}"));
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|e| {
            let agent = e["userAgent"].as_str()?.to_owned();
            let resource = e["objectRef"]["resource"].as_str().unwrap_or("?").to_owned();
            let name = e["objectRef"]["name"].as_str().unwrap_or("").to_owned();
            let namespace = e["objectRef"]["namespace"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| (resource == "namespaces").then(|| name.clone()))?;
            let received: jiff::Timestamp = e["requestReceivedTimestamp"].as_str()?.parse().ok()?;
            let completed: jiff::Timestamp = e["stageTimestamp"].as_str()?.parse().ok()?;
            (agent.starts_with("tidepool/") && received >= since).then(|| AuditedWrite {
                verb: e["verb"].as_str().unwrap_or("?").to_owned(),
                namespace,
                code: e["responseStatus"]["code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(0),
                agent,
                resource,
                name,
                received,
                completed,
            })
        })
        .collect()
}

/// Waits for Job `job` (pods labelled `job=<job>`) to make a pod other than `old` without
/// failing: its pod's end was not counted against it.
pub async fn wait_job_replaced(training: &Client, ns: &str, job: &str, old: &str) {
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let jobs = Api::<k8s_openapi::api::batch::v1::Job>::namespaced(training.clone(), ns);
    wait_for(Duration::from_secs(60), &format!("Job {job} makes a new pod"), || {
        let (pods, jobs) = (pods.clone(), jobs.clone());
        async move {
            let j = jobs.get(job).await.ok()?;
            let failed =
                j.status.as_ref()?.conditions.iter().flatten().any(|c| c.type_ == "Failed" && c.status == "True");
            assert!(!failed, "Job {job} failed: its pod's end was counted");
            let list = pods.list(&ListParams::default().labels(&format!("job={job}"))).await.ok()?.items;
            list.iter().any(|p| p.name_any() != old).then_some(())
        }
    })
    .await;
}

/// A virtual node's allocatable CPU in milli-cores, once it is Ready.
pub async fn lendable_cpu(training: &Client, node: &str) -> Option<i64> {
    let node = Api::<k8s_openapi::api::core::v1::Node>::all(training.clone()).get_opt(node).await.ok()??;
    let status = node.status?;
    let ready = status.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
    let cpu = status.allocatable?.get("cpu").map(|q| tidepool_api::resources::parse_milli(&q.0).unwrap_or(0))?;
    ready.then_some(cpu)
}

/// Lets MemberCluster `name`'s real pool (on cluster `cluster`'s real node, read with
/// `member`) lend `milli` CPU of that node, the rest held back as online demand would take it
/// (`spec.capacity.reserve`), or everything (`None`).
pub async fn lend_real_cpu(
    env: &Env,
    (training, member): (&Client, &Client),
    (name, cluster): (&str, &str),
    milli: Option<u32>,
) {
    let reserve = match milli {
        Some(m) => {
            let real = env.var(&format!("{}_REAL_NODE", cluster.to_uppercase().replace('-', "_")));
            let node = Api::<k8s_openapi::api::core::v1::Node>::all(member.clone()).get(real).await.unwrap();
            let cpu = node.status.unwrap().allocatable.unwrap()["cpu"].0.clone();
            let cores: u32 = cpu.parse().unwrap_or_else(|_| panic!("real node cpu {cpu} is not whole cores"));
            serde_json::json!({"cpu": format!("{}m", (cores * 1000).saturating_sub(m))})
        }
        None => serde_json::json!(null),
    };
    let patch = Patch::Merge(serde_json::json!({"spec": {"capacity": {"reserve": reserve}}}));
    Api::<MemberCluster>::all(training.clone()).patch(name, &PatchParams::default(), &patch).await.unwrap();
}

/// Polls `probe` every 250 ms until it returns `Some`, or panics after `timeout`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A test's clean start in the training cluster: the CRD served, the MemberClusters and pods an
/// earlier run of the same test left gone, its namespace there.
pub async fn prepare(env: &Env, training: &Client, test: &str, ns: &str) {
    env.install_crds(training).await;
    reset_members(training, test).await;
    ensure_namespace(training, ns).await;
    clear_pods(training, ns).await;
}

/// Creates a namespace (if missing) in a cluster.
pub async fn ensure_namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    match Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create namespace {name}: {e}"),
    }
    // The ServiceAccount admission plugin refuses pods until the default SA exists.
    let sa = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), name);
    wait_for(Duration::from_secs(30), "default service account", || {
        let sa = sa.clone();
        async move { sa.get_opt("default").await.ok().flatten().map(|_| ()) }
    })
    .await;
}

/// Removes every pod an earlier run of a test left in its namespace, at once (grace 0), so
/// nothing stale is placed or counted by this run. A pod that stays for a finalizer goes too:
/// a Job with a `podFailurePolicy` keeps its tracking finalizer on a deleted pod until the pod
/// is terminal, which no kubelet says of a pod on an earlier run's virtual node.
pub async fn clear_pods(client: &Client, ns: &str) {
    let api = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns);
    let dp = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    api.delete_collection(&dp, &kube::api::ListParams::default()).await.unwrap();
    let unfinalized = Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}}));
    wait_for(Duration::from_secs(30), "leftover pods gone", || {
        let (api, unfinalized) = (api.clone(), unfinalized.clone());
        async move {
            let pods = api.list(&kube::api::ListParams::default()).await.ok()?.items;
            for pod in pods.iter().filter(|p| p.metadata.deletion_timestamp.is_some() && !p.finalizers().is_empty()) {
                let _ = api.patch(&pod.name_any(), &PatchParams::default(), &unfinalized).await;
            }
            pods.is_empty().then_some(())
        }
    })
    .await;
}

/// Creates a PriorityClass (if missing) in a cluster.
pub async fn ensure_priority_class(client: &Client, name: &str, value: i32) {
    let pc: k8s_openapi::api::scheduling::v1::PriorityClass =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "value": value})).unwrap();
    match Api::<k8s_openapi::api::scheduling::v1::PriorityClass>::all(client.clone())
        .create(&PostParams::default(), &pc)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create PriorityClass {name}: {e}"),
    }
}

/// Deletes every pod in a namespace the way a tenant would (graceful), and waits until they
/// are gone: tidepool removes the offload copies first. Use before deleting a test's
/// MemberCluster, so no offload pod outlives the session that could collect it.
pub async fn drain_pods(client: &Client, ns: &str) {
    let api = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), ns);
    api.delete_collection(&kube::api::DeleteParams::default(), &kube::api::ListParams::default()).await.unwrap();
    wait_for(Duration::from_secs(90), "pods drained through tidepool", || {
        let api = api.clone();
        async move { api.list(&kube::api::ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
}

/// Stores `kubeconfig` in Secret `ns/name` under key `kubeconfig` (replacing it).
pub async fn put_kubeconfig_secret(client: &Client, ns: &str, name: &str, kubeconfig: &[u8]) {
    let secret = Secret {
        metadata: kube::api::ObjectMeta { name: Some(name.into()), namespace: Some(ns.into()), ..Default::default() },
        data: Some(BTreeMap::from([("kubeconfig".to_owned(), ByteString(kubeconfig.to_vec()))])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(&secret))
        .await
        .unwrap();
}

/// Deletes the MemberClusters a previous run of test `test` may have left, and waits until
/// they are gone, so no stale status is mistaken for a fresh one.
pub async fn reset_members(client: &Client, test: &str) {
    let api = Api::<MemberCluster>::all(client.clone());
    let selector = format!("tidepool.io/test={test}");
    let lp = kube::api::ListParams::default().labels(&selector);
    api.delete_collection(&kube::api::DeleteParams::default(), &lp).await.unwrap();
    // No tidepool serves an earlier run's MemberClusters any more: nobody will drain them,
    // so their drain finalizer goes too.
    for mc in api.list(&lp).await.unwrap().items {
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        let name = mc.metadata.name.unwrap_or_default();
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => panic!("remove finalizers of MemberCluster {name}: {e}"),
        }
    }
    wait_for(Duration::from_secs(30), "leftover MemberClusters gone", || {
        let (api, lp) = (api.clone(), lp.clone());
        async move { api.list(&lp).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
}

/// A MemberCluster labelled for one test's tidepool, its kubeconfig in Secret
/// `secret_ns/secret`, with no pools (the whole member, one virtual node).
pub fn member_cluster(name: &str, test: &str, secret_ns: &str, secret: &str) -> MemberCluster {
    let mut mc = MemberCluster::new(
        name,
        MemberClusterSpec {
            kubeconfig_secret_ref: SecretKeyRef { name: secret.into(), namespace: Some(secret_ns.into()), key: None },
            ..Default::default()
        },
    );
    mc.metadata.labels = Some(BTreeMap::from([("tidepool.io/test".to_owned(), test.to_owned())]));
    mc
}

/// Creates (or replaces the spec of) `mc`.
pub async fn apply_member_cluster(client: &Client, mc: &MemberCluster) {
    Api::<MemberCluster>::all(client.clone())
        .patch(&mc.name_any(), &PatchParams::apply("tidepool-e2e").force(), &Patch::Apply(mc))
        .await
        .unwrap();
}

/// Creates (or replaces the spec of) a MemberCluster labelled for one test's tidepool.
pub async fn apply_member(client: &Client, name: &str, test: &str, secret_ns: &str, secret: &str) {
    apply_member_cluster(client, &member_cluster(name, test, secret_ns, secret)).await;
}

/// The start of a test on a member's real node: the test's namespace prepared, the kubeconfig
/// Secret of the member cluster `mc` names (Secret `<cluster>`, as [`member_cluster`] is
/// given), `mc` (its pools on the real node) applied, a tidepool for the test (`dispatcher` as
/// in [`Tidepool::start_config`]) and virtual node `node` Ready. Fails loudly when the clusters
/// have no real nodes.
pub async fn start_on_real_node(
    env: &Env,
    training: &Client,
    (test, ns): (&str, &str),
    dispatcher: &str,
    mc: &MemberCluster,
    node: &str,
) -> Tidepool {
    assert_eq!(env.var("CP_REAL_NODES"), "1", "these tests need the real nodes (CP_REAL_NODES=1)");
    prepare(env, training, test, ns).await;
    let cluster = &mc.spec.kubeconfig_secret_ref.name;
    let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
    put_kubeconfig_secret(training, ns, cluster, &kubeconfig).await;
    apply_member_cluster(training, mc).await;
    let tidepool = Tidepool::start_config(env, test, ns, dispatcher, &kubelet_config(env));
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node of the real pool Ready", || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get_opt(node).await.ok().flatten()?;
            let ready = node.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(())
        }
    })
    .await;
    tidepool
}

/// A test's clients and tidepool on member-a's real node: MemberCluster `member` with pool
/// `real` (virtual node `node`), via [`start_on_real_node`]. Returns the environment, the
/// training and member-a clients, and the tidepool.
pub async fn real_node_setup(
    (test, ns): (&str, &str),
    member: &str,
    node: &str,
    dispatcher: &str,
) -> (Env, Client, Client, Tidepool) {
    let env = Env::load();
    let training = env.client("training").await;
    let member_a = env.client("member-a").await;
    let mut mc = member_cluster(member, test, ns, "member-a");
    mc.spec.pools = vec![real_pool(&env)];
    let tidepool = start_on_real_node(&env, &training, (test, ns), dispatcher, &mc, node).await;
    (env, training, member_a, tidepool)
}

/// [`real_node_setup`] for tests of Jobs: the clients and tidepool, the namespace's Jobs of an
/// earlier run (one that failed makes pods as fast as they go) and their pods gone.
pub struct RealNodeJobs {
    pub env: Env,
    pub training: Client,
    pub member: Client,
    /// Kept for its lifetime: dropping it stops tidepool.
    _tidepool: Tidepool,
}

impl RealNodeJobs {
    pub async fn start((test, ns): (&str, &str), member: &str, node: &str, dispatcher: &str) -> Self {
        let (env, training, member, tidepool) = real_node_setup((test, ns), member, node, dispatcher).await;
        let dp =
            DeleteParams { propagation_policy: Some(kube::api::PropagationPolicy::Background), ..Default::default() };
        let jobs = Api::<k8s_openapi::api::batch::v1::Job>::namespaced(training.clone(), ns);
        let _ = jobs.delete_collection(&dp, &ListParams::default()).await;
        drain_pods(&training, ns).await;
        Self { env, training, member, _tidepool: tidepool }
    }
}

/// Pool `real`: the member's real node (label `tidepool.io/test-pool=real`), whose taint
/// the copies tolerate.
pub fn real_pool(env: &Env) -> PoolSpec {
    let toleration = PoolToleration {
        key: Some(env.var("REAL_NODE_TAINT").to_owned()),
        operator: Some("Equal".into()),
        value: Some("true".into()),
        effect: Some("NoSchedule".into()),
    };
    PoolSpec {
        name: "real".into(),
        node_selector: BTreeMap::from([("tidepool.io/test-pool".to_owned(), "real".to_owned())]),
        tolerations: vec![toleration],
        ..Default::default()
    }
}

/// The scheduler name a test's tidepool answers to, so concurrent tests never place each
/// other's pods.
/// A small pod (10m CPU, 16Mi) labelled `app=<app>`, bound straight to virtual node `node`
/// and tolerating its taint: what a burst of offloaded pods is made of.
pub fn small_bound_pod(name: &str, node: &str, app: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": tidepool_api::keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]
        }
    }))
    .unwrap()
}

pub fn scheduler_name(test: &str) -> String {
    format!("tidepool-{test}")
}

/// Puts `cluster`'s admin kubeconfig in Secret `ns/<cluster>` and applies MemberCluster
/// `member` (labelled for `test`) pointing at it.
#[allow(dead_code)]
pub async fn bridge_member(env: &Env, training: &Client, test: &str, ns: &str, member: &str, cluster: &str) {
    let kubeconfig = std::fs::read(env.kubeconfig_path(cluster)).unwrap();
    put_kubeconfig_secret(training, ns, cluster, &kubeconfig).await;
    apply_member(training, member, test, ns, cluster).await;
}

/// A running `tidepool run` process serving the MemberClusters labelled
/// `tidepool.io/test=<test>`. Killed when dropped; it also exits by itself when the test
/// process dies (its standard input closes).
pub struct Tidepool {
    child: std::process::Child,
    log: PathBuf,
    metrics_port: u16,
    _dir: tempfile::TempDir,
}

impl Tidepool {
    pub fn start(env: &Env, test: &str, secret_ns: &str) -> Tidepool {
        Self::start_with(env, test, secret_ns, "")
    }

    /// Like [`Tidepool::start`], with `dispatcher:` settings (YAML flow mapping entries,
    /// e.g. `deficitHysteresisSeconds: 1`) added to the config.
    pub fn start_with(env: &Env, test: &str, secret_ns: &str, dispatcher: &str) -> Tidepool {
        Self::start_config(env, test, secret_ns, dispatcher, "")
    }

    /// Like [`Tidepool::start_with`], with top-level config lines added (YAML, e.g.
    /// `memberLossTimeoutSeconds: 5`).
    pub fn start_config(env: &Env, test: &str, secret_ns: &str, dispatcher: &str, top_level: &str) -> Tidepool {
        Self::start_as(env, test, secret_ns, &env.kubeconfig_path("training"), dispatcher, top_level)
    }

    /// Like [`Tidepool::start_config`], reaching the training cluster with `kubeconfig`.
    pub fn start_as(
        env: &Env,
        test: &str,
        secret_ns: &str,
        kubeconfig: &Path,
        dispatcher: &str,
        top_level: &str,
    ) -> Tidepool {
        Self::launch(env, (test, secret_ns), kubeconfig, (dispatcher, top_level), &[])
    }

    /// Like [`Tidepool::start_config`], as replica `identity` (its `POD_NAME`): one of several
    /// tidepools sharing the test's members.
    #[allow(dead_code)]
    pub fn start_replica(
        env: &Env,
        (test, secret_ns): (&str, &str),
        (dispatcher, top_level): (&str, &str),
        identity: &str,
    ) -> Tidepool {
        let kubeconfig = env.kubeconfig_path("training");
        Self::launch(env, (test, secret_ns), &kubeconfig, (dispatcher, top_level), &[("POD_NAME", identity)])
    }

    fn launch(
        _env: &Env,
        (test, secret_ns): (&str, &str),
        kubeconfig: &Path,
        (dispatcher, top_level): (&str, &str),
        vars: &[(&str, &str)],
    ) -> Tidepool {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("tidepool.yaml");
        let metrics_port = free_port();
        std::fs::write(
            &config,
            format!(
                "clusterName: training\nnamespace: {secret_ns}\ntrainingKubeconfig: {}\nmemberSelector: tidepool.io/test={test}\n\
                 metrics: {{bindAddress: \"127.0.0.1:{metrics_port}\"}}\n\
                 dispatcher: {{schedulerName: {}{}}}\n{top_level}\n{}",
                kubeconfig.display(),
                scheduler_name(test),
                if dispatcher.is_empty() { String::new() } else { format!(", {dispatcher}") },
                // Without a kubelet section tidepool would ask the training cluster for a
                // serving certificate: only the tests of that path want it.
                if top_level.contains("kubelet:") { "" } else { "kubelet: {serving: off}\n" },
            ),
        )
        .unwrap();
        let log = std::env::temp_dir().join(format!("tidepool-e2e-{test}-{}.log", run_id()));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_tidepool"))
            .args(["run", "--exit-on-stdin-eof", "--config"])
            .arg(&config)
            // TIDEPOOL_TEST_LOG overrides the filter (say, `tidepool_dispatcher=debug` to see
            // how long a reclaim's member delete took).
            .env(
                "RUST_LOG",
                std::env::var("TIDEPOOL_TEST_LOG").unwrap_or_else(|_| {
                    "info,tidepool_vk=debug,tidepool_kubelet=debug,tidepool_federation=debug,kube=warn".to_owned()
                }),
            )
            .envs(vars.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Tidepool { child, log, metrics_port, _dir: dir }
    }

    /// The bridge configuration file this tidepool runs with.
    pub fn config_path(&self) -> PathBuf {
        self._dir.path().join("tidepool.yaml")
    }

    /// The text of tidepool's `/metrics` (empty while it does not answer yet).
    #[allow(dead_code)]
    pub fn scrape(&self) -> String {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)) else {
            return String::new();
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: tidepool\r\nConnection: close\r\n\r\n");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
    }

    /// Like [`Tidepool::scrape`], for a check that reads zeros as meaning something: panics
    /// unless tidepool answered and has counted some API requests already, so a dead or
    /// not-yet-listening process never passes for one that sent nothing.
    #[allow(dead_code)]
    pub fn scrape_live(&self) -> String {
        let text = self.scrape();
        let requests = metric_sum(&text, "tidepool_api_requests_total", &[]);
        assert!(requests > 0.0, "tidepool's /metrics did not answer with live counters:\n{text}\n{}", self.log_tail());
        text
    }

    /// For the benchmark's memory readings (tests/bench shares this harness).
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, as a rollout stops a pod, then waits (60 s at most) for the process to end:
    /// its shutdown code runs. Whether it ended by itself.
    #[allow(dead_code)]
    pub fn terminate(&mut self) -> bool {
        let sent = std::process::Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "cannot send SIGTERM to tidepool {}", self.child.id());
        for _ in 0..600 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.kill();
        false
    }

    /// SIGKILL, as a crash would: no shutdown code runs.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The whole of tidepool's log so far. Panics when the file cannot be read: a check of
    /// what the log holds must never pass on a log it did not see.
    #[allow(dead_code)]
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log)
            .unwrap_or_else(|e| panic!("cannot read tidepool's log {}: {e}", self.log.display()));
        assert!(!text.is_empty(), "tidepool's log {} is empty", self.log.display());
        text
    }

    /// Where tidepool's log is written; it outlives the process.
    #[allow(dead_code)]
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of tidepool's log, for failure messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log, 40)
    }
}

impl Drop for Tidepool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- tidepool log ({}) ---\n{}", self.log.display(), self.log_tail());
        }
    }
}

/// `BENCH_SHARDED=1`: a benchmark runs two sharded replicas (see [`Sharded`]).
#[allow(dead_code)]
pub fn bench_sharded() -> bool {
    std::env::var("BENCH_SHARDED").is_ok_and(|v| v == "1")
}

/// Two sharded replicas of a benchmark, arranged so that its one member is owned by the
/// replica that does not run the dispatcher: placement then reads the owner's published
/// capacity record, and the owner notices and ends the reclaims.
#[allow(dead_code)]
pub struct Sharded {
    pub replicas: Vec<Tidepool>,
    /// Index in `replicas` of the member's owner.
    pub owner: usize,
}

impl Sharded {
    #[allow(dead_code)]
    pub async fn start(
        env: &Env,
        training: &Client,
        (test, ns): (&str, &str),
        dispatcher: &str,
        member: &str,
    ) -> Sharded {
        use k8s_openapi::api::coordination::v1::Lease;
        let election = format!("{test}-shards");
        let config = format!(
            "sharding: {{enabled: true, leaseDurationSeconds: 15, renewDeadlineSeconds: 10, retryPeriodSeconds: 2}}\n\
             leaderElection: {{leaseName: {election}}}"
        );
        let leases = Api::<Lease>::namespaced(training.clone(), ns);
        let _ = leases.delete_collection(&kube::api::DeleteParams::default(), &kube::api::ListParams::default()).await;
        let identity = |r: usize| format!("{test}-{r}");
        let start = |r: usize| Tidepool::start_replica(env, (test, ns), (dispatcher, &config), &identity(r));
        let mut replicas: Vec<Option<Tidepool>> = (0..2).map(|r| Some(start(r))).collect();
        let member_lease = format!("tidepool-member-{member}");
        let holders = || async {
            let held = |name: String| {
                let leases = leases.clone();
                async move { leases.get_opt(&name).await.ok().flatten()?.spec?.holder_identity }
            };
            Some((held(election.clone()).await?, held(member_lease.clone()).await?))
        };
        let (leader, owner) = wait_for(Duration::from_secs(90), "a leader and an owner", holders).await;
        if leader == owner {
            // The other replica takes the leader Lease; the restarted one gets its member
            // back (the rendezvous hash names it again) and does not run the dispatcher.
            let r = (0..2).find(|r| identity(*r) == leader).expect("the leader is a replica");
            replicas[r].as_mut().expect("started").kill();
            wait_for(Duration::from_secs(60), "the leader Lease moved", || async {
                (holders().await?.0 != leader).then_some(())
            })
            .await;
            replicas[r] = Some(start(r));
        }
        let (leader, owner) = wait_for(Duration::from_secs(90), "the leader and the owner apart", || async {
            let (leader, owner) = holders().await?;
            (leader != owner).then_some((leader, owner))
        })
        .await;
        eprintln!("sharded: the dispatcher runs on {leader}, member {member} is owned by {owner}");
        let owner = (0..2).find(|r| identity(*r) == owner).expect("the owner is a replica");
        Sharded { replicas: replicas.into_iter().flatten().collect(), owner }
    }
}

/// Resident memory (VmRSS) of process `pid`, in MiB; NaN if it cannot be read. For the
/// benchmarks, which share this harness.
#[allow(dead_code)]
pub fn rss_mib(pid: u32) -> f64 {
    Rss::of(pid).total
}

/// A process's resident memory (MiB) and its two parts: anonymous (heap, stacks: what grows
/// with the data it holds) and file-backed (mostly the binary's code and read-only data,
/// paged in the first time a path runs, then kept).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // the e2e tests read the total; the benchmarks its parts too
pub struct Rss {
    pub total: f64,
    pub anon: f64,
    pub file: f64,
}

impl Rss {
    pub fn of(pid: u32) -> Self {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .map_or(f64::NAN, |kb| kb / 1024.0)
        };
        Rss { total: field("VmRSS:"), anon: field("RssAnon:"), file: field("RssFile:") }
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The value of the series `name{labels}` in a metrics text, if present; `labels` is the
/// exact label set as printed (`member="a",pool="p"`), or empty for an unlabelled series.
#[allow(dead_code)]
pub fn metric_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() { name.to_owned() } else { format!("{name}{{{labels}}}") };
    text.lines().find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The sum of every series of `name` whose labels contain all of `filters` (`verb="get"`).
#[allow(dead_code)]
pub fn metric_sum(text: &str, name: &str, filters: &[&str]) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = rest.strip_prefix('{')?.rsplit_once("} ")?;
            filters.iter().all(|f| labels.split(',').any(|kv| kv == *f)).then(|| value.trim().parse::<f64>().ok())?
        })
        .sum()
}

pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Top-level config lines that make tidepool serve its kubelet API where the training
/// cluster's virtual nodes point, with the certificates `cluster.sh` made for it (pass them
/// as `top_level` to [`Tidepool::start_config`]). Only one tidepool at a time can hold the port.
#[allow(dead_code)] // tests/bench shares this harness
pub fn kubelet_config(env: &Env) -> String {
    format!(
        "kubelet: {{nodeAddress: {}, port: {}, tlsCertFile: {}, tlsKeyFile: {}, clientCaFile: {}}}",
        env.var("TIDEPOOL_KUBELET_ADDRESS"),
        env.var("TIDEPOOL_KUBELET_PORT"),
        env.var("TIDEPOOL_KUBELET_CERT"),
        env.var("TIDEPOOL_KUBELET_KEY"),
        env.var("TIDEPOOL_KUBELET_CLIENT_CA"),
    )
}

/// Runs the clusters' `kubectl` against `cluster` (with `stdin` written to it, if given) and
/// returns its exit code, stdout and stderr. Bounded: killed after 60 s.
#[allow(dead_code)] // tests/bench shares this harness
pub async fn kubectl(env: &Env, cluster: &str, args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(env.var("KUBECTL"))
        .arg("--kubeconfig")
        .arg(env.kubeconfig_path(cluster))
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run kubectl: {e}"));
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await.unwrap();
        drop(pipe);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish in 60 s"))
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Ready condition (status, reason, message) of a MemberCluster, once it has one.
#[allow(dead_code)]
pub async fn ready_condition(client: &Client, name: &str) -> Option<(String, String, String)> {
    let mc = Api::<MemberCluster>::all(client.clone()).get(name).await.ok()?;
    let c = mc.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
    Some((c.status, c.reason, c.message))
}

/// Waits (60 s) until MemberCluster `name` is `Ready=status` with `reason`; its message.
#[allow(dead_code)]
pub async fn wait_reason(client: &Client, name: &str, status: &str, reason: &str) -> String {
    wait_for(Duration::from_secs(60), &format!("{name}: Ready={status} reason {reason}"), || async move {
        let (s, r, m) = ready_condition(client, name).await?;
        (s == status && r == reason).then_some(m)
    })
    .await
}

/// `curl` against tidepool's kubelet API with a client certificate: the HTTP status and body.
#[allow(dead_code)] // tests/bench shares this harness
pub fn kubelet_call(env: &Env, (cert, key): &(String, String), method: &str, path: &str) -> (u16, String) {
    let url = format!("https://{}:{}{path}", env.var("TIDEPOOL_KUBELET_ADDRESS"), env.var("TIDEPOOL_KUBELET_PORT"));
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "-X", method, "-w", "\n%{http_code}"])
        .args(["--cacert", &format!("{}/ca.crt", env.var("CP_PKI")), "--cert", cert, "--key", key])
        .arg(url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// Waits (90 s at most) for training pod `name` to be rolled back with its gang (`Failed`,
/// reason `GangTimeout`); its message.
pub async fn wait_rolled_back(pods: &Api<Pod>, name: &str) -> String {
    wait_for(Duration::from_secs(90), &format!("{name} rolled back"), || async move {
        let s = pods.get(name).await.ok()?.status?;
        (s.phase.as_deref() == Some("Failed") && s.reason.as_deref() == Some("GangTimeout"))
            .then(|| s.message.unwrap_or_default())
    })
    .await
}

/// Everything the training API server says of the pods named `names` from now on that a
/// disruption would show: a deletion, a notice, `DisruptionTarget`, a phase other than
/// Running. The watch stops when the returned task is aborted.
pub fn watch_untouched(
    training: &Client,
    ns: &str,
    names: Vec<String>,
) -> (Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let api = Api::<Pod>::namespaced(training.clone(), ns);
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff().applied_objects());
        while let Some(Ok(p)) = events.next().await {
            if !names.contains(&p.name_any()) {
                continue;
            }
            let condition = |type_: &str| {
                let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
                conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
            };
            let phase = p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
            let touched = p.metadata.deletion_timestamp.is_some()
                || condition(tidepool_api::keys::CONDITION_RECLAIM_REQUESTED)
                || condition(tidepool_api::keys::CONDITION_DISRUPTION_TARGET)
                || phase != "Running";
            if touched {
                record.lock().unwrap().push(format!("{}: phase {phase}, {:?}", p.name_any(), p.status));
            }
        }
    });
    (seen, task)
}

/// A token for ServiceAccount `namespace/name`, from the TokenRequest API.
pub async fn token(client: &Client, namespace: &str, name: &str) -> String {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { audiences: None, expiration_seconds: Some(3600), ..Default::default() }),
        ..Default::default()
    };
    let api = Api::<ServiceAccount>::namespaced(client.clone(), namespace);
    let answer: TokenRequest = wait_for(Duration::from_secs(30), "service account token", || {
        let api = api.clone();
        let request = request.clone();
        async move { api.create_subresource("token", name, &PostParams::default(), &request).await.ok() }
    })
    .await;
    answer.status.unwrap().token.unwrap()
}

/// A kubeconfig that reaches `server` with a bearer token, everything embedded.
pub fn token_kubeconfig(env: &Env, server: &str, token: &str) -> String {
    use base64::Engine as _;
    let ca = std::fs::read(Path::new(env.var("CP_PKI")).join("ca.crt")).unwrap();
    let ca = base64::engine::general_purpose::STANDARD.encode(ca);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{server}\", certificate-authority-data: {ca}}}\n\
         users:\n- name: u\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
    )
}

/// A client from kubeconfig text.
pub async fn client_from(kubeconfig: &str) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
    Client::try_from(config).unwrap()
}
