//! Who may ask the kubelet API for what, decided as a kubelet in webhook mode
//! (`--authorization-mode=Webhook`) decides it. A client certificate from the client CA is
//! only authentication: on kubeadm clusters the same CA signs every node's client
//! certificate, and a node must not read the logs of, or run commands in, another node's pods.
//!
//! 1. The caller is its verified certificate's subject, as the API server's x509
//!    authenticator reads it: CN the user, every O a group, plus `system:authenticated`
//!    ([`Identity::from_certificate`]).
//! 2. The request is a verb and a `nodes` subresource, by the kubelet's table ([`asked`]),
//!    about the virtual node of the pod it names, or any of tidepool's virtual nodes.
//! 3. A SubjectAccessReview in the training cluster answers; the answer is cached, allowed
//!    for 5 min and denied for 30 s, the kubelet's defaults ([`Decisions`]). Denied is a 403
//!    worded as the kubelet words it; a review that fails is a 503, never a pass.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use std::time::Duration;
use tidepool_api::sync::Locked;

use hyper::{Method, StatusCode};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{Context, der};

/// How long an allowed decision is reused (kubelet `authorization.webhook.cacheAuthorizedTTL`).
pub(super) const ALLOWED_TTL: Duration = Duration::from_secs(300);
/// How long a denied decision is reused (kubelet `cacheUnauthorizedTTL`): short, so a
/// RoleBinding just created takes effect soon.
pub(super) const DENIED_TTL: Duration = Duration::from_secs(30);
/// Most decisions kept; callers are a handful of API servers, so this is only a bound.
pub(super) const CACHE_CAPACITY: usize = 1024;

/// The group every authenticated user is in, added by the API server's and the kubelet's
/// authenticators alike.
const AUTHENTICATED: &str = "system:authenticated";

/// Who a caller is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub user: String,
    pub groups: Vec<String>,
}

impl Identity {
    /// The identity in a verified leaf certificate. `None` without a common name: the API
    /// server's x509 authenticator does not authenticate such a certificate either.
    pub(super) fn from_certificate(leaf: &[u8]) -> Option<Identity> {
        let subject = der::subject(leaf)?;
        let user = subject.common_name.filter(|cn| !cn.is_empty())?;
        let mut groups = subject.organizations;
        groups.push(AUTHENTICATED.to_owned());
        Some(Identity { user, groups })
    }
}

/// What a request asks of a node, in the kubelet's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Asked<'a> {
    pub verb: String,
    /// Tried in order; the first one allowed grants the request (a fine-grained subresource,
    /// then `proxy`, where the kubelet checks that way).
    pub subresources: &'static [&'static str],
    /// The pod the request is about, `(namespace, name)`: its node is the one asked about.
    pub pod: Option<(&'a str, &'a str)>,
    /// The virtual node a usage path names (`/metrics/resource/<node>`,
    /// `/stats/summary/<node>`): the one asked about.
    pub node: Option<&'a str>,
}

/// The kubelet's request attributes for `method` on `path`: the verb from the method
/// (POST create, GET and HEAD get, PUT update, PATCH patch, DELETE delete), the subresource
/// from the path (`/stats/*` stats, `/metrics/*` metrics, `/logs/*` log, `/spec/*` spec,
/// `/checkpoint/*` checkpoint; `/pods` and `/runningPods` pods, `/healthz` healthz,
/// `/configz` configz, each falling back to proxy; everything else proxy, `/containerLogs`
/// included).
///
/// One departure, stricter: exec, attach, run and port forwarding are `create` whatever the
/// method. A kubelet says `get` for the WebSocket (GET) form, so a `get` on `nodes/proxy`
/// runs commands there; here it does not.
pub(super) fn asked<'a>(method: &Method, path: &'a str) -> Asked<'a> {
    let segments: Vec<&'a str> = path.trim_start_matches('/').split('/').collect();
    let first = segments.first().copied().unwrap_or("");
    let subresources: &'static [&'static str] = match first {
        "stats" => &["stats"],
        "metrics" => &["metrics"],
        "logs" => &["log"],
        "spec" => &["spec"],
        "checkpoint" => &["checkpoint"],
        "pods" | "runningPods" => &["pods", "proxy"],
        "healthz" => &["healthz", "proxy"],
        "configz" => &["configz", "proxy"],
        _ => &["proxy"],
    };
    let runs_commands = matches!(first, "exec" | "attach" | "run" | "portForward");
    let verb = match *method {
        _ if runs_commands => "create".to_owned(),
        Method::POST => "create".to_owned(),
        Method::GET | Method::HEAD => "get".to_owned(),
        Method::PUT => "update".to_owned(),
        Method::PATCH => "patch".to_owned(),
        Method::DELETE => "delete".to_owned(),
        ref other => other.as_str().to_ascii_lowercase(),
    };
    let pod = match segments.as_slice() {
        ["containerLogs" | "exec" | "attach" | "run" | "portForward", ns, pod, ..]
            if !ns.is_empty() && !pod.is_empty() =>
        {
            Some((*ns, *pod))
        }
        _ => None,
    };
    let node = match segments.as_slice() {
        ["metrics", "resource", node] | ["stats", "summary", node] if !node.is_empty() => Some(*node),
        _ => None,
    };
    Asked { verb, subresources, pod, node }
}

