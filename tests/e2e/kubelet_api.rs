//! Tidepool's kubelet API, end to end: the real `kubectl` against the training cluster reads
//! the logs of an offloaded pod and runs commands in it, through the training apiserver,
//! tidepool's kubelet API, the member's apiserver and kwok's kubelet API (which serves one
//! log file for every member pod and runs commands on this machine). Each answer is compared
//! with the same `kubectl` call made directly against the member.

use std::io::Write;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use tidepool_api::keys;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::harness::*;

const TEST: &str = "kubelet-api";
const NS: &str = "e2e-kubelet-api";
const MEMBER: &str = "e2e-kapi-a";
const NODE: &str = "tidepool-e2e-kapi-a";

/// Tidepool serving its kubelet API for member-a, and a running pod offloaded there.
struct Setup {
    env: Env,
    pod: String,
    tidepool: Tidepool,
}

impl Setup {
    async fn start() -> Setup {
        let env = Env::load();
        let training = env.client("training").await;
        prepare(&env, &training, TEST, NS).await;
        bridge_member(&env, &training, TEST, NS, MEMBER, "member-a").await;
        let tidepool = Tidepool::start_config(&env, TEST, NS, "", &kubelet_config(&env));
        let nodes = Api::<Node>::all(training.clone());
        wait_for(Duration::from_secs(90), "virtual node registered", || {
            let nodes = nodes.clone();
            async move { nodes.get_opt(NODE).await.ok().flatten().map(|_| ()) }
        })
        .await;
        let pod = format!("shell-{}", run_id());
        let spec: Pod = serde_json::from_value(json!({
            "metadata": {"name": pod},
            "spec": {
                "nodeName": NODE,
                "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
            }
        }))
        .unwrap();
        let pods = Api::<Pod>::namespaced(training.clone(), NS);
        pods.create(&PostParams::default(), &spec).await.unwrap();
        wait_for(Duration::from_secs(60), "offloaded pod Running", || {
            let (pods, pod) = (pods.clone(), pod.clone());
            async move {
                let p = pods.get(&pod).await.ok()?;
                (p.status?.phase.as_deref() == Some("Running")).then_some(())
            }
        })
        .await;
        Setup { env, pod, tidepool }
    }

    /// `kubectl` on the training pod, and the same on its offload pod in member-a.
    async fn both(&self, args: &[&str], stdin: Option<&str>) -> ((i32, String, String), (i32, String, String)) {
        let member_ns = offload_ns(NS);
        let with = |ns: &str| {
            let mut a: Vec<String> = vec!["-n".into(), ns.into()];
            a.extend(args.iter().map(|s| s.replace("POD", &self.pod)));
            a
        };
        let (t, m) = (with(NS), with(&member_ns));
        let t: Vec<&str> = t.iter().map(String::as_str).collect();
        let m: Vec<&str> = m.iter().map(String::as_str).collect();
        (kubectl(&self.env, "training", &t, stdin).await, kubectl(&self.env, "member-a", &m, stdin).await)
    }

    /// Appends lines to the log file kwok serves for every member-a pod (CRI log format).
    fn log(&self, lines: &[String]) {
        let mut f = std::fs::OpenOptions::new().append(true).open(self.env.var("MEMBER_A_POD_LOG")).unwrap();
        for line in lines {
            writeln!(f, "{} stdout F {line}", jiff::Timestamp::now()).unwrap();
        }
    }
}

