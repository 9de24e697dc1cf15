//! The capacity publisher of one member: computes every pool's capacity when the watches
//! change, spaced by what a computation costs, and publishes what is due on each pool's
//! channel (small drifts wait, see [`super::publish`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use tidepool_api::MemberName;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use tidepool_api::metrics::metrics;

use crate::capacity::{PUBLISH_MAX_INTERVAL, PoolCapacity, worth_publishing};
use crate::view_cache::Wakeups;

/// Shortest spacing of two capacity computations: the events of a burst that arrive
/// within it cost one computation.
pub(crate) const COALESCE: Duration = Duration::from_millis(100);

/// Shortest spacing while online demand moves: a pool is short (a deficit), or an HPA, a
/// Deployment or StatefulSet, or a pending online pod changed since the last computation.
/// What follows a first change (an HPA raising its bound, then the Deployment scaling, its
/// pods created one after another) is more of the same demand, and it is waiting.
pub(crate) const COALESCE_SHORT: Duration = Duration::from_millis(10);

/// Longest spacing of two computations.
pub(crate) const COALESCE_MAX: Duration = Duration::from_secs(1);

/// How far apart the next computation must start from the last one, given what the last
/// one cost and whether online demand moves (`short`, see [`COALESCE_SHORT`]): ten times the
/// cost, so a large member's capacity model takes at most about a tenth of a core under
/// constant churn, between [`COALESCE`] ([`COALESCE_SHORT`] while short) and
/// [`COALESCE_MAX`]. A change after a quiet spell is computed at once (an online service
/// growing wants its capacity back now); only the changes that follow it wait for the
/// spacing. Offload churn (a burst of copies
/// starting) keeps the longer spacing: it changes nothing online demand waits for, and each
/// publication rewrites the virtual node and wakes the dispatcher.
pub(crate) fn coalesce_after(cost: Duration, short: bool) -> Duration {
    let least = if short { COALESCE_SHORT } else { COALESCE };
    cost.saturating_mul(10).clamp(least, COALESCE_MAX)
}

/// What becomes of a pool's newly computed capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Publication {
    /// Equal to the published one: nothing to send, nothing waiting.
    Unchanged,
    /// A small change (see [`worth_publishing`]) the pool published recently: it waits, at
    /// most until [`PUBLISH_MAX_INTERVAL`] after the last publication.
    Defer,
    Publish,
}

/// Whether `next` goes out now, given the published `current`, how long ago the pool last
/// published and whether a gang waits for capacity (`wanted`): room that grows may be what it
/// waits for. Pure.
pub(crate) fn publication(
    current: &PoolCapacity,
    next: &PoolCapacity,
    since_published: Duration,
    wanted: bool,
) -> Publication {
    if current == next {
        Publication::Unchanged
    } else if since_published < PUBLISH_MAX_INTERVAL
        && !worth_publishing(current, next)
        && !(wanted && room_grew(current, next))
    {
        Publication::Defer
    } else {
        Publication::Publish
    }
}

/// Whether `next` leaves more room than `current` in any resource (capacity minus used).
pub(crate) fn room_grew(current: &PoolCapacity, next: &PoolCapacity) -> bool {
    let room = |c: &PoolCapacity, name: &str| c.capacity.get(name) - c.used.get(name);
    next.capacity.names().any(|name| room(next, name) > room(current, name))
}

/// The capacity publisher's memory between two computations: when each pool last published
/// and whether a small change waits, and when the last computation started, what it cost and
/// whether it found a pool short (see [`coalesce_after`]).
#[derive(Debug)]
pub(crate) struct Publisher {
    computed: bool,
    published: Vec<Instant>,
    deferred: Vec<bool>,
    last_started: Instant,
    last_cost: Duration,
    last_short: bool,
}

