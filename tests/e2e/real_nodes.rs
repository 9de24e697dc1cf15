//! Real processes across the bridge: member-a's real node (containerd, kubelet, CNI bridge,
//! CoreDNS; `tests/controlplane/realnode.sh`) runs the offload copies of training pods, and
//! what the process does comes back to the training cluster: its logs and exec through
//! tidepool's kubelet API, its exit code, crash loop and OOM kill in the pod status, and the
//! reclaim notice in its own `/etc/tidepool/annotations` file, and `kubectl port-forward` to it;
//! and the copy's sandbox as the kernel reports it (seccomp, capabilities) against the same
//! spec run straight in the member.
//!
//! The pool selects the real node by label and tolerates its taint
//! (`tidepool.io/real-node=true:NoSchedule`), so nothing else in the suite lands there.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::MemberCluster;
use tidepool_api::keys;

use crate::harness::*;

const TEST: &str = "real-nodes";
const NS: &str = "e2e-real-nodes";
const MEMBER: &str = "e2e-real-a";
const NODE: &str = "tidepool-e2e-real-a-real";

/// tidepool bridging member-a's real node as pool `real`, with its kubelet API.
struct Setup {
    env: Env,
    training: Client,
    member: Client,
    tidepool: Tidepool,
}

impl Setup {
    async fn start(dispatcher: &str) -> Setup {
        let (env, training, member, tidepool) = real_node_setup((TEST, NS), MEMBER, NODE, dispatcher).await;
        Setup { env, training, member, tidepool }
    }

    /// A pod spec for the dispatcher to place on the real pool: `script` in the workload
    /// image, 500m of CPU (what the reclaim tests hold back room for).
    fn dispatched_spec(&self, script: &str) -> serde_json::Value {
        json!({
            "schedulerName": scheduler_name(TEST),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": self.env.var("WORKLOAD_IMAGE"),
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"requests": {"cpu": "500m", "memory": "16Mi"}}
            }]
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), NS)
    }

    fn copies(&self) -> Api<Pod> {
        Api::namespaced(self.member.clone(), &offload_ns(NS))
    }

    /// Creates a training pod bound to the real pool's virtual node, running `script` in the
    /// workload image.
    async fn run(&self, name: &str, script: &str, restart: &str, memory_limit: Option<&str>) {
        let mut limits = json!({});
        if let Some(limit) = memory_limit {
            limits = json!({"memory": limit});
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "nodeName": NODE,
                "restartPolicy": restart,
                "terminationGracePeriodSeconds": 2,
                "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{
                    "name": "main",
                    "image": self.env.var("WORKLOAD_IMAGE"),
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}, "limits": limits}
                }]
            }
        }))
        .unwrap();
        self.pods().create(&PostParams::default(), &pod).await.unwrap();
    }

    /// Waits until the training pod's first container status satisfies `probe`.
    async fn await_container<T>(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        probe: impl Fn(&k8s_openapi::api::core::v1::ContainerStatus) -> Option<T>,
    ) -> T {
        let pods = self.pods();
        let probe = &probe;
        wait_for(timeout, what, || {
            let pods = pods.clone();
            async move {
                let pod = pods.get(name).await.ok()?;
                pod.status?.container_statuses?.first().and_then(probe)
            }
        })
        .await
    }
}

