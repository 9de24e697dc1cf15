//! One dispatcher round as data: the pure decisions that turn what the round read (the
//! gangs, their `minMember`, the pool views) into the [`Write`]s it plans, in order, which
//! [`crate::controller`] then commits. Reserve first, commit after, as Volcano's
//! `Statement` does for a gang: a decision can be read, and tested, before anything is
//! written.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Binding, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use tidepool_api::Resources;
use tidepool_api::keys::{self, Band, Native};
use tidepool_api::node_match::NodeConstraints;
use tidepool_api::pod::{PodLite, under_notice};

use crate::context::requests;
use crate::gang::{self, BandRanges, GangKey};
use crate::native_pool::{NATIVE, NativePool};
use crate::order::QueueEntry;
use crate::plan::{self, GangDemand, PoolView};
use crate::workload;

/// A gang as seen in one round.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct GangState {
    pub pods: Vec<Arc<PodLite>>,
    /// Virtual node recorded on any of its pods (annotation or binding): where its lent pods
    /// go.
    pub pinned: Option<String>,
    /// Some of its pods were placed on the training cluster's own nodes (the native floor).
    pub native: bool,
    /// Pods of the gang that completed: they count as having run.
    pub succeeded: usize,
    /// The domain of the pool the gang was planned into (annotation on any of its pods):
    /// where its elastic pods go too.
    pub domain: plan::Domain,
    /// Creation time (Unix seconds) of its newest live pod: a gang whose pods are still being
    /// created is not told, pod after pod, that it lacks some ([`FORMING_QUIET`]).
    pub newest: Option<i64>,
}

impl GangState {
    /// Whether any of its pods was placed (on lent capacity or on native nodes).
    pub(crate) fn placed(&self) -> bool {
        self.pinned.is_some() || self.native
    }

    /// Where it was placed, in words.
    fn whereabouts(&self) -> String {
        match (&self.pinned, self.native) {
            (Some(node), true) => format!("the training cluster's nodes and {node}"),
            (Some(node), false) => node.clone(),
            (None, _) => "the training cluster's nodes".to_owned(),
        }
    }

    /// Whether its pods are still arriving at `now` (Unix seconds): its newest is younger
    /// than [`FORMING_QUIET`].
    pub(crate) fn forming(&self, now: i64) -> bool {
        self.newest.is_some_and(|t| now - t < FORMING_QUIET)
    }
}

/// Seconds after its newest pod's creation during which a gang short of its `minMember`
/// is taken to be still forming and waits without a word: a job's pods arrive within this,
/// and each arrival would otherwise rewrite every earlier pod's reason and Event (the count
/// in it changes), a status write and an Event per pod per round while a large gang forms.
pub(crate) const FORMING_QUIET: i64 = 5;

/// A write a round plans, in the order it is to be made.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Write {
    /// Says why `pods` wait: `PodScheduled=False`, reason `Unschedulable`, and an Event,
    /// where the pod does not show `message` already.
    Explain { pods: Vec<Arc<PodLite>>, message: String },
    /// Fails every pod of a gang that timed out (reason `GangTimeout`).
    RollBack { pods: Vec<Arc<PodLite>>, message: String },
    /// Binds one pod of a placed gang to `target` (the gang's virtual node, or a native
    /// node), recording with the binding its band, its role (and, for a core pod, the size of
    /// the core and its planned member node) and the gang's planned domain.
    Bind { pod: Arc<PodLite>, target: Target, band: Band, role: Role, domain: plan::Domain },
    /// Labels a pod whose binding was to carry its band and role but did not (see
    /// [`unlabelled`]).
    Relabel { pod: Arc<PodLite>, band: Band, role: &'static str },
    /// A new gang: binds each of its `core` pods (`pods`) to `node` (its lent pool's virtual
    /// node; [`NATIVE`] when its whole core is native) or, a native pod, to its native node,
    /// recording with each binding the placement (band, planned node and domain, the core's
    /// size), and says `Placed` on the first.
    Place {
        gang: GangKey,
        node: String,
        member: String,
        pods: Vec<PlannedPod>,
        domain: plan::Domain,
        note: Option<String>,
    },
}

/// Where a binding puts a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// On the virtual node of a member's pool.
    Lent(String),
    /// On one of the training cluster's own nodes.
    Native(String),
}

impl Target {
    /// The node the binding names.
    pub(crate) fn node(&self) -> &str {
        match self {
            Target::Lent(node) | Target::Native(node) => node,
        }
    }

    /// What the pod's placement records: the virtual node, or [`NATIVE`].
    pub(crate) fn placement(&self) -> &str {
        match self {
            Target::Lent(node) => node,
            Target::Native(_) => NATIVE,
        }
    }
}

/// What a bound pod is to its gang.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Role {
    /// One of the gang's `size` core pods, planned on member node `planned_node` when known.
    Core { size: usize, planned_node: Option<String> },
    /// Beyond the core: elastic, band `low`.
    Elastic,
}

impl Role {
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Role::Core { .. } => keys::ROLE_CORE,
            Role::Elastic => keys::ROLE_ELASTIC,
        }
    }
}

/// What a binding records on its pod besides the node: the dispatcher's decision, read back
/// by every later round, by vk-provider (band, planned node and domain) and by reclaim.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Stamp {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

impl Stamp {
    /// The record of binding a pod to virtual node `node` with `band`, as `role`, inside
    /// `domain`, at `placed_at` (RFC 3339). Only core pods carry `placed-at` and the core's
    /// size: a late core pod's `placed-at` never precedes its gang's first, which the gang
    /// timeout counts from.
    pub(crate) fn new(node: &str, band: Band, role: &Role, domain: &plan::Domain, placed_at: &str) -> Self {
        let labels = [(keys::LABEL_BAND, band.as_str()), (keys::LABEL_ROLE, role.as_str())];
        let mut annotations = BTreeMap::from([(keys::ANNOTATION_PLACEMENT.to_owned(), node.to_owned())]);
        if !domain.is_empty() {
            annotations.insert(keys::ANNOTATION_PLANNED_DOMAIN.to_owned(), domain.to_annotation());
        }
        if let Role::Core { size, planned_node } = role {
            annotations.insert(keys::ANNOTATION_PLACED_AT.to_owned(), placed_at.to_owned());
            annotations.insert(keys::ANNOTATION_GANG_CORE.to_owned(), size.to_string());
            if let Some(n) = planned_node {
                annotations.insert(keys::ANNOTATION_PLANNED_NODE.to_owned(), n.clone());
            }
        }
        Self { labels: labels.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(), annotations }
    }

    /// `pod` as a binding to `node` with this record leaves it.
    pub(crate) fn bound(&self, pod: &PodLite, node: &str) -> PodLite {
        let mut p = pod.clone();
        p.spec.node_name = Some(node.to_owned());
        p.metadata.labels.get_or_insert_default().extend(self.labels.clone());
        p.metadata.annotations.get_or_insert_default().extend(self.annotations.clone());
        p
    }

    /// The writes that bind pod `name` to `node` with this record: the Binding, carrying it,
    /// and, where the training API server does not copy a Binding's labels onto its pod
    /// (`labels_on_binding` false: older than 1.35, or `PodTopologyLabelsAdmission` off), a
    /// merge patch that puts the record on the pod first.
    pub(crate) fn writes(
        &self,
        name: &str,
        node: &str,
        labels_on_binding: bool,
    ) -> (Option<serde_json::Value>, Binding) {
        let first = (!labels_on_binding)
            .then(|| serde_json::json!({ "metadata": { "labels": self.labels, "annotations": self.annotations } }));
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(self.labels.clone()),
                annotations: Some(self.annotations.clone()),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.to_owned()),
                ..Default::default()
            },
        };
        (first, binding)
    }
}

/// Whether a training API server of this version copies a Binding's labels onto its pod:
/// since 1.35 (`PodTopologyLabelsAdmission`, beta and on by default). `minor` may carry a
/// suffix (`"35+"`); one that does not parse counts as older.
pub(crate) fn copies_binding_labels(major: &str, minor: &str) -> bool {
    let minor: u32 = minor.chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap_or(0);
    major.parse::<u32>().is_ok_and(|m| m > 1 || (m == 1 && minor >= 35))
}