impl Publisher {
    fn new(pools: usize, now: Instant) -> Self {
        Self {
            computed: false,
            published: vec![now; pools],
            deferred: vec![false; pools],
            last_started: now,
            last_cost: Duration::ZERO,
            last_short: false,
        }
    }

    /// How long to wait for a change before computing anyway: `clock` (windows open and
    /// close with it), sooner while a small change waits.
    fn wake(&self, clock: Duration) -> Duration {
        if self.deferred.iter().any(|d| *d) { PUBLISH_MAX_INTERVAL.min(clock) } else { clock }
    }

    /// When the next computation may start; `demand_moved`: online demand changed since the
    /// last one (see [`coalesce_after`]). A pool found short counts as moving demand.
    fn next_start(&self, demand_moved: bool) -> Instant {
        self.last_started + coalesce_after(self.last_cost, demand_moved)
    }

    /// Sends each pool's `next` capacity that is due, at `now`. The first computation always
    /// goes out (consumers wait for it), whatever it is.
    fn publish(
        &mut self,
        senders: &[watch::Sender<PoolCapacity>],
        nexts: Vec<PoolCapacity>,
        now: Instant,
        wanted: bool,
    ) {
        let first = !self.computed;
        self.computed = true;
        for (i, (tx, next)) in senders.iter().zip(nexts).enumerate() {
            if first {
                tx.send_replace(next);
                continue;
            }
            let since = now.duration_since(self.published[i]);
            let sent = tx.send_if_modified(|cur| match publication(cur, &next, since, wanted) {
                Publication::Unchanged => {
                    self.deferred[i] = false;
                    false
                }
                Publication::Defer => {
                    self.deferred[i] = true;
                    false
                }
                Publication::Publish => {
                    debug!(capacity = %next.capacity, used = %next.used, nodes = next.nodes, "pool capacity changed");
                    *cur = next;
                    true
                }
            });
            if sent {
                self.published[i] = now;
                self.deferred[i] = false;
            }
        }
    }

    /// Records the computation that started at `started` and took `cost`.
    fn computed(&mut self, started: Instant, cost: Duration, short: bool) {
        (self.last_started, self.last_cost, self.last_short) = (started, cost, short);
    }
}

/// One pool as the capacity publisher serves it.
pub(crate) struct PoolOut {
    pub(crate) name: String,
    pub(crate) tx: watch::Sender<PoolCapacity>,
}

