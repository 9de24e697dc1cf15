//! Capacity published across replicas (sharding).
//!
//! A sharded replica bridges only the members it owns, but the dispatcher, on the replica
//! that holds the leader Lease, places gangs on every pool and may preempt on any of them.
//! So each replica publishes what the dispatcher reads of its members — per pool: capacity,
//! use, per-node free room with topology labels, and which offload pods the member shows
//! placed where — as one ConfigMap per member in tidepool's namespace
//! (`tidepool-capacity-<member>`, label [`LABEL_CAPACITY_OF`]), and every replica watches
//! them ([`Remote`]).
//!
//! A record is rewritten when what it says changes and at least every `heartbeat`, so a
//! reader can tell a live owner from a dead one: one not rewritten for `stale_after` (the
//! sharding lease duration, on the reader's own clock) counts as unreachable, and nothing
//! is placed there until the member's next owner publishes it. Only tidepool writes in its
//! namespace: tenants cannot forge a record.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};
use tidepool_api::{MemberName, Resources};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::capacity::{NodeFree, Placed, PoolCapacity};
use crate::{MemberHandle, Members};

/// Label of a published record: the member it describes.
pub const LABEL_CAPACITY_OF: &str = "tidepool.io/capacity-of";
/// The ConfigMap key holding the record (JSON).
const KEY: &str = "member.json";
const FIELD_MANAGER: &str = "tidepool-capacity";
/// Records written at once.
const WRITE_CONCURRENCY: usize = 8;
/// Changes closer together than this are published as one: a record carries every member
/// node and offload pod of its pools, and a burst changes it with every copy that lands. At
/// most ten writes a second per member; the dispatcher counts a pod bound but not yet in the
/// record as in flight meanwhile, so a late record only delays, never overbooks.
const COALESCE: Duration = Duration::from_millis(100);

/// Name of the ConfigMap publishing `member`.
pub fn record_name(member: &str) -> String {
    format!("tidepool-capacity-{member}")
}

/// What the dispatcher reads of one member, as its owner publishes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberRecord {
    pub member: String,
    /// The replica that owns the member and wrote this.
    pub owner: String,
    pub paused: bool,
    /// Reachable and usable: new pods may go there.
    pub healthy: bool,
    /// Answering (perhaps not usable): its pods may be reclaimed.
    pub answering: bool,
    pub pools: Vec<PoolRecord>,
    /// When the owner wrote it (for people; readers judge age on their own clock).
    pub written: jiff::Timestamp,
}

/// One pool of a [`MemberRecord`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolRecord {
    pub name: String,
    /// Its virtual node.
    pub node: String,
    pub capacity: Resources,
    pub used: Resources,
    pub held_back: Resources,
    pub nodes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_product: Option<String>,
    #[serde(default)]
    pub topology: Vec<String>,
    #[serde(default)]
    pub free_per_node: Vec<NodeRecord>,
    /// Origin UIDs of the offload pods the member shows placed, by member node.
    #[serde(default)]
    pub placed: BTreeMap<String, Vec<String>>,
}

/// One member node's free room and labels ([`NodeFree`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub free: Resources,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl PoolRecord {
    /// The record of pool `name` (virtual node `node`) at capacity `cap`.
    pub fn of(name: &str, node: &str, cap: &PoolCapacity) -> Self {
        let mut placed: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (uid, p) in cap.placed.iter() {
            placed.entry(p.node.to_string()).or_default().push(uid.to_string());
        }
        Self {
            name: name.to_owned(),
            node: node.to_owned(),
            capacity: cap.capacity.clone(),
            used: cap.used.clone(),
            held_back: cap.held_back.clone(),
            nodes: cap.nodes,
            gpu_product: cap.gpu_product.clone(),
            topology: cap.topology.clone(),
            free_per_node: cap
                .free_per_node
                .iter()
                .map(|n| NodeRecord { name: n.name.clone(), free: n.free.clone(), labels: n.labels.clone() })
                .collect(),
            placed,
        }
    }

    /// The capacity this record describes. Placed pods carry no copy UID: only the owner
    /// deletes copies.
    pub fn capacity(&self) -> PoolCapacity {
        let mut placed = BTreeMap::new();
        for (node, uids) in &self.placed {
            let node: Arc<str> = Arc::from(node.as_str());
            for uid in uids {
                placed.insert(Arc::from(uid.as_str()), Placed { node: node.clone(), copy_uid: None });
            }
        }
        PoolCapacity {
            capacity: self.capacity.clone(),
            used: self.used.clone(),
            nodes: self.nodes,
            gpu_product: self.gpu_product.clone(),
            free_per_node: self
                .free_per_node
                .iter()
                .map(|n| NodeFree { name: n.name.clone(), free: n.free.clone(), labels: n.labels.clone() })
                .collect(),
            topology: self.topology.clone(),
            placed: Arc::new(placed),
            held_back: self.held_back.clone(),
        }
    }
}

