//! Which gang a pod belongs to, and its band. Pure: the sources are read from the pod; the
//! PodGroup objects that hold `minMember` are fetched by the controller.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tidepool_api::keys::{self, Band};
use tidepool_api::pod::PodLite;

use crate::error::Error;
use crate::workload::{WorkloadKind, workload_of};

/// Where a gang's definition lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GangSource {
    /// Kubernetes' own `scheduling.k8s.io/v1beta1` PodGroup, named by the pod's
    /// `spec.schedulingGroup.podGroupName`.
    Native(String),
    /// `scheduling.x-k8s.io/v1alpha1` PodGroup named by the pod label.
    PodGroup(String),
    /// `scheduling.volcano.sh/v1beta1` PodGroup named by the pod annotation.
    Volcano(String),
    /// `tidepool.io/gang` annotation; minimum from `tidepool.io/min-member`.
    Annotation(String),
    /// A job an operator made the pods of, read from the operator's labels; minimum from the
    /// job's spec ([`crate::workload`]).
    Workload(WorkloadKind, String),
    /// A pod with no gang: a gang of one.
    Single(String),
}

/// A gang's identity: its namespace and source. Written `namespace/kind/name`
/// (`team-a/podgroup/job-1`), and ordered as it is written, so an order that ends on the key
/// (admission, victims) reads the same in logs as in the code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangKey {
    pub namespace: String,
    pub source: GangSource,
}

impl GangKey {
    /// The gang named by annotation `tidepool.io/gang: name` in `namespace`.
    pub fn annotation(namespace: &str, name: &str) -> Self {
        Self { namespace: namespace.to_owned(), source: GangSource::Annotation(name.to_owned()) }
    }

    fn kind_and_name(&self) -> (&'static str, &str) {
        match &self.source {
            GangSource::Native(n) => ("native", n),
            GangSource::PodGroup(n) => ("podgroup", n),
            GangSource::Volcano(n) => ("volcano", n),
            GangSource::Annotation(n) => ("gang", n),
            GangSource::Workload(kind, n) => (kind.word(), n),
            GangSource::Single(n) => ("pod", n),
        }
    }

    /// The bytes of its written form, without writing it.
    fn text(&self) -> impl Iterator<Item = u8> + '_ {
        let (kind, name) = self.kind_and_name();
        let slash = std::iter::once(b'/');
        self.namespace.bytes().chain(slash.clone()).chain(kind.bytes()).chain(slash).chain(name.bytes())
    }
}

impl std::fmt::Display for GangKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, name) = self.kind_and_name();
        write!(f, "{}/{kind}/{name}", self.namespace)
    }
}

impl Ord for GangKey {
    /// As the written forms compare. Consistent with `Eq`: a namespace holds no `/` and each
    /// source has a word of its own, so two keys written alike are the same key.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text().cmp(other.text())
    }
}

impl PartialOrd for GangKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The gang of a pod. Sources are checked in a fixed order so a pod carrying several
/// (say a Volcano job that also has our annotation) always lands in the same gang:
/// Kubernetes' own PodGroup first, which the API server ties to the pod for good.
pub fn gang_of(pod: &PodLite) -> GangKey {
    gang_of_meta(&pod.metadata, pod.spec.pod_group.as_deref())
}

/// The gang of a whole pod (see [`gang_of`]).
pub fn gang_of_pod(pod: &k8s_openapi::api::core::v1::Pod) -> GangKey {
    gang_of_meta(&pod.metadata, pod.spec.as_ref().and_then(tidepool_api::pod::scheduling_group))
}

/// [`gang_of`] for a pod's metadata and its `spec.schedulingGroup.podGroupName`, which is
/// all it reads.
pub fn gang_of_meta(meta: &ObjectMeta, pod_group: Option<&str>) -> GangKey {
    let namespace = meta.namespace.clone().unwrap_or_default();
    let labels = meta.labels.as_ref();
    let annotations = meta.annotations.as_ref();
    let source = if let Some(g) = pod_group.filter(|g| !g.is_empty()) {
        GangSource::Native(g.to_owned())
    } else if let Some(g) = labels.and_then(|l| l.get(keys::LABEL_POD_GROUP)).filter(|g| !g.is_empty()) {
        GangSource::PodGroup(g.clone())
    } else if let Some(g) = annotations.and_then(|a| a.get(keys::ANNOTATION_VOLCANO_GROUP)).filter(|g| !g.is_empty()) {
        GangSource::Volcano(g.clone())
    } else if let Some(g) = annotations.and_then(|a| a.get(keys::ANNOTATION_GANG)).filter(|g| !g.is_empty()) {
        GangSource::Annotation(g.clone())
    } else if let Some((kind, job)) = workload_of(meta) {
        GangSource::Workload(kind, job)
    } else {
        GangSource::Single(meta.name.clone().unwrap_or_default())
    };
    GangKey { namespace, source }
}