/// What one decision is cached under: everything the review was asked. Groups are a set to
/// the authorizer, so their order does not make another entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    user: String,
    groups: Vec<String>,
    verb: String,
    subresource: &'static str,
    node: String,
}

pub(super) fn key(identity: &Identity, verb: &str, subresource: &'static str, node: &str) -> Key {
    let groups: BTreeSet<&String> = identity.groups.iter().collect();
    Key {
        user: identity.user.clone(),
        groups: groups.into_iter().cloned().collect(),
        verb: verb.to_owned(),
        subresource,
        node: node.to_owned(),
    }
}

/// Recent decisions, each until its TTL ends; at most `capacity`, the ones closest to
/// expiry making room first. The caller says what time it is (`tokio::time`'s clock).
#[derive(Debug)]
pub(crate) struct Decisions {
    entries: Mutex<HashMap<Key, (bool, Instant)>>,
    capacity: usize,
}

impl Decisions {
    pub(super) fn new(capacity: usize) -> Self {
        Self { entries: Mutex::new(HashMap::new()), capacity: capacity.max(1) }
    }

    /// Whether `key` was allowed, if that was decided and has not expired.
    pub(super) fn get(&self, key: &Key, now: Instant) -> Option<bool> {
        let entries = self.entries.recovered("authorization cache");
        entries.get(key).filter(|(_, until)| *until > now).map(|(allowed, _)| *allowed)
    }

    pub(super) fn put(&self, key: Key, allowed: bool, now: Instant) {
        let until = now + if allowed { ALLOWED_TTL } else { DENIED_TTL };
        // A poisoned lock means a panic between two map operations: the map is whole.
        let mut entries = self.entries.recovered("authorization cache");
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            entries.retain(|_, (_, until)| *until > now);
            if entries.len() >= self.capacity {
                let soonest = entries.iter().min_by_key(|(_, (_, until))| *until).map(|(k, _)| k.clone());
                if let Some(soonest) = soonest {
                    entries.remove(&soonest);
                }
            }
        }
        entries.insert(key, (allowed, until));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.recovered("authorization cache").len()
    }
}

/// The kubelet's own words for a denied request.
pub(super) fn forbidden_message(identity: &Identity, verb: &str, subresource: &str) -> String {
    format!("Forbidden (user={}, verb={verb}, resource=nodes, subresource={subresource})", identity.user)
}

/// Serves the request (`Ok`) or refuses it with a status and message.
pub(super) async fn authorize(
    ctx: &Context,
    identity: &Identity,
    asked: &Asked<'_>,
) -> Result<(), (StatusCode, String)> {
    let node = node_asked(ctx, asked.pod, asked.node).await;
    let mut last = "proxy";
    for &subresource in asked.subresources {
        last = subresource;
        let key = key(identity, &asked.verb, subresource, &node);
        let allowed = match ctx.decisions.get(&key, Instant::now()) {
            Some(allowed) => allowed,
            None => match review(&ctx.training, identity, &asked.verb, subresource, &node).await {
                Ok((allowed, reason)) => {
                    debug!(user = %identity.user, verb = %asked.verb, subresource, %node, allowed, %reason,
                        "kubelet API access reviewed");
                    ctx.decisions.put(key, allowed, Instant::now());
                    allowed
                }
                Err(error) => {
                    warn!(user = %identity.user, verb = %asked.verb, subresource, %node, %error,
                        "kubelet API access review failed; request refused");
                    return Err((
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "Authorization error (user={}, verb={}, resource=nodes, subresource={subresource})",
                            identity.user, asked.verb
                        ),
                    ));
                }
            },
        };
        if allowed {
            return Ok(());
        }
    }
    info!(user = %identity.user, verb = %asked.verb, subresource = last, %node, "kubelet API request forbidden");
    Err((StatusCode::FORBIDDEN, forbidden_message(identity, &asked.verb, last)))
}

