//! Reflection, the pure part: which ConfigMaps and Secrets a pod references, what their
//! copies in a member look like, when a copy is stale, and which copies nothing uses.
//!
//! A pod reads ConfigMaps and Secrets of its own namespace through volumes, projected volume
//! sources, `env[].valueFrom`, `envFrom` (in every kind of container) and image pull
//! secrets. Its offload copy runs in the member namespace, so tidepool copies those objects
//! there before creating it, keeps the copies current, and deletes a copy once no pod in that
//! namespace uses it. The I/O around these functions is in `copies` (sync) and `collect`
//! (deletion).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{ConfigMap, EnvFromSource, EnvVar, PodSpec, Secret, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tidepool_api::keys;

use crate::translate;

/// The two kinds of object tidepool reflects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    ConfigMap,
    Secret,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::ConfigMap => "ConfigMap",
            Kind::Secret => "Secret",
        })
    }
}

/// A ConfigMap or Secret in the pod's namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Source {
    pub kind: Kind,
    pub name: String,
}

impl Source {
    pub fn new(kind: Kind, name: impl Into<String>) -> Self {
        Self { kind, name: name.into() }
    }
}

/// How a pod uses a source: whether it can start without it, and where it says so (the
/// first required reference, else the first one), for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Use {
    pub required: bool,
    pub field: String,
}

/// Every source a pod references, each once.
pub type References = BTreeMap<Source, Use>;

/// ConfigMaps every namespace of every cluster has, kept by that cluster itself (the API
/// server's CA, published by the root-ca-cert-publisher): the member's own copy is the right
/// one for a pod running there, and copying over it would fight that controller.
const CLUSTER_OWNED_CONFIG_MAPS: [&str; 1] = ["kube-root-ca.crt"];

/// The ConfigMaps and Secrets `spec` references. Volumes translation drops (the
/// training service-account token's) do not count: their objects never travel.
pub fn references(spec: &PodSpec) -> References {
    let mut refs = Refs::default();
    for (i, volume) in spec.volumes.iter().flatten().enumerate() {
        if translate::carries_training_token(volume) {
            continue;
        }
        let path = format!("spec.volumes[{i}]");
        if let Some(cm) = &volume.config_map {
            refs.add(Kind::ConfigMap, &cm.name, cm.optional, format!("{path}.configMap.name"));
        }
        if let Some(secret) = &volume.secret
            && let Some(name) = &secret.secret_name
        {
            refs.add(Kind::Secret, name, secret.optional, format!("{path}.secret.secretName"));
        }
        let projections = volume.projected.iter().flat_map(|p| p.sources.iter().flatten());
        for (j, projection) in projections.enumerate() {
            if let Some(cm) = &projection.config_map {
                refs.add(
                    Kind::ConfigMap,
                    &cm.name,
                    cm.optional,
                    format!("{path}.projected.sources[{j}].configMap.name"),
                );
            }
            if let Some(secret) = &projection.secret {
                refs.add(
                    Kind::Secret,
                    &secret.name,
                    secret.optional,
                    format!("{path}.projected.sources[{j}].secret.name"),
                );
            }
        }
    }
    for (i, c) in spec.init_containers.iter().flatten().enumerate() {
        refs.container(&format!("spec.initContainers[{i}]"), c.env.as_deref(), c.env_from.as_deref());
    }
    for (i, c) in spec.containers.iter().enumerate() {
        refs.container(&format!("spec.containers[{i}]"), c.env.as_deref(), c.env_from.as_deref());
    }
    for (i, c) in spec.ephemeral_containers.iter().flatten().enumerate() {
        refs.container(&format!("spec.ephemeralContainers[{i}]"), c.env.as_deref(), c.env_from.as_deref());
    }
    // The kubelet pulls without a missing pull secret (and fails only if the registry
    // insists), so these never hold a pod back.
    for (i, secret) in spec.image_pull_secrets.iter().flatten().enumerate() {
        refs.add(Kind::Secret, &secret.name, Some(true), format!("spec.imagePullSecrets[{i}].name"));
    }
    refs.0
}

