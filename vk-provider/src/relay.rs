//! Member Events, the pure part: which Events about an offload copy reach its training pod,
//! and how they are counted rather than copied, within bounds.
//!
//! The member's scheduler and kubelet tell about a copy in Events (FailedScheduling,
//! Pulling, Failed, BackOff, Killing, Preempted…) that the tenant never sees in the member.
//! Each becomes one Event on the training pod, keyed by pod, type, reason and message: the
//! same thing said again (the member's own Event counted up, or a new member Event saying
//! the same) raises that Event's count and last time instead of adding one. At most
//! [`Limits::per_pod`] distinct Events per pod (more are dropped and counted) and
//! [`Limits::total`] in all (the least recently seen is forgotten first; said again, it is
//! made anew). The I/O is in [`crate::member_events`].

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

/// Reasons not relayed: the member scheduler's `Scheduled` names a member node and says
/// what the training pod's status already says (it runs).
const NOT_RELAYED: [&str; 1] = ["Scheduled"];

/// Bounds on what is remembered and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Distinct Events per training pod.
    pub per_pod: usize,
    /// Distinct Events in all.
    pub total: usize,
    /// Member Events remembered per relayed Event (their counts so far).
    pub sources_per_event: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { per_pod: 16, total: 4096, sources_per_event: 8 }
    }
}

/// A member Event about a copy, reduced to what is relayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberEvent {
    /// UID of the member's Event: its count rising is the same Event said again.
    pub uid: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    pub message: String,
    /// The member Event's count so far (its `count`, or `series.count`, at least 1).
    pub count: i32,
    /// The component that reported it in the member (`kubelet`, `default-scheduler`).
    pub component: String,
}

impl MemberEvent {
    /// The event with its texts as tidepool relays them: control characters shown, not
    /// obeyed (a member cannot forge lines in `kubectl describe`), each text bounded.
    pub fn bounded(self) -> Self {
        use crate::bounded::{MAX_MESSAGE, MAX_REASON};
        use tidepool_api::text::shown;
        Self {
            reason: shown(&self.reason, MAX_REASON),
            message: shown(&self.message, MAX_MESSAGE),
            component: shown(&self.component, 64),
            ..self
        }
    }
}