/// Holds back all but 300m of the real node's CPU in `MEMBER` (as a member admin would for a
/// peak): a 500m pod no longer fits, and tidepool reclaims it with a notice. (An online pod
/// that cannot fit would be answered by the member's scheduler first: it preempts the copy at
/// once, and the trainer gets only SIGTERM.)
async fn hold_back_the_real_nodes_cpu(s: &Setup) {
    let node = Api::<Node>::all(s.member.clone()).get(s.env.var("MEMBER_A_REAL_NODE")).await.unwrap();
    let cpu = node.status.unwrap().allocatable.unwrap()["cpu"].0.clone();
    let cores: u32 = cpu.parse().unwrap_or_else(|_| panic!("real node cpu {cpu} is not whole cores"));
    let reserve = json!({"spec": {"capacity": {"reserve": {"cpu": format!("{}m", cores * 1000 - 300)}}}});
    Api::<MemberCluster>::all(s.training.clone())
        .patch(MEMBER, &PatchParams::default(), &Patch::Merge(&reserve))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_real_process_runs_on_the_members_real_node_and_its_logs_exec_and_attach_come_back() {
    let s = Setup::start("").await;
    let id = run_id();
    let name = format!("hello-{id}");
    // Three lines at once, then one more after exec is asked for (so `logs` sees the first
    // three exactly), then it waits to be killed.
    let script = format!(
        "for i in 1 2 3; do echo \"line $i of {id}\"; done; \
         while [ ! -f /tmp/go ]; do sleep 0.2; done; echo \"after exec {id}\"; exec sleep 3600"
    );
    s.run(&name, &script, "Never", None).await;
    s.await_container(&name, "container running", Duration::from_secs(90), |c| {
        c.state.as_ref()?.running.as_ref().map(|_| ())
    })
    .await;

    // The copy runs on the real node, with an address of member-a's pod bridge.
    let copy = s.copies().get(&name).await.unwrap();
    assert_eq!(copy.spec.as_ref().unwrap().node_name.as_deref(), Some(s.env.var("MEMBER_A_REAL_NODE")));
    let training_pod = s.pods().get(&name).await.unwrap();
    let pod_ip = training_pod.status.as_ref().unwrap().pod_ip.clone().unwrap();
    let bridge = s.env.var("MEMBER_A_BRIDGE_IP");
    assert_eq!(
        pod_ip.rsplit_once('.').map(|(net, _)| net),
        bridge.rsplit_once('.').map(|(net, _)| net),
        "pod IP {pod_ip} is not on member-a's pod bridge {bridge}"
    );

    // kubectl logs through the training cluster: exactly what the process printed.
    let expected: String = (1..=3).map(|i| format!("line {i} of {id}\n")).collect();
    let (code, out, err) = kubectl(&s.env, "training", &["-n", NS, "logs", &name], None).await;
    assert_eq!(code, 0, "kubectl logs failed: {err}\n{}", s.tidepool.log_tail());
    assert_eq!(out, expected);

    // exec runs in the container (its files, its PID namespace) and returns its exit code.
    let (code, out, err) = kubectl(
        &s.env,
        "training",
        &["-n", NS, "exec", &name, "--", "sh", "-c", "touch /tmp/go; cat /proc/1/comm; hostname; exit 7"],
        None,
    )
    .await;
    assert_eq!(code, 7, "exit code of the remote command: stdout {out:?}, stderr {err:?}");
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("sh"), "PID 1 of the container is the pod's shell: {out:?}");
    assert_eq!(lines.next(), Some(name.as_str()), "hostname is the pod name: {out:?}");
    // The line it printed after exec reached it.
    wait_for(Duration::from_secs(20), "line after exec in the logs", || {
        let (env, name, id) = (&s.env, &name, &id);
        async move {
            let (_, out, _) = kubectl(env, "training", &["-n", NS, "logs", name], None).await;
            out.ends_with(&format!("after exec {id}\n")).then_some(())
        }
    })
    .await;

    // kubectl attach (tenants.md): the container's stdin and stdout through the training
    // cluster. It reads lines until its stdin closes (stdinOnce: when attach ends), then exits.
    let listener = format!("listener-{id}");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": listener},
        "spec": {
            "nodeName": NODE, "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "main", "image": s.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                "stdin": true, "stdinOnce": true,
                "command": ["/bin/sh", "-c", "while read line; do echo \"got $line\"; done; echo bye"],
                "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}
            }]
        }
    }))
    .unwrap();
    s.pods().create(&PostParams::default(), &pod).await.unwrap();
    s.await_container(&listener, "listener running", Duration::from_secs(90), |c| {
        c.state.as_ref()?.running.as_ref().map(|_| ())
    })
    .await;
    let (code, out, err) =
        kubectl(&s.env, "training", &["-n", NS, "attach", "-i", &listener], Some("one\ntwo\n")).await;
    assert_eq!(
        (code, out.as_str()),
        (0, "got one\ngot two\nbye\n"),
        "kubectl attach: {err}\n{}",
        s.tidepool.log_tail()
    );
    s.await_container(&listener, "listener exited 0 after attach", Duration::from_secs(60), |c| {
        c.state.as_ref()?.terminated.as_ref().filter(|t| t.exit_code == 0).map(|_| ())
    })
    .await;
    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn exit_codes_crash_loops_and_oom_kills_of_real_containers_reach_the_training_pod() {
    let s = Setup::start("").await;
    let id = run_id();
    let (exits, crashes, hungry) = (format!("exits-{id}"), format!("crashes-{id}"), format!("hungry-{id}"));
    s.run(&exits, "echo bye; exit 3", "Never", None).await;
    s.run(&crashes, "echo crash; exit 1", "Always", None).await;
    // 64 MiB in one buffer against a 24 MiB limit: the kernel's OOM killer ends it (dd is the
    // container's main process, so the container ends with it).
    s.run(&hungry, "exec dd if=/dev/zero of=/dev/null bs=64M count=1", "Never", Some("24Mi")).await;

    // 1. A container that exits 3: the pod Failed, with exit code 3.
    let code = s
        .await_container(&exits, "terminated container", Duration::from_secs(90), |c| {
            c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code)
        })
        .await;
    assert_eq!(code, 3);
    let phase = wait_for(Duration::from_secs(30), "pod phase Failed", || {
        let pods = s.pods();
        let exits = exits.clone();
        async move {
            let phase = pods.get(&exits).await.ok()?.status?.phase?;
            (phase == "Failed").then_some(phase)
        }
    })
    .await;
    assert_eq!(phase, "Failed");

    // 2. A container that keeps crashing: CrashLoopBackOff and its restart count.
    let restarts = s
        .await_container(&crashes, "CrashLoopBackOff", Duration::from_secs(120), |c| {
            let waiting = c.state.as_ref()?.waiting.as_ref()?;
            (waiting.reason.as_deref() == Some("CrashLoopBackOff")).then_some(c.restart_count)
        })
        .await;
    assert!(restarts >= 1, "a crash loop has restarted at least once, got {restarts}");
    let copy = s.copies().get(&crashes).await.unwrap();
    let member_restarts = copy.status.unwrap().container_statuses.unwrap()[0].restart_count;
    assert!(member_restarts >= restarts, "training shows {restarts} restarts, the member {member_restarts}");

    // 3. Over its memory limit: OOMKilled.
    let reason = s
        .await_container(&hungry, "OOM-killed container", Duration::from_secs(90), |c| {
            c.state.as_ref()?.terminated.as_ref().map(|t| (t.reason.clone(), t.exit_code))
        })
        .await;
    assert_eq!(reason, (Some("OOMKilled".to_owned()), 137));
    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn the_process_sees_the_reclaim_notice_in_its_annotations_file() {
    // Reclaim quickly, and leave the low band a minute between notice and deletion.
    let s = Setup::start("deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 60, medium: 60, low: 60}").await;
    let id = run_id();
    let name = format!("trainer-{id}");
    let script = "echo started; \
                  until grep -q reclaim-deadline /etc/tidepool/annotations; do sleep 0.3; done; \
                  echo \"notice: $(grep reclaim-deadline /etc/tidepool/annotations)\"; exec sleep 3600";
    // Placed by the dispatcher (the notice is its doing), on the only node of the pool.
    let pod: Pod =
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": s.dispatched_spec(script)})).unwrap();
    s.pods().create(&PostParams::default(), &pod).await.unwrap();
    s.await_container(&name, "trainer running", Duration::from_secs(90), |c| {
        c.state.as_ref()?.running.as_ref().map(|_| ())
    })
    .await;
    wait_for(Duration::from_secs(20), "trainer started", || {
        let (env, name) = (&s.env, &name);
        async move {
            let (_, out, _) = kubectl(env, "training", &["-n", NS, "logs", name], None).await;
            (out == "started\n").then_some(())
        }
    })
    .await;
    let (code, before, err) =
        kubectl(&s.env, "training", &["-n", NS, "exec", &name, "--", "cat", "/etc/tidepool/annotations"], None).await;
    assert_eq!(code, 0, "{err}");
    assert!(!before.contains("reclaim-deadline"), "a notice before any demand: {before}");

    hold_back_the_real_nodes_cpu(&s).await;

    // The process itself reports the notice it read from its file: the same deadline the
    // dispatcher wrote on the training pod.
    let line = wait_for(Duration::from_secs(60), "the trainer's own notice line", || {
        let (env, name) = (&s.env, &name);
        async move {
            let (_, out, _) = kubectl(env, "training", &["-n", NS, "logs", name], None).await;
            out.lines().find(|l| l.starts_with("notice: ")).map(str::to_owned)
        }
    })
    .await;
    let deadline =
        s.pods().get(&name).await.unwrap().metadata.annotations.unwrap()[keys::ANNOTATION_RECLAIM_DEADLINE].clone();
    assert_eq!(line, format!("notice: {}=\"{deadline}\"", keys::ANNOTATION_RECLAIM_DEADLINE));

    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn pods_on_a_real_node_reach_each_other_by_ip_and_resolve_services_through_cluster_dns() {
    // Straight in member-a, no tidepool: the member's own pod network and DNS, which mirrored
    // Services of distributed jobs rely on.
    let env = Env::load();
    let member = env.client("member-a").await;
    let ns = "e2e-real-network";
    ensure_namespace(&member, ns).await;
    clear_pods(&member, ns).await;
    let pods = Api::<Pod>::namespaced(member.clone(), ns);
    let id = run_id();
    let pod = |name: &str, labels: serde_json::Value, script: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "nodeSelector": {"kubernetes.io/hostname": env.var("MEMBER_A_REAL_NODE")},
                "tolerations": [{"key": env.var("REAL_NODE_TAINT"), "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "main", "image": env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                                "command": ["/bin/sh", "-c", script]}]
            }
        }))
        .unwrap()
    };
    let server = format!("server-{id}");
    pods.create(
        &PostParams::default(),
        &pod(&server, json!({"app": "echo"}), "while true; do echo pong | nc -l -p 7000; done"),
    )
    .await
    .unwrap();
    let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
        "metadata": {"name": "echo"},
        "spec": {"clusterIP": "None", "selector": {"app": "echo"}, "ports": [{"name": "echo", "port": 7000}]}
    }))
    .unwrap();
    let services = Api::<k8s_openapi::api::core::v1::Service>::namespaced(member.clone(), ns);
    let _ = services.delete("echo", &Default::default()).await;
    services.create(&PostParams::default(), &svc).await.unwrap();
    let server_ip = wait_for(Duration::from_secs(90), "server running with an IP", || {
        let (pods, server) = (pods.clone(), server.clone());
        async move {
            let status = pods.get(&server).await.ok()?.status?;
            (status.phase.as_deref() == Some("Running")).then_some(())?;
            status.pod_ip
        }
    })
    .await;
    let client = format!("client-{id}");
    let fqdn = format!("echo.{ns}.svc.cluster.local");
    let script = format!(
        "set -e; by_ip=$(nc -w 5 {server_ip} 7000 </dev/null); \
         resolved=$(nslookup {fqdn} | awk '/^Address/ {{a=$NF}} END {{print a}}'); \
         by_name=$(nc -w 5 {fqdn} 7000 </dev/null); echo \"$by_ip $resolved $by_name\""
    );
    pods.create(&PostParams::default(), &pod(&client, json!({}), &script)).await.unwrap();
    let phase = wait_for(Duration::from_secs(90), "client done", || {
        let (pods, client) = (pods.clone(), client.clone());
        async move {
            let phase = pods.get(&client).await.ok()?.status?.phase?;
            matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
        }
    })
    .await;
    let (_, out, _) = kubectl(&env, "member-a", &["-n", ns, "logs", &client], None).await;
    assert_eq!(phase, "Succeeded", "client output: {out}");
    assert_eq!(out.trim(), format!("pong {server_ip} pong"));
    clear_pods(&member, ns).await;
}