/// A core pod of a new gang as planned: its band and the node it was simulated on (a member
/// node, or the native node it is bound to when `native`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedPod {
    pub pod: Arc<PodLite>,
    pub band: Band,
    pub member_node: String,
    pub native: bool,
}

impl PlannedPod {
    /// Where its binding puts it, its gang placed on `node`.
    pub(crate) fn target(&self, node: &str) -> Target {
        if self.native { Target::Native(self.member_node.clone()) } else { Target::Lent(node.to_owned()) }
    }
}

/// What admitting one gang plans.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Admission {
    pub writes: Vec<Write>,
    /// The requests of a new gang's whole core when it found no pool: a candidate for
    /// preemption.
    pub unplaced: Option<Resources>,
}

/// The virtual node a pod's gang was placed on: its placement annotation, else its binding.
fn placement_of(p: &PodLite) -> Option<&str> {
    p.annotations().get(keys::ANNOTATION_PLACEMENT).map(String::as_str).or_else(|| p.node_name())
}

/// The gangs of the pods for `scheduler` among `all`: live pods, with the placement any of
/// them carries, and the count of those that succeeded. A pod under a reclaim notice pins
/// nothing: its member is taking the room back, so the pods its operator makes again in its
/// stead are placed afresh (with the rest of the gang once all of it is there), never beside
/// it on that member (where each would get the notice in turn, and the gang never leave).
pub(crate) fn gangs_of(all: &[Arc<PodLite>], scheduler: &str) -> BTreeMap<GangKey, GangState> {
    let mut gangs: BTreeMap<GangKey, GangState> = BTreeMap::new();
    for p in all.iter().filter(|p| p.spec.scheduler_name.as_deref() == Some(scheduler)) {
        if !p.is_live() {
            if p.status.phase.as_deref() == Some("Succeeded") {
                gangs.entry(gang::gang_of(p)).or_default().succeeded += 1;
            }
            continue;
        }
        let g = gangs.entry(gang::gang_of(p)).or_default();
        match placement_of(p) {
            Some(NATIVE) => g.native = true,
            Some(node) if g.pinned.is_none() && !under_notice(p.status.tidepool_conditions()) => {
                g.pinned = Some(node.to_owned())
            }
            _ => {}
        }
        if g.domain.is_empty()
            && let Some(domain) = p.annotations().get(keys::ANNOTATION_PLANNED_DOMAIN)
        {
            g.domain = plan::Domain::parse(domain);
        }
        if let Some(t) = p.metadata.creation_timestamp.as_ref() {
            g.newest = g.newest.max(Some(t.0.as_second()));
        }
        g.pods.push(p.clone());
    }
    gangs
}

/// Live pods of `scheduler` bound where their placement says (the virtual node it names, or
/// a native node), by a binding that recorded the placement, that carry no band: the
/// training API server did not copy the binding's labels.
pub(crate) fn unlabelled(all: &[Arc<PodLite>], scheduler: &str) -> Vec<Arc<PodLite>> {
    all.iter()
        .filter(|p| p.spec.scheduler_name.as_deref() == Some(scheduler) && p.is_live())
        .filter(|p| tidepool_api::pod::placed_by_dispatcher(&p.metadata, p.node_name()))
        .filter(|p| !p.labels().contains_key(keys::LABEL_BAND))
        .cloned()
        .collect()
}

/// Seconds a placed gang has waited since its placement, when that is at least `timeout`:
/// it is then checked against its `minMember` ([`timed_out`]). `None` for a gang not placed
/// (or whose placement time cannot be read) and one still within its timeout.
pub(crate) fn overdue(g: &GangState, timeout: u64, now: jiff::Timestamp) -> Option<i64> {
    if !g.placed() {
        return None;
    }
    let placed_at: jiff::Timestamp =
        g.pods.iter().filter_map(|p| p.annotations().get(keys::ANNOTATION_PLACED_AT)?.parse().ok()).min()?;
    let waited = now.duration_since(placed_at).as_secs();
    (waited >= i64::try_from(timeout).unwrap_or(i64::MAX)).then_some(waited)
}

/// Why a placed gang that waited `waited` seconds (past its `timeout`) must be rolled back:
/// fewer than `min` of its pods run (or ran to completion). `None` when enough do.
pub(crate) fn timed_out(key: &GangKey, g: &GangState, min: usize, waited: i64, timeout: u64) -> Option<String> {
    if !g.placed() {
        return None;
    }
    let node = g.whereabouts();
    let running = g.succeeded
        + g.pods.iter().filter(|p| p.node_name().is_some() && p.status.phase.as_deref() == Some("Running")).count();
    (running < min).then(|| {
        format!("gang {key}: {running} of its {min} pods running on {node} after {waited}s (timeout {timeout}s); rolled back whole so it can be placed again")
    })
}

/// The queue entry of a gang with pods waiting: its band (of its highest priority, as a
/// core), `min`, the pods it would run with and those bound, and its age.
pub(crate) fn queue_entry(key: &GangKey, g: &GangState, min: u32, ranges: &BandRanges) -> QueueEntry {
    let bound = g.pods.iter().filter(|p| p.node_name().is_some()).count() as u32;
    let priority = g.pods.iter().filter_map(|p| p.spec.priority).max().unwrap_or(0);
    let created = g
        .pods
        .iter()
        .filter_map(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0.as_second()))
        .min()
        .unwrap_or(0);
    QueueEntry {
        key: key.clone(),
        band: gang::band_for(Some(priority).filter(|p| *p != 0), true, ranges),
        priority,
        min,
        max: (g.pods.len() as u32).max(min),
        current: bound,
        created,
    }
}

/// Counts `req` as used in `view`, on the first member node it fits (as the member's
/// scheduler would place it), so later decisions in the round see it. Returns that node.
pub(crate) fn assume(view: &mut PoolView, req: &Resources) -> Option<String> {
    assume_in(view, req, &plan::Domain::default())
}

/// [`assume`] on the member nodes of `domain` only (the whole pool when it is empty).
fn assume_in(view: &mut PoolView, req: &Resources, domain: &plan::Domain) -> Option<String> {
    view.used.add(req);
    let node = view.free_per_node.iter_mut().find(|n| domain.contains(n) && req.fits_in(&n.free))?;
    node.free.sub(req);
    Some(node.name.clone())
}

/// What a round may place on: the members' pools and, when the admin offers them, the
/// training cluster's own nodes. Each admission books what it plans on them, so later gangs
/// of the round see it taken.
#[derive(Debug)]
pub(crate) struct Offer<'a> {
    pub lent: &'a mut [PoolView],
    pub native: Option<&'a mut NativePool>,
    /// The virtual nodes of the lent pools a gang with native pods may not borrow from: their
    /// member's pod network overlaps the native nodes' or another member's
    /// ([`crate::native_pool::apart`]).
    pub apart: BTreeSet<String>,
}

impl<'a> Offer<'a> {
    /// The members' pools only.
    #[cfg(test)]
    pub(crate) fn lent(lent: &'a mut [PoolView]) -> Self {
        Self { lent, native: None, apart: BTreeSet::new() }
    }

    /// `plan` over the lent pools a gang with native pods may borrow from (those in `apart`
    /// taken for unschedulable while it runs), and why the others are left out, if any is.
    fn for_floor<R>(&mut self, plan: impl FnOnce(&[PoolView]) -> R) -> (R, Option<String>) {
        let hidden: Vec<usize> = (0..self.lent.len())
            .filter(|&i| self.lent[i].schedulable && self.apart.contains(&self.lent[i].node))
            .collect();
        hidden.iter().for_each(|&i| self.lent[i].schedulable = false);
        let result = plan(self.lent);
        hidden.iter().for_each(|&i| self.lent[i].schedulable = true);
        let why = (!hidden.is_empty()).then(|| {
            let nodes: Vec<&str> = hidden.iter().map(|&i| self.lent[i].node.as_str()).collect();
            format!(
                " ({} not offered to a job with native pods: its member's pod network overlaps the native nodes' or another member's)",
                nodes.join(", ")
            )
        });
        (result, why)
    }
}

