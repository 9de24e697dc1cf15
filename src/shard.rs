//! Sharded replicas: which members this replica bridges.
//!
//! Every replica keeps a presence Lease `tidepool-replica-<identity>`; the live replicas are
//! those whose presence Lease changed within a lease duration, judged on this replica's own
//! clock (as `leader` judges the leader Lease, so clock skew does not matter). The owner each
//! member should have is chosen by rendezvous hashing ([`owner`]) over the live set: every
//! replica computes the same answer, a replica holds about members/N, and a replica coming or
//! going moves only the members it gains or loses. A member is owned through its Lease
//! `tidepool-member-<name>`: taken when free or expired and this replica is the wanted owner,
//! renewed while it is, released (handed over) when the live set names another.
//!
//! Fencing: a member counts as owned only until `renewDeadline` after the last renewal that
//! succeeded (counted from when it was sent), well before anybody else may take it after a
//! lease duration; the federation stops the member's session (and fences its client) the
//! moment it leaves the owned set.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use sha2::{Digest, Sha256};
use tidepool_api::bridge::ShardingConfig;
use tidepool_api::{MemberCluster, MemberName};
use tidepool_federation::fence::{Owned, OwnedSender};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::leader::Record;

/// Label on the sharding Leases, saying which kind each is, so each kind is one list call.
pub const LABEL_SHARD_LEASE: &str = "tidepool.io/shard-lease";
/// Label on the sharding Leases naming the replica group (the leader Lease's name), so
/// releases sharing a namespace never count each other's replicas.
pub const LABEL_SHARD_GROUP: &str = "tidepool.io/shard-group";
pub const MEMBER_LEASE_PREFIX: &str = "tidepool-member-";
pub const REPLICA_LEASE_PREFIX: &str = "tidepool-replica-";

/// The rendezvous weight of `replica` for `member`: a stable hash, the same on every replica
/// and every version.
pub fn weight(replica: &str, member: &str) -> u64 {
    let digest = Sha256::new().chain_update(replica).chain_update([0u8]).chain_update(member).finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The replica of `live` that should own `member`: the highest weight (ties to the smaller
/// name). Pure.
pub fn owner<'a>(member: &str, live: &'a BTreeSet<String>) -> Option<&'a str> {
    live.iter().map(|r| (weight(r, member), std::cmp::Reverse(r))).max().map(|(_, r)| r.0.as_str())
}

/// When each Lease's record was last seen to change, on this replica's clock.
#[derive(Debug, Default)]
pub struct Seen(HashMap<String, (Record, Instant)>);

impl Seen {
    /// Whether Lease `name` with `record` is held by a live holder: held, and its record
    /// changed less than `duration` ago as seen from here (a record seen for the first time
    /// counts as just changed).
    pub fn alive(&mut self, name: &str, record: &Record, now: Instant, duration: Duration) -> bool {
        if record.holder.is_none() {
            return false;
        }
        match self.0.get(name) {
            Some((last, since)) if last == record => now.duration_since(*since) < duration,
            _ => {
                self.0.insert(name.to_owned(), (record.clone(), now));
                true
            }
        }
    }
}

/// What to do with one member's Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Missing, released or expired, and this replica should own it: take it.
    Take,
    /// Ours and still ours by the live set: renew.
    Renew,
    /// Ours, but the live set names another owner: hand it over.
    Release,
    /// Someone else's, alive; or free but another replica's to take.
    Wait,
}

/// The pure decision for one member's Lease. `holder` is its holder (`None`: missing or
/// released), `alive` whether that holder renewed within a lease duration as seen from here.
pub fn member_step(holder: Option<&str>, alive: bool, me: &str, wanted: Option<&str>) -> Step {
    let wanted_me = wanted == Some(me);
    match holder {
        Some(h) if h == me => {
            if wanted_me || wanted.is_none() {
                Step::Renew
            } else {
                Step::Release
            }
        }
        Some(_) if alive => Step::Wait,
        _ if wanted_me => Step::Take,
        _ => Step::Wait,
    }
}

/// The members still owned at `now`: renewed (request sent) less than `deadline` ago, and
/// not being handed over. Pure.
pub fn owned_at(renewed: &BTreeMap<MemberName, Instant>, now: Instant, deadline: Duration) -> BTreeSet<MemberName> {
    renewed.iter().filter(|(_, at)| now.duration_since(**at) < deadline).map(|(m, _)| m.clone()).collect()
}

/// A Lease name part from an identity: DNS-1123 (lower case, `-` for anything else).
pub fn lease_part(identity: &str) -> String {
    let part: String =
        identity.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    part.trim_matches('-').chars().take(200).collect()
}

