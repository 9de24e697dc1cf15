//! Topology end to end: a gang is planned into one rack of its pool, and the plan travels with
//! its copies as node affinity, so the member's scheduler lands it there (or leaves a copy
//! Pending, with its own reason, and the gang timeout rolls the gang back whole).
//!
//! The pool is made for the test: sixteen 1-GPU kwok nodes in member-a, two racks of eight in
//! one zone, selected by their own `tidepool.io/test-pool` label; they are removed at the end
//! (or when the test fails part-way), so member-a's other pools see only their own nodes.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tidepool_api::crd::PoolSpec;
use tidepool_api::keys;

use crate::dispatcher::occupy;
use crate::harness::*;

const ZONE: &str = "topology.kubernetes.io/zone";
const RACK: &str = "example.com/rack";
const MEMBER: &str = "member-a";

/// The two racks' kwok nodes in member-a, deleted when dropped.
struct Racks {
    api: Api<Node>,
    names: Vec<String>,
    kubectl: Vec<String>,
    removed: bool,
}

impl Racks {
    /// Creates `topo-<rack>-<i>` for racks r1 and r2, eight 1-GPU nodes each, labelled with
    /// the zone, the rack and `tidepool.io/test-pool=<test>`, and waits until kwok has them
    /// Ready.
    async fn create(env: &Env, test: &str) -> Racks {
        let member = env.client(MEMBER).await;
        let api = Api::<Node>::all(member);
        let mut names = Vec::new();
        for rack in ["r1", "r2"] {
            for i in 0..8 {
                names.push(format!("topo-{rack}-{i}"));
            }
        }
        let kubectl = vec![
            env.var("KUBECTL").to_owned(),
            "--kubeconfig".to_owned(),
            env.kubeconfig_path(MEMBER).display().to_string(),
        ];
        let racks = Racks { api: api.clone(), names: names.clone(), kubectl, removed: false };
        // What an earlier, failed run left goes first: its labels may differ.
        racks.delete_and_wait().await;
        for name in &names {
            let rack = &name[5..7];
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": name, "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                             "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        "tidepool.io/test-pool": test, ZONE: "z1", RACK: rack,
                                        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                "spec": {"providerID": format!("kwok://{name}")},
                "status": {
                    "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"},
                    "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"}
                }
            }))
            .unwrap();
            api.create(&PostParams::default(), &node).await.unwrap();
        }
        wait_for(Duration::from_secs(60), "rack nodes Ready", || {
            let (api, names) = (api.clone(), names.clone());
            async move {
                for n in &names {
                    let node = api.get(n).await.ok()?;
                    let ready = node.status?.conditions?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
                    if !ready {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await;
        racks
    }

    async fn delete_and_wait(&self) {
        for n in &self.names {
            let _ = self.api.delete(n, &DeleteParams::default()).await;
        }
        wait_for(Duration::from_secs(60), "rack nodes deleted", || async move {
            for n in &self.names {
                if self.api.get_opt(n).await.ok()?.is_some() {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }

    async fn remove(mut self) {
        self.delete_and_wait().await;
        self.removed = true;
    }
}

impl Drop for Racks {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let _ = std::process::Command::new(&self.kubectl[0])
            .args(&self.kubectl[1..])
            .args(["delete", "node", "--wait=false"])
            .args(&self.names)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Member-a with one pool over the racks, topology `[zone, rack]`, and a tidepool for `test`
/// (`dispatcher` settings as in [`Tidepool::start_with`]); returns the training client, the
/// tidepool and the virtual node's name once it lends `gpus` GPUs.
async fn setup(env: &Env, test: &str, ns: &str, dispatcher: &str, gpus: i64) -> (Client, Tidepool, String) {
    let training = env.client("training").await;
    prepare(env, &training, test, ns).await;
    let kubeconfig = std::fs::read(env.kubeconfig_path(MEMBER)).unwrap();
    put_kubeconfig_secret(&training, ns, MEMBER, &kubeconfig).await;
    let name = format!("{test}-{MEMBER}");
    let mut mc = member_cluster(&name, test, ns, MEMBER);
    mc.spec.pools = vec![PoolSpec {
        name: "racks".into(),
        node_selector: BTreeMap::from([("tidepool.io/test-pool".to_owned(), test.to_owned())]),
        topology: vec![ZONE.to_owned(), RACK.to_owned()],
        ..Default::default()
    }];
    apply_member_cluster(&training, &mc).await;
    let tidepool = Tidepool::start_with(env, test, ns, dispatcher);
    let node = format!("tidepool-{name}-racks");
    crate::dispatcher::wait_lends_at_least(&training, &node, gpus).await;
    (training, tidepool, node)
}

/// `n` 1-GPU pods of annotation gang `gang` (all core), each mounting ConfigMap `config`.
fn gang_pods(gang: &str, n: usize, scheduler: &str, config: &str) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            serde_json::from_value(json!({
                "metadata": {"name": format!("{gang}-{i}"),
                             "annotations": {keys::ANNOTATION_GANG: gang, keys::ANNOTATION_MIN_MEMBER: n.to_string()}},
                "spec": {
                    "schedulerName": scheduler,
                    "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                    "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}},
                                    "volumeMounts": [{"name": "config", "mountPath": "/etc/job"}]}],
                    "volumes": [{"name": "config", "configMap": {"name": config}}]
                }
            }))
            .unwrap()
        })
        .collect()
}

async fn create_config_map(training: &Client, ns: &str, name: &str) {
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name}, "data": {"job": "train"}})).unwrap();
    Api::<ConfigMap>::namespaced(training.clone(), ns).create(&PostParams::default(), &cm).await.unwrap();
}