#[tokio::test]
async fn kubectl_logs_and_exec_reach_the_offload_pod_through_tidepools_kubelet_api() {
    let s = Setup::start().await;
    let id = run_id();
    let lines: Vec<String> = (1..=3).map(|i| format!("line {i} of {id}")).collect();
    s.log(&lines);

    // 1. Logs with --tail, --timestamps and --limit-bytes: what the member itself answers.
    for args in [
        vec!["logs", "POD", "--tail=2"],
        vec!["logs", "POD", "--tail=2", "--timestamps"],
        vec!["logs", "POD", "--limit-bytes=9"],
    ] {
        let (training, member) = s.both(&args, None).await;
        assert_eq!(training.0, 0, "{args:?} failed: {}", training.2);
        assert_eq!(training, member, "{args:?}: training and member answers differ");
    }
    let (tail, _) = s.both(&["logs", "POD", "--tail=2"], None).await;
    assert_eq!(tail.1, format!("{}\n{}\n", lines[1], lines[2]));
    let (stamped, _) = s.both(&["logs", "POD", "--tail=1", "--timestamps"], None).await;
    let (stamp, text) = stamped.1.trim_end().split_once(' ').unwrap();
    assert!(stamp.parse::<jiff::Timestamp>().is_ok(), "not a timestamp: {stamp}");
    assert_eq!(text, lines[2]);
    let (limited, _) = s.both(&["logs", "POD", "--limit-bytes=9"], None).await;
    assert_eq!(limited.1.len(), 9);

    // 2. exec: output, stderr and stdin pass through; a failing command fails as in the member.
    let (ok, _) = s.both(&["exec", "POD", "--", "sh", "-c", &format!("echo out-{id}; echo err-{id} >&2")], None).await;
    assert_eq!(
        (ok.0, ok.1.as_str(), ok.2.as_str()),
        (0, format!("out-{id}\n").as_str(), format!("err-{id}\n").as_str())
    );
    // One line, not up to EOF: kwok's exec never closes the command's stdin.
    let read = ["exec", "-i", "POD", "--", "sh", "-c", "read line; echo \"got $line\""];
    let (piped, _) = s.both(&read, Some("through stdin\n")).await;
    assert_eq!((piped.0, piped.1.as_str()), (0, "got through stdin\n"), "stderr: {}", piped.2);
    // More than SPDY's default 64 KiB window each way, in case either side counted windows.
    let big = "x".repeat(200_000);
    let (echoed, _) =
        s.both(&["exec", "-i", "POD", "--", "sh", "-c", "head -c 200000; head -c 300000 /dev/zero"], Some(&big)).await;
    assert_eq!(echoed.0, 0, "stderr: {}", echoed.2);
    assert_eq!(echoed.1.len(), 500_000);
    assert!(echoed.1.starts_with(&big));
    let (failed, direct) = s.both(&["exec", "POD", "--", "sh", "-c", "exit 3"], None).await;
    assert_ne!(failed.0, 0, "a failing command must fail kubectl exec");
    assert_eq!(failed.0, direct.0, "exit code differs from the member's own: {} vs {}", failed.2, direct.2);
    assert!(failed.2.contains("exit status 3"), "no exit status in: {}", failed.2);
    // 3. logs -f sees a line written after it started, then is stopped.
    let mut follow = tokio::process::Command::new(s.env.var("KUBECTL"))
        .arg("--kubeconfig")
        .arg(s.env.kubeconfig_path("training"))
        .args(["-n", NS, "logs", "-f", "--tail=1", &s.pod])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(follow.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), out.next_line()).await.unwrap().unwrap();
    assert_eq!(first.as_deref(), Some(lines[2].as_str()));
    let later = format!("written later by {id}");
    s.log(std::slice::from_ref(&later));
    let next = tokio::time::timeout(Duration::from_secs(20), out.next_line())
        .await
        .expect("logs -f did not show the appended line within 20 s")
        .unwrap();
    // kwok writes this into the log when it cannot watch the file; the cause is the machine.
    if next.as_deref().is_some_and(|l| l.contains("fsnotify watcher: too many open files")) {
        panic!(
            "kwok could not follow the log file: this user's inotify instances \
             (/proc/sys/fs/inotify/max_user_instances) are all taken by other processes, \
             often other local cluster sets running beside this one"
        );
    }
    assert_eq!(next.as_deref(), Some(later.as_str()));
    follow.kill().await.unwrap();
    // ... and the stream to the member ends with it.
    wait_for(Duration::from_secs(10), "followed log stream closed in tidepool", || {
        let closed = s
            .tidepool
            .log_tail()
            .lines()
            .any(|l| l.contains("log stream closed") && l.contains(&s.pod) && l.contains("true"));
        async move { closed.then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn the_kubelet_port_refuses_callers_without_a_client_certificate() {
    let env = Env::load();
    let training = env.client("training").await;
    prepare(&env, &training, "kubelet-tls", "e2e-kubelet-tls").await;
    let _tidepool = Tidepool::start_config(&env, "kubelet-tls", "e2e-kubelet-tls", "", &kubelet_config(&env));
    let url = |path: &str| {
        format!("https://{}:{}{path}", env.var("TIDEPOOL_KUBELET_ADDRESS"), env.var("TIDEPOOL_KUBELET_PORT"))
    };
    let pki = env.var("CP_PKI").to_owned();
    let curl = |extra: Vec<String>, path: &str| {
        let mut c = std::process::Command::new("curl");
        c.args(["-sS", "--max-time", "5", "--cacert", &format!("{pki}/ca.crt")]).args(extra).arg(url(path));
        c.output().unwrap()
    };
    let with_cert =
        || vec!["--cert".to_owned(), format!("{pki}/admin.crt"), "--key".to_owned(), format!("{pki}/admin.key")];
    // The API server's client certificate is signed by the same CA as admin's.
    let healthy = wait_for(Duration::from_secs(30), "kubelet API answering /healthz", || {
        let out = curl(with_cert(), "/healthz");
        async move { out.status.success().then_some(String::from_utf8_lossy(&out.stdout).into_owned()) }
    })
    .await;
    assert_eq!(healthy.trim(), "ok");
    let pods = curl(with_cert(), "/pods");
    let list: serde_json::Value = serde_json::from_slice(&pods.stdout).unwrap();
    assert_eq!(list["kind"], "PodList");

    let refused = curl(vec![], "/healthz");
    assert!(!refused.status.success(), "a request without a client certificate got through");
    assert!(!String::from_utf8_lossy(&refused.stdout).contains("ok"));
}

/// A client certificate `O=group, CN=user` signed by the clusters' CA (the kubelet API's
/// client CA), with its key, in `dir`.
fn client_certificate(env: &Env, dir: &std::path::Path, user: &str, group: &str) -> (String, String) {
    let pki = env.var("CP_PKI");
    let (key, csr, crt, ext) =
        (dir.join("client.key"), dir.join("client.csr"), dir.join("client.crt"), dir.join("ext"));
    std::fs::write(&ext, "extendedKeyUsage = clientAuth\n").unwrap();
    let openssl = |args: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new("openssl").args(args).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let subject = format!("/O={group}/CN={user}");
    openssl(&[
        "req".as_ref(),
        "-new".as_ref(),
        "-newkey".as_ref(),
        "ec".as_ref(),
        "-pkeyopt".as_ref(),
        "ec_paramgen_curve:prime256v1".as_ref(),
        "-nodes".as_ref(),
        "-subj".as_ref(),
        subject.as_ref(),
        "-keyout".as_ref(),
        key.as_os_str(),
        "-out".as_ref(),
        csr.as_os_str(),
    ]);
    // A serial of our own: `-CAcreateserial` would write next to the shared CA.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let serial = format!("0x{nanos:x}");
    let (ca_crt, ca_key) = (format!("{pki}/ca.crt"), format!("{pki}/ca.key"));
    openssl(&[
        "x509".as_ref(),
        "-req".as_ref(),
        "-in".as_ref(),
        csr.as_os_str(),
        "-CA".as_ref(),
        ca_crt.as_ref(),
        "-CAkey".as_ref(),
        ca_key.as_ref(),
        "-set_serial".as_ref(),
        serial.as_ref(),
        "-days".as_ref(),
        "1".as_ref(),
        "-extfile".as_ref(),
        ext.as_os_str(),
        "-out".as_ref(),
        crt.as_os_str(),
    ]);
    (crt.display().to_string(), key.display().to_string())
}

#[tokio::test]
async fn a_node_certificate_from_the_client_ca_is_refused_and_the_api_servers_kubelet_client_is_served() {
    let s = Setup::start().await;
    let id = run_id();
    let line = format!("authorized line of {id}");
    s.log(std::slice::from_ref(&line));
    let dir = tempfile::tempdir().unwrap();
    // kubeadm's CA signs every node's client certificate too: being from the client CA is
    // authentication, not a grant. No RBAC in the training cluster gives a node nodes/proxy.
    let worker = client_certificate(&s.env, dir.path(), "system:node:worker-7", "system:nodes");
    let pki = s.env.var("CP_PKI");
    let apiserver = (format!("{pki}/apiserver-kubelet-client.crt"), format!("{pki}/apiserver-kubelet-client.key"));
    let logs = format!("/containerLogs/{NS}/{}/main?tailLines=1", s.pod);
    let exec = format!("/exec/{NS}/{}/main?command=true&output=1", s.pod);

    // The kubelet's mapping: logs are GET (verb get), exec is POST (verb create), both on
    // nodes/proxy of the pod's node; a denial is a 403 naming user, verb and subresource.
    for (method, path, verb) in [("GET", &logs, "get"), ("POST", &exec, "create")] {
        let (status, body) = kubelet_call(&s.env, &worker, method, path);
        assert_eq!(status, 403, "{method} {path} as system:node:worker-7 was not refused: {body}");
        assert_eq!(
            body.trim(),
            format!("Forbidden (user=system:node:worker-7, verb={verb}, resource=nodes, subresource=proxy)"),
            "{method} {path}"
        );
        assert!(!body.contains(&line), "the refused caller saw the log");
    }

    // The API server's own kubelet client (O=system:masters) is served, directly ...
    let (status, body) = kubelet_call(&s.env, &apiserver, "GET", &logs);
    assert_eq!((status, body.as_str()), (200, format!("{line}\n").as_str()));
    // ... and through the training cluster, for logs and exec.
    let (logged, _) = s.both(&["logs", "POD", "--tail=1"], None).await;
    assert_eq!((logged.0, logged.1.as_str()), (0, format!("{line}\n").as_str()), "stderr: {}", logged.2);
    let (ran, _) = s.both(&["exec", "POD", "--", "sh", "-c", &format!("echo ran-{id}")], None).await;
    assert_eq!((ran.0, ran.1.as_str()), (0, format!("ran-{id}\n").as_str()), "stderr: {}", ran.2);
}