/// Keeps this replica's presence and member Leases; publishes the members it owns.
pub struct Sharder {
    api: Api<Lease>,
    members: Api<MemberCluster>,
    selector: Option<String>,
    identity: String,
    /// The replica group: the leader Lease's name.
    group: String,
    config: ShardingConfig,
    seen: Seen,
    /// When the last successful take or renewal of each owned member was sent.
    renewed: BTreeMap<MemberName, Instant>,
    /// Members given up last round, whose Lease is released this round: their tasks have
    /// had a retry period to stop before the new owner may start.
    releasing: BTreeSet<MemberName>,
    /// Published after every round; a member leaving it is fenced in the same step.
    owned: OwnedSender,
}

impl Sharder {
    pub fn new(
        training: kube::Client,
        namespace: &str,
        selector: Option<String>,
        (identity, group): (String, String),
        config: ShardingConfig,
    ) -> (Self, Owned) {
        let (owned, rx) = tidepool_federation::fence::owned();
        let sharder = Self {
            api: Api::namespaced(training.clone(), namespace),
            members: Api::all(training),
            selector,
            identity,
            group,
            config,
            seen: Seen::default(),
            renewed: BTreeMap::new(),
            releasing: BTreeSet::new(),
            owned,
        };
        (sharder, rx)
    }

    fn duration(&self) -> Duration {
        Duration::from_secs(self.config.lease_duration_seconds)
    }

    fn retry(&self) -> Duration {
        Duration::from_secs(self.config.retry_period_seconds)
    }

    /// Runs until the process stops: one round per retry period, each bounded by it, and
    /// the owned set re-judged after every round whatever the round achieved.
    pub async fn run(mut self) {
        info!(identity = %self.identity, "sharding: sharing the members with the other replicas");
        loop {
            let started = Instant::now();
            let retry = self.retry();
            if let Err(e) = tokio::time::timeout(retry, self.round()).await.unwrap_or(Ok(())) {
                warn!(error = %e, "sharding: cannot read or write the member Leases");
            }
            self.publish();
            tokio::time::sleep_until(started + retry).await;
        }
    }

    /// Publishes the members still owned; a member whose renewals stopped leaves the set.
    fn publish(&mut self) {
        let deadline = Duration::from_secs(self.config.renew_deadline_seconds);
        let owned = owned_at(&self.renewed, Instant::now(), deadline);
        self.renewed.retain(|m, _| owned.contains(m));
        if self.owned.publish(&owned) {
            info!(owned = ?owned.iter().map(MemberName::as_str).collect::<Vec<_>>(), "sharding: members owned");
        }
    }

    /// One round: presence, live set, then every member's Lease.
    async fn round(&mut self) -> Result<(), kube::Error> {
        self.renew_presence().await?;
        let live = self.live().await?;
        let mut lp = ListParams::default();
        if let Some(selector) = &self.selector {
            lp = lp.labels(selector);
        }
        let members: BTreeSet<String> =
            self.members.list_metadata(&lp).await?.items.iter().map(|m| m.name_any()).collect();
        let leases = self.leases("member").await?;
        // Deselected or deleted members are not ours to hold.
        self.renewed.retain(|m, _| members.contains(m.as_str()));
        for member in &members {
            let name = format!("{MEMBER_LEASE_PREFIX}{member}");
            let step = self.step_for(member, &name, leases.get(&name), &live);
            self.act(member, &name, step, leases.get(&name)).await;
        }
        Ok(())
    }

    fn step_for(&mut self, member: &str, name: &str, lease: Option<&Lease>, live: &BTreeSet<String>) -> Step {
        let record = lease.map(|l| Record::of(l.spec.as_ref()));
        let duration = self.duration();
        let alive = record.as_ref().is_some_and(|r| self.seen.alive(name, r, Instant::now(), duration));
        member_step(record.as_ref().and_then(|r| r.holder.as_deref()), alive, &self.identity, owner(member, live))
    }

    /// Carries `step` out for `member`; a failure is logged and the member judged by its
    /// last renewal.
    async fn act(&mut self, member: &str, name: &str, step: Step, lease: Option<&Lease>) {
        let key = MemberName::new(member.to_owned());
        let sent = Instant::now();
        if step == Step::Wait {
            return;
        }
        // Stop writing first; give the Lease up a round later.
        if step == Step::Release && self.releasing.insert(key.clone()) {
            self.renewed.remove(&key);
            return self.publish();
        }
        let holder = (step != Step::Release).then_some(self.identity.as_str());
        let result = self.write(name, lease, holder).await;
        if step != Step::Release || result.is_ok() {
            self.releasing.remove(&key);
        }
        match result {
            Ok(()) if step == Step::Release => info!(member, "sharding: member handed over"),
            Ok(()) => {
                if self.renewed.insert(key, sent).is_none() {
                    info!(member, "sharding: member taken");
                }
            }
            Err(e) => warn!(member, error = %e, ?step, "sharding: member Lease not written"),
        }
    }

