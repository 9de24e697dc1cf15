//! `tidepool`: the binary. CLI and wiring only; the work happens in the crates.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

mod kubectl;
mod leader;
mod ready;
mod serve;
mod shard;
mod status;
mod supervise;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tidepool_api::BridgeConfig;
use tidepool_federation::published;
use tokio::io::AsyncReadExt;
use tracing::info;

#[derive(Parser, Debug)]
#[command(name = "tidepool", version, about = "Online clusters' surplus as virtual nodes in a training cluster")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the bridge: federation, virtual nodes and pod sync.
    Run {
        /// Bridge configuration file (YAML). Without it, the embedded defaults: training
        /// cluster from $KUBECONFIG or in-cluster, every MemberCluster bridged.
        #[arg(long, env = "TIDEPOOL_CONFIG")]
        config: Option<PathBuf>,
        /// Exit when standard input closes (used by tests, so tidepool never outlives them).
        #[arg(long, hide = true)]
        exit_on_stdin_eof: bool,
    },
    /// Print the CustomResourceDefinitions tidepool serves, as YAML.
    Crds,
    /// Check a bridge configuration file and report every problem with its path.
    CheckConfig { file: PathBuf },
    /// Members, pools (capacity / used / deficit), gangs and reclaims, as a terminal view.
    Status {
        /// Bridge configuration file (for the training kubeconfig and scheduler name).
        #[arg(long, env = "TIDEPOOL_CONFIG")]
        config: Option<PathBuf>,
    },
}

/// jemalloc: tidepool keeps every pod of the training cluster and
/// every offload pod in its caches, and after a burst what it holds is long-lived small
/// objects among the pages the burst's short-lived ones left. jemalloc keeps less of those
/// resident than mimalloc or glibc's allocator did with the same build: 4.2 KiB of RSS per
/// mirrored pod at 10,000 against 4.6–5.1 (mimalloc) and 5.5 (glibc) (BENCHMARKS.md,
/// "Session 19"). Its options are compiled in: a background thread that gives pages freed
/// after a burst back even while tidepool is idle (otherwise that happens only as it
/// allocates), and no transparent huge pages whatever the kernel's THP mode
/// (`.cargo/config.toml`; a 2 MiB page stays resident while any small object on it lives).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Reads, parses and validates the config file at `path`; every problem names the path.
fn load_config(path: &std::path::Path) -> Result<BridgeConfig, tidepool_api::bridge::ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| tidepool_api::bridge::ConfigError::Read { path: path.into(), source })?;
    BridgeConfig::from_file(path, &text)
}

fn main() -> anyhow::Result<()> {
    // Installed as `kubectl-tidepool`, the binary is the kubectl plugin.
    if kubectl::invoked_as_plugin() {
        std::process::exit(kubectl::main());
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Crds => {
            print!("{}", crds_yaml()?);
            Ok(())
        }
        Command::CheckConfig { file } => {
            load_config(&file)?;
            println!("{}: ok", file.display());
            Ok(())
        }
        Command::Status { config } => {
            let config = match config {
                Some(path) => load_config(&path)?,
                None => BridgeConfig::default(),
            };
            tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
                let client = training_client(&config).await?;
                print!("{}", status::render(client, &config.dispatcher.scheduler_name).await?);
                anyhow::Ok(())
            })
        }
        Command::Run { config, exit_on_stdin_eof } => {
            init_tracing();
            supervise::count_panics();
            let mut config = match config {
                Some(path) => load_config(&path)?,
                None => BridgeConfig::default(),
            };
            // In a Deployment the virtual nodes' address is the active replica's pod IP.
            if let Ok(address) = std::env::var("TIDEPOOL_KUBELET_NODE_ADDRESS")
                && !address.is_empty()
            {
                config.kubelet.node_address =
                    address.parse().with_context(|| format!("TIDEPOOL_KUBELET_NODE_ADDRESS={address}: not an IP"))?;
            }
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let result = runtime.block_on(run(config, exit_on_stdin_eof));
            // What is still running once `run` is done (the blocking read of standard input
            // with --exit-on-stdin-eof, a request abandoned at the shutdown grace) does not
            // hold the process: dropping the runtime would wait for blocking reads forever.
            runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
            result
        }
    }
}

/// How long tasks still running after `tidepool run` stopped get before the process exits.
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