/// `spec` without its references to `absent` sources: optional ones that do not exist in
/// training (a required one holds the pod back instead). Kept, the member's kubelet would
/// resolve them against whatever object of that name sits in the offload namespace — one
/// tidepool never copied. Each goes the way the kubelet treats a missing optional source: a
/// volume becomes an empty directory (its mounts keep working), a projection, an env var,
/// an `envFrom` entry and an image pull secret are left out.
pub fn drop_references(spec: &mut PodSpec, absent: &BTreeSet<Source>) {
    if absent.is_empty() {
        return;
    }
    let gone = |kind: Kind, name: &str| absent.contains(&Source::new(kind, name));
    for volume in spec.volumes.iter_mut().flatten() {
        let mut empty = volume.config_map.as_ref().is_some_and(|cm| gone(Kind::ConfigMap, &cm.name))
            || volume.secret.as_ref().and_then(|s| s.secret_name.as_deref()).is_some_and(|n| gone(Kind::Secret, n));
        if let Some(sources) = volume.projected.as_mut().and_then(|p| p.sources.as_mut()) {
            let before = sources.len();
            sources.retain(|p| {
                !(p.config_map.as_ref().is_some_and(|cm| gone(Kind::ConfigMap, &cm.name))
                    || p.secret.as_ref().is_some_and(|s| gone(Kind::Secret, &s.name)))
            });
            empty |= before > 0 && sources.is_empty();
        }
        if empty {
            *volume = Volume {
                name: std::mem::take(&mut volume.name),
                empty_dir: Some(Default::default()),
                ..Default::default()
            };
        }
    }
    let containers = spec.init_containers.iter_mut().flatten().map(|c| (&mut c.env, &mut c.env_from));
    let app = spec.containers.iter_mut().map(|c| (&mut c.env, &mut c.env_from));
    let ephemeral = spec.ephemeral_containers.iter_mut().flatten().map(|c| (&mut c.env, &mut c.env_from));
    for (env, env_from) in containers.chain(app).chain(ephemeral) {
        if let Some(env) = env.as_mut() {
            env.retain(|var| {
                let from = var.value_from.as_ref();
                !(from.and_then(|f| f.config_map_key_ref.as_ref()).is_some_and(|r| gone(Kind::ConfigMap, &r.name))
                    || from.and_then(|f| f.secret_key_ref.as_ref()).is_some_and(|r| gone(Kind::Secret, &r.name)))
            });
        }
        if let Some(env_from) = env_from.as_mut() {
            env_from.retain(|f| {
                !(f.config_map_ref.as_ref().is_some_and(|r| gone(Kind::ConfigMap, &r.name))
                    || f.secret_ref.as_ref().is_some_and(|r| gone(Kind::Secret, &r.name)))
            });
        }
    }
    if let Some(pull) = spec.image_pull_secrets.as_mut() {
        pull.retain(|p| !gone(Kind::Secret, &p.name));
    }
}

#[derive(Default)]
struct Refs(References);

impl Refs {
    fn add(&mut self, kind: Kind, name: &str, optional: Option<bool>, field: String) {
        if name.is_empty() || (kind == Kind::ConfigMap && CLUSTER_OWNED_CONFIG_MAPS.contains(&name)) {
            return;
        }
        let required = optional != Some(true);
        let entry = self.0.entry(Source::new(kind, name)).or_insert_with(|| Use { required, field: field.clone() });
        if required && !entry.required {
            *entry = Use { required, field };
        }
    }

