//! A mass deletion of offloaded pods: each copy is deleted in the member exactly once, and no
//! member DELETE answers 404 (a copy already gone), during the deletion or after it, however
//! far the member's watch lags behind the deletions.

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

/// tidepool's member DELETEs of pods so far, answered with `code` (`2xx`, `404`).
fn member_deletes(text: &str, code: &str) -> f64 {
    metric_sum(
        text,
        "tidepool_api_requests_total",
        &[&format!("cluster=\"{MEMBER}\""), "verb=\"delete\"", "resource=\"pods\"", &format!("code=\"{code}\"")],
    )
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
    let before = tidepool.scrape_live();
    let (ok_before, gone_before) = (member_deletes(&before, "2xx"), member_deletes(&before, "404"));

    // All at once, each with its grace period, as `kubectl delete pods --all` does.
    pods.delete_collection(&DeleteParams::default(), &ListParams::default().labels("app=mass")).await.unwrap();
    wait_for(Duration::from_secs(120), "every training pod gone", || {
        let pods = pods.clone();
        async move { pods.list(&ListParams::default().labels("app=mass")).await.ok()?.items.is_empty().then_some(()) }
    })
    .await;
    // What follows the last pod (the collector's look at each gone pod) must be counted too:
    // wait until tidepool's member DELETEs stop moving for 5 s.
    let mut last = f64::NAN;
    let settled = wait_for(Duration::from_secs(90), "member DELETEs settled", || {
        let text = tidepool.scrape_live();
        let now = member_deletes(&text, "2xx") + member_deletes(&text, "404");
        let same = now == last;
        last = now;
        async move {
            if !same {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            same.then_some(text)
        }
    })
    .await;
    let ok = member_deletes(&settled, "2xx") - ok_before;
    let gone = member_deletes(&settled, "404") - gone_before;
    assert_eq!(gone, 0.0, "tidepool sent {gone} member DELETEs for copies already gone:\n{}", tidepool.log_tail());
    assert_eq!(ok, PODS as f64, "each of the {PODS} copies deleted once; member DELETEs answered 2xx: {ok}");
}
