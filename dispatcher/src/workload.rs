//! The jobs the field's operators make, read from the labels they put on their pods: which
//! job a pod belongs to (so a TFJob, a PyTorchJob, an MPIJob or a JobSet is one gang with no
//! annotation of tidepool's), how many of its pods must start together (read from the job's
//! own spec), and which of its pods are its core (parameter servers, the chief or master, the
//! launcher, then workers by index). Pure: the controller fetches the job object.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

/// Labels the Kubeflow operators (training-operator, mpi-operator) put on every pod.
pub const LABEL_KUBEFLOW_JOB_NAME: &str = "training.kubeflow.org/job-name";
pub const LABEL_KUBEFLOW_OPERATOR: &str = "training.kubeflow.org/operator-name";
pub const LABEL_KUBEFLOW_REPLICA_TYPE: &str = "training.kubeflow.org/replica-type";
pub const LABEL_KUBEFLOW_REPLICA_INDEX: &str = "training.kubeflow.org/replica-index";
pub const LABEL_KUBEFLOW_JOB_ROLE: &str = "training.kubeflow.org/job-role";
/// Labels JobSet puts on its pods (a Kubeflow Trainer TrainJob runs as a JobSet).
pub const LABEL_JOBSET_NAME: &str = "jobset.sigs.k8s.io/jobset-name";
pub const LABEL_JOBSET_REPLICATED_JOB: &str = "jobset.sigs.k8s.io/replicatedjob-name";
pub const LABEL_JOBSET_GLOBAL_INDEX: &str = "jobset.sigs.k8s.io/job-global-index";
/// An Indexed Job's pod index.
pub const LABEL_JOB_COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// The training-operator's MPIJob v1 controller: its launcher runs `kubectl exec` with a
/// service-account token, which an offloaded pod never gets.
pub const MPIJOB_V1_OPERATOR: &str = "mpijob-controller";

/// A kind of job an operator makes pods for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkloadKind {
    TfJob,
    PyTorchJob,
    PaddleJob,
    XgBoostJob,
    JaxJob,
    /// MPIJob v2 (mpi-operator).
    MpiJob,
    JobSet,
}

impl WorkloadKind {
    /// The kind of the job that made a pod, from the operator's name on it.
    fn of_operator(name: &str) -> Option<Self> {
        Some(match name {
            "tfjob-controller" => Self::TfJob,
            "pytorchjob-controller" => Self::PyTorchJob,
            "paddlejob-controller" => Self::PaddleJob,
            "xgboostjob-controller" => Self::XgBoostJob,
            "jaxjob-controller" => Self::JaxJob,
            "mpi-operator" => Self::MpiJob,
            _ => return None,
        })
    }

    /// (API group, version, kind, plural) of its objects.
    pub fn api(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            Self::TfJob => ("kubeflow.org", "v1", "TFJob", "tfjobs"),
            Self::PyTorchJob => ("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs"),
            Self::PaddleJob => ("kubeflow.org", "v1", "PaddleJob", "paddlejobs"),
            Self::XgBoostJob => ("kubeflow.org", "v1", "XGBoostJob", "xgboostjobs"),
            Self::JaxJob => ("kubeflow.org", "v1", "JAXJob", "jaxjobs"),
            Self::MpiJob => ("kubeflow.org", "v2beta1", "MPIJob", "mpijobs"),
            Self::JobSet => ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets"),
        }
    }

    /// The word in a gang's written key (`team-a/tfjob/mnist`).
    pub fn word(self) -> &'static str {
        match self {
            Self::TfJob => "tfjob",
            Self::PyTorchJob => "pytorchjob",
            Self::PaddleJob => "paddlejob",
            Self::XgBoostJob => "xgboostjob",
            Self::JaxJob => "jaxjob",
            Self::MpiJob => "mpijob",
            Self::JobSet => "jobset",
        }
    }

    /// Where a Kubeflow job keeps its replica specs.
    fn replica_specs(self) -> &'static str {
        match self {
            Self::TfJob => "tfReplicaSpecs",
            Self::PyTorchJob => "pytorchReplicaSpecs",
            Self::PaddleJob => "paddleReplicaSpecs",
            Self::XgBoostJob => "xgbReplicaSpecs",
            Self::JaxJob => "jaxReplicaSpecs",
            Self::MpiJob => "mpiReplicaSpecs",
            Self::JobSet => "replicatedJobs",
        }
    }
}