impl MemberRecord {
    /// The record of a member this replica bridges, now.
    pub fn of(member: &MemberHandle, owner: &str) -> Self {
        let health = member.health.borrow().clone();
        Self {
            member: member.name.to_string(),
            owner: owner.to_owned(),
            paused: member.paused,
            healthy: health.is_healthy(),
            answering: health.is_answering(),
            pools: member
                .pools
                .iter()
                .map(|p| PoolRecord::of(p.name.as_str(), p.node.as_str(), &p.capacity.borrow()))
                .collect(),
            written: jiff::Timestamp::now(),
        }
    }

    /// Whether `self` says something `other` does not (the write time aside).
    fn differs(&self, other: &Self) -> bool {
        Self { written: other.written, ..self.clone() } != *other
    }
}

/// A member another replica owns, as its last record says.
#[derive(Debug, Clone)]
pub struct RemoteMember {
    pub paused: bool,
    pub healthy: bool,
    pub answering: bool,
    pub pools: Vec<RemotePool>,
    /// When this replica last saw the record rewritten.
    pub seen: Instant,
    /// The ConfigMap's resourceVersion then: a re-list that finds the same one saw no write.
    version: Option<String>,
}

/// One pool of a [`RemoteMember`], its record read back as capacity.
#[derive(Debug, Clone)]
pub struct RemotePool {
    pub name: String,
    /// Its virtual node.
    pub node: String,
    pub capacity: PoolCapacity,
}

impl RemoteMember {
    /// The member `record` describes, at resourceVersion `version`, seen `seen`.
    fn of(record: &MemberRecord, version: Option<String>, seen: Instant) -> Self {
        let pools = record
            .pools
            .iter()
            .map(|p| RemotePool { name: p.name.clone(), node: p.node.clone(), capacity: p.capacity() })
            .collect();
        let MemberRecord { paused, healthy, answering, .. } = *record;
        Self { paused, healthy, answering, pools, seen, version }
    }
}

impl RemoteMember {
    /// Whether the record was rewritten within `stale_after`: its owner is alive.
    pub fn fresh(&self, stale_after: Duration) -> bool {
        self.seen.elapsed() < stale_after
    }
}

/// Every published record this replica sees, by member.
pub type Remote = BTreeMap<MemberName, Arc<RemoteMember>>;

/// Publishes the records of the members this replica bridges (`members`) until the runtime
/// stops: at once on a change of capacity, health or membership, and every `heartbeat`
/// otherwise. A member that leaves without being handed over has its record deleted.
pub async fn publish(
    training: Client,
    namespace: String,
    owner: String,
    members: watch::Receiver<Members>,
    heartbeat: Duration,
) {
    let api = Api::<ConfigMap>::namespaced(training, &namespace);
    let mut members = members;
    let mut written: BTreeMap<MemberName, (MemberRecord, Instant)> = BTreeMap::new();
    let mut previous = Members::new();
    loop {
        let current = members.borrow_and_update().clone();
        // Capacities and health as of now count as seen: a change from here wakes the next pass.
        let mut wakers = wakers(&current);
        let due: Vec<MemberRecord> = current
            .values()
            .map(|m| MemberRecord::of(m, &owner))
            .filter(|r| {
                let name = MemberName::new(r.member.as_str());
                written.get(&name).is_none_or(|(w, at)| r.differs(w) || at.elapsed() >= heartbeat)
            })
            .collect();
        let writes = futures::stream::iter(due).map(|r| write(&api, r)).buffer_unordered(WRITE_CONCURRENCY);
        let done: Vec<Option<MemberRecord>> = writes.collect().await;
        for r in done.into_iter().flatten() {
            written.insert(MemberName::new(r.member.clone()), (r, Instant::now()));
        }
        for (name, gone) in previous.iter().filter(|(name, _)| !current.contains_key(*name)) {
            written.remove(name);
            // Handed over: the new owner rewrites the record; deleting it would hide the
            // member from the dispatcher until then.
            if !gone.handed_over.load(std::sync::atomic::Ordering::Relaxed) {
                remove(&api, name, &members).await;
            }
        }
        previous = current;
        tokio::select! {
            r = members.changed() => if r.is_err() { return },
            () = changed(&mut wakers) => {}
            () = tokio::time::sleep(heartbeat) => {}
        }
        tokio::time::sleep(COALESCE).await;
    }
}

