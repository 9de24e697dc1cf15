//! Admission order of the gang queue: who gets the next chance at capacity.
//!
//! Pure. The controller builds one [`QueueEntry`] per gang with pods waiting (a new gang's
//! core, or elastic pods of a placed gang) and admits them in [`admission_order`]: band (high
//! first), then priority (higher first), then the lowest [`Fulfillment`] first, so elastic
//! growth goes to the least served job, then age (older first), then key, so the order is
//! total and never depends on how the queue was built.

use std::cmp::Ordering;
use std::fmt;

use tidepool_api::keys::Band;

use crate::gang::GangKey;

/// One gang waiting for admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    pub key: GangKey,
    pub band: Band,
    pub priority: i32,
    /// `minMember`: pods that must start together.
    pub min: u32,
    /// Pods the job would run with all of its elastic pods.
    pub max: u32,
    /// Pods of the job admitted (bound) so far.
    pub current: u32,
    /// Creation time, unix seconds: the older gang goes first on a tie.
    pub created: i64,
}

impl QueueEntry {
    pub fn fulfillment(&self) -> Fulfillment {
        Fulfillment::new(self.current, self.min, self.max)
    }
}

/// How much of its elastic range a job has: `(current − min) / (max − min)`, 0 for a job with
/// no elastic range (`max ≤ min`). Below 0 while the gang core is not complete, above 1 when
/// a job runs more pods than it asked for.
///
/// Kept as an exact fraction and compared by cross-multiplication: with floats, 1/3 and 2/6
/// could rank differently from run to run of a refactor, and the order must be stable.
#[derive(Debug, Clone, Copy)]
pub struct Fulfillment {
    num: i64,
    /// Always > 0.
    den: i64,
}

impl Fulfillment {
    /// A job with no elastic range, or exactly at its `minMember`.
    pub const ZERO: Fulfillment = Fulfillment { num: 0, den: 1 };

    pub fn new(current: u32, min: u32, max: u32) -> Self {
        if max <= min {
            return Self::ZERO;
        }
        Self { num: i64::from(current) - i64::from(min), den: i64::from(max) - i64::from(min) }
    }
}

impl Ord for Fulfillment {
    fn cmp(&self, other: &Self) -> Ordering {
        // Both denominators are positive, so the cross products compare like the fractions;
        // i128 keeps u32-sized operands from overflowing.
        (i128::from(self.num) * i128::from(other.den)).cmp(&(i128::from(other.num) * i128::from(self.den)))
    }
}

impl PartialOrd for Fulfillment {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Fulfillment {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Fulfillment {}

impl fmt::Display for Fulfillment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.num, self.den)
    }
}

/// The admission comparison: `Less` means `a` is admitted before `b`.
pub fn admission_cmp(a: &QueueEntry, b: &QueueEntry) -> Ordering {
    b.band
        .cmp(&a.band)
        .then(b.priority.cmp(&a.priority))
        .then_with(|| a.fulfillment().cmp(&b.fulfillment()))
        .then(a.created.cmp(&b.created))
        .then_with(|| a.key.cmp(&b.key))
}