/// The training pods of `names` once every one is bound, with their annotations.
async fn bound(pods: &Api<Pod>, names: &[String]) -> Vec<Pod> {
    wait_for(Duration::from_secs(60), &format!("bound: {names:?}"), || async move {
        let mut out = Vec::new();
        for n in names {
            let p = pods.get(n).await.ok()?;
            p.spec.as_ref()?.node_name.as_ref()?;
            out.push(p);
        }
        Some(out)
    })
    .await
}

/// Required node affinity of a copy as `key → values`, and its preferred node names.
fn copy_affinity(copy: &Pod) -> (BTreeMap<String, Vec<String>>, Vec<String>) {
    let node = copy.spec.as_ref().and_then(|s| s.affinity.as_ref()).and_then(|a| a.node_affinity.as_ref());
    let required = node
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|r| r.node_selector_terms.iter().flat_map(|t| t.match_expressions.iter().flatten()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.key.clone(), e.values.clone().unwrap_or_default()))
        .collect();
    let preferred = node
        .and_then(|n| n.preferred_during_scheduling_ignored_during_execution.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|p| p.preference.match_fields.iter().flatten())
        .filter(|f| f.key == "metadata.name")
        .flat_map(|f| f.values.clone().unwrap_or_default())
        .collect();
    (required, preferred)
}