/// The capacity and health channels of `members`, marked seen.
fn wakers(members: &Members) -> Vec<Waker> {
    let mut wakers = Vec::new();
    for m in members.values() {
        let mut health = m.health.clone();
        health.borrow_and_update();
        wakers.push(Waker::Health(health));
        for p in &m.pools {
            let mut cap = p.capacity.clone();
            cap.borrow_and_update();
            wakers.push(Waker::Capacity(cap));
        }
    }
    wakers
}

enum Waker {
    Health(watch::Receiver<crate::Health>),
    Capacity(watch::Receiver<PoolCapacity>),
}

/// Resolves when one of `wakers` changes (never, with none).
async fn changed(wakers: &mut [Waker]) {
    if wakers.is_empty() {
        return std::future::pending().await;
    }
    let each = wakers.iter_mut().map(|w| {
        Box::pin(async move {
            let r = match w {
                Waker::Health(h) => h.changed().await,
                Waker::Capacity(c) => c.changed().await,
            };
            // A closed channel (session ended) is a membership change, seen through `members`.
            if r.is_err() {
                std::future::pending::<()>().await;
            }
        })
    });
    futures::future::select_all(each).await;
}

/// Applies `record`; returns it when written.
async fn write(api: &Api<ConfigMap>, record: MemberRecord) -> Option<MemberRecord> {
    let body = match serde_json::to_string(&record) {
        Ok(b) => b,
        Err(e) => {
            warn!(member = %record.member, error = %e, "cannot encode capacity record");
            return None;
        }
    };
    let labels = [(LABEL_CAPACITY_OF, record.member.as_str())];
    match put(api, &record_name(&record.member), &labels, (KEY, &body)).await {
        Ok(()) => Some(record),
        Err(e) => {
            warn!(member = %record.member, error = %e, "cannot publish capacity; will retry");
            None
        }
    }
}

/// Applies ConfigMap `name` holding `data` (one key), labelled as tidepool's and with `labels`.
async fn put(
    api: &Api<ConfigMap>,
    name: &str,
    labels: &[(&str, &str)],
    (key, value): (&str, &str),
) -> kube::Result<()> {
    let mut all = serde_json::Map::new();
    all.insert(tidepool_api::keys::LABEL_MANAGED_BY.into(), tidepool_api::keys::MANAGED_BY.into());
    for (k, v) in labels {
        all.insert((*k).into(), (*v).into());
    }
    let cm = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "labels": all},
        "data": {key: value},
    });
    api.patch(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(cm)).await.map(drop)
}

/// Deletes the record of `name`, which left this replica (not handed over) — unless it came
/// back already.
async fn remove(api: &Api<ConfigMap>, name: &MemberName, members: &watch::Receiver<Members>) {
    if members.borrow().contains_key(name) {
        return;
    }
    match api.delete(&record_name(name.as_str()), &DeleteParams::default()).await {
        Ok(_) => debug!(member = %name, "capacity record removed"),
        Err(e) if crate::api_code(&e, &[404]) => {}
        Err(e) => warn!(member = %name, error = %e, "cannot remove capacity record"),
    }
}

/// The ConfigMap saying whether the dispatcher waits for capacity (data `waiting`: `true` or
/// `false`), written by the replica that runs it.
pub const WANTED: &str = "tidepool-capacity-wanted";

/// Publishes `wanted` (whether a gang waits for capacity) as [`WANTED`], the latest value
/// whenever it changes, so the owners of other members publish room that grows at once, as
/// the dispatcher's own replica does ([`MemberHandle::want_capacity`]).
pub async fn publish_wanted(training: Client, namespace: String, mut wanted: watch::Receiver<bool>) {
    let api = Api::<ConfigMap>::namespaced(training, &namespace);
    loop {
        let waiting = *wanted.borrow_and_update();
        if let Err(e) = put(&api, WANTED, &[], ("waiting", &waiting.to_string())).await {
            warn!(error = %e, "cannot publish whether capacity is wanted; will retry");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        if wanted.changed().await.is_err() {
            return;
        }
    }
}

/// Follows [`WANTED`]: every member this replica bridges (`members`) wants capacity while the
/// dispatcher, on whichever replica, says a gang waits.
pub async fn follow_wanted(training: Client, namespace: String, mut members: watch::Receiver<Members>) {
    let api = Api::<ConfigMap>::namespaced(training, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={WANTED}"));
    let mut events = std::pin::pin!(watcher(api, config));
    let mut waiting = false;
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm))) => waiting = says_waiting(&cm),
                Some(Ok(watcher::Event::Delete(_))) => waiting = false,
                Some(Ok(_)) => continue,
                Some(Err(e)) => {
                    warn!(error = %e, "capacity-wanted watch failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                None => return,
            },
            r = members.changed() => if r.is_err() { return },
        }
        for m in members.borrow().values() {
            m.want_capacity(waiting);
        }
    }
}

