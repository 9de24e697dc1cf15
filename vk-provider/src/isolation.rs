//! The NetworkPolicy of an offload namespace (`spec.networkPolicy` of the member): written
//! before the namespace's first copy, so a tenant's process on a member reaches its own job
//! and the member's DNS, and not the online pods and Services, node ports or metadata
//! endpoints around it. What a job needs besides (its checkpoint store) the member's admin
//! adds. The member's CNI enforces it; a CNI that enforces no NetworkPolicy (the plain
//! bridge plugin) leaves copies as open as any pod there.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client};
use tidepool_api::crd::NetworkIsolation;
use tidepool_api::keys;
use tidepool_api::sync::Locked as _;
use tracing::info;

/// The policy's name in every offload namespace.
pub const POLICY_NAME: &str = "tidepool-isolation";

/// Where a member's cluster DNS runs, as kubeadm, the managed offerings and CoreDNS's own
/// manifests label it.
const DNS_NAMESPACE: &str = "kube-system";
const DNS_LABEL: (&str, &str) = ("k8s-app", "kube-dns");

/// The NetworkPolicy of offload namespace `namespace`, or `None` when the member's admin
/// turned it off. Every pod of the namespace (they are all copies) takes traffic from the
/// namespace and sends it there and to the cluster DNS, plus the admin's own rules.
pub fn policy(namespace: &str, labels: BTreeMap<String, String>, spec: &NetworkIsolation) -> Option<NetworkPolicy> {
    if spec.disabled {
        return None;
    }
    let same_namespace = || NetworkPolicyPeer { pod_selector: Some(LabelSelector::default()), ..Default::default() };
    let dns = NetworkPolicyPeer {
        namespace_selector: Some(matching("kubernetes.io/metadata.name", DNS_NAMESPACE)),
        pod_selector: Some(matching(DNS_LABEL.0, DNS_LABEL.1)),
        ip_block: None,
    };
    let port = |protocol: &str| NetworkPolicyPort {
        protocol: Some(protocol.to_owned()),
        port: Some(IntOrString::Int(53)),
        end_port: None,
    };
    let mut ingress = vec![NetworkPolicyIngressRule { from: Some(vec![same_namespace()]), ports: None }];
    ingress.extend(spec.ingress.iter().cloned());
    let mut egress = vec![
        NetworkPolicyEgressRule { to: Some(vec![same_namespace()]), ports: None },
        NetworkPolicyEgressRule { to: Some(vec![dns]), ports: Some(vec![port("UDP"), port("TCP")]) },
    ];
    egress.extend(spec.egress.iter().cloned());
    Some(NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(POLICY_NAME.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector::default()),
            policy_types: Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            ingress: Some(ingress),
            egress: Some(egress),
        }),
    })
}

fn matching(key: &str, value: &str) -> LabelSelector {
    LabelSelector { match_labels: Some([(key.to_owned(), value.to_owned())].into()), match_expressions: None }
}

/// Writes a member session's offload namespaces' policy, once per namespace per session (a
/// changed `spec.networkPolicy` starts a new session, which writes it again).
pub(crate) struct Isolation {
    client: Client,
    member: String,
    labels: BTreeMap<String, String>,
    spec: Arc<NetworkIsolation>,
    done: Mutex<HashSet<String>>,
}

impl Isolation {
    pub(crate) fn new(client: Client, (cluster, member): (&str, &str), spec: Arc<NetworkIsolation>) -> Self {
        let labels = [
            (keys::LABEL_MANAGED_BY, keys::MANAGED_BY),
            (keys::LABEL_ORIGIN_CLUSTER, cluster),
            (keys::LABEL_ORIGIN_MEMBER, member),
        ];
        let labels = labels.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
        Self { client, member: member.to_owned(), labels, spec, done: Mutex::default() }
    }

    /// Makes `namespace`'s policy what the member asks (server-side apply; deleted when
    /// turned off). A failure is returned: no copy goes into a namespace left open.
    pub(crate) async fn ensure(&self, namespace: &str) -> Result<(), kube::Error> {
        if self.done.locked_or_log("isolated namespaces").is_some_and(|d| d.contains(namespace)) {
            return Ok(());
        }
        let api = Api::<NetworkPolicy>::namespaced(self.client.clone(), namespace);
        match policy(namespace, self.labels.clone(), &self.spec) {
            Some(p) => {
                let params = PatchParams::apply(keys::MANAGED_BY).force();
                api.patch(POLICY_NAME, &params, &Patch::Apply(&p)).await?;
                info!(member = %self.member, namespace, "offload namespace isolated");
            }
            None => match api.delete(POLICY_NAME, &DeleteParams::default()).await {
                Ok(_) => info!(member = %self.member, namespace, "offload namespace isolation removed, as asked"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            },
        }
        if let Some(mut done) = self.done.locked_or_log("isolated namespaces") {
            done.insert(namespace.to_owned());
        }
        Ok(())
    }

    /// Forgets `namespace` (it was deleted): made again, it gets its policy again.
    pub(crate) fn forget(&self, namespace: &str) {
        if let Some(mut done) = self.done.locked_or_log("isolated namespaces") {
            done.remove(namespace);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn written(spec: &NetworkIsolation) -> serde_json::Value {
        serde_json::to_value(policy("team-a", BTreeMap::new(), spec)).unwrap()
    }

    #[test]
    fn copies_reach_their_namespace_and_the_members_dns_only() {
        let p = written(&NetworkIsolation::default());
        assert_eq!(p["metadata"]["name"], POLICY_NAME);
        assert_eq!(p["spec"]["podSelector"], json!({}), "every pod of the namespace");
        assert_eq!(p["spec"]["policyTypes"], json!(["Ingress", "Egress"]), "both ways closed but for the rules");
        assert_eq!(p["spec"]["ingress"], json!([{"from": [{"podSelector": {}}]}]));
        assert_eq!(
            p["spec"]["egress"],
            json!([
                {"to": [{"podSelector": {}}]},
                {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                         "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                 "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
            ]),
            "no ipBlock: nothing outside the namespace but DNS"
        );
    }

    #[test]
    fn the_admins_rules_come_after_the_defaults_and_off_writes_none() {
        let spec: NetworkIsolation = serde_json::from_value(json!({
            "egress": [{"to": [{"ipBlock": {"cidr": "10.9.0.0/24"}}], "ports": [{"port": 9000}]}],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}]
        }))
        .unwrap();
        let p = written(&spec);
        assert_eq!(p["spec"]["egress"][2]["to"][0]["ipBlock"]["cidr"], "10.9.0.0/24");
        assert_eq!(p["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]["name"], "monitoring");
        assert_eq!(p["spec"]["egress"].as_array().unwrap().len(), 3);
        let off = NetworkIsolation { disabled: true, ..spec };
        assert!(policy("team-a", BTreeMap::new(), &off).is_none());
    }
}