/// Admits what it can of gang `key` with `min` core pods: a placed gang finishes its core
/// and grows elastically where it was placed; a new gang is placed whole, its lent pods on
/// one pool and its native ones (`tidepool.io/native`) on the training cluster's nodes, or
/// waits with the reason (none while it is still forming at `now`, Unix seconds: see
/// [`FORMING_QUIET`]).
pub(crate) fn admit(
    key: &GangKey,
    g: &GangState,
    min: usize,
    offer: &mut Offer<'_>,
    (ranges, now): (&BandRanges, i64),
) -> Admission {
    let mut pending: Vec<&Arc<PodLite>> = g.pods.iter().filter(|p| p.node_name().is_none()).collect();
    // The core is the first `min` of them: by role and index, as the job needs them.
    pending.sort_by(|a, b| workload::core_cmp(&a.metadata, &b.metadata));
    let modes = match modes(&pending) {
        Ok(modes) => modes,
        Err(why) => {
            let message = format!("gang {key}: {why}");
            let pods = pending.iter().map(|p| (*p).clone()).collect();
            return Admission { writes: vec![Write::Explain { pods, message }], unplaced: None };
        }
    };
    let waiting = Waiting { pending: &pending, modes: &modes };
    if g.placed() {
        let bound = g.pods.len() - pending.len();
        let writes = admit_placed(key, g, waiting, (min, bound), offer, ranges);
        return Admission { writes, unplaced: None };
    }
    if pending.len() < min && g.forming(now) {
        return Admission::default();
    }
    admit_new(key, waiting, min, offer, ranges)
}

/// A gang's pods waiting to be bound, core first, and where each asks to run.
#[derive(Debug, Clone, Copy)]
struct Waiting<'a> {
    pending: &'a [&'a Arc<PodLite>],
    modes: &'a [Native],
}

impl<'a> Waiting<'a> {
    /// The first `core` pods split into those bound natively and those on lent capacity,
    /// then the rest (elastic) split the same way.
    fn split(&self, core: usize) -> [Vec<&'a Arc<PodLite>>; 4] {
        let mut parts: [Vec<&Arc<PodLite>>; 4] = Default::default();
        for (i, (p, mode)) in self.pending.iter().zip(self.modes).enumerate() {
            let is_core = i < core;
            let slot = usize::from(!is_core) * 2 + usize::from(!mode.on_native(is_core));
            parts[slot].push(*p);
        }
        parts
    }
}

/// Where each pod asks to run (its `tidepool.io/native`); the first unreadable one is an error.
fn modes(pods: &[&Arc<PodLite>]) -> Result<Vec<Native>, String> {
    pods.iter().map(|p| Native::parse(p.annotations().get(keys::ANNOTATION_NATIVE).map(String::as_str))).collect()
}

/// The gang was placed, `bound` of its `min` core pods are bound: bind the pods its core
/// lacks (a restart between its first and last binding left them), then each elastic pod
/// that fits: a native pod on the first native node with room for it, a lent one on the
/// gang's pool (chosen now for a gang whose pods were all native so far).
fn admit_placed(
    key: &GangKey,
    g: &GangState,
    waiting: Waiting<'_>,
    (min, bound): (usize, usize),
    offer: &mut Offer<'_>,
    ranges: &BandRanges,
) -> Vec<Write> {
    let [core_native, core_lent, elastic_native, elastic_lent] = waiting.split(min.saturating_sub(bound));
    let mut writes = bind_native(key, (&core_native, &elastic_native), min, offer.native.as_deref_mut(), ranges);
    if core_lent.is_empty() && elastic_lent.is_empty() {
        return writes;
    }
    let first = core_lent.first().or(elastic_lent.first()).copied();
    let lent_pool = match (&g.pinned, first) {
        (Some(node), _) => Ok((node.clone(), g.domain.clone())),
        (None, Some(p)) => {
            let (chosen, why) = offer.for_floor(|pools| choose_pool(key, p, pools));
            chosen.map_err(|message| message + why.as_deref().unwrap_or_default())
        }
        (None, None) => return writes,
    };
    match lent_pool {
        Ok((node, domain)) => {
            writes.extend(admit_lent(key, (&node, &domain), (&core_lent, &elastic_lent), min, offer.lent, ranges))
        }
        Err(message) => {
            let pods = core_lent.iter().chain(&elastic_lent).map(|p| (*p).clone()).collect();
            writes.push(Write::Explain { pods, message });
        }
    }
    writes
}

/// Binds the native pods of a placed gang, each on the first native node with room for it.
fn bind_native(
    key: &GangKey,
    (core, elastic): (&[&Arc<PodLite>], &[&Arc<PodLite>]),
    min: usize,
    mut native: Option<&mut NativePool>,
    ranges: &BandRanges,
) -> Vec<Write> {
    let mut writes = Vec::new();
    for (p, is_core) in core.iter().map(|p| (p, true)).chain(elastic.iter().map(|p| (p, false))) {
        let node = native.as_deref_mut().and_then(|n| n.take_one(&requests(p), p.spec.node_constraints.as_deref()));
        let Some(node) = node else {
            let what = if is_core { "its core pod" } else { "another of its pods" };
            let message = format!("gang {key}: no room for {what} on the training cluster's own nodes");
            writes.push(Write::Explain { pods: vec![(*p).clone()], message });
            continue;
        };
        let band = gang::band_for(p.spec.priority, is_core, ranges);
        let role = if is_core { Role::Core { size: min, planned_node: Some(node.clone()) } } else { Role::Elastic };
        let (target, domain) = (Target::Native(node), plan::Domain::default());
        writes.push(Write::Bind { pod: (*p).clone(), target, band, role, domain });
    }
    writes
}

/// The pool for the first lent pod `p` of a gang whose pods were all native: the one the
/// planner picks for `p` alone, pool-wide (the gang's later lent pods follow it there).
fn choose_pool(key: &GangKey, p: &Arc<PodLite>, lent: &[PoolView]) -> Result<(String, plan::Domain), String> {
    let demand = GangDemand {
        key: key.clone(),
        pods: vec![requests(p)],
        pinned: None,
        constraints: p.spec.node_constraints.as_deref().cloned().into_iter().collect(),
    };
    match plan::place_pool_wide(&demand, lent) {
        Ok(placement) => Ok((placement.node, plan::Domain::default())),
        Err(u) => Err(format!("gang {key}: its lent pods wait: {}", u.message)),
    }
}

/// The lent pods of a placed gang on its pool `node`, in its `domain`: the missing core
/// pods, each on the member node it fits first, then each elastic pod that fits.
fn admit_lent(
    key: &GangKey,
    (node, domain): (&str, &plan::Domain),
    (core, elastic): (&[&Arc<PodLite>], &[&Arc<PodLite>]),
    min: usize,
    pools: &mut [PoolView],
    ranges: &BandRanges,
) -> Vec<Write> {
    let Some(pool) = pools.iter_mut().find(|v| v.node == node) else {
        let message = format!("gang {key} is placed on {node}, which is not offered right now");
        return vec![Write::Explain { pods: core.iter().chain(elastic).map(|p| (*p).clone()).collect(), message }];
    };
    let target = Target::Lent(node.to_owned());
    let mut writes = Vec::new();
    for p in core {
        let planned_node = assume_in(pool, &requests(p), domain);
        let band = gang::band_for(p.spec.priority, true, ranges);
        let role = Role::Core { size: min, planned_node };
        writes.push(Write::Bind { pod: (*p).clone(), target: target.clone(), band, role, domain: domain.clone() });
    }
    let mut admitted = Vec::new();
    for p in elastic {
        let req = requests(p);
        if let Some(c) = p.spec.node_constraints.as_deref()
            && !c.matches(&pool.node, &pool.labels())
        {
            let message =
                format!("gang {key} runs on {node}, which the pod's node selection ({}) excludes", c.describe());
            writes.push(Write::Explain { pods: vec![(*p).clone()], message });
            continue;
        }
        if !plan::fits_one(&req, pool, &admitted, domain) {
            let inside = if domain.is_empty() { String::new() } else { format!(" in {}", domain.to_annotation()) };
            let message = format!("gang {key}: no room for another elastic pod on {node}{inside}");
            writes.push(Write::Explain { pods: vec![(*p).clone()], message });
            continue;
        }
        admitted.push(req);
        let band = gang::band_for(p.spec.priority, false, ranges);
        let (role, domain) = (Role::Elastic, domain.clone());
        writes.push(Write::Bind { pod: (*p).clone(), target: target.clone(), band, role, domain });
    }
    for r in &admitted {
        assume(pool, r);
    }
    writes
}