/// The training pod an Event is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// What to write on the training side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A new Event named `name` on the pod, with `count` so far.
    Create { name: String, pod: PodRef, event: MemberEvent, count: i32 },
    /// Event `name` (made before) has now been said `count` times.
    Count { name: String, pod: PodRef, event: MemberEvent, count: i32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key {
    pod_uid: String,
    type_: String,
    reason: String,
    message: String,
}

#[derive(Debug)]
struct Entry {
    name: String,
    count: i32,
    /// Member Event UID → its count already added.
    sources: BTreeMap<String, i32>,
    /// When it was last said ([`Relay::tick`]), to forget the stalest first.
    seen: u64,
}

/// The relay's memory: what was written, and how much of each member Event it counted.
#[derive(Debug, Default)]
pub struct Relay {
    limits: Limits,
    entries: HashMap<Key, Entry>,
    per_pod: HashMap<String, usize>,
    tick: u64,
    /// Events dropped for the per-pod bound, for the metric and the log.
    pub dropped: u64,
}

/// Name of the training Event for `key`: `<pod>.<hash>`, stable, so a restarted tidepool
/// finds the Event it made before instead of adding one.
fn event_name(pod: &str, key: &Key) -> String {
    let mut h = Sha256::new();
    for part in [&key.pod_uid, &key.type_, &key.reason, &key.message] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let hex: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{}.{hex}", &pod[..pod.len().min(230)])
}

impl Relay {
    pub fn new(limits: Limits) -> Self {
        Self { limits, ..Default::default() }
    }

    /// Distinct Events remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What to write for member Event `event` about the copy of `pod`, if anything: nothing
    /// for a reason not relayed, a count not risen, or a pod at its bound.
    pub fn observe(&mut self, pod: &PodRef, event: &MemberEvent) -> Option<Write> {
        if NOT_RELAYED.contains(&event.reason.as_str()) || !matches!(event.type_.as_str(), "Normal" | "Warning") {
            return None;
        }
        self.tick += 1;
        let key = Key {
            pod_uid: pod.uid.clone(),
            type_: event.type_.clone(),
            reason: event.reason.clone(),
            message: event.message.clone(),
        };
        let count = event.count.max(1);
        if let Some(entry) = self.entries.get_mut(&key) {
            let before = entry.sources.get(&event.uid).copied().unwrap_or(0);
            if count <= before {
                return None;
            }
            if before == 0 && entry.sources.len() >= self.limits.sources_per_event {
                // Keep the map small: the oldest member Event stops being told apart.
                let oldest = entry.sources.keys().next().cloned();
                oldest.map(|k| entry.sources.remove(&k));
            }
            entry.sources.insert(event.uid.clone(), count);
            entry.count += count - before;
            entry.seen = self.tick;
            let (name, count) = (entry.name.clone(), entry.count);
            return Some(Write::Count { name, pod: pod.clone(), event: event.clone(), count });
        }
        if self.per_pod.get(&pod.uid).copied().unwrap_or(0) >= self.limits.per_pod {
            self.dropped += 1;
            return None;
        }
        if self.entries.len() >= self.limits.total {
            self.forget_stalest();
        }
        let name = event_name(&pod.name, &key);
        let entry =
            Entry { name: name.clone(), count, sources: BTreeMap::from([(event.uid.clone(), count)]), seen: self.tick };
        self.entries.insert(key, entry);
        *self.per_pod.entry(pod.uid.clone()).or_default() += 1;
        Some(Write::Create { name, pod: pod.clone(), event: event.clone(), count })
    }

    fn forget_stalest(&mut self) {
        let Some(key) = self.entries.iter().min_by_key(|(_, e)| e.seen).map(|(k, _)| k.clone()) else { return };
        self.entries.remove(&key);
        if let Some(n) = self.per_pod.get_mut(&key.pod_uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_pod.remove(&key.pod_uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(n: u32) -> PodRef {
        PodRef { namespace: "team-a".into(), name: format!("p{n}"), uid: format!("u{n}") }
    }

    fn event(uid: &str, reason: &str, message: &str, count: i32) -> MemberEvent {
        MemberEvent {
            uid: uid.into(),
            type_: "Warning".into(),
            reason: reason.into(),
            message: message.into(),
            count,
            component: "kubelet".into(),
        }
    }

    #[test]
    fn a_members_event_text_is_shown_not_obeyed_and_bounded() {
        let forged = event("m1", "Killing\x1b[2K\r", &format!("ok\n  Normal  Started  {}", "x".repeat(5000)), 1);
        let relayed = MemberEvent { component: "kubelet\x07".repeat(40), ..forged }.bounded();
        assert_eq!(relayed.reason, "Killing\\u{1b}[2K\\r");
        assert!(relayed.message.starts_with("ok\\n  Normal") && relayed.message.len() <= 1024, "{}", relayed.message);
        assert!(relayed.component.len() <= 64 && !relayed.component.contains('\x07'));
        let plain = event("m2", "BackOff", "Back-off pulling image \"x\"", 1);
        assert_eq!(plain.clone().bounded(), plain);
    }

    fn count(w: Option<Write>) -> Option<(bool, i32)> {
        w.map(|w| match w {
            Write::Create { count, .. } => (true, count),
            Write::Count { count, .. } => (false, count),
        })
    }

    #[test]
    fn the_same_event_said_again_is_counted_not_copied() {
        let mut r = Relay::new(Limits::default());
        let back_off = |n| event("m1", "BackOff", "Back-off pulling image \"x\"", n);
        assert_eq!(count(r.observe(&pod(1), &back_off(1))), Some((true, 1)));
        assert_eq!(count(r.observe(&pod(1), &back_off(3))), Some((false, 3)), "the member counted to 3");
        assert_eq!(count(r.observe(&pod(1), &back_off(3))), None, "seen again (a relist): nothing new");
        // Another member Event saying the same adds its own count.
        assert_eq!(
            count(r.observe(&pod(1), &event("m2", "BackOff", "Back-off pulling image \"x\"", 2))),
            Some((false, 5))
        );
        assert_eq!(r.len(), 1);
        // Another message, or another pod, is another Event.
        assert_eq!(count(r.observe(&pod(1), &event("m3", "Failed", "ErrImagePull", 1))), Some((true, 1)));
        assert_eq!(count(r.observe(&pod(2), &back_off(1))), Some((true, 1)));
        assert_eq!(r.len(), 3);
    }

    #[test]
    fn names_are_stable_and_distinct() {
        let mut r = Relay::new(Limits::default());
        let Some(Write::Create { name: a, .. }) = r.observe(&pod(1), &event("m1", "Failed", "x", 1)) else { panic!() };
        let mut fresh = Relay::new(Limits::default());
        let Some(Write::Create { name: again, .. }) = fresh.observe(&pod(1), &event("m9", "Failed", "x", 1)) else {
            panic!()
        };
        assert_eq!(a, again, "a restarted relay names the same Event the same");
        let Some(Write::Create { name: b, .. }) = r.observe(&pod(1), &event("m2", "Failed", "y", 1)) else { panic!() };
        assert_ne!(a, b);
        assert!(a.starts_with("p1."));
    }

    #[test]
    fn scheduled_and_unknown_types_are_not_relayed() {
        let mut r = Relay::new(Limits::default());
        let mut scheduled = event("m1", "Scheduled", "Successfully assigned tp-team-a/p1 to node-7", 1);
        scheduled.type_ = "Normal".into();
        assert_eq!(r.observe(&pod(1), &scheduled), None);
        let mut odd = event("m2", "Pulling", "x", 1);
        odd.type_ = "Debug".into();
        assert_eq!(r.observe(&pod(1), &odd), None);
        let mut pulling = event("m3", "Pulling", "Pulling image", 1);
        pulling.type_ = "Normal".into();
        assert!(r.observe(&pod(1), &pulling).is_some());
    }

    #[test]
    fn a_pod_gets_at_most_its_bound_and_the_total_forgets_the_stalest() {
        let limits = Limits { per_pod: 3, total: 5, sources_per_event: 2 };
        let mut r = Relay::new(limits);
        for i in 0..10 {
            r.observe(&pod(1), &event(&format!("m{i}"), "Failed", &format!("msg {i}"), 1));
        }
        assert_eq!(r.len(), 3, "a chatty pod is held to its bound");
        assert_eq!(r.dropped, 7);
        // Saying a known one again still counts.
        assert_eq!(count(r.observe(&pod(1), &event("m0", "Failed", "msg 0", 4))), Some((false, 4)));
        for p in 2..6 {
            r.observe(&pod(p), &event(&format!("n{p}"), "Failed", "x", 1));
        }
        assert_eq!(r.len(), 5, "never more than the total");
        // The stalest were pod 1's msg 1 and msg 2 (msg 0 was said again), then pod 2's.
        assert_eq!(count(r.observe(&pod(1), &event("m1", "Failed", "msg 1", 2))), Some((true, 2)));
    }

    #[test]
    fn a_member_event_map_stays_small() {
        let mut r = Relay::new(Limits { per_pod: 4, total: 10, sources_per_event: 2 });
        for i in 0..5 {
            r.observe(&pod(1), &event(&format!("m{i}"), "BackOff", "same", 1));
        }
        let entry = r.entries.values().next().unwrap();
        assert_eq!(entry.sources.len(), 2);
        assert_eq!(entry.count, 5);
    }
}