/// The minimum of a PodGroup object (`data` holds its `spec`) of `source`'s kind: `minMember`
/// for sig-scheduling's and Volcano's; for Kubernetes' own, the gang policy's `minCount`, and
/// 1 under the `basic` policy (its pods are placed one by one). `None` when it says none.
pub fn pod_group_min(source: &GangSource, data: &serde_json::Value) -> Option<u32> {
    let spec = data.get("spec")?;
    let min = match source {
        GangSource::Native(_) => {
            let policy = spec.get("schedulingPolicy")?;
            match policy.get("gang") {
                Some(gang) => gang.get("minCount")?.as_u64()?,
                None if policy.get("basic").is_some() => 1,
                None => return None,
            }
        }
        _ => spec.get("minMember")?.as_u64()?,
    };
    (min >= 1).then(|| u32::try_from(min).unwrap_or(u32::MAX))
}

/// `tidepool.io/min-member` of a pod: `Ok(None)` when absent, an error when invalid.
pub fn annotated_min_member(pod: &PodLite) -> Result<Option<u32>, Error> {
    let Some(v) = pod.metadata.annotations.as_ref().and_then(|a| a.get(keys::ANNOTATION_MIN_MEMBER)) else {
        return Ok(None);
    };
    match v.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(Some(n)),
        _ => Err(Error::MinMemberInvalid { value: v.clone() }),
    }
}

/// Priority ranges that decide a band outright (inclusive bounds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BandRanges {
    pub high: (i32, i32),
    pub medium: (i32, i32),
    pub low: (i32, i32),
}

impl Default for BandRanges {
    fn default() -> Self {
        Self { high: (2001, 3000), medium: (1001, 2000), low: (1, 1000) }
    }
}

