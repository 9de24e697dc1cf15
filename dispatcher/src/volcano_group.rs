//! What a Volcano PodGroup (`scheduling.volcano.sh/v1beta1`) of a tidepool job is to say, on
//! plain data; [`crate::volcano`] reads the groups and writes what this decides.
//!
//! Volcano's job controller (and the training-operator with `--gang-scheduler-name=volcano`)
//! makes a job's PodGroup first and its pods only once a gang scheduler moves the group out of
//! `Pending`. For a job whose pods all name tidepool's scheduler, tidepool is that scheduler,
//! and the group goes through Volcano's phases by Volcano's scheduler's rules:
//! - `Running` once at least `minMember` of its pods are bound (or succeeded): the gang is
//!   placed;
//! - otherwise `Inqueue` stays `Inqueue` (the pods are coming, or wait for the dispatcher);
//! - otherwise (`Pending`, new, or a `Running` gang that lost its pods to a restart) `Inqueue`
//!   when some member pool lends, in total, at least the group's `minResources`, else
//!   `Pending` with condition `Unschedulable` saying why.
//!
//! `Inqueue` means "could run on some member", not "fits now": the dispatcher's gang admission
//! (order, bands, preemption of lower bands, the explanation on each pod) works on the pods,
//! so holding them back until the gang fits the free capacity would keep a higher band from
//! ever preempting a lower one.

use serde_json::Value;
use tidepool_api::Resources;
use tidepool_api::pod::PodLite;

use crate::context::Pool;

/// Volcano's group phases tidepool writes.
pub(crate) const PENDING: &str = "Pending";
pub(crate) const INQUEUE: &str = "Inqueue";
pub(crate) const RUNNING: &str = "Running";

/// Volcano's condition types and the reasons and messages its scheduler gives them.
pub(crate) const UNSCHEDULABLE: &str = "Unschedulable";
pub(crate) const SCHEDULED: &str = "Scheduled";
pub(crate) const NOT_ENOUGH_RESOURCES: &str = "NotEnoughResources";
pub(crate) const READY: &str = "tasks in gang are ready to be scheduled";

/// A group's controller, from its `ownerReferences`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    pub api_version: String,
    pub kind: String,
    pub name: String,
}

/// What tidepool reads of a Volcano PodGroup.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Group {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    /// `spec.minMember`, at least 1.
    pub min_member: u32,
    /// `spec.minResources` (what `minMember` pods request together), empty when absent.
    pub min_resources: Resources,
    /// `status.phase`, empty when the group has none yet.
    pub phase: String,
    /// `status.running`, `status.succeeded`, `status.failed`.
    pub counts: (u32, u32, u32),
    /// `status.conditions` as they are.
    pub conditions: Vec<Value>,
    pub owner: Option<Owner>,
}

impl Group {
    /// Reads `obj` (a PodGroup as JSON); `None` when it has no name, namespace or UID, or its
    /// `minResources` do not parse.
    pub(crate) fn read(obj: &Value) -> Option<Group> {
        let meta = obj.get("metadata")?;
        let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
        let spec = obj.get("spec");
        let status = obj.get("status");
        let count = |k: &str| status.and_then(|s| s.get(k)).and_then(Value::as_u64).unwrap_or(0) as u32;
        let min_resources = match spec.and_then(|s| s.get("minResources")) {
            Some(list) => requests(&Resources::from_quantities(&serde_json::from_value(list.clone()).ok()?).ok()?),
            None => Resources::new(),
        };
        Some(Group {
            namespace: text(meta.get("namespace"))?,
            name: text(meta.get("name"))?,
            uid: text(meta.get("uid"))?,
            resource_version: text(meta.get("resourceVersion")).unwrap_or_default(),
            min_member: spec.and_then(|s| s.get("minMember")).and_then(Value::as_u64).unwrap_or(1).max(1) as u32,
            min_resources,
            phase: text(status.and_then(|s| s.get("phase"))).unwrap_or_default(),
            counts: (count("running"), count("succeeded"), count("failed")),
            conditions: status.and_then(|s| s.get("conditions")).and_then(Value::as_array).cloned().unwrap_or_default(),
            owner: controller_of(meta),
        })
    }