/// Computes every pool's capacity when the watches change and publishes what is due (see
/// [`Publisher`], [`coalesce_after`]), until `stop`. `compute` answers `None` while the
/// watches are not synced.
pub(crate) async fn run_publisher<F>(
    member: &MemberName,
    mut compute: F,
    pools: &[PoolOut],
    wakeups: &Wakeups,
    clock: Duration,
    stop: &CancellationToken,
) -> Result<(), crate::Error>
where
    F: FnMut() -> Result<Option<Vec<PoolCapacity>>, crate::Error>,
{
    let senders: Vec<_> = pools.iter().map(|p| p.tx.clone()).collect();
    let mut state = Publisher::new(pools.len(), Instant::now());
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = wakeups.changed.notified() => {}
            () = tokio::time::sleep(state.wake(clock)) => {}
        }
        let urgent = state.last_short || wakeups.demand.swap(false, Ordering::Relaxed);
        tokio::time::sleep_until(state.next_start(urgent)).await;
        let started = Instant::now();
        let Some(nexts) = compute()? else { continue };
        let short = nexts.iter().any(|n| !n.deficit().is_empty());
        for (pool, next) in pools.iter().zip(&nexts) {
            metrics().set_pool(member.as_str(), &pool.name, &next.capacity, &next.used, &next.deficit());
        }
        state.publish(&senders, nexts, Instant::now(), wakeups.wanted.load(Ordering::Relaxed));
        metrics().observe_sync("capacity", started.elapsed());
        state.computed(started, started.elapsed(), short);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tidepool_api::Resources;

    fn pool(cpu: &str, gpus: &str, used_gpus: &str) -> PoolCapacity {
        PoolCapacity {
            capacity: Resources::from_pairs([("cpu", cpu), ("nvidia.com/gpu", gpus)]).unwrap(),
            used: Resources::from_pairs([("nvidia.com/gpu", used_gpus)]).unwrap(),
            nodes: 1,
            ..Default::default()
        }
    }

    #[test]
    fn a_pool_publishes_what_matters_at_once_and_lets_drift_wait() {
        let published = pool("100", "8", "2");
        let recent = Duration::from_millis(100);
        let cases = [
            ("the same capacity is not sent again", published.clone(), recent, Publication::Unchanged),
            ("a GPU freed goes out at once", pool("100", "8", "1"), recent, Publication::Publish),
            ("a cpu drift under 1% waits", pool("100.5", "8", "2"), recent, Publication::Defer),
            ("a cpu change over 1% goes out at once", pool("102", "8", "2"), recent, Publication::Publish),
            (
                "a drift goes out once the pool has been quiet long enough",
                pool("100.5", "8", "2"),
                PUBLISH_MAX_INTERVAL,
                Publication::Publish,
            ),
            ("a new deficit goes out at once", pool("100", "8", "9"), recent, Publication::Publish),
        ];
        for (name, next, since, want) in cases {
            assert_eq!(publication(&published, &next, since, false), want, "{name}");
        }
    }

    #[test]
    fn while_a_gang_waits_room_that_grows_goes_out_at_once() {
        let published = pool("100", "8", "2");
        let recent = Duration::from_millis(100);
        let cases = [
            ("more cpu, however little", pool("100.5", "8", "2"), Publication::Publish),
            ("less cpu still waits", pool("99.5", "8", "2"), Publication::Defer),
            ("the same is not sent again", published.clone(), Publication::Unchanged),
        ];
        for (name, next, want) in cases {
            assert_eq!(publication(&published, &next, recent, true), want, "{name}");
        }
    }

    #[test]
    fn a_waiting_drift_wakes_the_publisher_sooner() {
        let mut state = Publisher::new(2, Instant::now());
        let clock = Duration::from_secs(3600);
        assert_eq!(state.wake(clock), clock);
        state.deferred[1] = true;
        assert_eq!(state.wake(clock), PUBLISH_MAX_INTERVAL);
        // Whichever comes first: windows tick, or the drift's wait ends.
        assert_eq!(state.wake(Duration::from_millis(200)), Duration::from_millis(200));
    }

    /// A capacity publisher of one pool whose watches are a value the test sets.
    struct Bench {
        input: Arc<Mutex<Option<Vec<PoolCapacity>>>>,
        wakeups: Wakeups,
        rx: watch::Receiver<PoolCapacity>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<Result<(), crate::Error>>,
    }

    impl Bench {
        fn start() -> Bench {
            let (tx, rx) = watch::channel(PoolCapacity::default());
            let input: Arc<Mutex<Option<Vec<PoolCapacity>>>> = Arc::default();
            let (wakeups, stop) = (Wakeups::default(), CancellationToken::new());
            let (i, w, s) = (input.clone(), wakeups.clone(), stop.clone());
            let task = tokio::spawn(async move {
                let pools = [PoolOut { name: "gpu".into(), tx }];
                let member = MemberName::new("bench".to_owned());
                run_publisher(&member, || Ok(i.lock().unwrap().clone()), &pools, &w, Duration::from_secs(3600), &s)
                    .await
            });
            Bench { input, wakeups, rx, stop, task }
        }

        /// The watches now show `capacity`; `demand`: an online demand change among them.
        fn set(&self, capacity: PoolCapacity, demand: bool) {
            *self.input.lock().unwrap() = Some(vec![capacity]);
            if demand {
                self.wakeups.demand.store(true, Ordering::Relaxed);
            }
            self.wakeups.changed.notify_one();
        }

        /// The next published capacity, and how long (in paused time) it took from now.
        /// Bounded: a publication that never comes fails the test.
        async fn next(&mut self) -> (PoolCapacity, Duration) {
            let since = Instant::now();
            let limit = Duration::from_secs(4 * 3600);
            tokio::time::timeout(limit, self.rx.changed()).await.expect("nothing published").unwrap();
            (self.rx.borrow_and_update().clone(), since.elapsed())
        }

        /// Publishes `capacity` as the first result, then lets the publisher rest.
        async fn settled(&mut self, capacity: PoolCapacity) {
            self.set(capacity.clone(), false);
            assert_eq!(self.next().await.0, capacity);
            tokio::time::sleep(Duration::from_secs(60)).await;
        }

        async fn stop(self) {
            self.stop.cancel();
            self.task.await.unwrap().unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_goes_out_before_the_watches_are_synced_then_the_first_result_does() {
        let mut bench = Bench::start();
        bench.wakeups.changed.notify_one();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap(), "not synced: nothing published");
        // The first result goes out even though it equals the channel's initial value.
        bench.set(PoolCapacity::default(), false);
        assert_eq!(bench.next().await, (PoolCapacity::default(), Duration::ZERO));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_after_a_quiet_spell_goes_out_at_once() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await, (pool("100", "8", "3"), Duration::ZERO));
        // The same capacity again: nothing is sent.
        bench.set(pool("100", "8", "3"), false);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap());
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_coalesced_into_one_computation_after_the_spacing() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        // Two more changes right after: one computation, COALESCE after the last, sees the
        // later of them.
        bench.set(pool("100", "8", "4"), false);
        bench.set(pool("100", "8", "5"), false);
        assert_eq!(bench.next().await, (pool("100", "8", "5"), COALESCE));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!bench.rx.has_changed().unwrap(), "the burst cost one publication");
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_drift_waits_for_the_publication_interval() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        // Computed after the spacing, deferred as a drift, published when the wake-up for
        // waiting drifts comes.
        bench.set(pool("100.5", "8", "3"), false);
        assert_eq!(bench.next().await, (pool("100.5", "8", "3"), COALESCE + PUBLISH_MAX_INTERVAL));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn moving_online_demand_shortens_the_spacing() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        bench.set(pool("100", "8", "3"), false);
        assert_eq!(bench.next().await.1, Duration::ZERO);
        bench.set(pool("100", "6", "3"), true);
        assert_eq!(bench.next().await, (pool("100", "6", "3"), COALESCE_SHORT));
        bench.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_pool_goes_out_at_once_and_keeps_the_spacing_short() {
        let mut bench = Bench::start();
        bench.settled(pool("100", "8", "2")).await;
        // Online demand took GPUs offload pods use: the deficit goes out at once.
        bench.set(pool("100", "1", "2"), false);
        assert_eq!(bench.next().await, (pool("100", "1", "2"), Duration::ZERO));
        // While short, the next change follows after the short spacing, demand flag or not.
        bench.set(pool("100", "0", "2"), false);
        assert_eq!(bench.next().await, (pool("100", "0", "2"), COALESCE_SHORT));
        bench.stop().await;
    }

    #[test]
    fn a_costly_computation_waits_longer_for_the_next() {
        assert_eq!(coalesce_after(Duration::from_millis(1), false), COALESCE);
        assert_eq!(coalesce_after(Duration::from_millis(30), false), Duration::from_millis(300));
        assert_eq!(coalesce_after(Duration::from_secs(5), false), COALESCE_MAX);
        // Online demand moving (a pool short, an HPA or workload changed): the next
        // computation follows sooner, cost permitting.
        assert_eq!(coalesce_after(Duration::from_millis(1), true), COALESCE_SHORT);
        assert_eq!(coalesce_after(Duration::from_millis(30), true), Duration::from_millis(300));
    }
}