/// The operator-made job a pod belongs to, if any.
pub fn workload_of(meta: &ObjectMeta) -> Option<(WorkloadKind, String)> {
    let labels = meta.labels.as_ref()?;
    let named = |key: &str| labels.get(key).filter(|v| !v.is_empty()).cloned();
    if let (Some(op), Some(job)) = (named(LABEL_KUBEFLOW_OPERATOR), named(LABEL_KUBEFLOW_JOB_NAME)) {
        return WorkloadKind::of_operator(&op).map(|kind| (kind, job));
    }
    named(LABEL_JOBSET_NAME).map(|job| (WorkloadKind::JobSet, job))
}

/// Why a pod of an operator tidepool cannot run across the bridge is refused, if it is.
pub fn refused(meta: &ObjectMeta) -> Option<String> {
    let operator = meta.labels.as_ref()?.get(LABEL_KUBEFLOW_OPERATOR)?;
    (operator == MPIJOB_V1_OPERATOR).then(|| {
        "MPIJob v1 (the training-operator's) is not supported across the bridge: its launcher runs \
         `kubectl exec` with a service-account token, which offloaded pods never get; use MPIJob v2 \
         (mpi-operator, kubeflow.org/v2beta1), whose launcher reaches the workers over SSH"
            .to_owned()
    })
}

/// One part of a job and how many of its pods run at once; `after` is set for a part that
/// starts only when others have finished (a JobSet's `dependsOn`; an MPIJob launcher created
/// once its workers are ready).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub name: String,
    pub pods: u32,
    pub after: bool,
}

/// How a job is made up, as its spec says: its parts, or the minimum it states outright.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub parts: Vec<Part>,
    /// `runPolicy.schedulingPolicy.minAvailable`, or an elastic PyTorchJob's floor.
    pub stated_min: Option<u32>,
}

fn count(v: &Value, path: &[&str], default: u64) -> u32 {
    let got = path.iter().try_fold(v, |v, k| v.get(k)).and_then(Value::as_u64).unwrap_or(default);
    u32::try_from(got).unwrap_or(u32::MAX)
}

/// The shape of job object `obj` of `kind`; `None` when its spec names no replicas.
pub fn shape(kind: WorkloadKind, obj: &Value) -> Option<Shape> {
    let spec = obj.get("spec")?;
    if kind == WorkloadKind::JobSet {
        let parts = spec.get("replicatedJobs")?.as_array()?.iter().map(jobset_part).collect::<Option<Vec<_>>>()?;
        return (!parts.is_empty()).then_some(Shape { parts, stated_min: None });
    }
    let specs = spec.get(kind.replica_specs())?.as_object()?;
    let waits_for_workers = kind == WorkloadKind::MpiJob
        && spec.get("launcherCreationPolicy").and_then(Value::as_str) == Some("WaitForWorkersReady");
    let parts: Vec<Part> = specs
        .iter()
        .map(|(name, s)| Part {
            pods: count(s, &["replicas"], 1),
            after: waits_for_workers && name.eq_ignore_ascii_case("launcher"),
            name: name.to_ascii_lowercase(),
        })
        .collect();
    let min_available = count(spec, &["runPolicy", "schedulingPolicy", "minAvailable"], 0);
    let elastic_floor = spec.get("elasticPolicy").and_then(|e| e.get("minReplicas")).and_then(Value::as_u64).map(|m| {
        let others: u32 = parts.iter().filter(|p| p.name != "worker").map(|p| p.pods).sum();
        others.saturating_add(u32::try_from(m).unwrap_or(u32::MAX))
    });
    let stated_min = (min_available > 0).then_some(min_available).or(elastic_floor);
    (!parts.is_empty()).then_some(Shape { parts, stated_min })
}

