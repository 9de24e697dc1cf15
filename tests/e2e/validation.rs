//! Validation at apply time: the real training API server, with the CRD tidepool ships,
//! refuses each invalid `MemberCluster` field at `kubectl apply` with a message naming the
//! field; what only the controller can judge is still accepted and reported `InvalidSpec`.

use std::time::Duration;

use serde_json::{Value, json};
use tidepool_api::MemberCluster;

use crate::harness::*;

const TEST: &str = "validation";
const NS: &str = "e2e-validation";

/// A valid MemberCluster named `name`, with `spec` merged over a minimal spec.
fn member(name: &str, spec: Value) -> String {
    let mut base = json!({
        "apiVersion": "tidepool.io/v1alpha1", "kind": "MemberCluster",
        "metadata": {"name": name, "labels": {"tidepool.io/test": TEST}},
        "spec": {"kubeconfigSecretRef": {"name": "member-kubeconfig", "namespace": NS}}
    });
    if let (Some(base_spec), Some(extra)) = (base["spec"].as_object_mut(), spec.as_object()) {
        for (k, v) in extra {
            base_spec.insert(k.clone(), v.clone());
        }
    }
    base.to_string()
}

#[tokio::test]
async fn each_invalid_field_is_refused_at_apply_time_with_its_name() {
    let env = Env::load();
    let training = env.client("training").await;
    prepare(&env, &training, TEST, NS).await;

    let window = |w: Value| {
        let mut base =
            json!({"name": "peak", "schedule": "0 17 * * 1-5", "durationMinutes": 60, "reserve": {"cpu": "1"}});
        for (k, v) in w.as_object().unwrap() {
            base[k] = v.clone();
        }
        json!({"capacity": {"windows": [base]}})
    };
    let pool = |p: Value| json!({"pools": [p]});
    // (metadata.name, spec fields, the field the refusal must name)
    let cases: Vec<(&str, Value, &str)> = vec![
        ("e2e-val.dotted", json!({}), "metadata.name"),
        ("e2e-val", json!({"kubeconfigSecretRef": {"name": "Not_A_Secret"}}), "spec.kubeconfigSecretRef.name"),
        ("e2e-val", json!({"kubeconfigSecretRef": {"name": "s", "key": "a key"}}), "spec.kubeconfigSecretRef.key"),
        ("e2e-val", json!({"namespacePrefix": "kube-"}), "spec.namespacePrefix"),
        ("e2e-val", json!({"namespacePrefix": "tp"}), "spec.namespacePrefix"),
        ("e2e-val", json!({"capacity": {"reserve": {"cpu": "lots"}}}), "spec.capacity.reserve[cpu]"),
        ("e2e-val", json!({"capacity": {"reserve": {"memory": "-1Gi"}}}), "spec.capacity.reserve[memory]"),
        ("e2e-val", json!({"capacity": {"watermarkPercent": 0}}), "spec.capacity.watermarkPercent"),
        ("e2e-val", json!({"capacity": {"watermarkPercent": 101}}), "spec.capacity.watermarkPercent"),
        ("e2e-val", json!({"capacity": {"hpaHeadroomPercent": 5000}}), "spec.capacity.hpaHeadroomPercent"),
        ("e2e-val", window(json!({"schedule": "every day"})), "spec.capacity.windows[0].schedule"),
        ("e2e-val", window(json!({"schedule": "0 17 * *"})), "spec.capacity.windows[0].schedule"),
        ("e2e-val", window(json!({"timeZone": "not a zone"})), "spec.capacity.windows[0].timeZone"),
        ("e2e-val", window(json!({"durationMinutes": 0})), "spec.capacity.windows[0].durationMinutes"),
        ("e2e-val", window(json!({"leadSeconds": 100_000})), "spec.capacity.windows[0].leadSeconds"),
        (
            "e2e-val",
            window(json!({"reserve": {"nvidia.com/gpu": "two"}})),
            "spec.capacity.windows[0].reserve[nvidia.com/gpu]",
        ),
        ("e2e-val", pool(json!({"name": "GPU"})), "spec.pools[0].name"),
        ("e2e-val", json!({"pools": [{"name": "gpu"}, {"name": "gpu"}]}), "spec.pools[1]"),
        (
            "e2e-val",
            pool(json!({"name": "p", "tolerations": [{"key": "k", "operator": "Maybe"}]})),
            "spec.pools[0].tolerations[0].operator",
        ),
        (
            "e2e-val",
            pool(json!({"name": "p", "tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]})),
            "spec.pools[0].tolerations[0]",
        ),
        ("e2e-val", pool(json!({"name": "p", "tolerations": [{"value": "v"}]})), "spec.pools[0].tolerations[0]"),
        (
            "e2e-val",
            pool(json!({"name": "p", "tolerations": [{"key": "k", "effect": "Sometimes"}]})),
            "spec.pools[0].tolerations[0].effect",
        ),
        (
            "e2e-val",
            pool(json!({"name": "p", "runtimeClassNames": ["Bad Class"]})),
            "spec.pools[0].runtimeClassNames[0]",
        ),
        ("e2e-val", json!({"copyLabels": ["tidepool.io/band"]}), "spec.copyLabels[0]"),
        ("e2e-val", json!({"copyAnnotations": ["x.tidepool.io/*"]}), "spec.copyAnnotations[0]"),
        ("e2e-val", json!({"rateLimits": {"qps": 0}}), "spec.rateLimits.qps"),
    ];
    let mut failures = Vec::new();
    for (name, spec, field) in &cases {
        let text = member(name, spec.clone());
        let (code, out, err) = kubectl(&env, "training", &["apply", "--dry-run=server", "-f", "-"], Some(&text)).await;
        if code == 0 || !err.contains(field) {
            failures.push(format!("{field}: exit {code}, {out}{err}"));
        }
    }
    assert!(failures.is_empty(), "not refused with the field named:\n{}", failures.join("\n"));

    // A spec the schema cannot fault is accepted...
    let good = member(
        "e2e-val-good",
        json!({"namespacePrefix": "lend-", "capacity": {"reserve": {"cpu": 2, "memory": "4Gi"}, "watermarkPercent": 80,
               "windows": [{"name": "peak", "schedule": "*/15 9-17 ? * MON-FRI", "timeZone": "Europe/Paris",
                            "durationMinutes": 30, "leadSeconds": 600,
                            "reserve": {"nvidia.com/gpu": "4"}}]},
               "pools": [{"name": "gpu", "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]},
                         {"name": "cpu"}],
               "copyLabels": ["app.kubernetes.io/*"]}),
    );
    let (code, _, err) = kubectl(&env, "training", &["apply", "--dry-run=server", "-f", "-"], Some(&good)).await;
    assert_eq!(code, 0, "a valid MemberCluster was refused: {err}");

    // ...and one whose fault only the controller sees (a minute that does not exist) is
    // applied and reported InvalidSpec, naming the field.
    let late = member("e2e-val-late", window(json!({"schedule": "61 17 * * *"})));
    let (code, _, err) = kubectl(&env, "training", &["apply", "-f", "-"], Some(&late)).await;
    assert_eq!(code, 0, "{err}");
    let _tidepool = Tidepool::start(&env, TEST, NS);
    let api = kube::Api::<MemberCluster>::all(training.clone());
    let message = wait_for(Duration::from_secs(60), "InvalidSpec for the minute 61", || {
        let api = api.clone();
        async move {
            let mc = api.get("e2e-val-late").await.ok()?;
            let ready = mc.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
            (ready.reason == "InvalidSpec").then_some(ready.message)
        }
    })
    .await;
    assert!(message.contains("spec.capacity.windows[0].schedule"), "{message}");
}