/// The node a request is about ([`node_for`]), the pod's node read from the training cluster.
async fn node_asked(ctx: &Context, pod: Option<(&str, &str)>, named: Option<&str>) -> String {
    let nodes: BTreeSet<String> =
        ctx.members.borrow().values().flat_map(|m| m.pools.iter().map(|p| p.node.to_string())).collect();
    let mut pods_node = None;
    if named.is_none()
        && let Some((namespace, name)) = pod
        && let Ok(Some(pod)) = Api::<Pod>::namespaced(ctx.training.clone(), namespace).get_opt(name).await
    {
        pods_node = pod.spec.and_then(|s| s.node_name);
    }
    node_for(&nodes, named, pods_node)
}

/// The node a request is about: the virtual node it names, or the virtual node of the pod it
/// names. Otherwise (a request about every node this endpoint serves, like `/pods`, a node or
/// pod that is none of tidepool's, a pod not found) no name, so only a grant on every node
/// allows it: one endpoint serves all of tidepool's virtual nodes, so a grant on one of them
/// must not open the others, and a caller without such a grant learns nothing of which pods
/// exist (found or not, the answer is the same 403).
pub(super) fn node_for(nodes: &BTreeSet<String>, named: Option<&str>, pods_node: Option<String>) -> String {
    named.map(str::to_owned).or(pods_node).filter(|n| nodes.contains(n)).unwrap_or_default()
}

