//! Victim selection for reclaim: which offload pods of one pool give capacity back.
//!
//! Pure and deterministic. The reclaim controller passes a pool's deficit (per resource,
//! after hysteresis) and the offload pods running in that pool; [`victims`] answers which of
//! them to send the checkpoint notice to, each with a reason for the Event.
//!
//! The rules (deploy/docs/architecture.md, step 7 of a pod's life, and operations.md):
//! 1. Bands from the bottom: every `low` pod that helps is taken before any `medium` pod, and
//!    every `medium` one before any `high` one.
//! 2. A `medium` pod is a gang core: taking one breaks the gang, so the whole job on this pool
//!    (its pods of every band) is one victim unit.
//! 3. Only pods that help: a pod that frees nothing the deficit still lacks is left alone.
//! 4. Inside a band, units are ranked: the lower tenant priority first (a whole job counts
//!    as its highest), then one that covers the remaining deficit on its own,
//!    fewest pods first (the smallest set is one unit, and a small job breaks fewer pods than
//!    a big one); one that empties a member node (the online side gets a whole
//!    node back, the only way a large online pod can land); one of a job already hit (one
//!    degraded job rather than many); the job with the highest fulfillment (it has the most
//!    elastic room to lose); then the lower `pod-deletion-cost`; then the node with the fewest
//!    offload pods left (drain nodes one at a time); then key.
//! 5. `controller.kubernetes.io/pod-deletion-cost` is honoured the way its owner means it:
//!    within a job, a pod is never taken while a pod of the same job and band with a lower
//!    cost that also helps is still running. Costs of different tenants are not compared first.
//! 6. Once the deficit is covered, units of the last band taken that are no longer needed
//!    are put back, latest first, so the set stays small. Lower bands are not revisited: the
//!    rule that they go first wins over the size of the set.
//!
//! The set is irreducible (nothing of its last band can be put back, see the property test
//! `the_last_band_holds_no_victim_the_deficit_does_not_need`), not always the smallest: five
//! `low` pods of 3, 3, 3, 5 and 4 cpu of five jobs on one node and a deficit of 9 cpu give the
//! three 3-cpu pods, where the 5 and the 4 would do. The order of rule 4 wins over the count;
//! the docs say so.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use tidepool_api::Resources;
use tidepool_api::keys::Band;

use crate::gang::GangKey;
use crate::order::Fulfillment;

/// What victim selection needs to know of one running offload pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadPodView {
    /// `namespace/name` of the training pod; unique.
    pub key: String,
    /// The gang of its job.
    pub job: GangKey,
    pub band: Band,
    /// Member node it runs on.
    pub member_node: String,
    pub requests: Resources,
    /// `controller.kubernetes.io/pod-deletion-cost`, 0 when absent.
    pub deletion_cost: i32,
    /// The tenant's priority (`spec.priority`, 0 when absent): inside a band, the lower goes
    /// first.
    pub priority: i32,
    /// The job's `(current, min, max)` pods, for its fulfillment score.
    pub job_fulfillment: (u32, u32, u32),
}

impl OffloadPodView {
    fn fulfillment(&self) -> Fulfillment {
        let (current, min, max) = self.job_fulfillment;
        Fulfillment::new(current, min, max)
    }
}

/// A pod chosen for reclaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    pub key: String,
    pub job: GangKey,
    pub band: Band,
    /// Why this pod, in words for the Event and the pod's final message.
    pub reason: String,
}

/// Picks the offload pods to reclaim for `deficit` (see the module docs for the rules), in
/// the order they were chosen. Empty when the deficit is empty. When the running pods cannot
/// cover the deficit, every pod that helps is returned.
pub fn victims(deficit: &Resources, running: &[OffloadPodView]) -> Vec<Victim> {
    let need: Vec<(&str, i64)> = deficit.iter().filter(|(_, v)| *v > 0).collect();
    if need.is_empty() {
        return Vec::new();
    }
    // One canonical order, so nothing below depends on the order of `running`.
    let mut pods: Vec<&OffloadPodView> = running.iter().collect();
    pods.sort_by(|a, b| a.key.cmp(&b.key));
    let mut s = Selection::new(&need, pods);
    let mut picks: Vec<Unit> = Vec::new();
    for band in [Band::Low, Band::Medium, Band::High] {
        let first_of_band = picks.len();
        while !s.covered() {
            let Some(unit) = s.best_unit(band) else { break };
            s.take(&unit);
            picks.push(unit);
        }
        if s.covered() {
            s.put_back_unneeded(&mut picks, first_of_band);
            break;
        }
    }
    s.describe(&picks)
}