#[tokio::test]
async fn a_job_that_ignores_disruptions_replaces_a_reclaimed_pod_without_counting_a_failure() {
    let s = Setup::start("deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 5, medium: 5, low: 5}").await;
    let id = run_id();
    let name = format!("resumable-{id}");
    // backoffLimit 0: one counted failure fails the Job. The policy ignores disruptions.
    let job: k8s_openapi::api::batch::v1::Job = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
            ]},
            "template": {"spec": s.dispatched_spec("echo training; exec sleep 3600")}
        }
    }))
    .unwrap();
    let jobs = Api::<k8s_openapi::api::batch::v1::Job>::namespaced(s.training.clone(), NS);
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let selector = format!("job-name={name}");
    let first = wait_for(Duration::from_secs(90), "the Job's pod running", || {
        let (pods, selector) = (s.pods(), selector.clone());
        async move {
            let list = pods.list(&kube::api::ListParams::default().labels(&selector)).await.ok()?;
            let pod = list.items.into_iter().next()?;
            (pod.status.as_ref()?.phase.as_deref() == Some("Running")).then(|| pod.metadata.name.unwrap())
        }
    })
    .await;

    // The member admin holds the real node's CPU back: the pod is reclaimed.
    hold_back_the_real_nodes_cpu(&s).await;
    let members = Api::<MemberCluster>::all(s.training.clone());
    let reclaimed = wait_for(Duration::from_secs(90), "the pod Failed, Reclaimed", || {
        let (pods, first) = (s.pods(), first.clone());
        async move {
            let pod = pods.get(&first).await.ok()?;
            (pod.status.as_ref()?.reason.as_deref() == Some("Reclaimed")).then_some(pod)
        }
    })
    .await;
    let status = reclaimed.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Failed"));
    let target = status.conditions.unwrap().into_iter().find(|c| c.type_ == "DisruptionTarget");
    assert_eq!(
        target.map(|c| (c.status, c.reason)),
        Some(("True".to_owned(), Some(keys::REASON_DISRUPTION_RECLAIM.to_owned()))),
        "a reclaimed pod carries the standard DisruptionTarget condition"
    );

    // The Job makes a replacement and does not fail: the reclaim did not count.
    wait_for(Duration::from_secs(60), "a replacement pod", || {
        let (pods, selector, first) = (s.pods(), selector.clone(), first.clone());
        async move {
            let list = pods.list(&kube::api::ListParams::default().labels(&selector)).await.ok()?;
            list.items.iter().any(|p| p.metadata.name.as_deref() != Some(first.as_str())).then_some(())
        }
    })
    .await;
    let job = jobs.get(&name).await.unwrap();
    let conditions: Vec<String> = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.type_)
        .collect();
    assert!(!conditions.iter().any(|c| c == "Failed" || c == "FailureTarget"), "the Job failed: {conditions:?}");
    assert_eq!(job.status.unwrap().failed.unwrap_or(0), 0, "the reclaim counted as a failure");

    members.patch(MEMBER, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"capacity": null}}))).await.unwrap();
    jobs.delete(&name, &kube::api::DeleteParams::background()).await.unwrap();
    drain_pods(&s.training, NS).await;
}