/// The node selections of `pods`, each different one once.
fn constraints_of(pods: &[&Arc<PodLite>]) -> Vec<NodeConstraints> {
    let mut constraints: Vec<NodeConstraints> = Vec::new();
    for c in pods.iter().filter_map(|p| p.spec.node_constraints.as_deref()) {
        if !constraints.contains(c) {
            constraints.push(c.clone());
        }
    }
    constraints
}

/// A new gang: all of its core placed, its lent pods on one pool and its native pods on
/// the training cluster's nodes, or nothing.
fn admit_new(key: &GangKey, waiting: Waiting<'_>, min: usize, offer: &mut Offer<'_>, ranges: &BandRanges) -> Admission {
    let pending = waiting.pending;
    let all_waiting = || pending.iter().map(|p| (*p).clone()).collect();
    if pending.len() < min {
        let message = format!("gang {key} has {} of its {min} pods; waiting for the rest", pending.len());
        return Admission { writes: vec![Write::Explain { pods: all_waiting(), message }], unplaced: None };
    }
    let [native, lent, _, _] = waiting.split(min);
    let native_demand = GangDemand {
        key: key.clone(),
        pods: native.iter().map(|p| requests(p)).collect(),
        pinned: None,
        constraints: Vec::new(),
    };
    let lent_demand = GangDemand {
        key: key.clone(),
        pods: lent.iter().map(|p| requests(p)).collect(),
        pinned: None,
        constraints: constraints_of(&lent),
    };
    let native_plan = (!native.is_empty()).then(|| place_native(&native_demand, &native, offer.native.as_deref()));
    let (lent_plan, apart) = match (lent.is_empty(), native.is_empty()) {
        (true, _) => (None, None),
        (false, true) => (Some(plan::place(&lent_demand, offer.lent)), None),
        (false, false) => {
            let (placed, why) = offer.for_floor(|pools| plan::place(&lent_demand, pools));
            (Some(placed), why)
        }
    };
    match (native_plan, lent_plan) {
        (Some(Err(why)), lent_plan) => {
            let lent_too = match lent_plan {
                Some(Err(u)) => format!("; its {} lent core pods wait too: {}", lent.len(), u.message),
                _ => String::new(),
            };
            let message = format!("gang {key}: its {} native core pods wait: {why}{lent_too}", native.len());
            Admission { writes: vec![Write::Explain { pods: all_waiting(), message }], unplaced: None }
        }
        (native_plan, Some(Err(u))) => {
            let fits = if native_plan.is_some() {
                format!(" (its {} native core pods fit the training cluster's nodes)", native.len())
            } else {
                String::new()
            };
            let message = if native.is_empty() {
                format!("gang {key}: {}", u.message)
            } else {
                let apart = apart.unwrap_or_default();
                format!("gang {key}: its {} lent core pods wait: {}{apart}{fits}", lent.len(), u.message)
            };
            let mut total = Resources::new();
            lent_demand.pods.iter().for_each(|r| total.add(r));
            Admission { writes: vec![Write::Explain { pods: all_waiting(), message }], unplaced: Some(total) }
        }
        (native_plan, lent_plan) => {
            let native_plan = native_plan.and_then(Result::ok);
            let lent_plan = lent_plan.and_then(Result::ok);
            let place = book(key, (&native, native_plan), (&lent, lent_plan), offer, ranges);
            Admission { writes: vec![place], unplaced: None }
        }
    }
}

/// The native part of a new gang's core on the native nodes every one of its pods may go to.
fn place_native(
    demand: &GangDemand,
    pods: &[&Arc<PodLite>],
    native: Option<&NativePool>,
) -> Result<plan::Placement, String> {
    let Some(native) = native.filter(|n| !n.is_empty()) else {
        return Err(format!(
            "they ask for the training cluster's own nodes ({}), and none are offered to tidepool \
             (dispatcher.nativeNodes)",
            keys::ANNOTATION_NATIVE
        ));
    };
    let selections: Vec<Option<&NodeConstraints>> = pods.iter().map(|p| p.spec.node_constraints.as_deref()).collect();
    let view = native.view_for(&selections);
    if view.free_per_node.is_empty() {
        return Err("no native node is one every one of them may go to (selector, affinity, taints)".to_owned());
    }
    plan::place(demand, std::slice::from_ref(&view)).map_err(|u| u.message)
}

