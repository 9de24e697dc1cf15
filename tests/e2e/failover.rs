//! Health and failover: a test-owned TCP proxy between tidepool and member-b blackholes the
//! member. Through a 60 s outage its virtual node stays `Ready=Unknown` and tainted while its
//! offload pods run on untouched; on return everything converges without duplicates. Past the loss timeout the
//! training pods fail `MemberLost`, and their offload copies go once the member is back.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use tidepool_api::{MemberCluster, keys};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::harness::*;

/// A TCP proxy on 127.0.0.1 that forwards to one API server, or blackholes: accepts and
/// holds connections, reading and dropping every byte. Switching either way cuts every
/// connection it carries, as a partition (or its end) does to streams that lost bytes.
struct Proxy {
    addr: SocketAddr,
    blackhole: Arc<AtomicBool>,
    epoch: Arc<watch::Sender<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let blackhole = Arc::new(AtomicBool::new(false));
        let epoch = Arc::new(watch::channel(0u64).0);
        let (hole, ep) = (blackhole.clone(), epoch.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { return };
                let mut cut = ep.subscribe();
                let holed = hole.load(Ordering::SeqCst);
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let work = async {
                        if holed {
                            let mut buf = vec![0u8; 16 * 1024];
                            while matches!(inbound.read(&mut buf).await, Ok(n) if n > 0) {}
                            return;
                        }
                        let Ok(mut out) = TcpStream::connect(&upstream).await else { return };
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    };
                    tokio::select! {
                        () = work => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Proxy { addr, blackhole, epoch, task }
    }

    fn set_blackhole(&self, on: bool) {
        self.blackhole.store(on, Ordering::SeqCst);
        self.epoch.send_modify(|e| *e += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.set_blackhole(true);
    }
}

/// Member-b's kubeconfig, pointed at `proxy` (the API server's certificate names
/// 127.0.0.1, so TLS still verifies).
fn kubeconfig_via(env: &Env, proxy: &Proxy) -> Vec<u8> {
    let text = std::fs::read_to_string(env.kubeconfig_path("member-b")).unwrap();
    let server = env.var("MEMBER_B_SERVER");
    assert!(text.contains(server), "member-b kubeconfig does not name {server}");
    text.replace(server, &format!("https://{}", proxy.addr)).into_bytes()
}

fn condition(node: &Node, type_: &str) -> Option<(String, String)> {
    let c = node.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
}

fn has_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == key && t.effect == "NoSchedule"))
}

async fn member_condition(client: &Client, name: &str, type_: &str) -> Option<String> {
    let mc = Api::<MemberCluster>::all(client.clone()).get(name).await.ok()?;
    mc.status?.conditions.into_iter().find(|c| c.type_ == type_).map(|c| c.status)
}

/// Sets up member `member` through a fresh proxy and a tidepool with `top_level` config, and
/// runs one pod on it; returns the proxy, tidepool, pod name and the offload pod's UID.
struct Setup {
    proxy: Proxy,
    tidepool: Tidepool,
    training: Client,
    member_b: Client,
    node: String,
    worker: String,
    offload_uid: String,
    origin_uid: String,
}

async fn setup(test: &str, ns: &str, member: &str, top_level: &str) -> Setup {
    let env = Env::load();
    let training = env.client("training").await;
    let member_b = env.client("member-b").await;
    prepare(&env, &training, test, ns).await;
    let upstream = env.var("MEMBER_B_SERVER").trim_start_matches("https://").to_owned();
    let proxy = Proxy::start(upstream).await;
    put_kubeconfig_secret(&training, ns, "member-b-proxied", &kubeconfig_via(&env, &proxy)).await;
    apply_member(&training, member, test, ns, "member-b-proxied").await;
    let tidepool = Tidepool::start_config(&env, test, ns, "", top_level);

    let node = format!("tidepool-{member}");
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(90), "virtual node Ready", || {
        let (nodes, node) = (nodes.clone(), node.clone());
        async move {
            let n = nodes.get_opt(&node).await.ok()??;
            (condition(&n, "Ready")?.0 == "True").then_some(())
        }
    })
    .await;

    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let worker = format!("worker-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": worker},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists"}],
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    let origin_uid = created.metadata.uid.unwrap();
    wait_for(Duration::from_secs(60), "pod Running through the proxied member", || {
        let (pods, worker) = (pods.clone(), worker.clone());
        async move { (pods.get(&worker).await.ok()?.status?.phase.as_deref() == Some("Running")).then_some(()) }
    })
    .await;
    let offload = Api::<Pod>::namespaced(member_b.clone(), &offload_ns(ns)).get(&worker).await.unwrap();
    let offload_uid = offload.metadata.uid.unwrap();
    Setup { proxy, tidepool, training, member_b, node, worker, offload_uid, origin_uid }
}