    /// Renews (creating if missing) this replica's presence Lease.
    async fn renew_presence(&self) -> Result<(), kube::Error> {
        let name = format!("{REPLICA_LEASE_PREFIX}{}", lease_part(&self.identity));
        let lease = self.api.get_opt(&name).await?;
        self.write_kind(&name, lease.as_ref(), Some(&self.identity), "replica").await
    }

    /// The live replicas: this one, and every other whose presence Lease is alive.
    async fn live(&mut self) -> Result<BTreeSet<String>, kube::Error> {
        let leases = self.leases("replica").await?;
        let (now, duration) = (Instant::now(), self.duration());
        let mut live = BTreeSet::from([self.identity.clone()]);
        for (name, lease) in &leases {
            let record = Record::of(lease.spec.as_ref());
            if let Some(holder) = record.holder.clone()
                && self.seen.alive(name, &record, now, duration)
            {
                live.insert(holder);
            }
        }
        Ok(live)
    }

    async fn leases(&self, kind: &str) -> Result<BTreeMap<String, Lease>, kube::Error> {
        let lp = ListParams::default().labels(&group_selector(kind, &self.group));
        Ok(self.api.list(&lp).await?.items.into_iter().map(|l| (l.name_any(), l)).collect())
    }

    async fn write(&self, name: &str, lease: Option<&Lease>, holder: Option<&str>) -> Result<(), kube::Error> {
        self.write_kind(name, lease, holder, "member").await
    }

    /// Creates Lease `name` held by `holder`, or replaces `lease` (its resourceVersion kept: a
    /// concurrent writer makes this a 409 and this round waits).
    async fn write_kind(
        &self,
        name: &str,
        lease: Option<&Lease>,
        holder: Option<&str>,
        kind: &str,
    ) -> Result<(), kube::Error> {
        let now = MicroTime(jiff::Timestamp::now());
        let previous = lease.and_then(|l| l.spec.clone()).unwrap_or_default();
        let same = previous.holder_identity.as_deref() == holder;
        let spec = LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: i32::try_from(self.config.lease_duration_seconds).ok(),
            acquire_time: if same { previous.acquire_time.clone() } else { holder.map(|_| now.clone()) },
            renew_time: holder.map(|_| now),
            lease_transitions: Some(previous.lease_transitions.unwrap_or(0) + i32::from(!same && holder.is_some())),
            ..Default::default()
        };
        match lease {
            Some(lease) => {
                let mut lease = lease.clone();
                lease.spec = Some(spec);
                self.api.replace(name, &PostParams::default(), &lease).await.map(drop)
            }
            None => {
                let labels = BTreeMap::from([
                    (LABEL_SHARD_LEASE.to_owned(), kind.to_owned()),
                    (LABEL_SHARD_GROUP.to_owned(), self.group.clone()),
                ]);
                let metadata = ObjectMeta { name: Some(name.to_owned()), labels: Some(labels), ..Default::default() };
                self.api.create(&PostParams::default(), &Lease { metadata, spec: Some(spec) }).await.map(drop)
            }
        }
    }

    /// Clean shutdown: releases the members and deletes the presence Lease, so the others
    /// take over at once instead of after a lease duration.
    pub async fn release_all(training: kube::Client, namespace: &str, (identity, group): (&str, &str)) {
        let api = Api::<Lease>::namespaced(training, namespace);
        let lp = ListParams::default().labels(&group_selector("member", group));
        for mut lease in api.list(&lp).await.map(|l| l.items).unwrap_or_default() {
            let Some(spec) = lease.spec.as_mut().filter(|s| s.holder_identity.as_deref() == Some(identity)) else {
                continue;
            };
            spec.holder_identity = None;
            spec.renew_time = None;
            if let Err(e) = api.replace(&lease.name_any(), &PostParams::default(), &lease).await {
                warn!(lease = %lease.name_any(), error = %e, "sharding: cannot release a member Lease");
            }
        }
        let presence = format!("{REPLICA_LEASE_PREFIX}{}", lease_part(identity));
        if let Err(e) = api.delete(&presence, &Default::default()).await {
            warn!(lease = %presence, error = %e, "sharding: cannot delete the presence Lease");
        }
    }
}