/// `kubectl port-forward` in the training cluster reaches a server in the offload pod on the
/// member's real node, through tidepool's kubelet API and the member's API server; each
/// local connection is its own stream pair, so two in a row both get their answer.
#[tokio::test]
async fn kubectl_port_forward_reaches_a_server_in_the_offload_pod() {
    use std::process::Stdio;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

    let s = Setup::start("").await;
    let id = run_id();
    let name = format!("web-{id}");
    let script = format!("mkdir -p /www && echo 'hello from {id}' > /www/index.html && exec httpd -f -p 8080 -h /www");
    s.run(&name, &script, "Never", None).await;
    s.await_container(&name, "web server running", Duration::from_secs(90), |c| {
        c.state.as_ref()?.running.as_ref().map(|_| ())
    })
    .await;

    let mut forward = tokio::process::Command::new(s.env.var("KUBECTL"))
        .arg("--kubeconfig")
        .arg(s.env.kubeconfig_path("training"))
        .args(["-n", NS, "port-forward", &format!("pod/{name}"), ":8080"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(forward.stdout.take().unwrap()).lines();
    // "Forwarding from 127.0.0.1:PORT -> 8080"
    let line = tokio::time::timeout(Duration::from_secs(30), stdout.next_line()).await;
    let line = match line {
        Ok(Ok(Some(line))) => line,
        other => {
            let mut err = String::new();
            let _ = forward.stderr.take().unwrap().read_to_string(&mut err).await;
            panic!("kubectl port-forward did not start: {other:?} {err}\n{}", s.tidepool.log_tail());
        }
    };
    let local: u16 = line
        .strip_prefix("Forwarding from 127.0.0.1:")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected kubectl output: {line}"));
    for round in 1..=2 {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", local)).await.unwrap();
        conn.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(20), conn.read_to_string(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("connection {round}: no answer in 20 s\n{}", s.tidepool.log_tail()))
            .unwrap();
        assert!(answer.starts_with("HTTP/1."), "connection {round}: not an HTTP answer: {answer:?}");
        assert!(answer.contains(&format!("hello from {id}")), "connection {round}: {answer:?}");
    }
    drop(forward);
    drain_pods(&s.training, NS).await;
}

#[tokio::test]
async fn a_trainer_that_exits_on_its_notice_has_its_copy_deleted_at_once_and_is_reclaimed() {
    // A minute between notice and deadline: the copy going sooner is the exit's doing.
    let s = Setup::start("deficitHysteresisSeconds: 1, reclaimGraceSeconds: {high: 60, medium: 60, low: 60}").await;
    let name = format!("leaver-{}", run_id());
    let script = "echo started; until grep -q reclaim-deadline /etc/tidepool/annotations; do sleep 0.3; done; \
                  echo checkpointed; exit 0";
    let pod: Pod =
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": s.dispatched_spec(script)})).unwrap();
    s.pods().create(&PostParams::default(), &pod).await.unwrap();
    s.await_container(&name, "trainer running", Duration::from_secs(90), |c| {
        c.state.as_ref()?.running.as_ref().map(|_| ())
    })
    .await;
    let copy_uid = s.copies().get(&name).await.unwrap().metadata.uid.unwrap();

    hold_back_the_real_nodes_cpu(&s).await;

    // The notice, then the trainer's exit: its copy is deleted and the pod is Reclaimed,
    // saying it exited, long before the deadline.
    let noticed = wait_for(Duration::from_secs(30), "reclaim notice", || async {
        s.pods().get(&name).await.ok()?.metadata.annotations?.get(keys::ANNOTATION_RECLAIM_DEADLINE).cloned()
    })
    .await;
    let deadline: jiff::Timestamp = noticed.parse().unwrap();
    let status = wait_for(Duration::from_secs(40), "pod Failed/Reclaimed after its exit", || async {
        let st = s.pods().get(&name).await.ok()?.status?;
        (st.phase.as_deref() == Some("Failed") && st.reason.as_deref() == Some(keys::REASON_RECLAIMED)).then_some(st)
    })
    .await;
    let message = status.message.unwrap_or_default();
    assert!(message.contains("exited"), "{message}");
    wait_for(Duration::from_secs(20), "the copy deleted in the member", || async {
        let copy = s.copies().get_opt(&name).await.ok()?;
        copy.is_none_or(|c| c.metadata.uid.as_deref() != Some(copy_uid.as_str())).then_some(())
    })
    .await;
    assert!(jiff::Timestamp::now() < deadline, "the copy went only at the deadline {deadline}");
    drain_pods(&s.training, NS).await;
}

/// The kernel's view of a process: its seccomp mode (`0` none, `2` filter) and whether its
/// effective capabilities hold `NET_RAW` (bit 13), from a log of `/proc/self/status` lines and
/// `NVIDIA=<value>`.
fn sandbox_of(log: &str) -> (String, bool, String) {
    let field = |key: &str| log.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default().trim().to_owned();
    let caps = u64::from_str_radix(&field("CapEff:"), 16).unwrap_or_else(|_| panic!("no CapEff in {log:?}"));
    (field("Seccomp:"), caps & (1 << 13) != 0, field("NVIDIA="))
}

/// What `script` prints run straight in member-a's real node (namespace `ns`), no tidepool.
async fn direct_report(s: &Setup, ns: &str, name: &str, script: &str) -> String {
    ensure_namespace(&s.member, ns).await;
    clear_pods(&s.member, ns).await;
    let direct: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": s.env.var("MEMBER_A_REAL_NODE")},
            "tolerations": [{"key": s.env.var("REAL_NODE_TAINT"), "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": s.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", script]}]
        }
    }))
    .unwrap();
    Api::<Pod>::namespaced(s.member.clone(), ns).create(&PostParams::default(), &direct).await.unwrap();
    wait_for(Duration::from_secs(90), "the direct pod's report", || async move {
        let (_, out, _) = kubectl(&s.env, "member-a", &["-n", ns, "logs", name], None).await;
        out.contains("NVIDIA=").then_some(out)
    })
    .await
}