    /// `namespace/name`.
    pub(crate) fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What a node must hold of `min_resources`, written as Volcano writes them: in a quota's
/// names (`requests.cpu`, `count/pods`, `limits.memory`) beside the plain ones (`cpu`, `pods`).
/// `requests.X` is `X`; counts of objects and limits are not what a node holds.
fn requests(min_resources: &Resources) -> Resources {
    let mut out = Resources::new();
    for (name, amount) in min_resources.iter() {
        if name.starts_with("count/") || name.starts_with("limits.") {
            continue;
        }
        let name = name.strip_prefix("requests.").unwrap_or(name);
        out.set(name, out.get(name).max(amount));
    }
    out
}

fn controller_of(meta: &Value) -> Option<Owner> {
    let owners = meta.get("ownerReferences")?.as_array()?;
    let owner = owners.iter().find(|o| o.get("controller").and_then(Value::as_bool) == Some(true))?;
    let text = |k: &str| owner.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(Owner { api_version: text("apiVersion")?, kind: text("kind")?, name: text("name")? })
}

/// The scheduler each pod template of `owner` (a Volcano Job, a Kubeflow job, any object with
/// pod templates) names: every `template.spec.schedulerName` found in its `spec`, an empty one
/// read as the owner's own `spec.schedulerName` (a Volcano Job's default for its tasks) or, when
/// that is absent too, as the empty string.
pub(crate) fn template_schedulers(owner: &Value) -> Vec<String> {
    let Some(spec) = owner.get("spec") else { return Vec::new() };
    let fallback = spec.get("schedulerName").and_then(Value::as_str).unwrap_or_default();
    let mut found = Vec::new();
    collect_templates(spec, &mut found);
    found.into_iter().map(|s| if s.is_empty() { fallback.to_owned() } else { s }).collect()
}

fn collect_templates(v: &Value, found: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                if k == "template"
                    && let Some(spec) = child.get("spec").filter(|s| s.is_object())
                {
                    found.push(spec.get("schedulerName").and_then(Value::as_str).unwrap_or_default().to_owned());
                    continue;
                }
                collect_templates(child, found);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_templates(i, found)),
        _ => {}
    }
}

/// Whether a group whose job's templates name `schedulers` is tidepool's (`ours` is its
/// scheduler name): every template names it, and there is at least one. A job that mixes
/// schedulers is not: its gang would be split between two schedulers.
pub(crate) fn claimed(schedulers: &[String], ours: &str) -> bool {
    !schedulers.is_empty() && schedulers.iter().all(|s| s == ours)
}

/// The group's pods as Volcano's scheduler counts its tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Bound to a node, not ended and not being deleted.
    pub bound: u32,
    pub running: u32,
    pub succeeded: u32,
    pub failed: u32,
}

impl Tally {
    pub(crate) fn add(&mut self, p: &PodLite) {
        match p.status.phase.as_deref() {
            Some("Succeeded") => self.succeeded += 1,
            Some("Failed") => self.failed += 1,
            phase => {
                if p.spec.node_name.is_some() && p.metadata.deletion_timestamp.is_none() {
                    self.bound += 1;
                    self.running += u32::from(phase == Some("Running"));
                }
            }
        }
    }
}

/// Whether some member pool could hold the gang, or why none can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Room {
    Fits,
    Short(String),
}

/// [`Room`] for a gang needing `min` in all: some pool that takes new pods lends at least that
/// in total (what it lends, not what is free now: see the module's doc).
pub(crate) fn room(min: &Resources, pools: &[Pool]) -> Room {
    let usable: Vec<&Pool> = pools.iter().filter(|p| p.healthy && p.answering && !p.paused).collect();
    if usable.iter().any(|p| min.fits_in(&p.capacity.capacity)) {
        return Room::Fits;
    }
    let Some(largest) = usable.iter().max_by_key(|p| p.capacity.capacity.get("cpu")) else {
        return Room::Short("no member pool takes new pods (none is ready, or every member is paused)".into());
    };
    let mut lends = Resources::new();
    for (name, _) in min.iter() {
        lends.set(name, largest.capacity.capacity.get(name));
    }
    Room::Short(format!(
        "the gang's minResources ({}) are more than any member pool lends; the most is pool {} of member {} ({})",
        min.readable(),
        largest.name,
        largest.member,
        lends.readable()
    ))
}

/// The status a group is to have: its phase and the one condition tidepool writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Next {
    pub phase: &'static str,
    /// `(type, reason, message)` of a condition with status `True`.
    pub condition: Option<(&'static str, &'static str, String)>,
    pub counts: (u32, u32, u32),
}