fn jobset_part(rj: &Value) -> Option<Part> {
    let name = rj.get("name")?.as_str()?.to_owned();
    let replicas = count(rj, &["replicas"], 1);
    let parallelism = count(rj, &["template", "spec", "parallelism"], 1);
    let after = rj.get("dependsOn").and_then(Value::as_array).is_some_and(|d| !d.is_empty());
    Some(Part { name, pods: replicas.saturating_mul(parallelism), after })
}

/// How many pods of the job must start together, given the parts its live pods belong to
/// (`live_parts`, read from the pods' labels): a minimum the spec states; else every pod of
/// the parts that run now — the parts the live pods are in, or, before any of them is known,
/// those that start first. A job in stages (initializers, then trainers) is thus a gang per
/// stage, never waiting for pods its operator will only make later.
pub fn min_member(shape: &Shape, live_parts: &BTreeSet<String>) -> u32 {
    if let Some(m) = shape.stated_min {
        return m.max(1);
    }
    let staged = shape.parts.iter().any(|p| p.after);
    let now: Vec<&Part> = if !staged {
        shape.parts.iter().collect()
    } else {
        let live: Vec<&Part> = shape.parts.iter().filter(|p| live_parts.contains(&p.name)).collect();
        if live.is_empty() { shape.parts.iter().filter(|p| !p.after).collect() } else { live }
    };
    now.iter().map(|p| p.pods).fold(0u32, u32::saturating_add).max(1)
}

/// The part of its job a pod belongs to, by its operator's labels (lower case), if known.
pub fn part_of(meta: &ObjectMeta) -> Option<String> {
    let labels = meta.labels.as_ref()?;
    [LABEL_JOBSET_REPLICATED_JOB, LABEL_KUBEFLOW_REPLICA_TYPE, LABEL_KUBEFLOW_JOB_ROLE]
        .iter()
        .find_map(|k| labels.get(*k))
        .map(|v| v.to_ascii_lowercase())
}

/// Where a pod stands among its gang's pods when the core is chosen: the roles a job cannot
/// run without first (parameter servers, chief, master, launcher), then the rest, evaluators
/// last; inside a role by replica index; then by name, numbers compared as numbers
/// (`worker-2` before `worker-10`).
pub fn core_cmp(a: &ObjectMeta, b: &ObjectMeta) -> Ordering {
    rank(a)
        .cmp(&rank(b))
        .then_with(|| index(a).cmp(&index(b)))
        .then_with(|| natural_cmp(a.name.as_deref().unwrap_or_default(), b.name.as_deref().unwrap_or_default()))
}

fn rank(meta: &ObjectMeta) -> u8 {
    match part_of(meta).as_deref() {
        Some("ps" | "chief" | "master" | "launcher" | "scheduler") => 0,
        Some("evaluator") => 2,
        _ => 1,
    }
}

fn index(meta: &ObjectMeta) -> u32 {
    let labels: Option<&BTreeMap<String, String>> = meta.labels.as_ref();
    [LABEL_KUBEFLOW_REPLICA_INDEX, LABEL_JOBSET_GLOBAL_INDEX, LABEL_JOB_COMPLETION_INDEX]
        .iter()
        .find_map(|k| labels.and_then(|l| l.get(*k)).and_then(|v| v.parse().ok()))
        .unwrap_or(u32::MAX)
}

/// Compares names with their runs of digits as numbers.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let (da, ra) = split_digits(a);
                let (db, rb) = split_digits(b);
                let (ta, tb) = (trim_zeros(da), trim_zeros(db));
                let by_value = ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb)).then_with(|| da.len().cmp(&db.len()));
                if by_value != Ordering::Equal {
                    return by_value;
                }
                (a, b) = (ra, rb);
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                (a, b) = (&a[1..], &b[1..]);
            }
        }
    }
}