/// Sorts the queue into admission order (see the module docs).
pub fn admission_order(entries: &mut [QueueEntry]) {
    entries.sort_by(admission_cmp);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(name: &str) -> QueueEntry {
        QueueEntry {
            key: GangKey::annotation("ns", name),
            band: Band::Medium,
            priority: 0,
            min: 1,
            max: 1,
            current: 0,
            created: 0,
        }
    }

    fn order_of(mut entries: Vec<QueueEntry>) -> Vec<String> {
        admission_order(&mut entries);
        entries.into_iter().map(|e| e.key.to_string().replacen("ns/gang/", "", 1)).collect()
    }

    #[test]
    fn admission_follows_band_priority_fulfillment_age_and_key() {
        let cases: Vec<(&str, Vec<QueueEntry>, Vec<&str>)> = vec![
            (
                "the high band goes before a higher priority in a lower band",
                vec![
                    QueueEntry { priority: 1000, band: Band::Low, ..entry("low") },
                    QueueEntry { band: Band::High, ..entry("high") },
                    entry("medium"),
                ],
                vec!["high", "medium", "low"],
            ),
            (
                "inside a band, higher priority goes first",
                vec![QueueEntry { priority: -5, ..entry("a") }, QueueEntry { priority: 7, ..entry("b") }],
                vec!["b", "a"],
            ),
            (
                "the least fulfilled job grows first",
                vec![
                    QueueEntry { min: 2, max: 6, current: 5, ..entry("three-quarters") },
                    QueueEntry { min: 2, max: 4, current: 3, ..entry("half") },
                    QueueEntry { min: 4, max: 8, current: 4, ..entry("none") },
                ],
                vec!["none", "half", "three-quarters"],
            ),
            (
                "a job without an elastic range counts as fulfillment zero",
                vec![
                    QueueEntry { min: 2, max: 4, current: 3, ..entry("half") },
                    QueueEntry { min: 4, max: 4, current: 4, created: 50, ..entry("rigid") },
                ],
                vec!["rigid", "half"],
            ),
            (
                "equal fractions are equal and fall through to age",
                vec![
                    QueueEntry { min: 0, max: 6, current: 2, created: 20, ..entry("two-sixths") },
                    QueueEntry { min: 0, max: 3, current: 1, created: 10, ..entry("one-third") },
                ],
                vec!["one-third", "two-sixths"],
            ),
            (
                "the older gang goes first",
                vec![QueueEntry { created: 200, ..entry("young") }, QueueEntry { created: 100, ..entry("old") }],
                vec!["old", "young"],
            ),
            ("identical gangs are ordered by key", vec![entry("b"), entry("a"), entry("c")], vec!["a", "b", "c"]),
        ];
        for (name, entries, want) in cases {
            assert_eq!(order_of(entries), want, "{name}");
        }
    }

    #[test]
    fn fulfillment_compares_exactly() {
        assert_eq!(Fulfillment::new(1, 0, 3), Fulfillment::new(2, 0, 6));
        assert!(Fulfillment::new(0, 2, 4) < Fulfillment::new(2, 2, 4));
        assert!(Fulfillment::new(u32::MAX, 0, u32::MAX) > Fulfillment::new(u32::MAX - 1, 0, u32::MAX));
        assert_eq!(Fulfillment::new(9, 5, 5), Fulfillment::new(0, 0, 0));
        assert_eq!(Fulfillment::new(3, 2, 4).to_string(), "1/2");
    }

    fn arb_entry() -> impl Strategy<Value = QueueEntry> {
        (
            prop_oneof![Just(Band::High), Just(Band::Medium), Just(Band::Low)],
            -2i32..3,
            0u32..4,
            0u32..6,
            0u32..8,
            0i64..4,
        )
            .prop_map(|(band, priority, min, extra, current, created)| QueueEntry {
                key: GangKey::annotation("ns", ""),
                band,
                priority,
                min,
                max: min + extra,
                current,
                created,
            })
    }

    proptest! {
        #[test]
        fn the_order_is_total_and_independent_of_input_order(
            mut entries in proptest::collection::vec(arb_entry(), 0..12), seed in any::<u64>(),
        ) {
            for (i, e) in entries.iter_mut().enumerate() {
                e.key = GangKey::annotation("ns", &format!("g{i:02}"));
            }
            let mut sorted = entries.clone();
            admission_order(&mut sorted);
            for w in sorted.windows(2) {
                prop_assert_ne!(admission_cmp(&w[0], &w[1]), Ordering::Greater);
                prop_assert!(w[0].band >= w[1].band);
            }
            let mut shuffled = entries;
            crate::testutil::shuffle(&mut shuffled, seed);
            admission_order(&mut shuffled);
            prop_assert_eq!(sorted, shuffled);
        }
    }
}