/// Creates a pod on the real pool's virtual node that sets `NVIDIA_VISIBLE_DEVICES=all`
/// itself; returns the message it is refused with.
async fn refused_device_pod(s: &Setup, name: &str) -> String {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE, "restartPolicy": "Never",
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": s.env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"], "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
        }
    }))
    .unwrap();
    s.pods().create(&PostParams::default(), &pod).await.unwrap();
    wait_for(Duration::from_secs(60), "the pod asking for every GPU refused", || async move {
        let status = s.pods().get(name).await.ok()?.status?;
        (status.reason.as_deref() == Some(keys::REASON_OFFLOAD_POLICY)).then_some(status.message.unwrap_or_default())
    })
    .await
}

/// Security, second round: a pod that names no seccomp profile and no capabilities runs in a
/// member as the member's kubelet runs it (no seccomp filter, `NET_RAW` to forge packets on
/// the member's pod network) unless tidepool hardens the copy. The same spec straight in
/// member-a is the baseline; through tidepool the process reports a seccomp filter, no
/// `NET_RAW` and no GPU; a pod setting `NVIDIA_VISIBLE_DEVICES` itself is refused.
#[tokio::test]
async fn a_copy_runs_with_a_seccomp_filter_without_net_raw_and_sees_no_device() {
    let s = Setup::start("").await;
    let id = run_id();
    let script =
        "grep -E '^(Seccomp|CapEff):' /proc/self/status; echo \"NVIDIA=$NVIDIA_VISIBLE_DEVICES\"; exec sleep 3600";
    let ns = "e2e-real-sandbox";
    let direct = direct_report(&s, ns, &format!("direct-{id}"), script).await;
    println!("direct: {direct:?}");
    assert_eq!(sandbox_of(&direct), ("0".to_owned(), true, String::new()), "the member's kubelet alone");

    let name = format!("sandbox-{id}");
    s.run(&name, script, "Never", None).await;
    let log = wait_for(Duration::from_secs(90), "the copy's report", || async {
        let (_, out, _) = kubectl(&s.env, "training", &["-n", NS, "logs", &name], None).await;
        out.contains("NVIDIA=").then_some(out)
    })
    .await;
    println!("through tidepool: {log:?}");
    assert_eq!(sandbox_of(&log), ("2".to_owned(), false, "void".to_owned()), "seccomp filter, no NET_RAW, no device");

    let greedy = format!("greedy-{id}");
    let message = refused_device_pod(&s, &greedy).await;
    println!("refused: {message}");
    assert!(message.contains("spec.containers[0].env[0].name"), "names the field: {message}");
    assert!(s.copies().get_opt(&greedy).await.unwrap().is_none(), "nothing reached the member");
    clear_pods(&s.member, ns).await;
    drain_pods(&s.training, NS).await;
}