/// The label selector of one kind of Lease of replica group `group`.
fn group_selector(kind: &str, group: &str) -> String {
    format!("{LABEL_SHARD_LEASE}={kind},{LABEL_SHARD_GROUP}={group}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replicas(n: usize) -> BTreeSet<String> {
        (0..n).map(|i| format!("tidepool-{i}")).collect()
    }

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("member-{i}")).collect()
    }

    fn assignment(members: &[String], live: &BTreeSet<String>) -> BTreeMap<String, String> {
        members.iter().map(|m| (m.clone(), owner(m, live).unwrap().to_owned())).collect()
    }

    #[test]
    fn every_member_has_one_owner_and_each_replica_about_its_share() {
        let (live, members) = (replicas(4), members(400));
        let owners = assignment(&members, &live);
        let mut load: BTreeMap<&str, usize> = BTreeMap::new();
        for o in owners.values() {
            *load.entry(o).or_default() += 1;
        }
        assert_eq!(load.len(), 4, "every replica owns some: {load:?}");
        // 100 each on average; HRW over 400 keys stays well within ±35%.
        assert!(load.values().all(|&n| (65..=135).contains(&n)), "{load:?}");
    }

    #[test]
    fn a_replica_joining_takes_only_members_from_others_and_about_its_share() {
        let members = members(300);
        let before = assignment(&members, &replicas(3));
        let after = assignment(&members, &replicas(4));
        let moved: Vec<&String> = members.iter().filter(|m| before[*m] != after[*m]).collect();
        // Every moved member went to the newcomer; nothing moved between old replicas.
        assert!(moved.iter().all(|m| after[*m] == "tidepool-3"), "{moved:?}");
        // About 300/4 = 75 move.
        assert!((45..=105).contains(&moved.len()), "{} moved", moved.len());
    }

    #[test]
    fn a_replica_leaving_gives_up_only_its_own_members() {
        let members = members(300);
        let before = assignment(&members, &replicas(3));
        let mut live = replicas(3);
        live.remove("tidepool-1");
        let after = assignment(&members, &live);
        for m in &members {
            if before[m] != "tidepool-1" {
                assert_eq!(before[m], after[m], "{m} moved though its owner stayed");
            } else {
                assert_ne!(after[m], "tidepool-1");
            }
        }
    }

    #[test]
    fn a_stable_live_set_never_moves_a_member() {
        let (live, members) = (replicas(3), members(50));
        let first = assignment(&members, &live);
        for _ in 0..10 {
            assert_eq!(assignment(&members, &live), first);
        }
        // And the answer does not depend on the order the set was built in.
        let reversed: BTreeSet<String> = live.iter().rev().cloned().collect();
        assert_eq!(assignment(&members, &reversed), first);
    }

    #[test]
    fn member_lease_steps() {
        let cases = [
            ("a missing lease is taken by its wanted owner", None, false, Some("a"), Step::Take),
            ("a missing lease is left to another wanted owner", None, false, Some("b"), Step::Wait),
            ("our lease is renewed while we are wanted", Some("a"), true, Some("a"), Step::Renew),
            ("our lease is handed over when another is wanted", Some("a"), true, Some("b"), Step::Release),
            ("a live holder is waited for even if we are wanted", Some("b"), true, Some("a"), Step::Wait),
            ("an expired holder is replaced by the wanted owner", Some("b"), false, Some("a"), Step::Take),
            ("an expired holder is left to another wanted owner", Some("b"), false, Some("c"), Step::Wait),
        ];
        for (name, holder, alive, wanted, step) in cases {
            assert_eq!(member_step(holder, alive, "a", wanted), step, "{name}");
        }
    }

    #[test]
    fn a_lease_is_alive_until_unchanged_for_a_duration_on_our_clock() {
        let d = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut seen = Seen::default();
        let held = |renew: &str| Record { holder: Some("b".into()), renew_time: Some(renew.into()), transitions: 0 };
        assert!(seen.alive("l", &held("t1"), t0, d), "first sight counts as a change");
        assert!(seen.alive("l", &held("t1"), t0 + d - Duration::from_millis(1), d));
        assert!(!seen.alive("l", &held("t1"), t0 + d, d), "silent for a duration");
        assert!(seen.alive("l", &held("t2"), t0 + d, d), "renewed: alive again");
        let released = Record { holder: None, renew_time: None, transitions: 1 };
        assert!(!seen.alive("l", &released, t0 + d, d), "released is never alive");
    }

    #[test]
    fn a_member_stops_being_owned_once_its_renewals_are_older_than_the_deadline() {
        let t0 = Instant::now();
        let deadline = Duration::from_secs(10);
        let renewed =
            BTreeMap::from([(MemberName::from("fresh"), t0 + Duration::from_secs(5)), (MemberName::from("stale"), t0)]);
        let owned = owned_at(&renewed, t0 + deadline, deadline);
        assert_eq!(owned, BTreeSet::from([MemberName::from("fresh")]));
    }

    #[test]
    fn lease_names_are_dns_labels() {
        assert_eq!(lease_part("Host_1.example-42"), "host-1-example-42");
        assert_eq!(lease_part("tidepool-7d9f-abc"), "tidepool-7d9f-abc");
    }
}