/// What group `g`, whose pods count `tally`, is to say (see the module's doc).
pub(crate) fn next(g: &Group, tally: Tally, room: &Room) -> Next {
    let counts = (tally.running, tally.succeeded, tally.failed);
    let (phase, condition) = if tally.bound + tally.succeeded >= g.min_member {
        (RUNNING, Some((SCHEDULED, "", READY.to_owned())))
    } else if g.phase == INQUEUE {
        (INQUEUE, None)
    } else {
        match room {
            Room::Fits => (INQUEUE, None),
            Room::Short(why) => (PENDING, Some((UNSCHEDULABLE, NOT_ENOUGH_RESOURCES, why.clone()))),
        }
    };
    Next { phase, condition, counts }
}

/// Whether `g` already says what `n` says.
pub(crate) fn shows(g: &Group, n: &Next) -> bool {
    g.phase == n.phase
        && g.counts == n.counts
        && n.condition.as_ref().is_none_or(|(type_, reason, message)| {
            g.conditions.iter().any(|c| {
                let field = |k: &str| c.get(k).and_then(Value::as_str).unwrap_or_default();
                field("type") == *type_
                    && field("status") == "True"
                    && field("reason") == *reason
                    && field("message") == message
            })
        })
}

/// The merge patch that makes `g` say `n`: phase and counts, and the condition list with `n`'s
/// condition in place of any of its type (and `Unschedulable` dropped once the gang is
/// scheduled); a condition's time moves only when its status, reason or message changes.
pub(crate) fn patch(g: &Group, n: &Next, now: &str) -> Value {
    let mut conditions: Vec<Value> = g
        .conditions
        .iter()
        .filter(|c| {
            let t = c.get("type").and_then(Value::as_str).unwrap_or_default();
            n.condition.as_ref().is_none_or(|(type_, ..)| t != *type_ && !(*type_ == SCHEDULED && t == UNSCHEDULABLE))
        })
        .cloned()
        .collect();
    if let Some((type_, reason, message)) = &n.condition {
        conditions.push(serde_json::json!({
            "type": type_, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now,
        }));
    }
    let (running, succeeded, failed) = n.counts;
    serde_json::json!({"status": {
        "phase": n.phase, "running": running, "succeeded": succeeded, "failed": failed, "conditions": conditions,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tidepool_federation::capacity::PoolCapacity;

    fn group(phase: &str, min: u32) -> Group {
        Group::read(&json!({
            "metadata": {"namespace": "ns", "name": "g", "uid": "u1",
                "ownerReferences": [{"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "j", "controller": true}]},
            "spec": {"minMember": min, "minResources": {"cpu": "4", "requests.cpu": "4", "count/pods": "4", "requests.memory": "8Gi", "limits.memory": "16Gi"}},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn pool(cpu: &str, healthy: bool) -> Pool {
        Pool {
            member: "member-a".into(),
            name: "default".into(),
            node: "tidepool-member-a".into(),
            capacity: PoolCapacity {
                capacity: Resources::from_pairs([("cpu", cpu), ("memory", "64Gi")]).unwrap(),
                ..PoolCapacity::default()
            },
            paused: false,
            healthy,
            answering: true,
        }
    }

    fn pod(node: Option<&str>, phase: &str) -> PodLite {
        let mut p = PodLite::default();
        p.spec.node_name = node.map(str::to_owned);
        p.status.phase = Some(phase.into());
        p
    }

    #[test]
    fn a_group_reads_its_spec_status_and_controller() {
        let g = group("", 4);
        assert_eq!((g.key().as_str(), g.min_member, g.phase.as_str()), ("ns/g", 4, ""));
        assert_eq!(g.min_resources, Resources::from_pairs([("cpu", "4"), ("memory", "8Gi")]).unwrap());
        assert_eq!(g.owner.unwrap().kind, "Job");
        let bad =
            json!({"metadata": {"namespace": "ns", "name": "g", "uid": "u"}, "spec": {"minResources": {"cpu": "x"}}});
        assert_eq!(Group::read(&bad), None, "minResources that do not parse");
    }

    #[test]
    fn a_new_group_is_enqueued_when_some_pool_lends_its_minimum_in_total() {
        let g = group("", 4);
        let n = next(&g, Tally::default(), &room(&g.min_resources, &[pool("2", true), pool("8", true)]));
        assert_eq!((n.phase, n.condition), (INQUEUE, None));
    }

    #[test]
    fn a_group_no_pool_could_hold_stays_pending_and_says_why() {
        let g = group("Pending", 4);
        let r = room(&g.min_resources, &[pool("2", true), pool("16", false)]);
        let n = next(&g, Tally::default(), &r);
        assert_eq!(n.phase, PENDING);
        let (type_, reason, message) = n.condition.clone().unwrap();
        assert_eq!((type_, reason), (UNSCHEDULABLE, NOT_ENOUGH_RESOURCES));
        assert!(message.contains("(cpu=4,memory=8Gi)") && message.ends_with("(cpu=2,memory=64Gi)"), "{message}");
        let p = patch(&g, &n, "2026-12-05T00:00:00Z");
        assert_eq!(p["status"]["phase"], "Pending");
        assert_eq!(p["status"]["conditions"][0]["reason"], NOT_ENOUGH_RESOURCES);
        let none = room(&g.min_resources, &[]);
        assert!(matches!(none, Room::Short(m) if m.contains("no member pool")));
    }

    #[test]
    fn a_group_runs_once_its_minimum_is_bound_and_goes_back_when_a_restart_takes_its_pods() {
        let g = group("Inqueue", 3);
        let mut t = Tally::default();
        for p in [pod(Some("vn"), "Running"), pod(Some("vn"), "Pending"), pod(None, "Pending")] {
            t.add(&p);
        }
        assert_eq!(next(&g, t, &Room::Fits).phase, INQUEUE, "two of three bound: still waiting");
        t.add(&pod(Some("vn"), "Running"));
        let n = next(&g, t, &Room::Fits);
        assert_eq!((n.phase, n.counts), (RUNNING, (2, 0, 0)));
        // A restart: the job's pods failed and are gone; the group is enqueued again.
        let running = group("Running", 3);
        let mut after = Tally::default();
        after.add(&pod(Some("vn"), "Failed"));
        let n = next(&running, after, &Room::Fits);
        assert_eq!((n.phase, n.counts), (INQUEUE, (0, 0, 1)));
    }

    #[test]
    fn succeeded_pods_count_toward_the_minimum_deleted_ones_do_not() {
        let g = group("Running", 2);
        let mut t = Tally::default();
        t.add(&pod(Some("vn"), "Succeeded"));
        let mut going = pod(Some("vn"), "Running");
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()));
        t.add(&going);
        assert_eq!(next(&g, t, &Room::Fits).phase, INQUEUE);
        t.add(&pod(Some("vn"), "Running"));
        assert_eq!(next(&g, t, &Room::Fits).phase, RUNNING);
    }

    #[test]
    fn a_written_status_is_seen_as_shown_and_unschedulable_goes_once_scheduled() {
        let mut g = group("Pending", 1);
        let short = next(&g, Tally::default(), &Room::Short("no room".into()));
        let p = patch(&g, &short, "t0");
        g.phase = PENDING.into();
        g.conditions = p["status"]["conditions"].as_array().unwrap().clone();
        assert!(shows(&g, &short));
        assert!(!shows(&g, &next(&g, Tally::default(), &Room::Short("other".into()))));
        let mut t = Tally::default();
        t.add(&pod(Some("vn"), "Running"));
        let run = next(&g, t, &Room::Fits);
        let p = patch(&g, &run, "t1");
        let types: Vec<&str> =
            p["status"]["conditions"].as_array().unwrap().iter().map(|c| c["type"].as_str().unwrap()).collect();
        assert_eq!(types, vec![SCHEDULED]);
    }

    #[test]
    fn a_job_is_tidepools_when_every_pod_template_names_its_scheduler() {
        let volcano_job = json!({"spec": {"schedulerName": "tidepool", "tasks": [
            {"name": "ps", "template": {"spec": {"containers": []}}},
            {"name": "worker", "template": {"spec": {"schedulerName": "tidepool"}}},
        ]}});
        assert!(claimed(&template_schedulers(&volcano_job), "tidepool"));
        let tfjob = json!({"spec": {"tfReplicaSpecs": {
            "PS": {"replicas": 2, "template": {"spec": {"schedulerName": "tidepool"}}},
            "Worker": {"replicas": 2, "template": {"spec": {}}},
        }}});
        assert_eq!(template_schedulers(&tfjob), vec!["tidepool".to_owned(), String::new()]);
        assert!(!claimed(&template_schedulers(&tfjob), "tidepool"), "a mixed job is not tidepool's");
        assert!(!claimed(&template_schedulers(&json!({"spec": {}})), "tidepool"), "no template: nothing to go by");
        let theirs = json!({"spec": {"tasks": [{"template": {"spec": {}}}]}});
        assert!(!claimed(&template_schedulers(&theirs), "tidepool"));
    }
}