/// Band of a pod: bands follow roles. An elastic pod (beyond the gang's `minMember`) is
/// `low` whatever its priority, so it is reclaimed before any gang core, its own included: a
/// tenant who gives every worker one class cannot make a one-pod deficit take the whole job.
/// A core pod is in the band of its priority when that falls in a configured range, else
/// `medium`. Inside a band the priority orders pods ([`crate::victims`]).
pub fn band_for(priority: Option<i32>, core: bool, ranges: &BandRanges) -> Band {
    let within = |(lo, hi): (i32, i32), p: i32| lo <= p && p <= hi;
    match priority {
        _ if !core => Band::Low,
        Some(p) if within(ranges.high, p) => Band::High,
        Some(p) if within(ranges.medium, p) => Band::Medium,
        Some(p) if within(ranges.low, p) => Band::Low,
        _ => Band::Medium,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(meta: serde_json::Value) -> PodLite {
        PodLite { metadata: serde_json::from_value(meta).unwrap(), ..Default::default() }
    }

    #[test]
    fn gang_sources_are_read_in_a_fixed_order() {
        let cases = [
            (
                "a sig-scheduling pod group wins over everything",
                json!({"name": "p", "namespace": "ns", "labels": {"scheduling.x-k8s.io/pod-group": "pg"},
                       "annotations": {"scheduling.k8s.io/group-name": "vc", "tidepool.io/gang": "g"}}),
                GangSource::PodGroup("pg".into()),
            ),
            (
                "a volcano group wins over our annotation",
                json!({"name": "p", "namespace": "ns", "annotations": {"scheduling.k8s.io/group-name": "vc", "tidepool.io/gang": "g"}}),
                GangSource::Volcano("vc".into()),
            ),
            (
                "our annotation names a gang",
                json!({"name": "p", "namespace": "ns", "annotations": {"tidepool.io/gang": "g"}}),
                GangSource::Annotation("g".into()),
            ),
            (
                "our annotation wins over an operator's labels",
                json!({"name": "p", "namespace": "ns", "annotations": {"tidepool.io/gang": "g"},
                       "labels": {"training.kubeflow.org/operator-name": "tfjob-controller", "training.kubeflow.org/job-name": "j"}}),
                GangSource::Annotation("g".into()),
            ),
            (
                "an operator's pod is a gang of its job",
                json!({"name": "p", "namespace": "ns",
                       "labels": {"training.kubeflow.org/operator-name": "tfjob-controller", "training.kubeflow.org/job-name": "j"}}),
                GangSource::Workload(WorkloadKind::TfJob, "j".into()),
            ),
            (
                "a pod with nothing is a gang of one",
                json!({"name": "p", "namespace": "ns"}),
                GangSource::Single("p".into()),
            ),
            (
                "an empty label does not make a gang",
                json!({"name": "p", "namespace": "ns", "labels": {"scheduling.x-k8s.io/pod-group": ""}}),
                GangSource::Single("p".into()),
            ),
        ];
        for (name, meta, want) in cases {
            assert_eq!(gang_of(&pod(meta)).source, want, "{name}");
        }
    }

    #[test]
    fn a_pod_groups_minimum_is_read_from_its_kinds_own_field() {
        let native = GangSource::Native("g".into());
        let gang = json!({"spec": {"schedulingPolicy": {"gang": {"minCount": 4}}}});
        assert_eq!(pod_group_min(&native, &gang), Some(4));
        let basic = json!({"spec": {"schedulingPolicy": {"basic": {}}}});
        assert_eq!(pod_group_min(&native, &basic), Some(1), "basic: one by one");
        for bad in [
            json!({"spec": {"schedulingPolicy": {}}}),
            json!({"spec": {"schedulingPolicy": {"gang": {"minCount": 0}}}}),
            json!({}),
        ] {
            assert_eq!(pod_group_min(&native, &bad), None, "{bad}");
        }
        // A native group's spec has no minMember, and sig-scheduling's has no policy.
        assert_eq!(pod_group_min(&native, &json!({"spec": {"minMember": 3}})), None);
        let sig = GangSource::PodGroup("g".into());
        assert_eq!(pod_group_min(&sig, &json!({"spec": {"minMember": 3}})), Some(3));
        assert_eq!(pod_group_min(&sig, &gang), None);
    }

    #[test]
    fn kubernetes_own_pod_group_wins_over_every_label_and_annotation() {
        let everything = json!({"name": "p", "namespace": "ns", "labels": {"scheduling.x-k8s.io/pod-group": "pg"},
                                "annotations": {"scheduling.k8s.io/group-name": "vc", "tidepool.io/gang": "g"}});
        let mut p = pod(everything);
        p.spec.pod_group = Some("native".into());
        assert_eq!(gang_of(&p).source, GangSource::Native("native".into()));
        assert_eq!(gang_of(&p).to_string(), "ns/native/native");
        // The whole pod reads the same as its cached form.
        let whole: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "labels": {"scheduling.x-k8s.io/pod-group": "pg"}},
            "spec": {"containers": [], "schedulingGroup": {"podGroupName": "native"}}
        }))
        .unwrap();
        assert_eq!(gang_of_pod(&whole), gang_of(&PodLite::from(whole.clone())));
        assert_eq!(gang_of_pod(&whole).source, GangSource::Native("native".into()));
    }

    #[test]
    fn gang_keys_order_as_they_are_written() {
        let key = |ns: &str, source: GangSource| GangKey { namespace: ns.into(), source };
        let mut keys = [
            key("team", GangSource::Volcano("a".into())),
            key("team-a", GangSource::Single("z".into())),
            key("team", GangSource::Annotation("b".into())),
            key("team", GangSource::PodGroup("a".into())),
            key("team", GangSource::Native("a".into())),
            key("team", GangSource::Single("a".into())),
            key("team", GangSource::Workload(WorkloadKind::TfJob, "a".into())),
            key("team", GangSource::Workload(WorkloadKind::JobSet, "a".into())),
        ];
        let mut written: Vec<String> = keys.iter().map(ToString::to_string).collect();
        written.sort();
        keys.sort();
        assert_eq!(keys.iter().map(ToString::to_string).collect::<Vec<_>>(), written);
        // "team-a/…" before "team/…": '-' comes before '/', whatever the namespaces' lengths.
        assert_eq!(written[0], "team-a/pod/z");
    }

    #[test]
    fn min_member_annotation_is_validated() {
        let with = |v: &str| pod(json!({"name": "p", "annotations": {"tidepool.io/min-member": v}}));
        assert_eq!(annotated_min_member(&with("4")).unwrap(), Some(4));
        assert!(annotated_min_member(&with("0")).is_err());
        assert_eq!(
            annotated_min_member(&with("four")).unwrap_err().to_string(),
            "annotation tidepool.io/min-member=\"four\" is not a positive integer"
        );
        assert_eq!(annotated_min_member(&pod(json!({"name": "p"}))).unwrap(), None);
    }

    #[test]
    fn core_bands_follow_priority_ranges_and_elastic_pods_are_low() {
        let r = BandRanges::default();
        assert_eq!(band_for(Some(2500), true, &r), Band::High);
        assert_eq!(band_for(Some(1500), true, &r), Band::Medium);
        assert_eq!(band_for(Some(10), true, &r), Band::Low);
        assert_eq!(band_for(None, true, &r), Band::Medium);
        assert_eq!(band_for(Some(0), true, &r), Band::Medium);
        assert_eq!(band_for(Some(5000), true, &r), Band::Medium);
        // Elastic: low whatever class the tenant gave it.
        for priority in [None, Some(0), Some(10), Some(1500), Some(2500), Some(5000)] {
            assert_eq!(band_for(priority, false, &r), Band::Low, "{priority:?}");
        }
    }

    proptest::proptest! {
        /// Whatever one priority every worker of a gang has, its elastic pods are never in a
        /// band above its core's, so they are reclaimed first.
        #[test]
        fn elastic_pods_never_outrank_their_core(priority in proptest::option::of(-10i32..4000)) {
            let r = BandRanges::default();
            proptest::prop_assert!(band_for(priority, false, &r) <= band_for(priority, true, &r));
            proptest::prop_assert_eq!(band_for(priority, false, &r), Band::Low);
        }
    }
}