/// Running state of one selection: what is taken, what it frees, what is left per node.
struct Selection<'a> {
    deficit: Vec<i64>,
    pods: Vec<&'a OffloadPodView>,
    /// Requests of each pod over the deficit's resources, negatives as zero.
    req: Vec<Vec<i64>>,
    taken: Vec<bool>,
    freed: Vec<i64>,
    /// Offload pods not taken yet, per member node.
    left_on_node: BTreeMap<&'a str, usize>,
    hit_jobs: BTreeSet<&'a GangKey>,
}

/// Rank of a unit inside its band, smaller first: the fields compare in order, the preference
/// order of the module docs (rule 4).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank<'a> {
    /// The unit's highest tenant priority.
    priority: i32,
    /// It does not cover the remaining deficit on its own.
    short: bool,
    /// Pods in the unit when it covers alone (0 otherwise).
    size_when_covering: usize,
    /// It empties no member node.
    leaves_nodes_busy: bool,
    /// Its job has not lost a pod in this selection yet.
    fresh_job: bool,
    /// The job's fulfillment, highest first.
    fulfillment: Reverse<Fulfillment>,
    /// The lowest `pod-deletion-cost` in the unit.
    deletion_cost: i32,
    /// Offload pods left on its member node (0 for a whole job).
    left_on_node: usize,
    /// Its lead pod's key: the order is total.
    key: &'a str,
}

impl Rank<'_> {
    /// The rank of a unit with no pods: after every other.
    const LAST: Rank<'static> = Rank {
        priority: i32::MAX,
        short: true,
        size_when_covering: 0,
        leaves_nodes_busy: true,
        fresh_job: true,
        fulfillment: Reverse(Fulfillment::ZERO),
        deletion_cost: i32::MAX,
        left_on_node: usize::MAX,
        key: "",
    };
}

/// What is taken in one step: one pod, or a whole job for a gang core.
#[derive(Debug, Clone)]
struct Unit {
    members: Vec<usize>,
    whole_job: bool,
}

impl<'a> Selection<'a> {
    fn new(need: &[(&str, i64)], pods: Vec<&'a OffloadPodView>) -> Self {
        let req: Vec<Vec<i64>> =
            pods.iter().map(|p| need.iter().map(|(name, _)| p.requests.get(name).max(0)).collect()).collect();
        let mut left_on_node = BTreeMap::new();
        for p in &pods {
            *left_on_node.entry(p.member_node.as_str()).or_insert(0) += 1;
        }
        Self {
            deficit: need.iter().map(|(_, v)| *v).collect(),
            taken: vec![false; pods.len()],
            freed: vec![0; need.len()],
            pods,
            req,
            left_on_node,
            hit_jobs: BTreeSet::new(),
        }
    }

    fn remaining(&self, d: usize) -> i64 {
        self.deficit[d].saturating_sub(self.freed[d])
    }

    fn covered(&self) -> bool {
        (0..self.deficit.len()).all(|d| self.remaining(d) <= 0)
    }

    fn sum(&self, members: &[usize]) -> Vec<i64> {
        let mut total = vec![0i64; self.deficit.len()];
        for &i in members {
            for (t, r) in total.iter_mut().zip(&self.req[i]) {
                *t = t.saturating_add(*r);
            }
        }
        total
    }

    /// Frees something the deficit still lacks.
    fn helps(&self, amounts: &[i64]) -> bool {
        amounts.iter().enumerate().any(|(d, a)| *a > 0 && self.remaining(d) > 0)
    }

    /// The best unit of `band` that helps, by the ranking in the module docs.
    fn best_unit(&self, band: Band) -> Option<Unit> {
        let units = match band {
            Band::Medium => self.job_units(),
            Band::Low | Band::High => self.pod_units(band),
        };
        units.into_iter().min_by_key(|u| self.rank(u))
    }

    /// Single pods of `band` that help, only the cheapest (by deletion cost) of each job.
    fn pod_units(&self, band: Band) -> Vec<Unit> {
        let helping: Vec<usize> = (0..self.pods.len())
            .filter(|&i| !self.taken[i] && self.pods[i].band == band && self.helps(&self.req[i]))
            .collect();
        let mut cheapest: BTreeMap<&GangKey, i32> = BTreeMap::new();
        for &i in &helping {
            let p = self.pods[i];
            let c = cheapest.entry(&p.job).or_insert(p.deletion_cost);
            *c = (*c).min(p.deletion_cost);
        }
        helping
            .into_iter()
            .filter(|&i| cheapest.get(&self.pods[i].job) == Some(&self.pods[i].deletion_cost))
            .map(|i| Unit { members: vec![i], whole_job: false })
            .collect()
    }

