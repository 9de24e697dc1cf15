//! The long-running tasks of `tidepool run`, joined by the binary: none dies silently.
//!
//! Each component registers its controllers as named tasks of one [`Tasks`] set. One that
//! ends, or panics, ends the process with an error naming it, and the Deployment restarts the
//! pod: a controller that quietly stopped would leave its virtual nodes Ready and its pods
//! unsynced. A panic anywhere else (a task of a task, one kubelet API connection) stays in its
//! task, as tokio keeps it, but never silently: [`count_panics`] logs it and counts it in
//! `tidepool_panics_total`. That is not made fatal on purpose: a request that made one
//! connection's task panic must not take down the bridge of every member. A lock such a task
//! held is poisoned, and the code that takes it next returns an error
//! ([`tidepool_api::sync`]) rather than read what the panic left half-written.
//!
//! At shutdown, [`Supervisor::stop`] cancels the stop token: the pod sync starts no new
//! reconcile and finishes those in flight (kube's `graceful_shutdown_on`); what still runs
//! after [`SHUTDOWN_GRACE`] is aborted, which abandons a request cleanly (the API server
//! applies it whole or not at all).

use std::time::Duration;

use tidepool_federation::tasks::Tasks;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// How long the writers get to finish what they are doing at shutdown.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The tasks that write, waited for at shutdown; the others only read and are aborted.
const WRITERS: [&str; 1] = ["pod-sync"];

/// The components' tasks and the token they stop on.
#[derive(Default)]
pub struct Supervisor {
    pub tasks: Tasks,
    stop: CancellationToken,
}

impl Supervisor {
    /// The token the writers stop on.
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Waits for the first task to end: always an error, since each is meant to run as long
    /// as the process.
    pub async fn failure(&mut self) -> anyhow::Error {
        let ended = self.tasks.first_end().await;
        error!(%ended, "a controller task stopped; exiting so the pod restarts");
        anyhow::anyhow!("controller {ended}; exiting so the pod restarts")
    }

    /// Cancels the stop token, waits up to [`SHUTDOWN_GRACE`] for the writers to end, then
    /// aborts everything left.
    pub async fn stop(mut self) {
        self.stop.cancel();
        let waited = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while self.tasks.running().iter().any(|t| WRITERS.contains(t)) {
                let ended = self.tasks.first_end().await;
                info!(%ended, "stopped");
            }
        });
        if waited.await.is_err() {
            warn!(tasks = ?self.tasks.running(), "still running at the end of the shutdown grace; aborted");
        }
        self.tasks.abort_all();
    }
}

/// Logs every panic at error level and counts it in `tidepool_panics_total`, after the
/// default report. Installed by `tidepool run` only.
pub fn count_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        error!(panic = %info, "a task panicked");
        tidepool_api::metrics::metrics().panics.inc();
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn a_controller_that_ends_is_a_failure_naming_it() {
        let mut s = Supervisor::default();
        s.tasks.spawn("federation", std::future::pending());
        s.tasks.spawn("dispatcher", async {});
        let failure = s.failure().await.to_string();
        assert_eq!(failure, "controller task dispatcher ended; exiting so the pod restarts");
    }

    #[tokio::test(start_paused = true)]
    async fn stop_lets_the_pod_sync_finish_and_aborts_the_readers() {
        let mut s = Supervisor::default();
        let (token, finished) = (s.stop_token(), Arc::new(AtomicBool::new(false)));
        let done = finished.clone();
        s.tasks.spawn("pod-sync", async move {
            token.cancelled().await;
            // The write in flight, finishing within the grace.
            tokio::time::sleep(Duration::from_secs(2)).await;
            done.store(true, Ordering::SeqCst);
        });
        let (reader_tx, mut reader_gone) = tokio::sync::mpsc::channel::<()>(1);
        s.tasks.spawn("training-pods", async move {
            let _alive = reader_tx;
            std::future::pending::<()>().await;
        });
        let started = tokio::time::Instant::now();
        s.stop().await;
        assert!(finished.load(Ordering::SeqCst), "the pod sync finished its write");
        assert_eq!(started.elapsed(), Duration::from_secs(2), "no longer than the writer needed");
        assert_eq!(reader_gone.recv().await, None, "the reader was aborted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_writer_that_overstays_the_grace_is_aborted() {
        let mut s = Supervisor::default();
        s.tasks.spawn("pod-sync", std::future::pending());
        let started = tokio::time::Instant::now();
        s.stop().await;
        assert_eq!(started.elapsed(), SHUTDOWN_GRACE);
    }
}