/// Books a new gang's placed core (its native part on `native_plan`, its lent part on
/// `lent_plan`) on the offer and plans its `Place`, the core's pods in core order.
fn book(
    key: &GangKey,
    (native, native_plan): (&[&Arc<PodLite>], Option<plan::Placement>),
    (lent, lent_plan): (&[&Arc<PodLite>], Option<plan::Placement>),
    offer: &mut Offer<'_>,
    ranges: &BandRanges,
) -> Write {
    let planned = |p: &Arc<PodLite>, member_node: String, native: bool| PlannedPod {
        pod: p.clone(),
        band: gang::band_for(p.spec.priority, true, ranges),
        member_node,
        native,
    };
    let mut pods = Vec::new();
    if let (Some(plan), Some(pool)) = (&native_plan, offer.native.as_deref_mut()) {
        for (p, node) in native.iter().zip(&plan.planned_nodes) {
            pool.reserve(node, &requests(p));
            pods.push(planned(p, node.clone(), true));
        }
    }
    let (mut node, mut member, mut domain, mut note) =
        (NATIVE.to_owned(), String::new(), plan::Domain::default(), None);
    if let Some(plan) = lent_plan {
        if let Some(pool) = offer.lent.iter_mut().find(|v| v.node == plan.node) {
            let reqs: Vec<Resources> = lent.iter().map(|p| requests(p)).collect();
            pool.reserve(&reqs, &plan.per_pod_member_node);
        }
        pods.extend(lent.iter().zip(plan.planned_nodes).map(|(p, n)| planned(p, n, false)));
        (node, member, domain, note) = (plan.node, plan.member, plan.domain, plan.note);
    }
    if member.is_empty() {
        member = "the training cluster".to_owned();
    }
    pods.sort_by(|a, b| workload::core_cmp(&a.pod.metadata, &b.pod.metadata));
    Write::Place { gang: key.clone(), node, member, pods, domain, note }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodCondition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use proptest::prelude::*;
    use std::collections::BTreeSet;
    use tidepool_api::pod::SpecLite;
    use tidepool_federation::capacity::{GPU, NodeFree};

    fn gpus(n: i64) -> Resources {
        let mut r = Resources::new();
        r.set(GPU, n * 1000);
        r
    }

    /// A pending pod of annotation gang `g` in namespace `ns`, asking for `n` GPUs.
    fn pending(name: &str, n: i64) -> PodLite {
        let annotations = [(keys::ANNOTATION_GANG.to_owned(), "g".to_owned())].into();
        PodLite {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: SpecLite { scheduler_name: Some("tidepool".into()), requests: gpus(n), ..Default::default() },
            ..Default::default()
        }
    }

    /// `p` bound to virtual node `node` by the dispatcher, running.
    fn running_on(mut p: PodLite, node: &str) -> PodLite {
        p.spec.node_name = Some(node.into());
        p.metadata.annotations.get_or_insert_default().insert(keys::ANNOTATION_PLACEMENT.into(), node.into());
        p.status.phase = Some("Running".into());
        p
    }

    /// A schedulable pool on virtual node `node` with `nodes` empty member nodes of `per_node` GPUs.
    fn pool(node: &str, nodes: usize, per_node: i64) -> PoolView {
        PoolView {
            node: node.into(),
            member: format!("member-of-{node}"),
            pool: "default".into(),
            capacity: gpus(per_node * nodes as i64),
            used: Resources::new(),
            free_per_node: (0..nodes).map(|i| NodeFree::new(format!("n{i}"), gpus(per_node))).collect(),
            gpu_product: Some("A100".into()),
            topology: Vec::new(),
            schedulable: true,
        }
    }

    fn gang(pods: Vec<PodLite>, pinned: Option<&str>) -> GangState {
        GangState {
            pods: pods.into_iter().map(Arc::new).collect(),
            pinned: pinned.map(str::to_owned),
            native: false,
            succeeded: 0,
            domain: plan::Domain::default(),
            newest: None,
        }
    }

    /// The round's time in the tests (Unix seconds).
    const NOW: i64 = 1_800_000_000;

    fn key() -> GangKey {
        GangKey::annotation("ns", "g")
    }

    #[test]
    fn a_new_gang_is_placed_whole_on_one_pool_and_only_its_core_is_booked() {
        // Three pods, minMember 2, 2 GPUs each. Pool a has one 8-GPU node, pool b two 2-GPU
        // nodes: b fits the core most tightly. The third pod is elastic: it waits for the
        // next round, when the gang has its pool.
        let g = gang(vec![pending("w-2", 2), pending("w-0", 2), pending("w-1", 2)], None);
        let mut pools = vec![pool("tidepool-a", 1, 8), pool("tidepool-b", 2, 2)];
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let core = |name: &str, member_node: &str| PlannedPod {
            pod: g.pods.iter().find(|p| p.name_any() == name).unwrap().clone(),
            band: Band::Medium,
            member_node: member_node.into(),
            native: false,
        };
        let place = Write::Place {
            gang: key(),
            node: "tidepool-b".into(),
            member: "member-of-tidepool-b".into(),
            pods: vec![core("w-0", "n0"), core("w-1", "n1")],
            domain: plan::Domain::default(),
            note: None,
        };
        assert_eq!(admission, Admission { writes: vec![place], unplaced: None });
        assert_eq!(pools[1].used, gpus(4), "the core is booked on its pool for the rest of the round");
        assert_eq!(pools[1].free_per_node.iter().map(|n| n.free.clone()).collect::<Vec<_>>(), vec![gpus(0), gpus(0)]);
        assert_eq!(pools[0].used, Resources::new(), "the other pool keeps its room");
    }

    /// `p` with `spec.nodeSelector` `tidepool.io/member: member`.
    fn selecting(mut p: PodLite, member: &str) -> PodLite {
        let selector = [(keys::LABEL_MEMBER.to_owned(), member.to_owned())].into();
        p.spec.node_constraints = Some(Box::new(NodeConstraints { selector, ..Default::default() }));
        p
    }

    #[test]
    fn a_gang_goes_only_to_a_pool_its_pods_select() {
        // Pool b fits the core more tightly, but the pods select pool a's member.
        let pods = vec![
            selecting(pending("w-0", 2), "member-of-tidepool-a"),
            selecting(pending("w-1", 2), "member-of-tidepool-a"),
        ];
        let mut pools = vec![pool("tidepool-a", 1, 8), pool("tidepool-b", 2, 2)];
        let admission =
            admit(&key(), &gang(pods, None), 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        assert!(
            matches!(&admission.writes[..], [Write::Place { node, .. }] if node == "tidepool-a"),
            "{:?}",
            admission.writes
        );
    }

    #[test]
    fn a_gang_whose_pods_select_no_pool_waits_saying_what_they_select() {
        let pods = vec![selecting(pending("w-0", 2), "member-z")];
        let mut pools = vec![pool("tidepool-a", 1, 8)];
        let admission =
            admit(&key(), &gang(pods, None), 1, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = &admission.writes[..] else { panic!("{:?}", admission.writes) };
        assert!(
            message.contains("no pool matches the pods' node selection (tidepool.io/member=member-z)"),
            "{message}"
        );
    }

    #[test]
    fn an_elastic_pod_that_excludes_its_gangs_pool_waits_with_the_reason() {
        let core = running_on(pending("w-0", 2), "tidepool-a");
        let elastic = selecting(pending("w-1", 2), "member-z");
        let mut pools = vec![pool("tidepool-a", 1, 8)];
        let admission = admit(
            &key(),
            &gang(vec![core, elastic], Some("tidepool-a")),
            1,
            &mut Offer::lent(&mut pools),
            (&BandRanges::default(), NOW),
        );
        let [Write::Explain { message, .. }] = &admission.writes[..] else { panic!("{:?}", admission.writes) };
        assert!(message.contains("which the pod's node selection (tidepool.io/member=member-z) excludes"), "{message}");
    }

    #[test]
    fn a_new_gang_short_of_its_minimum_waits_for_the_rest() {
        let g = gang(vec![pending("w-0", 1)], None);
        let mut pools = vec![pool("tidepool-a", 1, 8)];
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let message = "gang ns/gang/g has 1 of its 2 pods; waiting for the rest".to_owned();
        assert_eq!(admission.writes, vec![Write::Explain { pods: g.pods.clone(), message }]);
        assert_eq!(admission.unplaced, None, "a gang still forming asks no one to make room");
        assert_eq!(pools[0].used, Resources::new());
    }

    #[test]
    fn a_gang_still_forming_waits_without_a_word_until_its_pods_stop_arriving() {
        let mut g = gang(vec![pending("w-0", 1)], None);
        let mut pools = vec![pool("tidepool-a", 1, 8)];
        g.newest = Some(NOW - FORMING_QUIET + 1);
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        assert_eq!(admission, Admission::default(), "its newest pod is younger than the quiet period");
        g.newest = Some(NOW - FORMING_QUIET);
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let message = "gang ns/gang/g has 1 of its 2 pods; waiting for the rest".to_owned();
        assert_eq!(admission.writes, vec![Write::Explain { pods: g.pods.clone(), message }]);
        // A whole gang is placed at once, however young.
        let mut g = gang(vec![pending("w-0", 1), pending("w-1", 1)], None);
        g.newest = Some(NOW);
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        assert!(matches!(admission.writes.as_slice(), [Write::Place { .. }]), "{admission:?}");
    }

    #[test]
    fn gangs_know_when_their_newest_pod_was_created() {
        let mut older = pending("w-0", 1);
        older.metadata.creation_timestamp = Some(Time("2026-12-01T10:00:00Z".parse().unwrap()));
        let mut newer = pending("w-1", 1);
        newer.metadata.creation_timestamp = Some(Time("2026-12-01T10:00:07Z".parse().unwrap()));
        let gangs = gangs_of(&[Arc::new(newer), Arc::new(older)], "tidepool");
        let want: jiff::Timestamp = "2026-12-01T10:00:07Z".parse().unwrap();
        assert_eq!(gangs[&key()].newest, Some(want.as_second()));
    }

    #[test]
    fn a_new_gang_that_fits_nowhere_waits_and_asks_for_its_whole_core() {
        let g = gang(vec![pending("w-0", 4), pending("w-1", 4), pending("w-2", 4)], None);
        let mut pools = vec![pool("tidepool-a", 1, 4)];
        let admission = admit(&key(), &g, 3, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        assert_eq!(admission.unplaced, Some(gpus(12)));
        let [Write::Explain { pods, message }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert_eq!(pods.len(), 3);
        assert!(message.starts_with("gang ns/gang/g: "), "{message}");
        assert_eq!(pools[0].used, Resources::new(), "nothing is booked for a gang that waits");
    }

    #[test]
    fn a_placed_gang_binds_its_missing_core_then_each_elastic_pod_that_fits() {
        // minMember 2: one core pod runs, one is to bind (1 GPU), then two elastic pods of 2
        // GPUs each on a 4-GPU node: after the core's 1, room for one of them only.
        let node = "tidepool-a";
        let pods = vec![running_on(pending("w-0", 1), node), pending("w-1", 1), pending("w-2", 2), pending("w-3", 2)];
        let g = gang(pods, Some(node));
        let mut pools = vec![pool(node, 1, 4)];
        let admission = admit(&key(), &g, 2, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let bind = |i: usize, band, role| Write::Bind {
            pod: g.pods[i].clone(),
            target: Target::Lent(node.into()),
            band,
            role,
            domain: plan::Domain::default(),
        };
        let message = format!("gang ns/gang/g: no room for another elastic pod on {node}");
        let want = vec![
            bind(1, Band::Medium, Role::Core { size: 2, planned_node: Some("n0".into()) }),
            bind(2, Band::Low, Role::Elastic),
            Write::Explain { pods: vec![g.pods[3].clone()], message },
        ];
        assert_eq!(admission, Admission { writes: want, unplaced: None });
        assert_eq!(pools[0].used, gpus(3), "the core pod and the elastic pod are booked");
    }

    #[test]
    fn a_placed_gang_whose_pool_is_not_offered_waits_with_the_reason() {
        let g = gang(vec![pending("w-0", 1)], Some("tidepool-gone"));
        let mut pools = vec![pool("tidepool-a", 1, 4)];
        let admission = admit(&key(), &g, 1, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let message = "gang ns/gang/g is placed on tidepool-gone, which is not offered right now".to_owned();
        assert_eq!(
            admission,
            Admission { writes: vec![Write::Explain { pods: g.pods.clone(), message }], unplaced: None }
        );
    }

    #[test]
    fn gangs_hold_the_live_pods_of_our_scheduler_their_placement_and_what_succeeded() {
        let mut done = pending("w-9", 1);
        done.status.phase = Some("Succeeded".into());
        let mut other = pending("x", 1);
        other.spec.scheduler_name = Some("default-scheduler".into());
        let all: Vec<Arc<PodLite>> = [pending("w-0", 1), running_on(pending("w-1", 1), "tidepool-a"), done, other]
            .into_iter()
            .map(Arc::new)
            .collect();
        let gangs = gangs_of(&all, "tidepool");
        assert_eq!(gangs.len(), 1, "the other scheduler's pod is no gang of ours");
        let g = &gangs[&key()];
        assert_eq!(g.pods.iter().map(|p| p.name_any()).collect::<Vec<_>>(), ["w-0", "w-1"]);
        assert_eq!(g.pinned.as_deref(), Some("tidepool-a"));
        assert_eq!(g.succeeded, 1);
    }

    #[test]
    fn a_gang_whose_placed_pods_are_all_under_notice_is_pinned_nowhere() {
        let noticed = |mut p: PodLite| {
            let condition = PodCondition {
                type_: keys::CONDITION_RECLAIM_REQUESTED.into(),
                status: "True".into(),
                reason: Some("CapacityReclaimed".into()),
                ..Default::default()
            };
            p.status.marks_mut().tidepool_conditions.push(condition);
            p
        };
        // The chief was reclaimed and made again; its four peers still have the notice.
        let mut all = vec![Arc::new(pending("chief-0", 1))];
        for i in 0..4 {
            all.push(Arc::new(noticed(running_on(pending(&format!("w-{i}"), 1), "tidepool-a"))));
        }
        let gangs = gangs_of(&all, "tidepool");
        assert_eq!(gangs[&key()].pinned, None, "the new chief must not follow its gang onto the reclaimed member");
        assert!(!gangs[&key()].placed());
        // One peer without the notice: the gang is still where that one runs.
        all.push(Arc::new(running_on(pending("w-4", 1), "tidepool-a")));
        assert_eq!(gangs_of(&all, "tidepool")[&key()].pinned.as_deref(), Some("tidepool-a"));
    }

    #[test]
    fn a_placed_gang_is_checked_once_its_placement_is_older_than_the_timeout() {
        let now: jiff::Timestamp = "2026-12-01T10:01:40Z".parse().unwrap();
        let mut p = pending("w-0", 1);
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert(keys::ANNOTATION_PLACED_AT.into(), "2026-12-01T10:00:00Z".into());
        let placed = gang(vec![p.clone()], Some("tidepool-a"));
        assert_eq!(overdue(&placed, 60, now), Some(100), "placed 100 s ago, timeout 60 s");
        assert_eq!(overdue(&placed, 100, now), Some(100), "the timeout itself is overdue");
        assert_eq!(overdue(&placed, 101, now), None);
        assert_eq!(overdue(&gang(vec![p], None), 60, now), None, "a gang never placed has no timeout");
        assert_eq!(overdue(&gang(vec![pending("w-0", 1)], Some("tidepool-a")), 60, now), None, "no placement time");
    }

    #[test]
    fn an_overdue_gang_is_rolled_back_when_fewer_than_its_minimum_run_or_ran() {
        let node = "tidepool-a";
        let mut g = gang(vec![running_on(pending("w-0", 1), node), pending("w-1", 1)], Some(node));
        let message = "gang ns/gang/g: 1 of its 2 pods running on tidepool-a after 100s (timeout 60s); rolled back whole so it can be placed again";
        assert_eq!(timed_out(&key(), &g, 2, 100, 60).as_deref(), Some(message));
        // A pod that completed counts as having run.
        g.succeeded = 1;
        assert_eq!(timed_out(&key(), &g, 2, 100, 60), None);
    }

    #[test]
    fn a_queue_entry_counts_what_is_bound_and_takes_the_band_of_the_highest_priority() {
        let node = "tidepool-a";
        let mut high = pending("w-1", 1);
        high.spec.priority = Some(2500);
        high.metadata.creation_timestamp = Some(Time("2026-12-01T10:00:00Z".parse().unwrap()));
        let mut low = running_on(pending("w-0", 1), node);
        low.spec.priority = Some(10);
        low.metadata.creation_timestamp = Some(Time("2026-12-01T10:00:05Z".parse().unwrap()));
        let g = gang(vec![low, high, pending("w-2", 1)], Some(node));
        let e = queue_entry(&key(), &g, 2, &BandRanges::default());
        let created = "2026-12-01T10:00:00Z".parse::<jiff::Timestamp>().unwrap().as_second();
        let want = QueueEntry { key: key(), band: Band::High, priority: 2500, min: 2, max: 3, current: 1, created };
        assert_eq!(e, want);
        // Fewer pods than its minimum: it asks for its minimum.
        assert_eq!(queue_entry(&key(), &gang(vec![pending("w-0", 1)], None), 4, &BandRanges::default()).max, 4);
    }

    /// `p` as a binding by the dispatcher leaves it: on `node`, core of a gang of `size`.
    fn bound_core(p: PodLite, node: &str, size: usize) -> PodLite {
        let role = Role::Core { size, planned_node: Some("n0".into()) };
        Stamp::new(node, Band::Medium, &role, &plan::Domain::default(), "2026-12-01T10:00:00Z").bound(&p, node)
    }

    #[test]
    fn a_binding_records_the_core_with_its_time_size_and_node_and_an_elastic_pod_with_its_place_only() {
        let domain = plan::Domain { pairs: vec![("rack".into(), "r1".into())] };
        let role = Role::Core { size: 8, planned_node: Some("gpu-3".into()) };
        let core = Stamp::new("tidepool-a", Band::Medium, &role, &domain, "2026-12-01T10:00:00Z");
        let labels: BTreeMap<String, String> =
            [(keys::LABEL_BAND, "medium"), (keys::LABEL_ROLE, "core")].map(|(k, v)| (k.into(), v.into())).into();
        let annotations: BTreeMap<String, String> = [
            (keys::ANNOTATION_PLACEMENT, "tidepool-a"),
            (keys::ANNOTATION_PLANNED_DOMAIN, "rack=r1"),
            (keys::ANNOTATION_PLACED_AT, "2026-12-01T10:00:00Z"),
            (keys::ANNOTATION_GANG_CORE, "8"),
            (keys::ANNOTATION_PLANNED_NODE, "gpu-3"),
        ]
        .map(|(k, v)| (k.into(), v.into()))
        .into();
        assert_eq!(core, Stamp { labels, annotations });
        let elastic = Stamp::new("tidepool-a", Band::Low, &Role::Elastic, &plan::Domain::default(), "t");
        assert_eq!(elastic.annotations, [(keys::ANNOTATION_PLACEMENT.to_owned(), "tidepool-a".to_owned())].into());
        assert_eq!(elastic.labels[keys::LABEL_ROLE], "elastic");
        let p = core.bound(&pending("w-0", 1), "tidepool-a");
        assert_eq!(p.node_name(), Some("tidepool-a"));
        assert_eq!(tidepool_api::pod::band_of(&p.metadata, p.node_name()), Some(Band::Medium));
        assert!(crate::restart::is_core(&p));
    }

    #[test]
    fn a_training_server_older_than_1_35_gets_the_record_on_the_pod_before_the_binding() {
        assert!(!copies_binding_labels("1", "34"));
        assert!(!copies_binding_labels("1", "34+"));
        assert!(!copies_binding_labels("1", ""));
        assert!(copies_binding_labels("1", "35"));
        assert!(copies_binding_labels("1", "37+"));
        let core = Stamp::new(
            "tidepool-a",
            Band::High,
            &Role::Core { size: 2, planned_node: None },
            &plan::Domain::default(),
            "t",
        );
        let (first, binding) = core.writes("w-0", "tidepool-a", copies_binding_labels("1", "34"));
        let first = first.expect("an older server is given the labels in a patch before the binding");
        assert_eq!(first["metadata"]["labels"][keys::LABEL_BAND], "high");
        assert_eq!(first["metadata"]["labels"][keys::LABEL_ROLE], "core");
        assert_eq!(first["metadata"]["annotations"][keys::ANNOTATION_GANG_CORE], "2");
        assert_eq!(binding.target.name.as_deref(), Some("tidepool-a"));
        assert_eq!(binding.metadata.labels.as_ref(), Some(&core.labels));
        let (first, binding) = core.writes("w-0", "tidepool-a", copies_binding_labels("1", "37"));
        assert_eq!(first, None, "a 1.35+ server copies the Binding's labels: one write");
        assert_eq!(binding.metadata.name.as_deref(), Some("w-0"));
        assert_eq!(binding.metadata.annotations.as_ref(), Some(&core.annotations));
    }

    #[test]
    fn a_pod_bound_with_its_placement_but_no_band_is_found_for_labelling() {
        let node = "tidepool-a";
        let stamped = bound_core(pending("w-0", 1), node, 1);
        let mut dropped = stamped.clone();
        dropped.metadata.labels = None;
        let hand_bound = {
            let mut p = pending("w-2", 1);
            p.spec.node_name = Some(node.into());
            p
        };
        let all: Vec<Arc<PodLite>> = [stamped, dropped.clone(), hand_bound].into_iter().map(Arc::new).collect();
        assert_eq!(unlabelled(&all, "tidepool"), vec![Arc::new(dropped)]);
    }

    /// `p` asking for native nodes as `mode` (`tidepool.io/native`).
    fn native(mut p: PodLite, mode: &str) -> PodLite {
        p.metadata.annotations.get_or_insert_default().insert(keys::ANNOTATION_NATIVE.into(), mode.into());
        p
    }

    /// A native pool of `nodes` training nodes `t0`, `t1`, … of `per_node` GPUs each.
    fn native_pool(nodes: usize, per_node: i64) -> NativePool {
        let views = (0..nodes).map(|i| tidepool_federation::capacity::NodeView {
            name: format!("t{i}"),
            ready: true,
            allocatable: gpus(per_node),
            ..Default::default()
        });
        NativePool::new(views, &BTreeMap::new(), &[])
    }

    /// `p` bound natively to training node `node` by the dispatcher, running.
    fn running_native(mut p: PodLite, node: &str) -> PodLite {
        p.spec.node_name = Some(node.into());
        p.metadata.annotations.get_or_insert_default().insert(keys::ANNOTATION_PLACEMENT.into(), NATIVE.into());
        p.status.phase = Some("Running".into());
        p
    }

    fn targets(writes: &[Write]) -> Vec<(String, Target)> {
        writes
            .iter()
            .flat_map(|w| match w {
                Write::Place { node, pods, .. } => pods.iter().map(|p| (p.pod.name_any(), p.target(node))).collect(),
                Write::Bind { pod, target, .. } => vec![(pod.name_any(), target.clone())],
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn a_native_floor_puts_the_core_on_native_nodes_and_the_elastic_part_on_one_pool() {
        // Four workers asking for the native floor, minMember 2, 2 GPUs each; one 4-GPU
        // native node. The core goes native, whole; the elastic pods wait for the next round.
        let pods = (0..4).map(|i| native(pending(&format!("w-{i}"), 2), "core")).collect();
        let g = gang(pods, None);
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 2, 2), pool("tidepool-b", 1, 8)], native_pool(1, 4));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: BTreeSet::new() };
        let admission = admit(&key(), &g, 2, &mut offer, (&BandRanges::default(), NOW));
        let native_to = |n: &str| Target::Native(n.into());
        assert_eq!(targets(&admission.writes), [("w-0".into(), native_to("t0")), ("w-1".into(), native_to("t0"))]);
        let [Write::Place { node, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert_eq!(node, NATIVE);
        assert_eq!(floor.take_one(&gpus(1), None), None, "the core is booked on the native node");
        assert_eq!(pools[0].used, Resources::new(), "nothing lent is booked for a native core");
        // Next round: the core runs natively; both elastic pods go to ONE pool.
        let pods = vec![
            running_native(native(pending("w-0", 2), "core"), "t0"),
            running_native(native(pending("w-1", 2), "core"), "t0"),
            native(pending("w-2", 2), "core"),
            native(pending("w-3", 2), "core"),
        ];
        let mut g = gang(pods, None);
        g.native = true;
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 2, 2), pool("tidepool-b", 1, 8)], native_pool(1, 0));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: BTreeSet::new() };
        let admission = admit(&key(), &g, 2, &mut offer, (&BandRanges::default(), NOW));
        let got = targets(&admission.writes);
        assert_eq!(got.len(), 2, "{admission:?}");
        assert!(got.iter().all(|(_, t)| *t == got[0].1 && matches!(t, Target::Lent(_))), "{got:?}");
        assert!(admission.writes.iter().all(|w| matches!(w, Write::Bind { role: Role::Elastic, .. })));
    }

    #[test]
    fn a_core_split_by_role_goes_native_and_lent_at_once_or_not_at_all() {
        // The launcher stays native (`all`), the workers are lent (no annotation).
        let mut launcher = native(pending("launcher", 1), "all");
        launcher.metadata.labels = Some([(workload::LABEL_KUBEFLOW_REPLICA_TYPE.into(), "launcher".into())].into());
        let g = gang(vec![pending("w-0", 2), launcher.clone(), pending("w-1", 2)], None);
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 4)], native_pool(1, 1));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: BTreeSet::new() };
        let admission = admit(&key(), &g, 3, &mut offer, (&BandRanges::default(), NOW));
        let lent = |n: &str| Target::Lent(n.into());
        let want = [
            ("launcher".into(), Target::Native("t0".into())),
            ("w-0".into(), lent("tidepool-a")),
            ("w-1".into(), lent("tidepool-a")),
        ];
        assert_eq!(targets(&admission.writes), want);
        // No room for the lent half: nothing is booked anywhere, and the message says which
        // half waits.
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 3)], native_pool(1, 1));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: BTreeSet::new() };
        let admission = admit(&key(), &g, 3, &mut offer, (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert!(message.contains("its 2 lent core pods wait"), "{message}");
        assert!(message.contains("its 1 native core pods fit"), "{message}");
        assert_eq!(admission.unplaced, Some(gpus(4)), "only the lent half asks for room on a member");
        assert_eq!(floor.take_one(&gpus(1), None).as_deref(), Some("t0"), "the native half was not booked");
        // No room for the native half: the lent one is not booked either, and no member is
        // asked to make room (it would not help).
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 4)], native_pool(1, 0));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: BTreeSet::new() };
        let admission = admit(&key(), &g, 3, &mut offer, (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert!(message.contains("its 1 native core pods wait"), "{message}");
        assert_eq!((admission.unplaced, &pools[0].used), (None, &Resources::new()));
    }

    #[test]
    fn a_pod_asking_for_native_nodes_where_none_are_offered_or_in_words_unknown_waits_told_why() {
        let g = gang(vec![native(pending("w-0", 1), "core")], None);
        let mut pools = vec![pool("tidepool-a", 1, 4)];
        let admission = admit(&key(), &g, 1, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert!(message.contains("none are offered to tidepool (dispatcher.nativeNodes)"), "{message}");
        let g = gang(vec![native(pending("w-0", 1), "yes")], None);
        let admission = admit(&key(), &g, 1, &mut Offer::lent(&mut pools), (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert!(message.contains("\"yes\" is not one of core, all, none"), "{message}");
    }

    #[test]
    fn a_gang_placed_natively_is_known_as_placed_and_timed_out_there() {
        let all: Vec<Arc<PodLite>> =
            [running_native(pending("w-0", 1), "t0"), pending("w-1", 1)].into_iter().map(Arc::new).collect();
        let gangs = gangs_of(&all, "tidepool");
        let g = &gangs[&key()];
        assert!(g.native && g.placed());
        assert_eq!(g.pinned, None, "a native node is no pool to pin the lent pods to");
        let message = timed_out(&key(), g, 2, 100, 60).unwrap();
        assert!(message.contains("1 of its 2 pods running on the training cluster's nodes"), "{message}");
    }

    #[test]
    fn a_gang_with_native_pods_never_borrows_from_a_member_whose_pod_network_overlaps() {
        // The launcher native, two lent workers; pool a fits them most tightly but its member's
        // pod network overlaps.
        let launcher = native(pending("launcher", 1), "all");
        let g = gang(vec![launcher, pending("w-0", 2), pending("w-1", 2)], None);
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 4), pool("tidepool-b", 1, 8)], native_pool(1, 1));
        let apart = BTreeSet::from(["tidepool-a".to_owned()]);
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: apart.clone() };
        let admission = admit(&key(), &g, 3, &mut offer, (&BandRanges::default(), NOW));
        let [Write::Place { node, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert_eq!(node, "tidepool-b");
        assert!(pools[0].schedulable, "the pool is offered again after the decision");
        // Only the overlapping pool: the gang waits, told why.
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 4)], native_pool(1, 1));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart: apart.clone() };
        let admission = admit(&key(), &g, 3, &mut offer, (&BandRanges::default(), NOW));
        let [Write::Explain { message, .. }] = admission.writes.as_slice() else { panic!("{admission:?}") };
        assert!(message.contains("tidepool-a not offered to a job with native pods"), "{message}");
        // A gang with no native pod is placed there as before.
        let g = gang(vec![pending("w-0", 2), pending("w-1", 2)], None);
        let (mut pools, mut floor) = (vec![pool("tidepool-a", 1, 4)], native_pool(1, 1));
        let mut offer = Offer { lent: &mut pools, native: Some(&mut floor), apart };
        let admission = admit(&key(), &g, 2, &mut offer, (&BandRanges::default(), NOW));
        assert!(matches!(admission.writes.as_slice(), [Write::Place { .. }]), "{admission:?}");
    }

    /// One pod of a generated gang: its GPUs and where it asks to run.
    fn arb_member() -> impl Strategy<Value = (i64, Native)> {
        (1i64..=3, prop_oneof![Just(Native::None), Just(Native::Core), Just(Native::All)])
    }

    /// Applies a round's bindings to `pods` as the API server would (node and placement).
    fn apply(pods: &mut [PodLite], writes: &[Write]) -> Vec<(String, Target, bool)> {
        let mut bound = Vec::new();
        for (name, target, core) in writes.iter().flat_map(|w| match w {
            Write::Place { node, pods, .. } => pods.iter().map(|p| (p.pod.name_any(), p.target(node), true)).collect(),
            Write::Bind { pod, target, role, .. } => {
                vec![(pod.name_any(), target.clone(), matches!(role, Role::Core { .. }))]
            }
            _ => Vec::new(),
        }) {
            let p = pods.iter_mut().find(|p| p.name_any() == name).unwrap();
            p.spec.node_name = Some(target.node().to_owned());
            p.metadata
                .annotations
                .get_or_insert_default()
                .insert(keys::ANNOTATION_PLACEMENT.into(), target.placement().into());
            p.metadata.labels.get_or_insert_default().insert(keys::LABEL_BAND.into(), "medium".into());
            p.status.phase = Some("Running".into());
            bound.push((name, target, core));
        }
        bound
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Over rounds of one gang whose pods ask for native nodes or not: its core is placed
        /// whole or not at all; every pod lands where its mode and role say (native or lent);
        /// its lent pods never span two pools; no native node is given more than it has; and
        /// reclaim, asked for everything a pool has, never picks a pod bound natively.
        #[test]
        fn a_gang_across_native_and_lent_pools_keeps_its_core_whole_its_lent_part_on_one_pool_and_its_native_pods_safe(
            members in prop::collection::vec(arb_member(), 1..7),
            min in 1usize..7,
            lent_nodes in prop::collection::vec((1usize..3, 0i64..6), 1..4),
            native_nodes in prop::collection::vec(0i64..6, 0..3),
        ) {
            let min = min.min(members.len());
            let mut pods: Vec<PodLite> = members.iter().enumerate().map(|(i, (g, mode))| {
                let p = pending(&format!("w-{i}"), *g);
                if *mode == Native::None { p } else { native(p, if *mode == Native::All { "all" } else { "core" }) }
            }).collect();
            let mut pools: Vec<PoolView> =
                lent_nodes.iter().enumerate().map(|(i, (n, per))| pool(&format!("tidepool-{i}"), *n, *per)).collect();
            let native_views: Vec<tidepool_federation::capacity::NodeView> = native_nodes.iter().enumerate().map(|(i, g)| {
                tidepool_federation::capacity::NodeView { name: format!("t{i}"), ready: true, allocatable: gpus(*g), ..Default::default() }
            }).collect();
            let mode_of: BTreeMap<String, Native> = pods.iter().zip(&members).map(|(p, (_, m))| (p.name_any(), *m)).collect();
            let mut lent_pools = BTreeSet::new();
            for _ in 0..3 {
                let all: Vec<Arc<PodLite>> = pods.iter().cloned().map(Arc::new).collect();
                let gangs = gangs_of(&all, "tidepool");
                let Some(g) = gangs.get(&key()) else { break };
                let mut floor = NativePool::new(native_views.clone(), &BTreeMap::new(), &all);
                let mut offer = Offer { lent: &mut pools, native: (!native_views.is_empty()).then_some(&mut floor), apart: BTreeSet::new() };
                let admission = admit(&key(), g, min, &mut offer, (&BandRanges::default(), NOW));
                let placing = admission.writes.iter().find_map(|w| match w { Write::Place { pods, .. } => Some(pods.len()), _ => None });
                prop_assert!(placing.is_none_or(|n| n == min), "a core is placed whole: {:?}", admission.writes);
                for (name, target, core) in apply(&mut pods, &admission.writes) {
                    let wants_native = mode_of[&name].on_native(core);
                    prop_assert_eq!(matches!(target, Target::Native(_)), wants_native, "{} as {:?} (core {})", name, target, core);
                    if let Target::Lent(node) = target {
                        lent_pools.insert(node);
                    }
                }
                prop_assert!(lent_pools.len() <= 1, "lent pods on {:?}", lent_pools);
            }
            for (i, g) in native_nodes.iter().enumerate() {
                let node = format!("t{i}");
                let used: i64 = pods.iter().filter(|p| p.node_name() == Some(node.as_str())).map(|p| p.spec.requests.get(GPU)).sum();
                prop_assert!(used <= g * 1000, "{} holds {} of {}", node, used, g * 1000);
            }
            let all: Vec<Arc<PodLite>> = pods.iter().cloned().map(Arc::new).collect();
            let placed: BTreeMap<Arc<str>, tidepool_federation::capacity::Placed> = all.iter()
                .map(|p| (Arc::from(p.metadata.uid.clone().unwrap_or_default()), Default::default()))
                .collect();
            let cap = tidepool_federation::capacity::PoolCapacity { placed: Arc::new(placed), ..Default::default() };
            let mut everything = Resources::new();
            everything.set(GPU, 1_000_000);
            for node in &lent_pools {
                let candidates = crate::reclaim::candidates(&crate::reclaim::on_pool(&all, node), &cap, &Default::default());
                for v in crate::victims::victims(&everything, &candidates) {
                    let p = all.iter().find(|p| format!("ns/{}", p.name_any()) == v.key).unwrap();
                    prop_assert_eq!(p.node_name(), Some(node.as_str()), "a victim of {} off its pool", node);
                }
            }
        }
    }
}