fn split_digits(s: &[u8]) -> (&[u8], &[u8]) {
    let n = s.iter().take_while(|c| c.is_ascii_digit()).count();
    s.split_at(n)
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|c| **c == b'0').count();
    &s[n.min(s.len().saturating_sub(1))..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn meta(name: &str, labels: Value) -> ObjectMeta {
        serde_json::from_value(json!({"name": name, "namespace": "ns", "labels": labels})).unwrap()
    }

    fn kubeflow(name: &str, op: &str, job: &str, rtype: &str, index: u32) -> ObjectMeta {
        meta(
            name,
            json!({LABEL_KUBEFLOW_OPERATOR: op, LABEL_KUBEFLOW_JOB_NAME: job,
                   LABEL_KUBEFLOW_REPLICA_TYPE: rtype, LABEL_KUBEFLOW_REPLICA_INDEX: index.to_string()}),
        )
    }

    #[test]
    fn operator_pods_name_their_job() {
        let cases = [
            (
                "a TFJob's pod",
                kubeflow("mnist-ps-0", "tfjob-controller", "mnist", "ps", 0),
                Some((WorkloadKind::TfJob, "mnist")),
            ),
            (
                "a PyTorchJob's pod",
                kubeflow("r-master-0", "pytorchjob-controller", "r", "master", 0),
                Some((WorkloadKind::PyTorchJob, "r")),
            ),
            (
                "an MPIJob v2 pod",
                meta(
                    "pi-launcher",
                    json!({LABEL_KUBEFLOW_OPERATOR: "mpi-operator", LABEL_KUBEFLOW_JOB_NAME: "pi", LABEL_KUBEFLOW_JOB_ROLE: "launcher"}),
                ),
                Some((WorkloadKind::MpiJob, "pi")),
            ),
            (
                "a JobSet's pod",
                meta("t-node-0-0-x", json!({LABEL_JOBSET_NAME: "t", LABEL_JOBSET_REPLICATED_JOB: "node"})),
                Some((WorkloadKind::JobSet, "t")),
            ),
            ("an operator tidepool does not know", kubeflow("x-0", "someone-else", "x", "worker", 0), None),
            ("an empty job name", kubeflow("x-0", "tfjob-controller", "", "worker", 0), None),
            ("a plain pod", meta("p", json!({"app": "x"})), None),
        ];
        for (what, m, want) in cases {
            assert_eq!(workload_of(&m), want.map(|(k, n)| (k, n.to_owned())), "{what}");
        }
    }

    #[test]
    fn mpijob_v1_pods_are_refused_with_the_reason() {
        let v1 = kubeflow("pi-launcher", MPIJOB_V1_OPERATOR, "pi", "launcher", 0);
        assert!(refused(&v1).is_some_and(|r| r.contains("kubectl exec") && r.contains("MPIJob v2")));
        assert_eq!(workload_of(&v1), None);
        assert_eq!(refused(&kubeflow("m-0", "tfjob-controller", "m", "ps", 0)), None);
    }

    #[test]
    fn a_jobs_minimum_comes_from_its_spec() {
        let none = BTreeSet::new();
        let tf = json!({"spec": {"tfReplicaSpecs": {"PS": {"replicas": 2}, "Worker": {"replicas": 4}, "Chief": {}}}});
        assert_eq!(
            min_member(&shape(WorkloadKind::TfJob, &tf).unwrap(), &none),
            7,
            "every replica; a replica spec without replicas has one"
        );
        let stated = json!({"spec": {"runPolicy": {"schedulingPolicy": {"minAvailable": 3}}, "pytorchReplicaSpecs": {"Master": {"replicas": 1}, "Worker": {"replicas": 5}}}});
        assert_eq!(min_member(&shape(WorkloadKind::PyTorchJob, &stated).unwrap(), &none), 3, "minAvailable wins");
        let elastic = json!({"spec": {"elasticPolicy": {"minReplicas": 2, "maxReplicas": 4}, "pytorchReplicaSpecs": {"Worker": {"replicas": 4}}}});
        assert_eq!(min_member(&shape(WorkloadKind::PyTorchJob, &elastic).unwrap(), &none), 2, "an elastic job's floor");
        let mpi = json!({"spec": {"mpiReplicaSpecs": {"Launcher": {"replicas": 1}, "Worker": {"replicas": 2}}}});
        assert_eq!(min_member(&shape(WorkloadKind::MpiJob, &mpi).unwrap(), &none), 3);
        let mpi_later = json!({"spec": {"launcherCreationPolicy": "WaitForWorkersReady",
                                        "mpiReplicaSpecs": {"Launcher": {"replicas": 1}, "Worker": {"replicas": 2}}}});
        let s = shape(WorkloadKind::MpiJob, &mpi_later).unwrap();
        assert_eq!(min_member(&s, &none), 2, "the workers first: the launcher is made once they are ready");
        assert_eq!(min_member(&s, &BTreeSet::from(["launcher".to_owned()])), 1, "then the launcher alone");
        assert_eq!(shape(WorkloadKind::TfJob, &json!({"spec": {}})), None, "no replicas: no shape");
    }

    #[test]
    fn a_jobset_in_stages_is_a_gang_per_stage() {
        let js = json!({"spec": {"replicatedJobs": [
            {"name": "dataset-initializer", "replicas": 1, "template": {"spec": {"parallelism": 1}}},
            {"name": "node", "replicas": 1, "dependsOn": [{"name": "dataset-initializer", "status": "Complete"}],
             "template": {"spec": {"parallelism": 4}}}
        ]}});
        let s = shape(WorkloadKind::JobSet, &js).unwrap();
        assert_eq!(min_member(&s, &BTreeSet::new()), 1, "before any pod: the first stage");
        assert_eq!(min_member(&s, &BTreeSet::from(["node".to_owned()])), 4, "the trainer nodes, whole");
        let flat = json!({"spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": {"spec": {"parallelism": 3}}},
                                                       {"name": "driver"}]}});
        assert_eq!(min_member(&shape(WorkloadKind::JobSet, &flat).unwrap(), &BTreeSet::new()), 7);
    }

    #[test]
    fn the_core_is_chosen_by_role_then_index_never_by_name_alone() {
        let tf = |name: &str, rtype: &str, i: u32| kubeflow(name, "tfjob-controller", "j", rtype, i);
        let mut pods = [
            tf("j-worker-10", "worker", 10),
            tf("j-evaluator-0", "evaluator", 0),
            tf("j-worker-2", "worker", 2),
            tf("j-ps-1", "ps", 1),
            tf("j-chief-0", "chief", 0),
            tf("j-ps-0", "ps", 0),
        ];
        pods.sort_by(core_cmp);
        let names: Vec<&str> = pods.iter().map(|m| m.name.as_deref().unwrap()).collect();
        assert_eq!(names, ["j-chief-0", "j-ps-0", "j-ps-1", "j-worker-2", "j-worker-10", "j-evaluator-0"]);
        let launcher = meta("pi-launcher", json!({LABEL_KUBEFLOW_JOB_ROLE: "launcher"}));
        let worker = meta("pi-worker-0", json!({LABEL_KUBEFLOW_JOB_ROLE: "worker", LABEL_KUBEFLOW_REPLICA_INDEX: "0"}));
        assert_eq!(core_cmp(&launcher, &worker), Ordering::Less, "the MPI launcher is core");
    }

    #[test]
    fn names_compare_with_numbers_as_numbers() {
        let mut names = vec!["w-10", "w-2", "w-1", "w-02", "w-b", "w-a10", "w-a9", "w"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["w", "w-1", "w-2", "w-02", "w-10", "w-a9", "w-a10", "w-b"]);
    }
}