/// The CRDs as one YAML stream; `deploy/crds/` holds exactly this (checked by a test).
fn crds_yaml() -> anyhow::Result<String> {
    let crd = serde_saphyr::to_string(&tidepool_api::schema::member_cluster_crd())?;
    Ok(format!("# Generated by `tidepool crds` from api/src/crd.rs. Do not edit.\n---\n{crd}"))
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn,kube_runtime=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

async fn run(config: BridgeConfig, exit_on_stdin_eof: bool) -> anyhow::Result<()> {
    let (ready, readiness) = tokio::sync::watch::channel(ready::Readiness::Connecting);
    if let Some(addr) = config.metrics.bind_address {
        serve::start(addr, readiness).await?;
    }
    let training = training_client(&config).await?;
    let version = training.apiserver_version().await.context("training cluster does not answer")?;
    info!(version = %version.git_version, cluster = %config.cluster_name, "connected to the training cluster");
    let shutdown = shutdown(exit_on_stdin_eof);
    tokio::pin!(shutdown);

    let identity = leader::identity();
    let sharded = config.sharding.enabled;
    // Sharded, the leader Lease elects the dispatcher alone (see `elected_dispatcher`).
    let elector = (config.leader_election.enabled || sharded)
        .then(|| leader::Elector::new(training.clone(), &config.namespace, &config.leader_election, identity.clone()));
    // A standby replica stops here until it leads: it starts no controller, so it writes
    // nothing but the Lease.
    match elector.as_ref().filter(|_| !sharded) {
        Some(elector) => {
            ready.send_replace(ready::Readiness::Standby);
            info!(identity = %elector.identity(), "waiting for the leader Lease");
            tokio::select! {
                () = elector.acquire() => {}
                result = &mut shutdown => return result,
            }
        }
        None if sharded => info!(%identity, "sharded: sharing the members with the other replicas"),
        None => {
            tidepool_api::metrics::metrics().leader.set(1);
        }
    }

    ready.send_replace(ready::Readiness::Syncing("the federation to start".into()));
    let config = Arc::new(config);
    let dispatcher_elector = elector.clone().filter(|_| sharded);
    let mut supervisor = start(config.clone(), training.clone(), ready, &identity, dispatcher_elector).await?;

    let lost = async {
        match elector.as_ref().filter(|_| !sharded) {
            Some(elector) => elector.hold().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        result = &mut shutdown => result?,
        // Another replica may be active by now: stop at once, writing nothing more.
        reason = lost => anyhow::bail!("{reason}; exiting so the replica restarts as a standby"),
        failure = supervisor.failure() => return Err(failure),
    }
    // Writes in flight finish before the Lease goes: the next leader starts after them.
    supervisor.stop().await;
    if sharded {
        let group = config.leader_election.lease_name.as_str();
        shard::Sharder::release_all(training, &config.namespace, (&identity, group)).await;
    }
    if let Some(elector) = &elector {
        elector.release().await;
    }
    Ok(())
}

/// Starts the components, their controllers supervised (see [`supervise`]).
/// With `dispatcher_elector` (sharded), the dispatcher runs only while this replica holds the
/// leader Lease.
async fn start(
    config: Arc<BridgeConfig>,
    training: kube::Client,
    ready: tokio::sync::watch::Sender<ready::Readiness>,
    identity: &str,
    dispatcher_elector: Option<leader::Elector>,
) -> anyhow::Result<supervise::Supervisor> {
    let mut supervisor = supervise::Supervisor::default();
    let stop = supervisor.stop_token();
    let tasks = &mut supervisor.tasks;
    let ownership = ownership(tasks, &training, &config, identity);
    let owned = ownership.owned.as_ref().map(tidepool_federation::fence::Owned::members);
    let federation = tidepool_federation::Federation::start(tasks, training.clone(), config.clone(), ownership);
    // Before anything else runs: a kubelet API that cannot start is a configuration error.
    tidepool_kubelet::start(&config.kubelet, training.clone(), federation.members()).await?;
    // One watch of the training cluster's pods, shared by the pod sync and the dispatcher.
    let pods = tidepool_federation::TrainingPods::start(tasks, training.clone());
    // Reclaim's member deletes go through the pod sync, the one writer of offload copies.
    let (copy_writer, copy_writes) = tidepool_federation::writes::copy_writes();
    let members = federation.members();
    tidepool_vk::VirtualKubelet::start(
        tasks,
        stop,
        training.clone(),
        config.clone(),
        members.clone(),
        pods.clone(),
        copy_writes,
    );
    // Ends once ready: nothing more to report then.
    let selector = config.member_selector.clone();
    tokio::spawn(ready::follow(ready, training.clone(), selector, (members.clone(), owned), pods.clone()));
    match dispatcher_elector {
        Some(elector) => {
            let (remote, publish_wanted) = share_capacity(tasks, &training, &config, identity, &members);
            let dispatcher =
                tidepool_dispatcher::Dispatcher::new(training, config, (members, Some(remote)), pods, copy_writer);
            dispatcher.start_reclaim(tasks);
            tasks.spawn("dispatcher-election", elected_dispatcher(elector, dispatcher, publish_wanted));
        }
        None => tidepool_dispatcher::Dispatcher::new(training, config, (members, None), pods, copy_writer).start(tasks),
    }
    Ok(supervisor)
}

/// Sharded: this replica publishes its members' capacity (task `capacity-publisher`), watches
/// the others' (`capacity-records`) and whether the dispatcher wants capacity
/// (`capacity-wanted`). Returns the others' pools for the dispatcher, and the publisher of
/// what it wants, for the replica that runs it.
fn share_capacity(
    tasks: &mut tidepool_federation::tasks::Tasks,
    training: &kube::Client,
    config: &BridgeConfig,
    identity: &str,
    members: &tokio::sync::watch::Receiver<tidepool_federation::Members>,
) -> (tidepool_dispatcher::RemotePools, impl std::future::Future<Output = ()> + Send + 'static) {
    let namespace = config.namespace.clone();
    let lease = Duration::from_secs(config.sharding.lease_duration_seconds);
    let heartbeat = (lease / 3).max(Duration::from_secs(1));
    let publish =
        published::publish(training.clone(), namespace.clone(), identity.to_owned(), members.clone(), heartbeat);
    tasks.spawn("capacity-publisher", publish);
    let records = published::watch_records(tasks, training.clone(), &namespace);
    tasks.spawn("capacity-wanted", published::follow_wanted(training.clone(), namespace.clone(), members.clone()));
    let (wanted, wanted_rx) = tokio::sync::watch::channel(false);
    let remote = tidepool_dispatcher::RemotePools { records, stale_after: lease, wanted };
    (remote, published::publish_wanted(training.clone(), namespace, wanted_rx))
}

/// Which members this replica bridges: sharded, those [`shard::Sharder`] (task `sharding`)
/// gives it; otherwise every selected one.
fn ownership(
    tasks: &mut tidepool_federation::tasks::Tasks,
    training: &kube::Client,
    config: &BridgeConfig,
    identity: &str,
) -> tidepool_federation::Ownership {
    let owned = config.sharding.enabled.then(|| {
        let selector = config.member_selector.clone();
        let sharding = config.sharding.clone();
        let names = (identity.to_owned(), config.leader_election.lease_name.clone());
        let (sharder, owned) = shard::Sharder::new(training.clone(), &config.namespace, selector, names, sharding);
        tasks.spawn("sharding", sharder.run());
        owned
    });
    tidepool_federation::Ownership { identity: identity.to_owned(), owned }
}

/// Sharded: the dispatcher runs on the replica holding the leader Lease. Losing the Lease
/// ends this task, and so the process (it restarts without the dispatcher).
async fn elected_dispatcher(
    elector: leader::Elector,
    dispatcher: tidepool_dispatcher::Dispatcher,
    publish_wanted: impl std::future::Future<Output = ()> + Send + 'static,
) {
    elector.acquire().await;
    let mut tasks = tidepool_federation::tasks::Tasks::default();
    tasks.spawn("dispatcher", dispatcher.schedule());
    tasks.spawn("capacity-wanted-publisher", publish_wanted);
    tokio::select! {
        ended = tasks.first_end() => tracing::error!(%ended, "the dispatcher stopped"),
        reason = elector.hold() => tracing::error!(%reason, "the dispatcher lost the leader Lease"),
    }
}

/// Resolves on SIGINT, SIGTERM, or (for tests) standard input closing.
async fn shutdown(exit_on_stdin_eof: bool) -> anyhow::Result<()> {
    let stdin_closed = async {
        if exit_on_stdin_eof {
            let mut buf = [0u8; 64];
            let mut stdin = tokio::io::stdin();
            while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot listen for SIGINT")?,
        () = terminate() => {}
        () = stdin_closed => info!("standard input closed"),
    }
    info!("shutting down");
    Ok(())
}

async fn terminate() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

async fn training_client(config: &BridgeConfig) -> anyhow::Result<kube::Client> {
    let kube_config = match &config.training_kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read training kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await.context("no training cluster credentials found")?,
    };
    Ok(tidepool_federation::api_metrics::counted_client(kube_config, "training")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// deploy/crds/ is generated from the Rust types; this fails when they drift.
    #[test]
    fn committed_crds_match_the_types() {
        for path in [
            concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/crds/memberclusters.yaml"),
            concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/tidepool/crds/memberclusters.yaml"),
        ] {
            let committed = std::fs::read_to_string(path).unwrap_or_default();
            assert!(committed == crds_yaml().unwrap(), "{path} is out of date: run `cargo run -- crds > {path}`");
        }
    }

    /// Every metric the Grafana dashboard queries is one tidepool exports.
    #[test]
    fn dashboard_queries_only_exported_metrics() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/tidepool-dashboard.json");
        let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let exported = tidepool_api::metrics::metrics().series_names();
        let mut queried = Vec::new();
        let panels = dashboard["panels"].as_array().unwrap();
        for panel in panels {
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap();
                queried.extend(metric_names(expr));
            }
        }
        assert!(queried.len() >= 20, "the dashboard should query tidepool's metrics: {queried:?}");
        let missing: Vec<&String> = queried.iter().filter(|q| !exported.contains(q)).collect();
        assert!(missing.is_empty(), "{path} queries metrics tidepool does not export: {missing:?}");
        // And every exported family shows up somewhere on the dashboard.
        let families: std::collections::BTreeSet<&str> = exported
            .iter()
            .map(|n| n.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count"))
            .collect();
        let unused: Vec<&&str> = families.iter().filter(|f| !queried.iter().any(|q| q.starts_with(**f))).collect();
        assert!(unused.is_empty(), "metrics missing from the dashboard: {unused:?}");
    }

    /// The `tidepool_*` identifiers in a PromQL expression.
    fn metric_names(expr: &str) -> Vec<String> {
        expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("tidepool_"))
            .map(str::to_owned)
            .collect()
    }
}