async fn offload_copies(member_b: &Client, origin_uid: &str) -> Vec<Pod> {
    let lp = ListParams::default().labels(&format!("{}={origin_uid}", keys::LABEL_ORIGIN_UID));
    Api::<Pod>::all(member_b.clone()).list(&lp).await.unwrap().items
}

async fn teardown(s: &Setup, ns: &str, member: &str) {
    let pods = Api::<Pod>::namespaced(s.training.clone(), ns);
    let _ = pods.delete(&s.worker, &DeleteParams::default()).await;
    wait_for(Duration::from_secs(60), "worker deleted", || {
        let (pods, worker) = (pods.clone(), s.worker.clone());
        async move { pods.get_opt(&worker).await.ok()?.is_none().then_some(()) }
    })
    .await;
    Api::<MemberCluster>::all(s.training.clone()).delete(member, &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn an_unreachable_member_is_held_not_torn_down_and_recovers_without_duplicates() {
    const TEST: &str = "failover";
    const NS: &str = "e2e-failover";
    const MEMBER: &str = "e2e-fo-b";
    // The outage below lasts 60 s; the loss timeout is well past it, so this is a partition
    // the member is expected to come back from, not a lost member.
    const OUTAGE: Duration = Duration::from_secs(60);
    let s = setup(TEST, NS, MEMBER, "memberLossTimeoutSeconds: 150").await;
    let nodes = Api::<Node>::all(s.training.clone());
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);

    // 1. Blackhole (connections accepted, every byte dropped): the node turns Ready=Unknown
    //    and tainted, the member Reachable=False.
    s.proxy.set_blackhole(true);
    let cut = std::time::Instant::now();
    wait_for(Duration::from_secs(30), "virtual node Ready=Unknown with the unreachable taint", || {
        let (nodes, node) = (nodes.clone(), s.node.clone());
        async move {
            let n = nodes.get_opt(&node).await.ok()??;
            let (status, reason) = condition(&n, "Ready")?;
            (status == "Unknown" && reason == keys::REASON_MEMBER_UNREACHABLE && has_taint(&n, keys::TAINT_UNREACHABLE))
                .then_some(())
        }
    })
    .await;
    wait_for(Duration::from_secs(30), "MemberCluster Reachable=False and Ready=False", || async {
        let reachable = member_condition(&s.training, MEMBER, keys::CONDITION_REACHABLE).await?;
        let ready = member_condition(&s.training, MEMBER, keys::CONDITION_READY).await?;
        (reachable == "False" && ready == "False").then_some(())
    })
    .await;

    // 2. For the whole outage nothing is torn down: the node stays (NotReady, tainted), the
    //    offload pod is the same one, still Running, and the training pod still Running.
    //    Watched for the outage's whole length (not sampled): any change in between is seen.
    let member_ns = offload_ns(NS);
    let copies_api = Api::<Pod>::namespaced(s.member_b.clone(), &member_ns);
    let origin = format!("{}={}", keys::LABEL_ORIGIN_UID, s.origin_uid);
    let mut copies_watch = Box::pin(watcher(copies_api.clone(), watcher::Config::default().labels(&origin)));
    let node_field = format!("metadata.name={}", s.node);
    let mut node_watch = Box::pin(watcher(nodes.clone(), watcher::Config::default().fields(&node_field)));
    let worker_field = format!("metadata.name={}", s.worker);
    let mut worker_watch = Box::pin(watcher(pods.clone(), watcher::Config::default().fields(&worker_field)));
    // A pod for tidepool's scheduler that would fit the member: nothing new is placed on an
    // unreachable member, though the dispatcher looks at it (and says why it waits).
    let newcomer = format!("newcomer-{}", run_id());
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": newcomer},
        "spec": {
            "schedulerName": scheduler_name(TEST),
            "containers": [{"name": "main", "image": "example.invalid/trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let newcomer_field = format!("metadata.name={newcomer}");
    let mut newcomer_watch = Box::pin(watcher(pods.clone(), watcher::Config::default().fields(&newcomer_field)));
    let mut newcomer_explained = false;
    let (mut copy_events, mut node_events, mut worker_events) = (0usize, 0usize, 0usize);
    let held = async {
        loop {
            tokio::select! {
                e = copies_watch.next() => match e.expect("copies watch ended").expect("copies watch failed") {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                        copy_events += 1;
                        assert_eq!(p.metadata.uid.as_deref(), Some(s.offload_uid.as_str()), "another copy during the outage");
                        assert!(p.metadata.deletion_timestamp.is_none(), "copy deleted during the outage at {:?}", cut.elapsed());
                        assert_eq!(p.status.as_ref().and_then(|st| st.phase.as_deref()), Some("Running"));
                    }
                    watcher::Event::Delete(_) => panic!("copy gone during the outage at {:?}", cut.elapsed()),
                    _ => {}
                },
                e = node_watch.next() => match e.expect("node watch ended").expect("node watch failed") {
                    watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                        node_events += 1;
                        assert_eq!(condition(&n, "Ready").map(|c| c.0).as_deref(), Some("Unknown"), "at {:?}", cut.elapsed());
                        assert!(has_taint(&n, keys::TAINT_UNREACHABLE), "taint lifted during the outage at {:?}", cut.elapsed());
                    }
                    watcher::Event::Delete(_) => panic!("virtual node deleted during the outage at {:?}", cut.elapsed()),
                    _ => {}
                },
                e = worker_watch.next() => match e.expect("worker watch ended").expect("worker watch failed") {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                        worker_events += 1;
                        assert_eq!(p.status.and_then(|st| st.phase).as_deref(), Some("Running"), "at {:?}", cut.elapsed());
                    }
                    watcher::Event::Delete(_) => panic!("training pod deleted during the outage"),
                    _ => {}
                },
                e = newcomer_watch.next() => match e.expect("newcomer watch ended").expect("newcomer watch failed") {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                        let node = p.spec.as_ref().and_then(|sp| sp.node_name.clone());
                        assert_eq!(node, None, "a new pod placed on the unreachable member at {:?}", cut.elapsed());
                        let conditions = p.status.and_then(|st| st.conditions).unwrap_or_default();
                        newcomer_explained |= conditions.iter().any(|c| {
                            c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
                        });
                    }
                    watcher::Event::Delete(_) => panic!("new pod deleted during the outage"),
                    _ => {}
                },
            }
        }
    };
    let _ = tokio::time::timeout(OUTAGE.saturating_sub(cut.elapsed()), held).await;
    // Each watch delivered at least the object's state once: they were watching.
    assert!(copy_events > 0 && node_events > 0 && worker_events > 0, "{copy_events} {node_events} {worker_events}");
    assert!(newcomer_explained, "the dispatcher never looked at the new pod during the outage");

    // 3. Restored: node Ready, taint gone, member Ready, exactly the one offload pod. Every
    //    copy made from here on is seen (a watch started before the connection is back).
    let (added_tx, mut added_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let added = tokio::spawn({
        let (copies_api, origin) = (copies_api.clone(), origin.clone());
        async move {
            let mut stream = Box::pin(watcher(copies_api, watcher::Config::default().labels(&origin)));
            while let Some(e) = stream.next().await {
                if let watcher::Event::Apply(p) | watcher::Event::InitApply(p) =
                    e.expect("offload namespace watch failed")
                {
                    let _ = added_tx.send(p.metadata.uid.unwrap_or_default());
                }
            }
        }
    });
    let synced_before =
        metric_value(&s.tidepool.scrape_live(), "tidepool_sync_duration_seconds_count", "controller=\"pod\"")
            .unwrap_or(0.0);
    s.proxy.set_blackhole(false);
    wait_for(Duration::from_secs(90), "virtual node Ready again without the taint", || {
        let (nodes, node) = (nodes.clone(), s.node.clone());
        async move {
            let n = nodes.get_opt(&node).await.ok()??;
            (condition(&n, "Ready")?.0 == "True" && !has_taint(&n, keys::TAINT_UNREACHABLE)).then_some(())
        }
    })
    .await;
    wait_for(Duration::from_secs(60), "MemberCluster Ready again", || async {
        (member_condition(&s.training, MEMBER, keys::CONDITION_READY).await? == "True").then_some(())
    })
    .await;
    // Instead of waiting "long enough" for a duplicate: the pod sync has run again since the
    // member came back (a duplicate would be created by such a sync) and nothing is queued.
    wait_for(Duration::from_secs(60), "pods re-synced after the member came back", || {
        let text = s.tidepool.scrape();
        async move {
            let synced = metric_value(&text, "tidepool_sync_duration_seconds_count", "controller=\"pod\"")?;
            let queued = metric_value(&text, "tidepool_queue_depth", "queue=\"pod_triggers\"").unwrap_or(0.0);
            (synced > synced_before && queued == 0.0).then_some(())
        }
    })
    .await;
    added.abort();
    let mut uids = std::collections::BTreeSet::new();
    while let Ok(uid) = added_rx.try_recv() {
        uids.insert(uid);
    }
    let all = copies_api.list(&ListParams::default()).await.unwrap();
    let mut per_origin = std::collections::BTreeMap::<String, usize>::new();
    for p in &all.items {
        let uid = p.metadata.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_UID)).cloned().unwrap_or_default();
        *per_origin.entry(uid).or_default() += 1;
    }
    assert!(per_origin.values().all(|n| *n == 1), "duplicate offload pods after recovery: {per_origin:?}");
    // The only copy of the worker the watch saw since before the recovery is the old one.
    assert_eq!(uids, std::collections::BTreeSet::from([s.offload_uid.clone()]), "copies seen after recovery");
    let copies = offload_copies(&s.member_b, &s.origin_uid).await;
    assert_eq!(copies.len(), 1, "offload copies after recovery: {copies:?}");
    assert_eq!(copies[0].metadata.uid.as_deref(), Some(s.offload_uid.as_str()));
    assert_eq!(pods.get(&s.worker).await.unwrap().status.unwrap().phase.as_deref(), Some("Running"));
    // The member is back: the pod that waited is placed there now, and runs.
    wait_for(Duration::from_secs(60), "the waiting pod placed on the recovered member", || {
        let (pods, newcomer, node) = (pods.clone(), newcomer.clone(), s.node.clone());
        async move {
            let p = pods.get(&newcomer).await.ok()?;
            (p.spec?.node_name.as_deref() == Some(node.as_str()) && p.status?.phase.as_deref() == Some("Running"))
                .then_some(())
        }
    })
    .await;
    pods.delete(&newcomer, &DeleteParams::default()).await.unwrap();
    wait_for(Duration::from_secs(60), "waiting pod deleted", || {
        let (pods, newcomer) = (pods.clone(), newcomer.clone());
        async move { pods.get_opt(&newcomer).await.ok()?.is_none().then_some(()) }
    })
    .await;

    teardown(&s, NS, MEMBER).await;
    drop(s);
}