/// A member that asks for the `restricted` Pod Security level (`spec.podSecurity`): its offload
/// namespace enforces it, and a copy whose pod says nothing runs as the level asks. A pod
/// running as uid 65532 reports no new privileges and an empty capability bounding set from
/// inside; a pod whose image runs as root does not start, and its training pod says why, in
/// the kubelet's words.
#[tokio::test]
async fn a_restricted_member_runs_copies_non_root_without_escalation_or_capabilities() {
    const TEST: &str = "restricted";
    const NS: &str = "e2e-restricted";
    const MEMBER: &str = "e2e-restricted-a";
    const NODE: &str = "tidepool-e2e-restricted-a-real";
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    // An earlier run's offload namespace keeps the label it was made with: gone first.
    let offload = without_offload_namespace(&member, NS).await;
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(member.clone());
    let mut mc = member_cluster(MEMBER, TEST, NS, "member-a");
    mc.spec.pools = vec![real_pool(&env)];
    mc.spec.pod_security = Some(tidepool_api::crd::PodSecurityLevel::Restricted);
    let _tidepool = start_on_real_node(&env, &training, (TEST, NS), "", &mc, NODE).await;
    let pods = Api::<Pod>::namespaced(training.clone(), NS);
    let id = run_id();
    let pod = |name: &str, user: Option<i64>| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "nodeName": NODE, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                "securityContext": user.map_or(json!({}), |u| json!({"runAsUser": u})),
                "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "main", "image": env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                                "command": ["/bin/sh", "-c",
                                            "grep -E '^(NoNewPrivs|CapBnd):' /proc/self/status; exec sleep 3600"],
                                "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}}]
            }
        }))
        .unwrap()
    };
    let nonroot = format!("nonroot-{id}");
    pods.create(&PostParams::default(), &pod(&nonroot, Some(65532))).await.unwrap();
    let log = wait_for(Duration::from_secs(90), "the non-root copy's report", || async {
        let (_, out, _) = kubectl(&env, "training", &["-n", NS, "logs", &nonroot], None).await;
        out.contains("CapBnd:").then_some(out)
    })
    .await;
    println!("restricted copy: {log:?}");
    let field = |key: &str| log.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default().trim().to_owned();
    assert_eq!(field("NoNewPrivs:"), "1", "no privilege escalation");
    assert_eq!(u64::from_str_radix(&field("CapBnd:"), 16).ok(), Some(0), "every capability dropped");
    let ns = namespaces.get(&offload).await.unwrap();
    assert_eq!(
        ns.metadata.labels.unwrap_or_default().get("pod-security.kubernetes.io/enforce").map(String::as_str),
        Some("restricted")
    );

    let root = format!("root-{id}");
    pods.create(&PostParams::default(), &pod(&root, None)).await.unwrap();
    let (reason, message) = wait_for(Duration::from_secs(90), "the root image's pod says why it waits", || {
        let (pods, root) = (pods.clone(), root.clone());
        async move {
            let p = pods.get(&root).await.ok()?;
            let waiting = p.status?.container_statuses?.into_iter().next()?.state?.waiting?;
            (waiting.reason.as_deref() == Some("CreateContainerConfigError"))
                .then(|| (waiting.reason.unwrap_or_default(), waiting.message.unwrap_or_default()))
        }
    })
    .await;
    println!("root image: {reason}: {message}");
    assert!(message.contains("runAsNonRoot"), "{message}");
    drain_pods(&training, NS).await;
}