#[tokio::test]
async fn a_gang_lands_wholly_on_the_free_rack_and_its_copies_carry_the_affinity() {
    let env = Env::load();
    let test = "topo-land";
    let ns = "e2e-topo-land";
    let racks = Racks::create(&env, test).await;
    // Rack r1 fragmented: online pods hold five of its eight GPUs. 11 GPUs free in the pool,
    // 3 of them in r1: an 8-GPU gang fits rack r2 only.
    let taken: Vec<(String, u32)> = (0..5).map(|i| (format!("topo-r1-{i}"), 1)).collect();
    let taken: Vec<(&str, u32)> = taken.iter().map(|(n, g)| (n.as_str(), *g)).collect();
    let online = occupy(&env, MEMBER, test, &taken).await;
    let (training, _tp, node) = setup(&env, test, ns, "", 11).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    let config = format!("cfg-{id}");
    create_config_map(&training, ns, &config).await;
    let gang = format!("land-{id}");
    let mut names = Vec::new();
    for p in gang_pods(&gang, 8, &scheduler_name(test), &config) {
        names.push(p.name_any());
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    let placed = bound(&pods, &names).await;
    let want_domain = format!("{ZONE}=z1,{RACK}=r2");
    let mut planned = BTreeMap::new();
    for p in &placed {
        assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some(node.as_str()));
        assert_eq!(p.annotations().get(keys::ANNOTATION_PLANNED_DOMAIN), Some(&want_domain), "{}", p.name_any());
        let planned_node = p.annotations()[keys::ANNOTATION_PLANNED_NODE].clone();
        assert!(planned_node.starts_with("topo-r2-"), "{}: planned on {planned_node}", p.name_any());
        planned.insert(p.name_any(), planned_node);
    }
    // The copies land in rack r2, each with the domain required and its planned node preferred.
    let member = env.client(MEMBER).await;
    let copies = Api::<Pod>::namespaced(member, &offload_ns(ns));
    let landed: Vec<Pod> = wait_for(Duration::from_secs(90), "all copies on member nodes", || {
        let (copies, names) = (copies.clone(), names.clone());
        async move {
            let mut out = Vec::new();
            for n in &names {
                let c = copies.get(n).await.ok()?;
                c.spec.as_ref()?.node_name.as_ref()?;
                out.push(c);
            }
            Some(out)
        }
    })
    .await;
    for c in &landed {
        let on = c.spec.as_ref().unwrap().node_name.clone().unwrap();
        assert!(on.starts_with("topo-r2-"), "copy {} landed on {on}, outside rack r2", c.name_any());
        let (required, preferred) = copy_affinity(c);
        let want: BTreeMap<String, Vec<String>> =
            BTreeMap::from([(ZONE.to_owned(), vec!["z1".to_owned()]), (RACK.to_owned(), vec!["r2".to_owned()])]);
        assert_eq!(required, want, "copy {}", c.name_any());
        assert_eq!(preferred, vec![planned[&c.name_any()].clone()], "copy {}", c.name_any());
    }
    clear_pods(&training, ns).await;
    wait_for(Duration::from_secs(60), "copies removed", || {
        let copies = copies.clone();
        async move { copies.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    online.release().await;
    racks.remove().await;
}

#[tokio::test]
async fn a_gang_whose_planned_node_is_taken_before_its_copies_exist_waits_pending_and_is_rolled_back_whole() {
    let env = Env::load();
    let test = "topo-taken";
    let ns = "e2e-topo-taken";
    let racks = Racks::create(&env, test).await;
    // Rack r1 fragmented as above: the 8-GPU gang fills rack r2 exactly.
    let taken: Vec<(String, u32)> = (0..5).map(|i| (format!("topo-r1-{i}"), 1)).collect();
    let taken: Vec<(&str, u32)> = taken.iter().map(|(n, g)| (n.as_str(), *g)).collect();
    let online = occupy(&env, MEMBER, test, &taken).await;
    let (training, _tp, _node) = setup(&env, test, ns, "gangTimeoutSeconds: 60", 11).await;
    let pods = Api::<Pod>::namespaced(training.clone(), ns);
    let id = run_id();
    // The ConfigMap the pods mount does not exist yet: the pod sync holds their copies back
    // until it does, which opens the window between plan and copy.
    let config = format!("cfg-{id}");
    let gang = format!("taken-{id}");
    let mut names = Vec::new();
    for p in gang_pods(&gang, 8, &scheduler_name(test), &config) {
        names.push(p.name_any());
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    let placed = bound(&pods, &names).await;
    let victim = placed[0].annotations()[keys::ANNOTATION_PLANNED_NODE].clone();
    assert!(victim.starts_with("topo-r2-"), "planned on {victim}");
    // An online pod takes that node's GPU; then the copies may be made.
    let late = occupy(&env, MEMBER, &format!("{test}-late"), &[(victim.as_str(), 1)]).await;
    create_config_map(&training, ns, &config).await;
    // Seven copies land in r2; the eighth has no room left there and the required domain keeps
    // it off rack r1's free nodes: it stays Pending, and its training pod shows the member's
    // scheduler's reason.
    let (pending, message) =
        wait_for(Duration::from_secs(60), "a training pod Pending with the member's reason", || {
            let (pods, names) = (pods.clone(), names.clone());
            async move {
                for n in &names {
                    let p = pods.get(n).await.ok()?;
                    let conditions = p.status.and_then(|s| s.conditions).unwrap_or_default();
                    let unschedulable = conditions.into_iter().find(|c| {
                        c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
                    });
                    let message = unschedulable.and_then(|c| c.message).unwrap_or_default();
                    if message.contains("nodes are available") {
                        return Some((n.clone(), message));
                    }
                }
                None
            }
        })
        .await;
    // The member's own words: rack r2 is full, and the other nodes are outside the domain.
    assert!(message.contains("Insufficient nvidia.com/gpu"), "{pending}: {message}");
    assert!(message.contains("didn't match Pod's node affinity"), "{pending}: {message}");
    let member = env.client(MEMBER).await;
    let copies = Api::<Pod>::namespaced(member, &offload_ns(ns));
    let outside: Vec<String> = copies
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|c| c.spec.as_ref()?.node_name.clone())
        .filter(|n| !n.starts_with("topo-r2-"))
        .collect();
    assert!(outside.is_empty(), "copies landed outside rack r2: {outside:?}");
    // At the timeout the gang is rolled back whole: every pod, the running ones too.
    for n in &names {
        let msg = wait_rolled_back(&pods, n).await;
        assert!(msg.contains("7 of its 8 pods running"), "{msg}");
    }
    wait_for(Duration::from_secs(60), "copies removed", || {
        let copies = copies.clone();
        async move { copies.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    clear_pods(&training, ns).await;
    late.release().await;
    online.release().await;
    racks.remove().await;
}
