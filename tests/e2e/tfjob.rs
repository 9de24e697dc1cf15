//! A TFJob as the Kubeflow training-operator runs it (chief, 2 parameter servers, 2 workers,
//! `TF_CONFIG` naming `<job>-<type>-<i>.<namespace>.svc:2222`), real TensorFlow
//! ParameterServerStrategy processes (tests/frameworks/tf_ps.py) on member-a's real node:
//! it trains (the loss falls, read with `kubectl logs` through the training cluster); member-a
//! takes its node back: every pod gets the notice, the chief saves and every process acks
//! from inside its pod (`Failed`, `Reclaimed`, `DisruptionTarget`, exit code 143, which the
//! `ExitCode` policy restarts); the operator makes the pods again under their names, tidepool
//! places them on member-b, where the same FQDNs resolve (same-named namespaces); the chief
//! resumes from its saved step, and the TFJob ends `Succeeded`.

use std::time::Duration;

use kube::ResourceExt;
use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "tfjob";
const NS: &str = "e2e-tfjob";

#[tokio::test]
async fn a_tfjob_trains_is_reclaimed_with_the_notice_and_resumes_on_the_other_member_to_success() {
    let b = Bridge::start(TEST, NS).await;
    let _operator = Operator::start(&b.env, "training-operator", &[&format!("--namespace={NS}")]).await;
    let id = run_id();
    let name = format!("tf-{id}");
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    // member-b lends nothing yet: the job starts on member-a.
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("kubeflow.org", "v1", "TFJob", "tfjobs");
    // 300 steps: the reclaim comes some 50 steps in (4 logged steps and the notice), and the
    // rest runs on member-b (about 2 steps a second there beside the other lane's tests).
    b.submit(&jobs, tfjob(&name, &scheduler_name(TEST), &store, (2, 2), 300)).await;
    let selector = format!("training.kubeflow.org/job-name={name}");
    let (on_a, on_b) = (real_node(TEST, 0), real_node(TEST, 1));
    let first = b.await_running(&selector, 5, &on_a).await;
    for p in &first {
        println!(
            "{} on {}: band {:?}, role {:?}",
            p.name_any(),
            node_of(p),
            p.labels().get(keys::LABEL_BAND),
            p.labels().get(keys::LABEL_ROLE)
        );
    }
    assert!(
        first.iter().all(|p| p.labels().get(keys::LABEL_ROLE).map(String::as_str) == Some(keys::ROLE_CORE)),
        "the whole TFJob is one gang, its core (no annotation of tidepool's)"
    );
    let chief = format!("{name}-chief-0");
    let before = b.await_steps(&chief, None, 4).await;
    println!("chief on member-a: {before:?}");
    assert!(before.last().unwrap().1 < before.first().unwrap().1, "the loss falls: {before:?}");

    // member-a takes its real node back; member-b has room.
    let uids: Vec<String> = first.iter().filter_map(|p| p.metadata.uid.clone()).collect();
    let seen = b.watch(&selector);
    let reclaim_started = jiff::Timestamp::now();
    b.lend(1, None).await;
    b.lend(0, Some(0)).await;
    let reclaimed =
        seen.await_ended(&uids, keys::REASON_RECLAIMED, "every pod of the TFJob reclaimed from member-a").await;
    let mut saved = 0;
    for p in &reclaimed {
        let ack = acked_step(p);
        println!(
            "{}: {} ({:?}), ack at step {ack:?}",
            p.name_any(),
            reason(p),
            condition_reason(p, "DisruptionTarget")
        );
        assert_eq!(condition_reason(p, "DisruptionTarget").as_deref(), Some(keys::REASON_DISRUPTION_RECLAIM));
        assert!(ack.is_some(), "{} acked from inside its pod", p.name_any());
        if p.name_any() == chief {
            saved = ack.unwrap_or_default();
        }
    }
    assert!(saved >= before.last().unwrap().0, "the chief saved at or after the last step it logged");

    // The operator makes the pods again (ExitCode policy: 143 is retryable); they run on member-b.
    let again = b.await_running(&selector, 5, &on_b).await;
    assert!(again.iter().all(|p| !uids.contains(p.metadata.uid.as_ref().unwrap())), "new pods");
    // From member-a's API server (its audit log of tidepool's writes): once the reclaim began,
    // tidepool made no copy of a pod of the job there again, so none could be bound there (the
    // operator's new pods wait for the whole gang and go to member-b; they once followed their
    // noticed peers back onto member-a, generation after generation).
    let back_on_a: Vec<String> = audited_writes(&b.env, "member-a", reclaim_started)
        .into_iter()
        .filter(|w| w.resource == "pods" && w.verb == "create" && w.name.starts_with(&name))
        .map(|w| w.what())
        .collect();
    assert!(back_on_a.is_empty(), "pods of the job made again in member-a during its reclaim: {back_on_a:?}");
    let after = b.await_steps(&chief, None, 2).await;
    let log = b.log(&chief, None).await;
    println!("chief on member-b: resumed at {:?}, {after:?}", resumed_at(&log));
    assert_eq!(resumed_at(&log), Some(saved), "the chief resumed from the step it acked");
    assert!(after[0].0 > saved, "the steps go on from there: {after:?}");
    b.await_condition(&jobs, &name, "Succeeded", Duration::from_secs(600)).await;
    assert_ne!(b.condition(&jobs, &name, "Failed").await.as_deref(), Some("True"));
}
