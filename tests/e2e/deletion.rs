//! A mass deletion of offloaded pods: each copy is deleted in the member exactly once, and no
//! member DELETE answers 404 (a copy already gone), during the deletion or after it, however
//! far the member's watch lags behind the deletions. Counted from member-a's audit log, what
//! its API server saw, not from tidepool's own counters.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use crate::harness::*;

const TEST: &str = "deletion";
const NS: &str = "e2e-deletion";
const MEMBER: &str = "e2e-deletion-a";
const NODE: &str = "tidepool-e2e-deletion-a";
const PODS: usize = 300;

/// tidepool's DELETEs of pods in the offload namespace since `since`, from member-a's audit
/// log: pod name → the codes the API server answered, in order.
fn member_deletes(env: &Env, since: jiff::Timestamp) -> BTreeMap<String, Vec<u16>> {
    let mut deletes: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    let ns = offload_ns(NS);
    for w in audited_writes(env, "member-a", since) {
        if w.verb == "delete" && w.resource == "pods" && w.namespace == ns {
            deletes.entry(w.name).or_default().push(w.code);
        }
    }
    deletes
}

#[tokio::test]
async fn a_mass_deletion_deletes_each_copy_once_and_never_a_copy_already_gone() {
    let env = Env::load();
    let training = env.client("training").await;
    prepare(&env, &training, TEST, NS).await;
    bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
    let tidepool = Tidepool::start(&env, TEST, NS);
    let nodes = Api::<Node>::all(training.clone());
    wait_for(Duration::from_secs(60), "virtual node", || {
        let nodes = nodes.clone();
        async move { nodes.get_opt(NODE).await.ok().flatten() }
    })
    .await;

    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let run = run_id();
    for i in 0..PODS {
        pods.create(&PostParams::default(), &small_bound_pod(&format!("mass-{run}-{i}"), NODE, "mass")).await.unwrap();
    }
    wait_for(Duration::from_secs(120), "every pod Running", || {
        let pods = pods.clone();
        async move {
            let listed = pods.list(&ListParams::default().labels("app=mass")).await.ok()?;
            let running =
                listed.items.iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"));
            (running.count() == PODS).then_some(())
        }
    })
    .await;
    let since = jiff::Timestamp::now();

    // All at once, each with its grace period, as `kubectl delete pods --all` does.
    pods.delete_collection(&DeleteParams::default(), &ListParams::default().labels("app=mass")).await.unwrap();
    wait_for(Duration::from_secs(120), "every training pod gone", || {
        let pods = pods.clone();
        async move { pods.list(&ListParams::default().labels("app=mass")).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    // What follows the last pod (the collector's look at each gone pod) must be counted too:
    // wait until tidepool's member DELETEs in the audit log stop moving for 5 s.
    let mut last = usize::MAX;
    let settled = wait_for(Duration::from_secs(90), "member DELETEs settled", || {
        let deletes = member_deletes(&env, since);
        let now = deletes.values().map(Vec::len).sum::<usize>();
        let same = now == last;
        last = now;
        async move {
            if !same {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            same.then_some(deletes)
        }
    })
    .await;
    let gone: Vec<_> = settled.iter().filter(|(_, codes)| codes.contains(&404)).collect();
    assert!(gone.is_empty(), "member DELETEs of copies already gone: {gone:?}\n{}", tidepool.log_tail());
    let twice: Vec<_> = settled.iter().filter(|(_, codes)| codes.len() > 1).collect();
    assert!(twice.is_empty(), "copies deleted more than once: {twice:?}");
    let ok = settled.values().filter(|codes| codes.iter().all(|c| (200..300).contains(c))).count();
    assert_eq!(
        ok,
        PODS,
        "each of the {PODS} copies deleted once with 2xx; the audit log shows {} copies",
        settled.len()
    );
}