/// Asks the training cluster: allowed, and the authorizer's reason.
async fn review(
    client: &Client,
    identity: &Identity,
    verb: &str,
    subresource: &str,
    node: &str,
) -> Result<(bool, String), kube::Error> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(identity.user.clone()),
            groups: Some(identity.groups.clone()),
            resource_attributes: Some(ResourceAttributes {
                group: Some(String::new()),
                version: Some("v1".into()),
                resource: Some("nodes".into()),
                subresource: Some(subresource.into()),
                name: (!node.is_empty()).then(|| node.to_owned()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone()).create(&PostParams::default(), &review).await?;
    let status = answer.status.unwrap_or_default();
    Ok((status.allowed && status.denied != Some(true), status.reason.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::testing::Ca;

    /// Verb, subresources tried, pod named.
    type Expected = (&'static str, &'static [&'static str], Option<(&'static str, &'static str)>);

    #[test]
    fn requests_map_to_the_kubelets_verbs_and_node_subresources() {
        let pod = Some(("ns", "p"));
        let cases: &[(&str, Method, &str, Expected)] = &[
            ("logs of a container are proxy", Method::GET, "/containerLogs/ns/p/c", ("get", &["proxy"], pod)),
            ("exec is create on proxy", Method::POST, "/exec/ns/p/c", ("create", &["proxy"], pod)),
            ("exec with the pod UID too", Method::POST, "/exec/ns/p/uid/c", ("create", &["proxy"], pod)),
            ("attach is create on proxy", Method::POST, "/attach/ns/p/c", ("create", &["proxy"], pod)),
            ("a GET exec (WebSocket) still runs commands", Method::GET, "/exec/ns/p/c", ("create", &["proxy"], pod)),
            ("port forwarding runs on the node", Method::GET, "/portForward/ns/p", ("create", &["proxy"], pod)),
            ("run is create", Method::POST, "/run/ns/p/c", ("create", &["proxy"], pod)),
            ("the pod list is pods, then proxy", Method::GET, "/pods", ("get", &["pods", "proxy"], None)),
            ("running pods as well", Method::GET, "/runningPods/", ("get", &["pods", "proxy"], None)),
            ("healthz is healthz, then proxy", Method::GET, "/healthz", ("get", &["healthz", "proxy"], None)),
            ("a HEAD is a get", Method::HEAD, "/healthz/ping", ("get", &["healthz", "proxy"], None)),
            ("configz is configz, then proxy", Method::GET, "/configz", ("get", &["configz", "proxy"], None)),
            ("node logs are log", Method::GET, "/logs/kubelet.log", ("get", &["log"], None)),
            ("stats", Method::GET, "/stats/summary", ("get", &["stats"], None)),
            ("resource metrics are metrics", Method::GET, "/metrics/resource", ("get", &["metrics"], None)),
            ("metrics", Method::GET, "/metrics/cadvisor", ("get", &["metrics"], None)),
            ("spec", Method::GET, "/spec/", ("get", &["spec"], None)),
            (
                "checkpoint is create on checkpoint",
                Method::POST,
                "/checkpoint/ns/p/c",
                ("create", &["checkpoint"], None),
            ),
            ("a prefix is not a path", Method::GET, "/statsx", ("get", &["proxy"], None)),
            ("anything else is proxy", Method::GET, "/", ("get", &["proxy"], None)),
            ("PUT is update", Method::PUT, "/x", ("update", &["proxy"], None)),
            ("PATCH is patch", Method::PATCH, "/x", ("patch", &["proxy"], None)),
            ("DELETE is delete", Method::DELETE, "/x", ("delete", &["proxy"], None)),
            ("other methods by their name", Method::OPTIONS, "/x", ("options", &["proxy"], None)),
            ("a path without a pod names none", Method::GET, "/containerLogs/ns", ("get", &["proxy"], None)),
            ("an empty pod name names none", Method::GET, "/containerLogs/ns//c", ("get", &["proxy"], None)),
        ];
        for (case, method, path, (verb, subresources, pod)) in cases {
            let expected = Asked { verb: verb.to_string(), subresources, pod: *pod, node: None };
            assert_eq!(asked(method, path), expected, "{case}");
        }
    }

    #[test]
    fn a_request_about_no_one_node_needs_a_grant_on_every_node() {
        let nodes: BTreeSet<String> = ["tidepool-a".to_owned(), "tidepool-b".to_owned()].into();
        assert_eq!(node_for(&nodes, Some("tidepool-b"), None), "tidepool-b");
        assert_eq!(node_for(&nodes, None, Some("tidepool-b".into())), "tidepool-b", "the pod's node");
        // Not the first virtual node (a grant on tidepool-a would open tidepool-b's pods).
        assert_eq!(node_for(&nodes, None, None), "", "/pods, /stats/summary");
        assert_eq!(node_for(&nodes, Some("worker-1"), None), "", "a node not tidepool's");
        assert_eq!(node_for(&nodes, None, Some("worker-1".into())), "", "a pod not on a virtual node");
    }

    #[test]
    fn usage_paths_name_the_node_they_are_about() {
        fn node(path: &str) -> Option<&str> {
            asked(&Method::GET, path).node
        }
        assert_eq!(node("/metrics/resource/tidepool-a"), Some("tidepool-a"));
        assert_eq!(node("/stats/summary/tidepool-a"), Some("tidepool-a"));
        assert_eq!(asked(&Method::GET, "/metrics/resource/tidepool-a").subresources, &["metrics"]);
        assert_eq!(asked(&Method::GET, "/stats/summary/tidepool-a").subresources, &["stats"]);
        for none in ["/metrics/resource", "/stats/summary", "/metrics/resource/", "/metrics/cadvisor/x", "/pods/x"] {
            assert_eq!(node(none), None, "{none}");
        }
    }

    fn identity(user: &str, groups: &[&str]) -> Identity {
        Identity { user: user.into(), groups: groups.iter().map(|g| g.to_string()).collect() }
    }

    #[test]
    fn the_cache_key_is_everything_the_review_asks_and_the_groups_as_a_set() {
        let node = identity("system:node:worker-7", &["system:nodes", "system:authenticated"]);
        let base = key(&node, "get", "proxy", "tidepool-a");
        let reordered = identity("system:node:worker-7", &["system:authenticated", "system:nodes", "system:nodes"]);
        assert_eq!(key(&reordered, "get", "proxy", "tidepool-a"), base, "same groups in another order");
        let differs = [
            ("another user", key(&identity("system:node:worker-8", &node.groups_str()), "get", "proxy", "tidepool-a")),
            (
                "another group",
                key(&identity("system:node:worker-7", &["system:masters"]), "get", "proxy", "tidepool-a"),
            ),
            ("another verb", key(&node, "create", "proxy", "tidepool-a")),
            ("another subresource", key(&node, "get", "pods", "tidepool-a")),
            ("another node", key(&node, "get", "proxy", "tidepool-b")),
        ];
        for (case, other) in differs {
            assert_ne!(other, base, "{case}");
        }
    }

    impl Identity {
        fn groups_str(&self) -> Vec<&str> {
            self.groups.iter().map(String::as_str).collect()
        }
    }

    #[test]
    fn allowed_is_remembered_five_minutes_and_denied_thirty_seconds() {
        let decisions = Decisions::new(16);
        let who = identity("u", &[]);
        let (allowed, denied) = (key(&who, "get", "proxy", "a"), key(&who, "create", "proxy", "a"));
        let start = Instant::now();
        decisions.put(allowed.clone(), true, start);
        decisions.put(denied.clone(), false, start);
        assert_eq!(decisions.get(&allowed, start), Some(true));
        assert_eq!(decisions.get(&denied, start), Some(false));
        let second = Duration::from_secs(1);
        assert_eq!(decisions.get(&denied, start + Duration::from_secs(30) - second), Some(false));
        assert_eq!(decisions.get(&denied, start + Duration::from_secs(30)), None, "denied asks again after 30 s");
        assert_eq!(decisions.get(&allowed, start + Duration::from_secs(300) - second), Some(true));
        assert_eq!(decisions.get(&allowed, start + Duration::from_secs(300)), None, "allowed asks again after 5 min");
        assert_eq!(decisions.get(&key(&who, "get", "pods", "a"), start), None, "never asked");
    }

    #[test]
    fn the_cache_is_bounded_expired_entries_go_first_then_the_soonest_to_expire() {
        let decisions = Decisions::new(3);
        let who = identity("u", &[]);
        let k = |node: &str| key(&who, "get", "proxy", node);
        let start = Instant::now();
        decisions.put(k("denied-early"), false, start);
        decisions.put(k("allowed"), true, start);
        decisions.put(k("denied-later"), false, start + Duration::from_secs(10));
        // Full, nothing expired: the one closest to expiry makes room.
        decisions.put(k("fourth"), true, start + Duration::from_secs(11));
        assert_eq!(decisions.len(), 3);
        assert_eq!(decisions.get(&k("denied-early"), start + Duration::from_secs(11)), None);
        assert_eq!(decisions.get(&k("denied-later"), start + Duration::from_secs(11)), Some(false));
        // Full again, one expired (denied-later at 40 s): it goes, the rest stay.
        decisions.put(k("fifth"), true, start + Duration::from_secs(41));
        assert_eq!(decisions.len(), 3);
        let later = start + Duration::from_secs(41);
        assert_eq!(
            [
                decisions.get(&k("allowed"), later),
                decisions.get(&k("fourth"), later),
                decisions.get(&k("fifth"), later)
            ],
            [Some(true); 3]
        );
        // Replacing an entry never evicts another.
        decisions.put(k("fifth"), false, later);
        assert_eq!(decisions.len(), 3);
        assert_eq!(decisions.get(&k("fifth"), later), Some(false));
    }

    #[test]
    fn the_identity_is_the_certificates_common_name_and_organizations() {
        let ca = Ca::new("client-ca");
        let (cert, _) = ca.issue_with("system:node:worker-7", &["system:nodes"]);
        assert_eq!(
            Identity::from_certificate(&cert),
            Some(identity("system:node:worker-7", &["system:nodes", "system:authenticated"]))
        );
        let (no_group, _) = ca.issue_with("kube-apiserver-kubelet-client", &[]);
        assert_eq!(
            Identity::from_certificate(&no_group),
            Some(identity("kube-apiserver-kubelet-client", &["system:authenticated"]))
        );
        let (nameless, _) = ca.issue_with("", &["system:masters"]);
        assert_eq!(Identity::from_certificate(&nameless), None, "no common name, no user");
    }

    #[test]
    fn a_denial_reads_as_the_kubelets() {
        assert_eq!(
            forbidden_message(&identity("system:node:worker-7", &["system:nodes"]), "get", "proxy"),
            "Forbidden (user=system:node:worker-7, verb=get, resource=nodes, subresource=proxy)"
        );
    }
}