    /// Every job with a gang-core pod still running, as the unit of all its running pods.
    fn job_units(&self) -> Vec<Unit> {
        let mut jobs: BTreeMap<&GangKey, Vec<usize>> = BTreeMap::new();
        for (i, p) in self.pods.iter().enumerate() {
            if !self.taken[i] {
                jobs.entry(&p.job).or_default().push(i);
            }
        }
        jobs.into_values()
            .filter(|members| members.iter().any(|&i| self.pods[i].band == Band::Medium))
            .filter(|members| self.helps(&self.sum(members)))
            .map(|members| Unit { members, whole_job: true })
            .collect()
    }

    /// Smaller is better; see [`Rank`].
    fn rank(&self, unit: &Unit) -> Rank<'a> {
        let total = self.sum(&unit.members);
        let covers_alone = (0..self.deficit.len()).all(|d| total[d] >= self.remaining(d));
        let Some(&first) = unit.members.first() else { return Rank::LAST };
        let lead = self.pods[first];
        let mut on_node: BTreeMap<&str, usize> = BTreeMap::new();
        for &i in &unit.members {
            *on_node.entry(self.pods[i].member_node.as_str()).or_insert(0) += 1;
        }
        let empties_node = on_node.iter().any(|(node, n)| self.left_on_node.get(node) == Some(n));
        let cost = unit.members.iter().map(|&i| self.pods[i].deletion_cost).min().unwrap_or(0);
        let priority = unit.members.iter().map(|&i| self.pods[i].priority).max().unwrap_or(0);
        let left_on_node =
            if unit.whole_job { 0 } else { self.left_on_node.get(lead.member_node.as_str()).copied().unwrap_or(0) };
        Rank {
            priority,
            short: !covers_alone,
            size_when_covering: if covers_alone { unit.members.len() } else { 0 },
            leaves_nodes_busy: !empties_node,
            fresh_job: !self.hit_jobs.contains(&lead.job),
            fulfillment: Reverse(lead.fulfillment()),
            deletion_cost: cost,
            left_on_node,
            key: lead.key.as_str(),
        }
    }

    fn take(&mut self, unit: &Unit) {
        for &i in &unit.members {
            self.taken[i] = true;
            for (f, r) in self.freed.iter_mut().zip(&self.req[i]) {
                *f = f.saturating_add(*r);
            }
            let p = self.pods[i];
            if let Some(n) = self.left_on_node.get_mut(p.member_node.as_str()) {
                *n = n.saturating_sub(1);
            }
            self.hit_jobs.insert(&p.job);
        }
    }

    /// Drops units of the last band, latest first, while the rest still covers the deficit.
    fn put_back_unneeded(&mut self, picks: &mut Vec<Unit>, first_of_band: usize) {
        for idx in (first_of_band..picks.len()).rev() {
            let sum = self.sum(&picks[idx].members);
            let still_covered =
                (0..self.deficit.len()).all(|d| self.freed[d].saturating_sub(sum[d]) >= self.deficit[d]);
            if still_covered {
                for (f, s) in self.freed.iter_mut().zip(&sum) {
                    *f = f.saturating_sub(*s);
                }
                for &i in &picks[idx].members {
                    self.taken[i] = false;
                }
                picks.remove(idx);
            }
        }
    }

    /// The victims with their reasons, worded from the final set (after put-back).
    fn describe(&self, picks: &[Unit]) -> Vec<Victim> {
        let chosen: BTreeSet<usize> = picks.iter().flat_map(|u| u.members.iter().copied()).collect();
        let mut running_on: BTreeMap<&str, usize> = BTreeMap::new();
        let mut chosen_on: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, p) in self.pods.iter().enumerate() {
            *running_on.entry(p.member_node.as_str()).or_insert(0) += 1;
            if chosen.contains(&i) {
                *chosen_on.entry(p.member_node.as_str()).or_insert(0) += 1;
            }
        }
        let mut out = Vec::new();
        for unit in picks {
            for &i in &unit.members {
                let p = self.pods[i];
                let node = p.member_node.as_str();
                let empties = running_on.get(node) == chosen_on.get(node);
                let mut reason = if unit.whole_job {
                    if p.band == Band::Medium {
                        format!(
                            "gang core of job {} (band medium): the whole job on this pool is reclaimed together",
                            p.job
                        )
                    } else {
                        format!("job {} loses its gang core: the whole job on this pool is reclaimed together", p.job)
                    }
                } else {
                    let order = match p.band {
                        Band::Low => "lowest band first",
                        _ => "no lower-band pod left that frees what is needed",
                    };
                    format!(
                        "band {} ({order}); job {} at fulfillment {}; pod-deletion-cost {}",
                        p.band.as_str(),
                        p.job,
                        p.fulfillment(),
                        p.deletion_cost
                    )
                };
                if empties {
                    reason.push_str(&format!("; empties member node {node}"));
                }
                out.push(Victim { key: p.key.clone(), job: p.job.clone(), band: p.band, reason });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tidepool_federation::capacity::GPU;

    fn r(pairs: &[(&str, &str)]) -> Resources {
        Resources::from_pairs(pairs.iter().copied()).unwrap()
    }

    /// `pod("ns/a", "job", Band::Low, "n1", &[("cpu", "2")])`, cost 0, job at 1/1..2.
    fn pod(key: &str, job: &str, band: Band, node: &str, req: &[(&str, &str)]) -> OffloadPodView {
        OffloadPodView {
            key: key.into(),
            job: GangKey::annotation("ns", job),
            band,
            member_node: node.into(),
            requests: r(req),
            deletion_cost: 0,
            priority: 0,
            job_fulfillment: (1, 1, 2),
        }
    }

    fn keys(v: &[Victim]) -> Vec<&str> {
        v.iter().map(|v| v.key.as_str()).collect()
    }

    fn sorted_keys(v: &[Victim]) -> Vec<&str> {
        let mut k = keys(v);
        k.sort();
        k
    }

    #[test]
    fn an_empty_deficit_takes_nothing() {
        let running = [pod("a", "j", Band::Low, "n1", &[("cpu", "1")])];
        assert!(victims(&Resources::new(), &running).is_empty());
        assert!(victims(&r(&[("cpu", "0"), ("memory", "-1Gi")]), &running).is_empty());
    }

    #[test]
    fn one_class_on_every_worker_still_takes_an_elastic_pod_not_the_job() {
        // Four workers of one job, all of priority 1500 (the medium range), minMember 2: the
        // two admitted beyond the core are elastic, hence low, and a one-pod deficit takes one.
        let r0 = crate::gang::BandRanges::default();
        let running: Vec<_> = (0..4)
            .map(|i| {
                let band = crate::gang::band_for(Some(1500), i < 2, &r0);
                OffloadPodView {
                    priority: 1500,
                    job_fulfillment: (4, 2, 4),
                    ..pod(&format!("w{i}"), "j", band, "n1", &[("cpu", "1")])
                }
            })
            .collect();
        assert_eq!(running.iter().filter(|p| p.band == Band::Medium).count(), 2);
        let v = victims(&r(&[("cpu", "1")]), &running);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].band, Band::Low);
        assert!(["w2", "w3"].contains(&v[0].key.as_str()), "{v:?}");
    }

    #[test]
    fn inside_a_band_the_lower_tenant_priority_goes_first() {
        // Either pod covers alone; without priorities the key ("a") would decide.
        let running = [
            OffloadPodView { priority: 500, ..pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]) },
            OffloadPodView { priority: 100, ..pod("b", "j2", Band::Low, "n2", &[("cpu", "1")]) },
        ];
        assert_eq!(keys(&victims(&r(&[("cpu", "1")]), &running)), ["b"]);
        // A band still wins over priority: a low pod of high priority before a medium one.
        let running = [
            OffloadPodView { priority: 900, ..pod("elastic", "j1", Band::Low, "n1", &[("cpu", "1")]) },
            OffloadPodView { priority: 1, ..pod("core", "j2", Band::Medium, "n2", &[("cpu", "1")]) },
        ];
        assert_eq!(keys(&victims(&r(&[("cpu", "1")]), &running)), ["elastic"]);
    }

    #[test]
    fn the_low_band_goes_before_any_medium_pod() {
        let running = [
            pod("core", "j1", Band::Medium, "n1", &[("cpu", "8")]),
            pod("elastic-1", "j2", Band::Low, "n2", &[("cpu", "1")]),
            pod("elastic-2", "j2", Band::Low, "n2", &[("cpu", "1")]),
        ];
        let v = victims(&r(&[("cpu", "2")]), &running);
        assert_eq!(sorted_keys(&v), ["elastic-1", "elastic-2"]);
        assert!(v.iter().all(|v| v.band == Band::Low));
    }

    #[test]
    fn the_medium_band_is_reached_only_when_low_pods_cannot_cover() {
        let running = [
            pod("core", "j1", Band::Medium, "n1", &[("cpu", "8")]),
            pod("elastic", "j2", Band::Low, "n2", &[("cpu", "1")]),
        ];
        let v = victims(&r(&[("cpu", "4")]), &running);
        assert_eq!(keys(&v), ["elastic", "core"]);
    }

    #[test]
    fn a_gang_core_pod_takes_its_whole_job_with_it() {
        let running = [
            pod("j1-worker-0", "j1", Band::Medium, "n1", &[(GPU, "4")]),
            pod("j1-worker-1", "j1", Band::Medium, "n2", &[(GPU, "4")]),
            pod("j1-ps", "j1", Band::High, "n3", &[("cpu", "4")]),
            pod("j1-elastic", "j1", Band::Low, "n3", &[("cpu", "1")]),
            pod("j2-worker-0", "j2", Band::Medium, "n4", &[(GPU, "8")]),
        ];
        let v = victims(&r(&[(GPU, "2")]), &running);
        // j2 alone covers the deficit with one pod; j1 would take four.
        assert_eq!(keys(&v), ["j2-worker-0"]);
        let v = victims(&r(&[(GPU, "10")]), &running);
        assert_eq!(sorted_keys(&v), ["j1-elastic", "j1-ps", "j1-worker-0", "j1-worker-1", "j2-worker-0"]);
        let ps = v.iter().find(|v| v.key == "j1-ps").unwrap();
        assert!(ps.reason.contains("loses its gang core"), "{}", ps.reason);
    }

    #[test]
    fn the_high_band_goes_last() {
        let running = [
            pod("ps", "j1", Band::High, "n1", &[("cpu", "4")]),
            pod("core", "j2", Band::Medium, "n2", &[("cpu", "4")]),
            pod("elastic", "j3", Band::Low, "n3", &[("cpu", "4")]),
        ];
        assert_eq!(keys(&victims(&r(&[("cpu", "4")]), &running)), ["elastic"]);
        assert_eq!(keys(&victims(&r(&[("cpu", "8")]), &running)), ["elastic", "core"]);
        let all = victims(&r(&[("cpu", "12")]), &running);
        assert_eq!(keys(&all), ["elastic", "core", "ps"]);
        assert!(all[2].reason.starts_with("band high (no lower-band pod left"), "{}", all[2].reason);
    }

    #[test]
    fn ranking_inside_a_band() {
        let cost = |mut p: OffloadPodView, c: i32| {
            p.deletion_cost = c;
            p
        };
        let fulfilled = |mut p: OffloadPodView, f: (u32, u32, u32)| {
            p.job_fulfillment = f;
            p
        };
        let cases: Vec<(&str, Resources, Vec<OffloadPodView>, Vec<&str>)> = vec![
            (
                "a pod that empties its member node goes before one that shares a node",
                r(&[("cpu", "1")]),
                vec![
                    pod("a-shared", "j1", Band::Low, "n1", &[("cpu", "1")]),
                    pod("b-shared", "j2", Band::Low, "n1", &[("cpu", "1")]),
                    pod("z-alone", "j3", Band::Low, "n2", &[("cpu", "1")]),
                ],
                vec!["z-alone"],
            ),
            (
                "a second pod comes from the job already hit",
                r(&[("cpu", "2")]),
                vec![
                    pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]),
                    pod("b", "j2", Band::Low, "n1", &[("cpu", "1")]),
                    pod("c", "j1", Band::Low, "n1", &[("cpu", "1")]),
                    pod("d", "j2", Band::Low, "n1", &[("cpu", "1")]),
                ],
                vec!["a", "c"],
            ),
            (
                "the job with the highest fulfillment gives first",
                r(&[("cpu", "1")]),
                vec![
                    fulfilled(pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]), (3, 2, 6)),
                    fulfilled(pod("b", "j2", Band::Low, "n1", &[("cpu", "1")]), (5, 2, 6)),
                    fulfilled(pod("c", "j3", Band::Low, "n1", &[("cpu", "1")]), (2, 2, 6)),
                ],
                vec!["b"],
            ),
            (
                "within a job the lower pod-deletion-cost goes first, even if another pod would empty a node",
                r(&[("cpu", "1")]),
                vec![
                    cost(pod("a-precious", "j1", Band::Low, "n1", &[("cpu", "1")]), 100),
                    cost(pod("b-cheap", "j1", Band::Low, "n2", &[("cpu", "1")]), -5),
                    pod("c-other", "j2", Band::Low, "n2", &[("cpu", "1")]),
                ],
                vec!["b-cheap"],
            ),
            (
                "the lower tenant priority goes first even where a higher one would cover alone",
                r(&[("cpu", "2")]),
                vec![
                    OffloadPodView { priority: 100, ..pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]) },
                    OffloadPodView { priority: 500, ..pod("b", "j2", Band::Low, "n2", &[("cpu", "2")]) },
                    OffloadPodView { priority: 100, ..pod("c", "j3", Band::Low, "n3", &[("cpu", "1")]) },
                ],
                vec!["a", "c"],
            ),
            (
                "one pod that covers the deficit alone beats several small ones",
                r(&[(GPU, "4")]),
                vec![
                    pod("a", "j1", Band::Low, "n1", &[(GPU, "1")]),
                    pod("b", "j1", Band::Low, "n2", &[(GPU, "1")]),
                    pod("c", "j1", Band::Low, "n3", &[(GPU, "1")]),
                    pod("d", "j1", Band::Low, "n4", &[(GPU, "1")]),
                    pod("e", "j2", Band::Low, "n5", &[(GPU, "4")]),
                ],
                vec!["e"],
            ),
            (
                "pods that free nothing the deficit lacks are left alone",
                r(&[(GPU, "1")]),
                vec![
                    pod("a-cpu", "j1", Band::Low, "n1", &[("cpu", "16")]),
                    pod("b-gpu", "j2", Band::Medium, "n2", &[(GPU, "1")]),
                ],
                vec!["b-gpu"],
            ),
            (
                "every resource of the deficit is covered",
                r(&[("cpu", "4"), ("memory", "8Gi")]),
                vec![
                    pod("a", "j1", Band::Low, "n1", &[("cpu", "4"), ("memory", "1Gi")]),
                    pod("b", "j1", Band::Low, "n1", &[("cpu", "1"), ("memory", "8Gi")]),
                    pod("c", "j1", Band::Low, "n2", &[("cpu", "1"), ("memory", "1Gi")]),
                ],
                vec!["a", "b"],
            ),
            (
                "victims no longer needed once later ones cover are put back",
                r(&[("cpu", "2"), ("memory", "2Gi")]),
                vec![
                    fulfilled(pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]), (5, 2, 6)),
                    pod("b", "j2", Band::Low, "n2", &[("cpu", "1"), ("memory", "1Gi")]),
                    fulfilled(pod("c", "j3", Band::Low, "n3", &[("cpu", "2"), ("memory", "1Gi")]), (2, 2, 6)),
                    pod("d", "j2", Band::Low, "n2", &[("memory", "1Gi")]),
                ],
                vec!["b", "c"],
            ),
            (
                "a deficit larger than everything takes every pod that helps",
                r(&[("cpu", "100")]),
                vec![
                    pod("a", "j1", Band::Low, "n1", &[("cpu", "1")]),
                    pod("b", "j1", Band::Low, "n1", &[("memory", "1Gi")]),
                    pod("c", "j2", Band::High, "n2", &[("cpu", "1")]),
                ],
                vec!["a", "c"],
            ),
        ];
        for (name, deficit, running, want) in cases {
            assert_eq!(sorted_keys(&victims(&deficit, &running)), want, "{name}");
        }
    }

    #[test]
    fn reasons_name_the_band_the_job_and_an_emptied_node() {
        let running = [pod("ns/a", "job", Band::Low, "n1", &[("cpu", "1")])];
        let v = victims(&r(&[("cpu", "1")]), &running);
        assert_eq!(
            v[0].reason,
            "band low (lowest band first); job ns/gang/job at fulfillment 0/1; pod-deletion-cost 0; empties member node n1"
        );
    }

    // ---- properties ----

    const NAMES: [&str; 3] = [GPU, "cpu", "memory"];

    fn arb_running() -> impl Strategy<Value = Vec<OffloadPodView>> {
        let job_state = proptest::collection::vec((0u32..4, 0u32..3, 0u32..4), 4);
        let pods = proptest::collection::vec(
            (
                0usize..4,
                prop_oneof![Just(Band::Low), Just(Band::Medium), Just(Band::High)],
                0usize..4,
                proptest::collection::vec(0i64..5, 3),
                -1i32..2,
            ),
            0..12,
        );
        (job_state, pods).prop_map(|(jobs, pods)| {
            pods.into_iter()
                .enumerate()
                .map(|(i, (job, band, node, req, cost))| {
                    let (current, min, extra) = jobs[job];
                    let mut requests = Resources::new();
                    for (name, v) in NAMES.iter().zip(req) {
                        requests.set(name, v * 1000);
                    }
                    OffloadPodView {
                        key: format!("ns/p{i:02}"),
                        job: GangKey::annotation("ns", &format!("j{job}")),
                        band,
                        member_node: format!("n{node}"),
                        requests,
                        deletion_cost: cost,
                        priority: 0,
                        job_fulfillment: (current, min, min + extra),
                    }
                })
                .collect()
        })
    }

    fn arb_deficit() -> impl Strategy<Value = Resources> {
        proptest::collection::vec(-2i64..12, 3).prop_map(|v| {
            let mut d = Resources::new();
            for (name, x) in NAMES.iter().zip(v) {
                d.set(name, x * 1000);
            }
            d
        })
    }

    fn freed<'a>(running: &'a [OffloadPodView], keys: impl IntoIterator<Item = &'a str>) -> Resources {
        let keys: BTreeSet<&str> = keys.into_iter().collect();
        let mut total = Resources::new();
        for p in running.iter().filter(|p| keys.contains(p.key.as_str())) {
            total.add(&p.requests);
        }
        total
    }

    fn covers(freed: &Resources, deficit: &Resources) -> bool {
        deficit.iter().all(|(name, need)| need <= 0 || freed.get(name) >= need)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_deficit_is_covered_whenever_the_running_pods_can_cover_it(
            deficit in arb_deficit(), running in arb_running(),
        ) {
            let v = victims(&deficit, &running);
            let all = freed(&running, running.iter().map(|p| p.key.as_str()));
            if covers(&all, &deficit) {
                prop_assert!(covers(&freed(&running, keys(&v)), &deficit));
            }
            if deficit.iter().all(|(_, n)| n <= 0) {
                prop_assert!(v.is_empty());
            }
            let unique: BTreeSet<&str> = keys(&v).into_iter().collect();
            prop_assert_eq!(unique.len(), v.len(), "no pod is taken twice");
        }

        #[test]
        fn a_higher_band_is_taken_only_when_lower_bands_cannot_help(
            deficit in arb_deficit(), running in arb_running(),
        ) {
            let v = victims(&deficit, &running);
            let medium_jobs: BTreeSet<&GangKey> =
                v.iter().filter(|v| v.band == Band::Medium).map(|v| &v.job).collect();
            // A high pod taken with its job's gang core was taken at the medium stage.
            let stage = |v: &Victim| {
                if v.band == Band::High && medium_jobs.contains(&v.job) { Band::Medium } else { v.band }
            };
            let chosen: BTreeSet<&str> = keys(&v).into_iter().collect();
            for victim in v.iter().filter(|x| stage(x) == x.band) {
                let before = freed(&running, v.iter().filter(|u| stage(u) < victim.band).map(|u| u.key.as_str()));
                for p in running.iter().filter(|p| p.band < victim.band && !chosen.contains(p.key.as_str())) {
                    for (name, amount) in p.requests.iter() {
                        let need = deficit.get(name);
                        prop_assert!(
                            amount <= 0 || need <= 0 || before.get(name) >= need,
                            "{} ({:?}) taken while {} ({:?}) could still free {}", victim.key, victim.band, p.key, p.band, name
                        );
                    }
                }
            }
        }

        #[test]
        fn medium_victims_always_come_with_their_whole_job(deficit in arb_deficit(), running in arb_running()) {
            let v = victims(&deficit, &running);
            let chosen: BTreeSet<&str> = keys(&v).into_iter().collect();
            for victim in v.iter().filter(|v| v.band == Band::Medium) {
                for p in running.iter().filter(|p| p.job == victim.job) {
                    prop_assert!(chosen.contains(p.key.as_str()), "{} left behind by {}", p.key, victim.key);
                }
            }
        }

        #[test]
        fn the_last_band_holds_no_victim_the_deficit_does_not_need(
            deficit in arb_deficit(), running in arb_running(),
        ) {
            let v = victims(&deficit, &running);
            let total = freed(&running, keys(&v));
            let medium_jobs: BTreeSet<&GangKey> =
                v.iter().filter(|v| v.band == Band::Medium).map(|v| &v.job).collect();
            let stage = |v: &Victim| {
                if v.band == Band::High && medium_jobs.contains(&v.job) { Band::Medium } else { v.band }
            };
            let Some(top) = v.iter().map(stage).max() else { return Ok(()) };
            if !covers(&total, &deficit) {
                return Ok(());
            }
            for victim in v.iter().filter(|v| stage(v) == top) {
                // A gang core goes back only with its whole job.
                let unit: Vec<&str> = if top == Band::Medium {
                    v.iter().filter(|u| u.job == victim.job).map(|u| u.key.as_str()).collect()
                } else {
                    vec![victim.key.as_str()]
                };
                let without = freed(&running, keys(&v).into_iter().filter(|k| !unit.contains(k)));
                prop_assert!(!covers(&without, &deficit), "{} is not needed", victim.key);
            }
        }

        #[test]
        fn a_pod_is_taken_only_after_its_cheaper_twins_in_the_same_job(
            deficit in arb_deficit(),
            running in arb_running(),
            twins in proptest::collection::vec((0usize..12, 0usize..4, -3i32..4), 1..4),
        ) {
            // A twin: the same job, band and requests as an existing pod, on any node, at
            // another pod-deletion-cost. Only the cost (and the node) tells them apart.
            let mut running = running;
            prop_assume!(!running.is_empty());
            for (n, (of, node, cost)) in twins.into_iter().enumerate() {
                let mut twin = running[of % running.len()].clone();
                twin.key = format!("ns/twin{n}");
                twin.member_node = format!("n{node}");
                twin.deletion_cost = cost;
                running.push(twin);
            }
            let v = victims(&deficit, &running);
            let at: BTreeMap<&str, usize> = v.iter().enumerate().map(|(i, x)| (x.key.as_str(), i)).collect();
            let medium_jobs: BTreeSet<&GangKey> =
                v.iter().filter(|v| v.band == Band::Medium).map(|v| &v.job).collect();
            for a in &running {
                for b in &running {
                    let twins = a.job == b.job && a.band == b.band && a.requests == b.requests;
                    // A job taken whole goes at once: its costs do not order anything.
                    if !twins || a.deletion_cost >= b.deletion_cost || medium_jobs.contains(&a.job) {
                        continue;
                    }
                    if let Some(&b_at) = at.get(b.key.as_str()) {
                        let a_at = at.get(a.key.as_str());
                        prop_assert!(
                            a_at.is_some_and(|&i| i < b_at),
                            "{} (cost {}) taken while its twin {} (cost {}) is {}",
                            b.key, b.deletion_cost, a.key, a.deletion_cost,
                            if a_at.is_some() { "taken later" } else { "left running" }
                        );
                    }
                }
            }
        }

        #[test]
        fn the_answer_does_not_depend_on_input_order(
            deficit in arb_deficit(), running in arb_running(), seed in any::<u64>(),
        ) {
            let first = victims(&deficit, &running);
            let mut shuffled = running.clone();
            crate::testutil::shuffle(&mut shuffled, seed);
            prop_assert_eq!(first, victims(&deficit, &shuffled));
        }
    }

    /// The last band a selection reached, what it lacked after the bands below (fixed by the
    /// band rule), and the units that band could take: single pods of it, or (medium) the rest of a job
    /// with a gang core. Units the pod-deletion-cost rule forbids are kept out: a pod goes
    /// only with every cheaper pod of its job and band that frees something still lacking.
    struct LastBand<'a> {
        top: Band,
        taken: Vec<&'a str>,
        /// Allowed sets of the last band, as lists of pod keys (a pod with the cheaper pods
        /// of its job and band it needs to come after).
        units: Vec<Vec<&'a str>>,
        /// What is still lacking after `below`.
        rest: Resources,
    }

    fn last_band<'a>(deficit: &Resources, running: &'a [OffloadPodView], v: &'a [Victim]) -> Option<LastBand<'a>> {
        let medium_jobs: BTreeSet<&GangKey> = v.iter().filter(|v| v.band == Band::Medium).map(|v| &v.job).collect();
        let stage = |v: &Victim| {
            if v.band == Band::High && medium_jobs.contains(&v.job) { Band::Medium } else { v.band }
        };
        let top = v.iter().map(stage).max()?;
        let below: Vec<&str> = v.iter().filter(|x| stage(x) < top).map(|x| x.key.as_str()).collect();
        let taken: Vec<&str> = v.iter().filter(|x| stage(x) == top).map(|x| x.key.as_str()).collect();
        let mut rest = deficit.clone();
        rest.sub(&freed(running, below.iter().copied()));
        let helps = |p: &OffloadPodView| p.requests.iter().any(|(n, a)| a > 0 && rest.get(n) > 0);
        let free: Vec<&OffloadPodView> = running.iter().filter(|p| !below.contains(&p.key.as_str())).collect();
        let units = if top == Band::Medium {
            let mut jobs: BTreeMap<&GangKey, Vec<&str>> = BTreeMap::new();
            for p in &free {
                jobs.entry(&p.job).or_default().push(p.key.as_str());
            }
            jobs.into_iter()
                .filter(|(job, _)| free.iter().any(|p| &p.job == *job && p.band == Band::Medium))
                .map(|(_, keys)| keys)
                .collect()
        } else {
            free.iter()
                .filter(|p| p.band == top && helps(p))
                .map(|p| {
                    let mut unit: Vec<&str> = free
                        .iter()
                        .filter(|q| q.band == top && q.job == p.job && q.deletion_cost < p.deletion_cost && helps(q))
                        .map(|q| q.key.as_str())
                        .collect();
                    unit.push(p.key.as_str());
                    unit
                })
                .collect()
        };
        Some(LastBand { top, taken, units, rest })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_unit_that_covers_the_rest_alone_is_all_the_last_band_takes(
            deficit in arb_deficit(), running in arb_running(),
        ) {
            let v = victims(&deficit, &running);
            let Some(last) = last_band(&deficit, &running, &v) else { return Ok(()) };
            // Single units only: a pod that must come after cheaper ones is not one unit.
            let alone: Vec<&Vec<&str>> = last
                .units
                .iter()
                .filter(|u| last.top == Band::Medium || u.len() == 1)
                .filter(|u| covers(&freed(&running, u.iter().copied()), &last.rest))
                .collect();
            let Some(fewest) = alone.iter().map(|u| u.len()).min() else { return Ok(()) };
            let mut taken = last.taken.clone();
            taken.sort_unstable();
            prop_assert!(
                alone.iter().any(|u| {
                    let mut u = (*u).clone();
                    u.sort_unstable();
                    u == taken
                }),
                "band {:?}: took {:?} although {:?} covers alone", last.top, last.taken, alone
            );
            prop_assert_eq!(taken.len(), fewest, "band {:?}: took {:?}", last.top, last.taken);
        }
    }
}