    fn container(&mut self, path: &str, env: Option<&[EnvVar]>, env_from: Option<&[EnvFromSource]>) {
        for (k, var) in env.into_iter().flatten().enumerate() {
            let Some(from) = &var.value_from else { continue };
            if let Some(r) = &from.config_map_key_ref {
                self.add(
                    Kind::ConfigMap,
                    &r.name,
                    r.optional,
                    format!("{path}.env[{k}].valueFrom.configMapKeyRef.name"),
                );
            }
            if let Some(r) = &from.secret_key_ref {
                self.add(Kind::Secret, &r.name, r.optional, format!("{path}.env[{k}].valueFrom.secretKeyRef.name"));
            }
        }
        for (k, from) in env_from.into_iter().flatten().enumerate() {
            if let Some(r) = &from.config_map_ref {
                self.add(Kind::ConfigMap, &r.name, r.optional, format!("{path}.envFrom[{k}].configMapRef.name"));
            }
            if let Some(r) = &from.secret_ref {
                self.add(Kind::Secret, &r.name, r.optional, format!("{path}.envFrom[{k}].secretRef.name"));
            }
        }
    }
}

/// Where copies go and whose they are.
#[derive(Debug, Clone)]
pub struct CopyTarget<'a> {
    /// Bridge `clusterName`.
    pub cluster: &'a str,
    /// `MemberCluster` name.
    pub member: &'a str,
    /// The member namespace.
    pub namespace: &'a str,
}

/// Why a training object is not copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReflectable {
    #[error("has no {0}")]
    MissingField(&'static str),
    /// Training credentials never travel to a member (deploy/docs/security.md).
    #[error("is a service-account token of the training cluster, and those stay there")]
    ServiceAccountToken,
}

/// Label selector of the copies one tidepool instance made in one member: all three labels,
/// so two training clusters (or two instances) sharing a member never collect each other's.
pub fn copy_selector(cluster: &str, member: &str) -> String {
    format!(
        "{}=true,{}={cluster},{}={member}",
        keys::LABEL_REFLECTED,
        keys::LABEL_ORIGIN_CLUSTER,
        keys::LABEL_ORIGIN_MEMBER
    )
}

/// True when `meta` is a copy this instance made in this member (so it may update or
/// delete it); anything else of the same name belongs to someone else.
pub fn is_ours(meta: &ObjectMeta, cluster: &str, member: &str) -> bool {
    let Some(labels) = meta.labels.as_ref() else { return false };
    labels.get(keys::LABEL_REFLECTED).map(String::as_str) == Some("true")
        && labels.get(keys::LABEL_ORIGIN_CLUSTER).map(String::as_str) == Some(cluster)
        && labels.get(keys::LABEL_ORIGIN_MEMBER).map(String::as_str) == Some(member)
}

/// True when `copy` was made from the current version of `source`. Resource versions are
/// unique across a cluster's objects, so a source deleted and created again never matches.
pub fn is_current(copy: &ObjectMeta, source: &ObjectMeta) -> bool {
    let made_from = copy.annotations.as_ref().and_then(|a| a.get(keys::ANNOTATION_ORIGIN_RESOURCE_VERSION));
    made_from.is_some() && made_from == source.resource_version.as_ref()
}

/// Metadata of a copy: its origin, never the source's own labels (they could match a
/// member's selectors) nor its identity fields.
fn copy_meta(source: &ObjectMeta, target: &CopyTarget<'_>) -> Result<ObjectMeta, NotReflectable> {
    let name = source.name.clone().ok_or(NotReflectable::MissingField("metadata.name"))?;
    let namespace = source.namespace.clone().ok_or(NotReflectable::MissingField("metadata.namespace"))?;
    let version = source.resource_version.clone().ok_or(NotReflectable::MissingField("metadata.resourceVersion"))?;
    let labels = [
        (keys::LABEL_MANAGED_BY, keys::MANAGED_BY),
        (keys::LABEL_REFLECTED, "true"),
        (keys::LABEL_ORIGIN_CLUSTER, target.cluster),
        (keys::LABEL_ORIGIN_MEMBER, target.member),
    ];
    let annotations = [
        (keys::ANNOTATION_ORIGIN_NAMESPACE, namespace),
        (keys::ANNOTATION_ORIGIN_NAME, name.clone()),
        (keys::ANNOTATION_ORIGIN_RESOURCE_VERSION, version),
    ];
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(target.namespace.to_owned()),
        labels: Some(labels.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect()),
        annotations: Some(annotations.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()),
        ..Default::default()
    })
}

