//! Online pods that the member's scheduler would not protect from offload pods.
//!
//! Offload pods run at the band PriorityClasses (`tidepool-offload-<band>`, negative values,
//! never preempting). That keeps them below online pods only while online pods run above
//! those values: an online pod at or below the highest band value can be starved or (at
//! equal value) compete with offload pods, so the member's admin is told. Pure: tested on
//! plain views.

use tidepool_api::keys::Band;

use super::{PodCapacityKey, PodView};

/// Pods named in the condition message; the rest are counted.
pub const EXAMPLES: usize = 3;

/// The highest priority an offload pod can have (the `high` band's).
pub fn offload_ceiling() -> i32 {
    Band::ALL.into_iter().map(Band::priority_value).max().unwrap_or(0)
}

/// Online pods at or below the offload priority ceiling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriorityConflict {
    /// How many such pods the member runs.
    pub count: usize,
    /// The lowest-priority ones (`namespace/name`, priority), lowest first, then by name.
    pub examples: Vec<(String, i32)>,
    pub ceiling: i32,
}

impl PriorityConflict {
    /// The condition message: a few pods and their priorities.
    pub fn message(&self) -> String {
        let named: Vec<String> = self.examples.iter().map(|(pod, p)| format!("{pod} ({p})")).collect();
        let more = self.count.saturating_sub(self.examples.len());
        let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
        format!(
            "{} online pod(s) run at or below the offload priority {} (tidepool-offload-high), so offload \
             pods are not kept below them: {}{tail}; give online workloads a PriorityClass above {}",
            self.count,
            self.ceiling,
            named.join(", "),
            self.ceiling
        )
    }
}

/// The online pods (neither offload copies nor finished) whose `spec.priority` is at or
/// below `ceiling`. Pods without a resolved priority are left out: the API server sets it
/// at admission, so only objects from before admission lack it. `None` when there are none.
pub fn priority_conflict<'a>(
    pods: impl IntoIterator<Item = (&'a PodCapacityKey, &'a PodView)>,
    ceiling: i32,
) -> Option<PriorityConflict> {
    let mut low: Vec<(String, i32)> = pods
        .into_iter()
        .filter(|(_, p)| !p.offload && !p.terminated)
        .filter_map(|((ns, name), p)| p.priority.filter(|v| *v <= ceiling).map(|v| (format!("{ns}/{name}"), v)))
        .collect();
    if low.is_empty() {
        return None;
    }
    let count = low.len();
    low.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    low.truncate(EXAMPLES);
    Some(PriorityConflict { count, examples: low, ceiling })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(priority: Option<i32>) -> PodView {
        PodView { priority, node: Some("n1".into()), ..Default::default() }
    }

    fn key(name: &str) -> PodCapacityKey {
        ("shop".to_owned(), name.to_owned())
    }

    #[test]
    fn the_ceiling_is_the_high_band() {
        assert_eq!(offload_ceiling(), Band::High.priority_value());
        assert!(Band::ALL.iter().all(|b| b.priority_value() <= offload_ceiling()));
    }

    #[test]
    fn only_running_online_pods_at_or_below_the_ceiling_conflict() {
        let c = offload_ceiling();
        let offload = PodView { offload: true, ..pod(Some(Band::Low.priority_value())) };
        let done = PodView { terminated: true, ..pod(Some(c - 5)) };
        let pods = [
            (key("default-priority"), pod(Some(0))),
            (key("no-priority-yet"), pod(None)),
            (key("just-above"), pod(Some(c + 1))),
            (key("offload-copy"), offload),
            (key("finished"), done),
        ];
        assert_eq!(priority_conflict(pods.iter().map(|(k, v)| (k, v)), c), None);

        let pods = [(key("equal"), pod(Some(c))), (key("below"), pod(Some(c - 500))), (key("fine"), pod(Some(10)))];
        let found = priority_conflict(pods.iter().map(|(k, v)| (k, v)), c).unwrap();
        assert_eq!(found.count, 2);
        assert_eq!(found.examples, vec![("shop/below".to_owned(), c - 500), ("shop/equal".to_owned(), c)]);
        assert!(found.message().contains("shop/below (-1500), shop/equal (-1000)"), "{}", found.message());
    }

    #[test]
    fn the_message_names_a_few_and_counts_the_rest() {
        let c = offload_ceiling();
        let pods: Vec<_> = (0..7).map(|i| (key(&format!("p{i}")), pod(Some(c - i)))).collect();
        let found = priority_conflict(pods.iter().map(|(k, v)| (k, v)), c).unwrap();
        assert_eq!(found.count, 7);
        assert_eq!(found.examples.len(), EXAMPLES);
        assert_eq!(found.examples[0], ("shop/p6".to_owned(), c - 6));
        assert!(found.message().ends_with(&format!("and 4 more; give online workloads a PriorityClass above {c}")));
    }
}
