//! Distributed jobs across the bridge (issue 22, items 1, 2, 7): training Services that select
//! offloaded pods are mirrored into the member, so the copies on member-a's real node find
//! each other by Service name through the member's own EndpointSlices and CoreDNS; member
//! Events about a copy reach the training pod, counted.
//!
//! The pods are bound to the real pool's virtual node by name (as in `real_nodes`), so only
//! the bridge is under test here, not the dispatcher. The local clusters have no kube-proxy
//! (`shared/realnode.md`): connections go through headless Services (as the Kubeflow
//! training operator makes them); a ClusterIP Service is shown mirrored, with its own member
//! cluster IP and the copy in its EndpointSlice.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tidepool_api::crd::NamespaceMode;
use tidepool_api::keys;

use crate::harness::*;

const MEMBER: &str = "e2e-svc-a";
const NODE: &str = "tidepool-e2e-svc-a-real";

/// tidepool bridging member-a's real node as pool `real`, for one test and namespace.
struct Setup {
    env: Env,
    training: Client,
    member: Client,
    ns: String,
    member_ns: String,
    tidepool: Tidepool,
}

impl Setup {
    async fn start(test: &str, ns: &str, mode: NamespaceMode) -> Setup {
        let env = Env::load();
        let training = env.client("training").await;
        let member = env.client("member-a").await;
        let mut mc = member_cluster(MEMBER, test, ns, "member-a");
        mc.spec.pools = vec![real_pool(&env)];
        // SameName is the default: it is left unset, as a member's admin would leave it.
        mc.spec.namespace_mode = (mode == NamespaceMode::Prefixed).then_some(mode);
        let tidepool = start_on_real_node(&env, &training, (test, ns), "", &mc, NODE).await;
        let member_ns = match mode {
            NamespaceMode::SameName => ns.to_owned(),
            NamespaceMode::Prefixed => format!("{}{ns}", keys::DEFAULT_NAMESPACE_PREFIX),
        };
        Setup { env, training, member, ns: ns.to_owned(), member_ns, tidepool }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.training.clone(), &self.ns)
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.training.clone(), &self.ns)
    }

    fn member_services(&self) -> Api<Service> {
        Api::namespaced(self.member.clone(), &self.member_ns)
    }

    /// A training pod bound to the real pool, labelled `labels`, running `script`; `dns`
    /// is `(hostname, subdomain)`.
    async fn run(&self, name: &str, labels: serde_json::Value, dns: Option<(&str, &str)>, script: &str) {
        self.run_image(name, labels, dns, script, self.env.var("WORKLOAD_IMAGE"), "Never").await;
    }

    async fn run_image(
        &self,
        name: &str,
        labels: serde_json::Value,
        dns: Option<(&str, &str)>,
        script: &str,
        image: &str,
        pull: &str,
    ) {
        let mut spec = json!({
            "nodeName": NODE,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": keys::TAINT_VIRTUAL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": pull,
                "command": ["/bin/sh", "-c", script],
                "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}}
            }]
        });
        if let Some((hostname, subdomain)) = dns {
            spec["hostname"] = json!(hostname);
            spec["subdomain"] = json!(subdomain);
        }
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec})).unwrap();
        self.pods().create(&PostParams::default(), &pod).await.unwrap();
    }

    async fn service(&self, name: &str, headless: bool, selector: serde_json::Value, port: i32) {
        let _ = self.services().delete(name, &DeleteParams::default()).await;
        let mut spec = json!({"selector": selector, "ports": [{"name": "rdzv", "port": port, "targetPort": port}]});
        if headless {
            spec["clusterIP"] = json!("None");
            // Workers dial the master before it is Ready (it has no readiness probe either way).
            spec["publishNotReadyAddresses"] = json!(true);
        }
        let svc: Service = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
        wait_for(Duration::from_secs(30), "training Service created", || {
            let (api, svc) = (self.services(), svc.clone());
            async move { api.create(&PostParams::default(), &svc).await.ok().map(|_| ()) }
        })
        .await;
    }

    /// Waits for `name` to finish; its phase and what the process wrote to its termination
    /// message (the copy of a finished pod is gone with its logs; its status came up).
    async fn finished(&self, name: &str) -> (String, String) {
        wait_for(Duration::from_secs(120), &format!("{name} finished"), || {
            let pods = self.pods();
            async move {
                let status = pods.get(name).await.ok()?.status?;
                let phase = status.phase.filter(|p| p == "Succeeded" || p == "Failed")?;
                let terminated = status.container_statuses?.first()?.state.as_ref()?.terminated.clone()?;
                Some((phase, terminated.message.unwrap_or_default()))
            }
        })
        .await
    }

    async fn mirror(&self, name: &str) -> Option<Service> {
        self.member_services().get_opt(name).await.unwrap()
    }

    /// Waits for the member's mirror of Service `name`: it lives only while a copy it
    /// selects exists (a finished pod's copy is deleted at once, step row 7).
    async fn mirrored(&self, name: &str) -> Service {
        wait_for(Duration::from_secs(60), &format!("mirror of {name}"), || async move {
            self.member_services().get_opt(name).await.ok()?
        })
        .await
    }

    async fn mirror_gone(&self, name: &str) {
        wait_for(Duration::from_secs(60), &format!("mirror of {name} removed"), || async move {
            self.member_services().get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await;
    }
}

/// A worker's script: dial `addr`:23456 until the master answers (bounded), print its word.
fn worker_script(addr: &str) -> String {
    format!(
        "export MASTER_ADDR={addr} MASTER_PORT=23456; \
         for i in $(seq 120); do r=$(nc -w 2 $MASTER_ADDR $MASTER_PORT </dev/null 2>/dev/null); \
         [ -n \"$r\" ] && echo \"joined $r\" >/dev/termination-log && exit 0; sleep 0.5; done; \
         echo never reached $MASTER_ADDR >/dev/termination-log; exit 1"
    )
}

/// The master's script: answer `workers` rendezvous connections, then finish.
fn master_script(workers: u32) -> String {
    format!("for i in $(seq {workers}); do echo rdzv-$i | nc -l -p 23456; done; echo all joined >/dev/termination-log")
}

/// A PyTorchJob's shape: master pod + a Service named for it + workers that dial
/// `MASTER_ADDR`; every process finishes once the rendezvous is reached.
async fn pytorchjob(s: &Setup, master_addr: impl Fn(&str) -> String) {
    let id = run_id();
    let job = format!("ptj-{id}");
    let master_svc = format!("{job}-master-0");
    let role = |r: &str| json!({"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": r});
    s.service(&master_svc, true, role("master"), 23456).await;
    s.run(&format!("{job}-master-0"), role("master"), None, &master_script(2)).await;
    // The mirror selects by tidepool's labels only: no tenant key is in the member's selector.
    // Read while the master's copy runs: the workers cannot finish before they reach it.
    let mirror = s.mirrored(&master_svc).await;
    let selector = mirror.spec.unwrap().selector.unwrap();
    assert!(selector.keys().all(|k| k.starts_with("svc.tidepool.io/")), "{selector:?}");
    for w in 0..2 {
        s.run(&format!("{job}-worker-{w}"), role("worker"), None, &worker_script(&master_addr(&master_svc))).await;
    }
    let (phase, logs) = s.finished(&format!("{job}-master-0")).await;
    assert_eq!((phase.as_str(), logs.trim()), ("Succeeded", "all joined"), "{}", s.tidepool.log_tail());
    for w in 0..2 {
        let (phase, logs) = s.finished(&format!("{job}-worker-{w}")).await;
        assert_eq!(phase, "Succeeded", "worker {w}: {logs}");
        assert!(logs.starts_with("joined rdzv-"), "worker {w}: {logs}");
    }
    drain_pods(&s.training, &s.ns).await;
    s.mirror_gone(&master_svc).await;
}

#[tokio::test]
async fn a_pytorchjob_shaped_job_reaches_its_master_by_service_name_and_finishes() {
    let s = Setup::start("services", "e2e-services", NamespaceMode::Prefixed).await;
    pytorchjob(&s, |svc| svc.to_owned()).await;
}

#[tokio::test]
async fn same_name_namespaces_let_a_job_use_the_training_namespaces_fqdn() {
    let ns = "e2e-services-same";
    let s = Setup::start("services-same", ns, NamespaceMode::SameName).await;
    assert_eq!(s.member_ns, ns);
    pytorchjob(&s, |svc| format!("{svc}.{ns}.svc.cluster.local")).await;
}

#[tokio::test]
async fn a_jobset_shaped_job_reaches_its_pods_by_hostname_and_subdomain() {
    let s = Setup::start("services-jobset", "e2e-services-jobset", NamespaceMode::Prefixed).await;
    let id = run_id();
    let js = format!("js-{id}");
    let labels = json!({"jobset.sigs.k8s.io/jobset-name": js});
    s.service(&js, true, labels.clone(), 23456).await;
    // A ClusterIP Service of the same pods: mirrored with an address of the member's own.
    let ip_svc = format!("{js}-ip");
    s.service(&ip_svc, false, labels.clone(), 23456).await;
    let leader = format!("{js}-leader-0");
    // The leader stays up after the rendezvous, so the ClusterIP Service has an endpoint.
    s.run(&leader, labels.clone(), Some((&leader, &js)), &format!("{}; exec sleep 3600", master_script(1))).await;
    let follower = format!("{js}-follower-0");
    s.run(&follower, labels.clone(), Some((&follower, &js)), &worker_script(&format!("{leader}.{js}"))).await;
    let (phase, logs) = s.finished(&follower).await;
    assert_eq!((phase.as_str(), logs.trim()), ("Succeeded", "joined rdzv-1"), "{}", s.tidepool.log_tail());

    let mirror = s.mirror(&ip_svc).await.expect("the ClusterIP Service is mirrored");
    let ip = mirror.spec.unwrap().cluster_ip.unwrap_or_default();
    let training_ip = s.services().get(&ip_svc).await.unwrap().spec.unwrap().cluster_ip.unwrap_or_default();
    assert!(!ip.is_empty() && ip != "None", "the member allocated a cluster IP: {ip:?}");
    // The member's EndpointSlice controller lists the leader's copy behind it.
    let slices = Api::<EndpointSlice>::namespaced(s.member.clone(), &s.member_ns);
    let leader_ip = s.pods().get(&leader).await.unwrap().status.unwrap().pod_ip.unwrap();
    let selector = format!("kubernetes.io/service-name={ip_svc}");
    wait_for(Duration::from_secs(30), "the leader's copy in the mirror's EndpointSlice", || {
        let (slices, selector, leader_ip) = (slices.clone(), selector.clone(), leader_ip.clone());
        async move {
            let items = slices.list(&ListParams::default().labels(&selector)).await.ok()?.items;
            let mut addresses =
                items.into_iter().flat_map(|s| s.endpoints.unwrap_or_default()).flat_map(|e| e.addresses);
            addresses.any(|a| a == leader_ip).then_some(())
        }
    })
    .await;
    assert_ne!(ip, training_ip, "the member's own address, not the training cluster's");
    drain_pods(&s.training, &s.ns).await;
    s.mirror_gone(&js).await;
    s.mirror_gone(&ip_svc).await;
}

#[tokio::test]
async fn a_member_service_tidepool_does_not_own_is_never_overwritten_and_mirrors_leave_with_the_last_copy() {
    let s = Setup::start("services-conflict", "e2e-services-conflict", NamespaceMode::Prefixed).await;
    let id = run_id();
    let labels = json!({"app": format!("a-{id}")});
    let pod = format!("p-{id}");
    s.run(&pod, labels.clone(), None, "exec sleep 3600").await;
    wait_for(Duration::from_secs(90), "copy running", || async {
        (s.pods().get(&pod).await.ok()?.status?.phase? == "Running").then_some(())
    })
    .await;
    // The member's own Service, made before the tenant's of the same name.
    let clash = format!("clash-{id}");
    let theirs: Service = serde_json::from_value(json!({
        "metadata": {"name": clash, "labels": {"team": "online"}},
        "spec": {"selector": {"app": "online"}, "ports": [{"port": 80}]}
    }))
    .unwrap();
    s.member_services().create(&PostParams::default(), &theirs).await.unwrap();
    s.service(&clash, false, labels.clone(), 80).await;
    let mirrored = format!("ok-{id}");
    s.service(&mirrored, true, labels.clone(), 80).await;

    // The tenant is told, on its Service.
    let events = Api::<Event>::namespaced(s.training.clone(), &s.ns);
    let told = wait_for(Duration::from_secs(60), "ServiceMirrorConflict on the training Service", || {
        let (events, clash) = (events.clone(), clash.clone());
        async move {
            let list =
                events.list(&ListParams::default().fields(&format!("involvedObject.name={clash}"))).await.ok()?;
            list.items.into_iter().find(|e| e.reason.as_deref() == Some(keys::REASON_SERVICE_CONFLICT))
        }
    })
    .await;
    assert_eq!(told.type_.as_deref(), Some("Warning"));
    // The other one is mirrored; the member's own is as it was.
    wait_for(Duration::from_secs(30), "the other Service mirrored", || async { s.mirror(&mirrored).await }).await;
    let untouched = s.mirror(&clash).await.unwrap();
    assert_eq!(untouched.metadata.labels, Some(BTreeMap::from([("team".to_owned(), "online".to_owned())])));
    assert_eq!(untouched.spec.unwrap().selector, Some(BTreeMap::from([("app".to_owned(), "online".to_owned())])));

    // The last copy leaves: its mirror goes, the member's own stays.
    drain_pods(&s.training, &s.ns).await;
    s.mirror_gone(&mirrored).await;
    assert!(s.mirror(&clash).await.is_some(), "the member's own Service was deleted");
    s.member_services().delete(&clash, &DeleteParams::default()).await.unwrap();
}

/// The member already has a namespace of the training namespace's name: it is never shared;
/// that training namespace's copies go to the prefixed namespace, said once on the pod.
#[tokio::test]
async fn a_member_namespace_that_is_not_tidepools_is_never_shared_its_pods_fall_back_to_the_prefix() {
    let ns = "e2e-services-taken";
    let env = Env::load();
    let member = env.client("member-a").await;
    // The member's own namespace of that name.
    ensure_namespace(&member, ns).await;
    let s = Setup::start("services-taken", ns, NamespaceMode::SameName).await;
    let labels = Api::<Namespace>::all(member.clone()).get(ns).await.unwrap().metadata.labels.unwrap_or_default();
    assert!(!labels.contains_key(keys::LABEL_MANAGED_BY), "the test's namespace must be the member's own");
    let pod = format!("p-{}", run_id());
    s.run(&pod, json!({}), None, "exec sleep 3600").await;
    let events = Api::<Event>::namespaced(s.training.clone(), ns);
    wait_for(Duration::from_secs(60), "OffloadNamespaceFallback on the pod", || {
        let (events, pod) = (events.clone(), pod.clone());
        async move {
            let list = events.list(&ListParams::default().fields(&format!("involvedObject.name={pod}"))).await.ok()?;
            list.items
                .iter()
                .any(|e| e.reason.as_deref() == Some(keys::REASON_OFFLOAD_NAMESPACE_FALLBACK))
                .then_some(())
        }
    })
    .await;
    let fallback = format!("{}{ns}", keys::DEFAULT_NAMESPACE_PREFIX);
    let in_fallback = Api::<Pod>::namespaced(member.clone(), &fallback);
    wait_for(Duration::from_secs(60), "the copy in the prefixed namespace", || {
        let (api, pod) = (in_fallback.clone(), pod.clone());
        async move { api.get_opt(&pod).await.ok().flatten() }
    })
    .await;
    let copies = Api::<Pod>::namespaced(member.clone(), ns).list(&ListParams::default()).await.unwrap();
    assert!(copies.items.is_empty(), "a copy went into the member's own namespace");
    let made = Api::<Namespace>::all(member.clone()).get(&fallback).await.unwrap();
    assert_eq!(
        kube::ResourceExt::labels(&made).get(keys::LABEL_ORIGIN_NAMESPACE).map(String::as_str),
        Some(ns),
        "the fallback is recorded"
    );
    drain_pods(&s.training, ns).await;
}

#[tokio::test]
async fn member_events_of_a_pod_whose_image_does_not_exist_reach_the_training_pod_counted() {
    let s = Setup::start("services-events", "e2e-services-events", NamespaceMode::Prefixed).await;
    let pod = format!("missing-{}", run_id());
    s.run_image(&pod, json!({}), None, "true", "tidepool.invalid/does-not-exist:1", "IfNotPresent").await;
    let events = Api::<Event>::namespaced(s.training.clone(), &s.ns);
    let selector = format!("involvedObject.name={pod}");
    // The kubelet's pull failures and back-off, on the training pod; the back-off said more
    // than once is one Event with a count.
    let relayed = wait_for(Duration::from_secs(120), "the member's BackOff counted on the training pod", || {
        let (events, selector) = (events.clone(), selector.clone());
        async move {
            let list = events.list(&ListParams::default().fields(&selector)).await.ok()?.items;
            let back_off: Vec<&Event> = list.iter().filter(|e| e.reason.as_deref() == Some("BackOff")).collect();
            let counted = back_off.len() == 1 && back_off[0].count.unwrap_or(0) >= 2;
            let failed = list.iter().any(|e| e.reason.as_deref() == Some("Failed"));
            (counted && failed).then_some(list)
        }
    })
    .await;
    let uid = s.pods().get(&pod).await.unwrap().metadata.uid;
    // Every relayed one (from the member's kubelet) is about the training pod itself.
    let from_member = format!("{MEMBER}/");
    let relayed: Vec<Event> = relayed
        .into_iter()
        .filter(|e| e.source.as_ref().and_then(|s| s.component.as_deref()).is_some_and(|c| c.starts_with(&from_member)))
        .collect();
    assert!(relayed.len() >= 2, "{relayed:?}");
    for e in &relayed {
        assert_eq!(e.involved_object.uid, uid, "about the training pod: {e:?}");
    }
    let failed: Vec<&Event> = relayed.iter().filter(|e| e.reason.as_deref() == Some("Failed")).collect();
    let messages: std::collections::BTreeSet<_> = failed.iter().map(|e| e.message.clone()).collect();
    assert_eq!(failed.len(), messages.len(), "one Event per message, counted, not copies: {failed:?}");
    let (code, out, err) = kubectl(&s.env, "training", &["-n", &s.ns, "describe", "pod", &pod], None).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("BackOff") && out.contains(&format!("{MEMBER}/kubelet")), "{out}");
    drain_pods(&s.training, &s.ns).await;
}