/// The member copy of a training ConfigMap. `immutable` is not carried: the copy must follow
/// a source that is deleted and created again under the same name.
pub fn config_map_copy(source: &ConfigMap, target: &CopyTarget<'_>) -> Result<ConfigMap, NotReflectable> {
    Ok(ConfigMap {
        metadata: copy_meta(&source.metadata, target)?,
        data: source.data.clone(),
        binary_data: source.binary_data.clone(),
        immutable: None,
    })
}

/// The member copy of a training Secret (not carrying `immutable`, as for ConfigMaps).
pub fn secret_copy(source: &Secret, target: &CopyTarget<'_>) -> Result<Secret, NotReflectable> {
    if source.type_.as_deref() == Some("kubernetes.io/service-account-token") {
        return Err(NotReflectable::ServiceAccountToken);
    }
    Ok(Secret {
        metadata: copy_meta(&source.metadata, target)?,
        data: source.data.clone(),
        string_data: None,
        type_: source.type_.clone(),
        immutable: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    fn names(refs: &References) -> Vec<(Kind, &str, bool)> {
        refs.iter().map(|(s, u)| (s.kind, s.name.as_str(), u.required)).collect()
    }

    #[test]
    fn every_way_of_referencing_is_found_in_every_kind_of_container() {
        let s = spec(json!({
            "volumes": [
                {"name": "a", "configMap": {"name": "cm-volume"}},
                {"name": "b", "secret": {"secretName": "secret-volume"}},
                {"name": "c", "projected": {"sources": [{"configMap": {"name": "cm-projected"}},
                                                         {"secret": {"name": "secret-projected"}}]}},
                {"name": "d", "emptyDir": {}}
            ],
            "initContainers": [{"name": "init", "envFrom": [{"configMapRef": {"name": "cm-init-envfrom"}}]}],
            "containers": [{"name": "main",
                "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm-env", "key": "a"}}},
                        {"name": "B", "valueFrom": {"secretKeyRef": {"name": "secret-env", "key": "b"}}},
                        {"name": "C", "value": "plain"},
                        {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "envFrom": [{"secretRef": {"name": "secret-envfrom"}}]}],
            "ephemeralContainers": [{"name": "debug", "env": [{"name": "E", "valueFrom": {"secretKeyRef": {"name": "secret-debug", "key": "e"}}}]}],
            "imagePullSecrets": [{"name": "registry"}]
        }));
        let refs = references(&s);
        assert_eq!(
            names(&refs),
            [
                (Kind::ConfigMap, "cm-env", true),
                (Kind::ConfigMap, "cm-init-envfrom", true),
                (Kind::ConfigMap, "cm-projected", true),
                (Kind::ConfigMap, "cm-volume", true),
                (Kind::Secret, "registry", false),
                (Kind::Secret, "secret-debug", true),
                (Kind::Secret, "secret-env", true),
                (Kind::Secret, "secret-envfrom", true),
                (Kind::Secret, "secret-projected", true),
                (Kind::Secret, "secret-volume", true),
            ]
        );
        assert_eq!(
            refs[&Source::new(Kind::ConfigMap, "cm-init-envfrom")].field,
            "spec.initContainers[0].envFrom[0].configMapRef.name"
        );
        assert_eq!(
            refs[&Source::new(Kind::Secret, "secret-env")].field,
            "spec.containers[0].env[1].valueFrom.secretKeyRef.name"
        );
        assert_eq!(
            refs[&Source::new(Kind::Secret, "secret-projected")].field,
            "spec.volumes[2].projected.sources[1].secret.name"
        );
    }

    #[test]
    fn a_source_is_required_when_any_reference_requires_it() {
        let s = spec(json!({
            "volumes": [{"name": "a", "configMap": {"name": "shared", "optional": true}},
                        {"name": "b", "secret": {"secretName": "maybe", "optional": true}}],
            "containers": [{"name": "main", "envFrom": [{"configMapRef": {"name": "shared"}}]}]
        }));
        let refs = references(&s);
        assert_eq!(names(&refs), [(Kind::ConfigMap, "shared", true), (Kind::Secret, "maybe", false)]);
        assert_eq!(
            refs[&Source::new(Kind::ConfigMap, "shared")].field,
            "spec.containers[0].envFrom[0].configMapRef.name"
        );
    }

    #[test]
    fn a_configmap_and_a_secret_of_one_name_are_two_sources() {
        let s = spec(
            json!({"volumes": [{"name": "a", "configMap": {"name": "x"}}, {"name": "b", "secret": {"secretName": "x"}}],
                            "containers": [{"name": "main"}]}),
        );
        assert_eq!(names(&references(&s)), [(Kind::ConfigMap, "x", true), (Kind::Secret, "x", true)]);
    }

    #[test]
    fn the_training_token_volume_and_the_clusters_own_ca_do_not_travel() {
        let s = spec(json!({
            "volumes": [
                {"name": "kube-api-access-x", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}},
                                                                         {"configMap": {"name": "kube-root-ca.crt"}},
                                                                         {"secret": {"name": "beside-the-token"}}]}},
                {"name": "ca", "configMap": {"name": "kube-root-ca.crt"}}
            ],
            "containers": [{"name": "main"}]
        }));
        assert!(references(&s).is_empty());
    }

    #[test]
    fn unresolved_optional_references_leave_the_copy() {
        let mut s = spec(json!({
            "volumes": [
                {"name": "a", "secret": {"secretName": "gone", "optional": true}},
                {"name": "b", "configMap": {"name": "gone"}},
                {"name": "c", "projected": {"sources": [{"secret": {"name": "gone", "optional": true}},
                                                         {"configMap": {"name": "here"}}]}},
                {"name": "d", "projected": {"sources": [{"configMap": {"name": "gone-cm", "optional": true}}]}},
                {"name": "e", "configMap": {"name": "gone-cm", "optional": true}}
            ],
            "initContainers": [{"name": "init", "envFrom": [{"secretRef": {"name": "gone", "optional": true}},
                                                            {"configMapRef": {"name": "here"}}]}],
            "containers": [{"name": "main",
                "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": true}}},
                        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "here", "key": "k"}}},
                        {"name": "C", "value": "plain"},
                        {"name": "D", "valueFrom": {"configMapKeyRef": {"name": "gone-cm", "key": "k", "optional": true}}}],
                "volumeMounts": [{"name": "a", "mountPath": "/a"}, {"name": "e", "mountPath": "/e"}]}],
            "ephemeralContainers": [{"name": "debug", "envFrom": [{"configMapRef": {"name": "gone-cm", "optional": true}}]}],
            "imagePullSecrets": [{"name": "gone"}, {"name": "registry"}]
        }));
        let absent = BTreeSet::from([Source::new(Kind::Secret, "gone"), Source::new(Kind::ConfigMap, "gone-cm")]);
        drop_references(&mut s, &absent);
        // What is left references only what exists (a ConfigMap named like the absent Secret
        // is another source).
        assert_eq!(
            names(&references(&s)),
            [(Kind::ConfigMap, "gone", true), (Kind::ConfigMap, "here", true), (Kind::Secret, "registry", false)]
        );
        let volumes = s.volumes.as_ref().unwrap();
        let names: Vec<_> = volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d", "e"], "volumes stay, so every mount still has its volume");
        for i in [0, 3, 4] {
            let v = serde_json::to_value(&volumes[i]).unwrap();
            assert_eq!(v, json!({"name": volumes[i].name, "emptyDir": {}}), "volume {i} is an empty directory");
        }
        assert_eq!(volumes[2].projected.as_ref().unwrap().sources.as_ref().unwrap().len(), 1);
        let env: Vec<_> = s.containers[0].env.iter().flatten().map(|e| e.name.as_str()).collect();
        assert_eq!(env, ["B", "C"]);
        assert_eq!(s.init_containers.as_ref().unwrap()[0].env_from.as_ref().unwrap().len(), 1);
        assert_eq!(s.ephemeral_containers.as_ref().unwrap()[0].env_from.as_deref().map(<[_]>::len), Some(0));
        let pull: Vec<_> = s.image_pull_secrets.iter().flatten().map(|p| p.name.as_str()).collect();
        assert_eq!(pull, ["registry"]);
    }

    fn target() -> CopyTarget<'static> {
        CopyTarget { cluster: "training", member: "member-a", namespace: "tp-team-a" }
    }

    fn config_map() -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": "cfg", "namespace": "team-a", "uid": "u-1", "resourceVersion": "42",
                         "labels": {"app": "trainer"}, "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u-0"}]},
            "data": {"lr": "0.1"}, "binaryData": {"blob": "AAE="}, "immutable": true
        }))
        .unwrap()
    }

    #[test]
    fn a_copy_carries_the_contents_and_its_origin_but_not_the_sources_identity() {
        let copy = config_map_copy(&config_map(), &target()).unwrap();
        let m = &copy.metadata;
        assert_eq!((m.name.as_deref(), m.namespace.as_deref()), (Some("cfg"), Some("tp-team-a")));
        assert!(m.uid.is_none() && m.resource_version.is_none() && m.owner_references.is_none());
        assert!(is_ours(m, "training", "member-a"));
        assert!(!is_ours(m, "training", "member-b") && !is_ours(m, "other", "member-a"));
        assert!(!m.labels.as_ref().unwrap().contains_key("app"));
        let a = m.annotations.as_ref().unwrap();
        assert_eq!(a[keys::ANNOTATION_ORIGIN_NAMESPACE], "team-a");
        assert_eq!(a[keys::ANNOTATION_ORIGIN_RESOURCE_VERSION], "42");
        assert_eq!(copy.data.unwrap()["lr"], "0.1");
        assert_eq!(copy.binary_data.unwrap()["blob"], ByteString(vec![0, 1]));
        assert_eq!(copy.immutable, None);
        let selector = copy_selector("training", "member-a");
        assert_eq!(
            selector,
            "tidepool.io/reflected=true,tidepool.io/origin-cluster=training,tidepool.io/member-cluster=member-a"
        );
    }

    #[test]
    fn a_copy_is_current_until_the_source_changes() {
        let source = config_map();
        let copy = config_map_copy(&source, &target()).unwrap();
        assert!(is_current(&copy.metadata, &source.metadata));
        let mut changed = source.metadata.clone();
        changed.resource_version = Some("43".into());
        assert!(!is_current(&copy.metadata, &changed));
        assert!(!is_current(&ObjectMeta::default(), &source.metadata));
    }

    #[test]
    fn secrets_keep_their_type_but_training_tokens_are_refused() {
        let mut secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "creds", "namespace": "team-a", "resourceVersion": "7"},
            "type": "kubernetes.io/dockerconfigjson", "data": {".dockerconfigjson": "e30="}
        }))
        .unwrap();
        let copy = secret_copy(&secret, &target()).unwrap();
        assert_eq!(copy.type_.as_deref(), Some("kubernetes.io/dockerconfigjson"));
        assert_eq!(copy.data.unwrap()[".dockerconfigjson"], ByteString(b"{}".to_vec()));
        secret.type_ = Some("kubernetes.io/service-account-token".into());
        assert_eq!(secret_copy(&secret, &target()), Err(NotReflectable::ServiceAccountToken));
        secret.type_ = None;
        secret.metadata.resource_version = None;
        assert_eq!(secret_copy(&secret, &target()), Err(NotReflectable::MissingField("metadata.resourceVersion")));
    }
}
