//! An MPIJob v2 as mpi-operator runs it, started with `--gang-scheduling=<tidepool's name>` (it
//! then writes that `schedulerName` into every pod and makes a `scheduling.x-k8s.io` PodGroup,
//! which is the gang tidepool reads): a launcher and 2 workers from the frameworks image,
//! `mpirun` reaching the workers over SSH by the hostfile's names
//! (`<job>-worker-<i>.<job>.<namespace>.svc`, resolved by member-a's DNS through the mirrored
//! headless Service and the same-named namespace); mpi4py all-reduce SGD trains to the end
//! and the MPIJob is `Succeeded`.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::ListParams;
use serde_json::json;
use tidepool_api::keys;

use crate::harness::*;
use crate::operators::*;

const TEST: &str = "mpijob";
const NS: &str = "e2e-mpijob";

fn mpijob(name: &str, store: &str, steps: u32) -> serde_json::Value {
    let env = json!([{"name": "TP_STEPS", "value": steps.to_string()}, {"name": "TP_STEP_DELAY_MS", "value": "20"}]);
    let mut launcher = framework_container("launcher", "mpi_allreduce.py", store, env.clone());
    launcher["command"] = json!([
        "mpirun",
        "--allow-run-as-root",
        "-np",
        "2",
        "-x",
        "TP_STORE",
        "-x",
        "TP_STEPS",
        "-x",
        "TP_STEP_DELAY_MS",
        "-x",
        "TIDEPOOL_ACK_EXIT_CODE",
        "python3",
        "/opt/tidepool/mpi_allreduce.py"
    ]);
    let mut worker = framework_container("worker", "mpi_allreduce.py", store, env);
    worker["command"] = json!(["/opt/tidepool/sshd.sh"]);
    json!({
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name},
        "spec": {
            "slotsPerWorker": 1,
            "runPolicy": {"cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [launcher]}}},
                "Worker": {"replicas": 2, "template": {"spec": {"containers": [worker]}}}
            }
        }
    })
}

#[tokio::test]
async fn an_mpijob_runs_mpirun_over_ssh_through_the_members_dns_to_success() {
    let b = Bridge::start(TEST, NS).await;
    let scheduler = scheduler_name(TEST);
    let flags = [format!("--gang-scheduling={scheduler}"), format!("--namespace={NS}")];
    let _operator = Operator::start(&b.env, "mpi-operator", &[&flags[0], &flags[1]]).await;
    let name = format!("pi-{}", run_id());
    let store = format!("{}/ckpt/{name}", b.env.var("CHECKPOINT_STORE"));
    b.lend(1, Some(0)).await;
    let jobs = b.jobs("kubeflow.org", "v2beta1", "MPIJob", "mpijobs");
    b.submit(&jobs, mpijob(&name, &store, 300)).await;
    let selector = format!("training.kubeflow.org/job-name={name}");
    let pods = b.await_running(&selector, 3, &real_node(TEST, 0)).await;
    for p in &pods {
        println!(
            "{} {:?} band {:?}",
            p.name_any(),
            p.labels().get("training.kubeflow.org/job-role"),
            p.labels().get(keys::LABEL_BAND)
        );
        assert_eq!(p.spec.as_ref().unwrap().scheduler_name.as_deref(), Some(scheduler.as_str()), "the operator set it");
        assert!(p.labels().contains_key(keys::LABEL_POD_GROUP), "the operator's PodGroup is the gang");
    }
    let launcher =
        pods.iter().find(|p| p.labels().get("training.kubeflow.org/job-role").map(String::as_str) == Some("launcher"));
    let launcher = launcher.expect("a launcher pod").name_any();
    let seen = b.await_steps(&launcher, None, 3).await;
    println!("launcher's log (the ranks' lines, through mpirun): {seen:?}");
    assert!(seen.last().unwrap().1 < seen.first().unwrap().1, "the loss falls: {seen:?}");
    b.await_condition(&jobs, &name, "Succeeded", Duration::from_secs(600)).await;
    let left = b.pods().list(&ListParams::default().labels(&selector)).await.unwrap().items;
    println!("{:?}", left.iter().map(|p| (p.name_any(), phase(p).to_owned())).collect::<Vec<_>>());
    b.lend(1, None).await;
}