#[tokio::test]
async fn a_member_lost_past_the_timeout_fails_its_pods_and_cleans_up_on_return() {
    const TEST: &str = "failover-lost";
    const NS: &str = "e2e-failover-lost";
    const MEMBER: &str = "e2e-fol-b";
    let s = setup(TEST, NS, MEMBER, "memberLossTimeoutSeconds: 5").await;
    let pods = Api::<Pod>::namespaced(s.training.clone(), NS);

    // 1. Past the loss timeout the training pod fails MemberLost, with an Event.
    s.proxy.set_blackhole(true);
    let status = wait_for(Duration::from_secs(45), "training pod Failed with reason MemberLost", || {
        let (pods, worker) = (pods.clone(), s.worker.clone());
        async move {
            let st = pods.get(&worker).await.ok()?.status?;
            (st.phase.as_deref() == Some("Failed") && st.reason.as_deref() == Some(keys::REASON_MEMBER_LOST))
                .then_some(st)
        }
    })
    .await;
    assert!(status.message.unwrap_or_default().contains(MEMBER));
    let events = Api::<Event>::namespaced(s.training.clone(), NS);
    wait_for(Duration::from_secs(20), "MemberLost Event", || {
        let (events, worker) = (events.clone(), s.worker.clone());
        async move {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some(keys::REASON_MEMBER_LOST)
                        && e.involved_object.name.as_deref() == Some(&worker)
                })
                .then_some(())
        }
    })
    .await;
    // The member was not reachable: its copy is still there.
    let copies = offload_copies(&s.member_b, &s.origin_uid).await;
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(copies[0].metadata.uid.as_deref(), Some(s.offload_uid.as_str()));

    // 2. Back: the copy of the failed pod is deleted, and the pod stays Failed.
    s.proxy.set_blackhole(false);
    wait_for(Duration::from_secs(90), "offload copy of the lost pod deleted", || async {
        offload_copies(&s.member_b, &s.origin_uid).await.is_empty().then_some(())
    })
    .await;
    let st = pods.get(&s.worker).await.unwrap().status.unwrap();
    assert_eq!((st.phase.as_deref(), st.reason.as_deref()), (Some("Failed"), Some(keys::REASON_MEMBER_LOST)));

    teardown(&s, NS, MEMBER).await;
    drop(s);
}