fn says_waiting(cm: &ConfigMap) -> bool {
    cm.data.as_ref().and_then(|d| d.get("waiting")).is_some_and(|w| w == "true")
}

/// Watches the published records in `namespace`; the channel holds the valid ones by member.
/// A record that does not parse is logged and left out: the others still count.
pub fn watch_records(tasks: &mut crate::tasks::Tasks, training: Client, namespace: &str) -> watch::Receiver<Remote> {
    let (tx, rx) = watch::channel(Remote::new());
    let api = Api::<ConfigMap>::namespaced(training, namespace);
    tasks.spawn("capacity-records", follow(api, tx));
    rx
}

async fn follow(api: Api<ConfigMap>, tx: watch::Sender<Remote>) {
    let config = watcher::Config::default().labels(LABEL_CAPACITY_OF);
    let mut events = std::pin::pin!(watcher(api, config));
    let mut listing = Remote::new();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(cm)) => {
                tx.send_modify(|remote| {
                    let known = remote.clone();
                    apply(remote, &cm, &known);
                });
            }
            Ok(watcher::Event::Delete(cm)) => {
                tx.send_modify(|remote| {
                    remote.remove(&MemberName::new(cm.labels().get(LABEL_CAPACITY_OF).cloned().unwrap_or_default()));
                });
            }
            Ok(watcher::Event::Init) => listing.clear(),
            Ok(watcher::Event::InitApply(cm)) => apply(&mut listing, &cm, &tx.borrow()),
            Ok(watcher::Event::InitDone) => {
                let listed = std::mem::take(&mut listing);
                tx.send_replace(listed);
            }
            Err(e) => {
                warn!(error = %e, "capacity records watch failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Puts the record `cm` holds into `remote`, or says why it cannot. A record `known` at the
/// same resourceVersion (a re-list after a watch restart) keeps the time it was last seen
/// written: a dead owner's record must not look fresh again.
fn apply(remote: &mut Remote, cm: &ConfigMap, known: &Remote) {
    match parse(cm) {
        Ok(record) => {
            let name = MemberName::new(record.member.clone());
            let version = cm.metadata.resource_version.clone();
            let unchanged = known.get(&name).filter(|k| version.is_some() && k.version == version);
            let seen = unchanged.map_or_else(Instant::now, |k| k.seen);
            remote.insert(name, Arc::new(RemoteMember::of(&record, version, seen)));
        }
        Err(e) => warn!(record = %cm.name_any(), error = %e, "capacity record ignored"),
    }
}

/// The record `cm` holds; it must describe the member its label names.
pub fn parse(cm: &ConfigMap) -> Result<MemberRecord, String> {
    let labelled = cm.labels().get(LABEL_CAPACITY_OF).cloned().unwrap_or_default();
    let body = cm.data.as_ref().and_then(|d| d.get(KEY)).ok_or_else(|| format!("no {KEY}"))?;
    let record: MemberRecord = serde_json::from_str(body).map_err(|e| format!("{KEY}: {e}"))?;
    if record.member != labelled {
        return Err(format!("describes member {:?} but is labelled {labelled:?}", record.member));
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity() -> PoolCapacity {
        let mut cap = PoolCapacity {
            capacity: Resources::from_pairs([("cpu", "16"), ("nvidia.com/gpu", "8")]).unwrap(),
            used: Resources::from_pairs([("cpu", "4")]).unwrap(),
            nodes: 2,
            gpu_product: Some("A100".into()),
            topology: vec!["rack".into()],
            held_back: Resources::from_pairs([("cpu", "1")]).unwrap(),
            ..PoolCapacity::default()
        };
        let mut labels = BTreeMap::new();
        labels.insert("rack".to_owned(), "r1".to_owned());
        cap.free_per_node = vec![
            NodeFree { name: "n1".into(), free: Resources::from_pairs([("cpu", "6")]).unwrap(), labels },
            NodeFree::new("n2", Resources::from_pairs([("cpu", "6")]).unwrap()),
        ];
        let mut placed = BTreeMap::new();
        placed.insert(Arc::from("u1"), Placed { node: "n1".into(), copy_uid: Some("c1".into()) });
        placed.insert(Arc::from("u2"), Placed { node: "n1".into(), copy_uid: None });
        placed.insert(Arc::from("u3"), Placed { node: "n2".into(), copy_uid: Some("c3".into()) });
        cap.placed = Arc::new(placed);
        cap
    }

    #[test]
    fn a_published_pool_reads_back_as_the_capacity_it_was_made_from_less_its_copy_uids() {
        let cap = capacity();
        let record = PoolRecord::of("gpu", "tidepool-m-gpu", &cap);
        let json = serde_json::to_string(&record).unwrap();
        let back: PoolRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, record);
        let read = back.capacity();
        let mut expected = cap.clone();
        let uids: BTreeMap<Arc<str>, Placed> =
            cap.placed.iter().map(|(u, p)| (u.clone(), Placed { node: p.node.clone(), copy_uid: None })).collect();
        expected.placed = Arc::new(uids);
        assert_eq!(read, expected);
        assert_eq!(record.placed["n1"], vec!["u1".to_owned(), "u2".to_owned()]);
    }

    fn config_map(label: &str, body: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": record_name(label), "labels": {LABEL_CAPACITY_OF: label}},
            "data": {KEY: body},
        }))
        .unwrap()
    }

    fn record(member: &str) -> MemberRecord {
        MemberRecord {
            member: member.into(),
            owner: "r1".into(),
            paused: false,
            healthy: true,
            answering: true,
            pools: vec![PoolRecord::of("gpu", "tidepool-m-gpu", &capacity())],
            written: jiff::Timestamp::now(),
        }
    }

    #[test]
    fn a_record_that_does_not_parse_or_names_another_member_is_left_out_and_the_others_stay() {
        let (mut remote, known) = (Remote::new(), Remote::new());
        apply(&mut remote, &config_map("a", &serde_json::to_string(&record("a")).unwrap()), &known);
        apply(&mut remote, &config_map("b", "{not json"), &known);
        // A record labelled for one member that describes another is refused: the label is
        // what deletions and the record's name go by.
        apply(&mut remote, &config_map("c", &serde_json::to_string(&record("d")).unwrap()), &known);
        assert_eq!(remote.keys().map(|k| k.as_str()).collect::<Vec<_>>(), vec!["a"]);
        assert!(parse(&config_map("b", "{not json")).unwrap_err().contains(KEY));
        assert!(
            parse(&config_map("c", &serde_json::to_string(&record("d")).unwrap())).unwrap_err().contains("labelled")
        );
    }

    #[test]
    fn a_record_differs_only_by_what_it_says_not_when_it_was_written() {
        let a = record("a");
        let later = MemberRecord { written: a.written + jiff::SignedDuration::from_secs(5), ..a.clone() };
        assert!(!later.differs(&a));
        assert!(MemberRecord { paused: true, ..a.clone() }.differs(&a));
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_relisted_unchanged_keeps_its_age_and_a_rewritten_one_is_fresh() {
        let at = |version: &str| {
            let mut cm = config_map("a", &serde_json::to_string(&record("a")).unwrap());
            cm.metadata.resource_version = Some(version.into());
            cm
        };
        let mut remote = Remote::new();
        apply(&mut remote, &at("7"), &Remote::new());
        tokio::time::advance(Duration::from_secs(16)).await;
        // The watch restarts and lists again: the same resourceVersion, no write since.
        let mut listing = Remote::new();
        apply(&mut listing, &at("7"), &remote);
        assert!(!listing[&MemberName::new("a")].fresh(Duration::from_secs(15)), "a re-list made a stale record fresh");
        let mut rewritten = Remote::new();
        apply(&mut rewritten, &at("8"), &remote);
        assert!(rewritten[&MemberName::new("a")].fresh(Duration::from_secs(15)));
    }

    #[test]
    fn capacity_is_wanted_only_while_the_dispatcher_says_true() {
        let cm = |data: serde_json::Value| -> ConfigMap {
            serde_json::from_value(serde_json::json!({"metadata": {"name": WANTED}, "data": data})).unwrap()
        };
        assert!(says_waiting(&cm(serde_json::json!({"waiting": "true"}))));
        assert!(!says_waiting(&cm(serde_json::json!({"waiting": "false"}))));
        assert!(!says_waiting(&cm(serde_json::json!({}))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_not_rewritten_within_the_stale_time_is_not_fresh() {
        let r = RemoteMember::of(&record("a"), None, Instant::now());
        assert!(r.fresh(Duration::from_secs(15)));
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(!r.fresh(Duration::from_secs(15)));
    }
}