/// A member's copies are fenced as its admin asks. No copy goes into an offload namespace
/// whose NetworkPolicy the member refuses (an admission policy in member-a refuses it first:
/// the pod waits, saying so, and nothing is created); allowed, the policy is there before the
/// first copy (the member's API server says when each was created): every pod of the namespace
/// takes traffic only from the namespace, and sends it only there, to the member's DNS and to
/// what the admin added (`spec.networkPolicy`).
/// With `spec.userNamespaces`, root in the copy is not the node's root: the kernel's uid map
/// inside it maps uid 0 elsewhere, where the same spec run straight in the member maps it to 0.
#[tokio::test]
async fn a_members_copies_are_fenced_by_its_network_policy_and_run_in_user_namespaces() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    const TEST: &str = "fenced";
    const NS: &str = "e2e-fenced";
    const MEMBER: &str = "e2e-fenced-a";
    const NODE: &str = "tidepool-e2e-fenced-a-real";
    let env = Env::load();
    let training = env.client("training").await;
    let member = env.client("member-a").await;
    // An earlier run's offload namespace (and its policy) goes first: this run's is judged.
    let offload = without_offload_namespace(&member, NS).await;
    let mut mc = member_cluster(MEMBER, TEST, NS, "member-a");
    mc.spec.pools = vec![real_pool(&env)];
    mc.spec.user_namespaces = true;
    mc.spec.network_policy = serde_json::from_value(json!({
        "egress": [{"to": [{"ipBlock": {"cidr": "10.123.0.0/24"}}], "ports": [{"protocol": "TCP", "port": 9000}]}]
    }))
    .unwrap();
    let refusal = RefusedPolicies::install(&member, NS).await;
    let _tidepool = start_on_real_node(&env, &training, (TEST, NS), "", &mc, NODE).await;
    let script = "head -n 1 /proc/self/uid_map; exec sleep 3600";
    let name = format!("fenced-{}", run_id());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": env.var("WORKLOAD_IMAGE"), "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", script],
                            "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}}]
        }
    }))
    .unwrap();
    Api::<Pod>::namespaced(training.clone(), NS).create(&PostParams::default(), &pod).await.unwrap();
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(training.clone(), NS);
    let said = wait_for(Duration::from_secs(60), "the pod says its namespace is not fenced yet", || {
        let (events, name) = (events.clone(), name.clone());
        async move {
            let lp = kube::api::ListParams::default().fields(&format!("involvedObject.name={name}"));
            let list = events.list(&lp).await.ok()?.items;
            list.into_iter().find(|e| e.reason.as_deref() == Some(keys::REASON_OFFLOAD_ISOLATION))?.message
        }
    })
    .await;
    println!("while the member refuses the policy: {said}");
    assert!(said.contains("tidepool-isolation"), "names the policy: {said}");
    let copies = Api::<Pod>::namespaced(member.clone(), &offload);
    assert!(copies.get_opt(&name).await.unwrap().is_none(), "no copy in an open namespace");
    refusal.remove().await;
    let log = wait_for(Duration::from_secs(90), "the copy's uid map", || async {
        let (_, out, _) = kubectl(&env, "training", &["-n", NS, "logs", &name], None).await;
        (!out.trim().is_empty()).then_some(out)
    })
    .await;
    println!("uid map in the copy: {log:?}");
    let map: Vec<u64> = log.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    assert_eq!(map.first(), Some(&0), "uid 0 inside: {log}");
    assert_ne!(map.get(1), Some(&0), "uid 0 inside is not the node's uid 0: {log}");

    let policy = Api::<NetworkPolicy>::namespaced(member.clone(), &offload).get("tidepool-isolation").await.unwrap();
    let copy = Api::<Pod>::namespaced(member.clone(), &offload).get(&name).await.unwrap();
    let (made, copied) = (policy.metadata.creation_timestamp.clone(), copy.metadata.creation_timestamp.clone());
    assert!(made.unwrap().0 <= copied.unwrap().0, "the policy came before the copy");
    let spec = serde_json::to_value(policy.spec.unwrap()).unwrap();
    println!("the offload namespace's policy: {spec}");
    assert_eq!(spec["podSelector"], json!({}));
    assert_eq!(spec["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(spec["ingress"], json!([{"from": [{"podSelector": {}}]}]), "only its own namespace comes in");
    let egress = spec["egress"].as_array().unwrap();
    assert_eq!(egress.len(), 3, "its namespace, DNS, the admin's: {spec}");
    assert_eq!(egress[1]["to"][0]["podSelector"]["matchLabels"]["k8s-app"], "kube-dns");
    assert_eq!(egress[2]["to"][0]["ipBlock"]["cidr"], "10.123.0.0/24");
    let open = egress.iter().flat_map(|r| r["to"].as_array().cloned().unwrap_or_default());
    assert!(open.filter(|p| p["ipBlock"].is_object()).count() == 1, "no address range but the admin's");
    drain_pods(&training, NS).await;
}

/// An admission policy of member-a refusing tidepool's NetworkPolicy in namespace `ns` (and in
/// `default`, where the test sees it in effect), until removed.
struct RefusedPolicies {
    member: Client,
}

impl RefusedPolicies {
    const NAME: &str = "e2e-refuse-isolation";

    async fn install(member: &Client, ns: &str) -> Self {
        use k8s_openapi::api::admissionregistration::v1::{
            ValidatingAdmissionPolicy as Vap, ValidatingAdmissionPolicyBinding as Binding,
        };
        use k8s_openapi::api::networking::v1::NetworkPolicy;
        let policy: Vap = serde_json::from_value(json!({
            "metadata": {"name": Self::NAME},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{"apiGroups": ["networking.k8s.io"], "apiVersions": ["v1"],
                    "operations": ["CREATE", "UPDATE"], "resources": ["networkpolicies"]}]},
                "matchConditions": [{"name": "tidepools-here", "expression":
                    format!("object.metadata.name == 'tidepool-isolation' && object.metadata.namespace in ['{ns}', 'default']")}],
                "validations": [{"expression": "false", "reason": "Forbidden", "message": "e2e: this member refuses the policy"}]
            }
        }))
        .unwrap();
        let binding: Binding = serde_json::from_value(json!({
            "metadata": {"name": Self::NAME},
            "spec": {"policyName": Self::NAME, "validationActions": ["Deny"]}
        }))
        .unwrap();
        let pp = PatchParams::apply("tidepool-e2e").force();
        Api::<Vap>::all(member.clone()).patch(Self::NAME, &pp, &Patch::Apply(&policy)).await.unwrap();
        Api::<Binding>::all(member.clone()).patch(Self::NAME, &pp, &Patch::Apply(&binding)).await.unwrap();
        let probe: NetworkPolicy =
            serde_json::from_value(json!({"metadata": {"name": "tidepool-isolation"}, "spec": {"podSelector": {}}}))
                .unwrap();
        let api = Api::<NetworkPolicy>::namespaced(member.clone(), "default");
        let dry = PostParams { dry_run: true, ..Default::default() };
        wait_for(Duration::from_secs(30), "the refusal in effect", || {
            let (api, probe, dry) = (api.clone(), probe.clone(), dry.clone());
            async move { matches!(api.create(&dry, &probe).await, Err(kube::Error::Api(e)) if e.code == 403).then_some(()) }
        })
        .await;
        Self { member: member.clone() }
    }

    async fn remove(self) {
        use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding as Binding;
        Api::<Binding>::all(self.member.clone()).delete(Self::NAME, &Default::default()).await.unwrap();
    }
}

/// Deletes training namespace `ns`'s offload namespace in `member`, as an earlier run left it,
/// and waits until it is gone; its name.
async fn without_offload_namespace(member: &Client, ns: &str) -> String {
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(member.clone());
    let offload = offload_ns(ns);
    let _ = namespaces.delete(&offload, &Default::default()).await;
    wait_for(Duration::from_secs(120), "an earlier run's offload namespace gone", || {
        let (namespaces, offload) = (namespaces.clone(), offload.clone());
        async move { namespaces.get_opt(&offload).await.ok()?.is_none().then_some(()) }
    })
    .await;
    offload
}
