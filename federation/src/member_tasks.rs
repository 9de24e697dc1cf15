//! The tasks of one member's session, supervised.
//!
//! A member's session runs several tasks for as long as it lives: the health probe, one watch
//! per kind feeding the capacity model, the capacity publisher, the eviction-request watch,
//! and vk-provider's pod sync helpers and Service mirror for that member. Each is spawned
//! through the session's [`MemberTasks`]: one that ends or panics while the session lives
//! leaves the member's numbers stale (a watch that stopped keeps its last views, a publisher
//! its last capacity), so it is never left to do that silently: the member is marked not
//! healthy ([`Health::stopped`]: its virtual nodes turn `Ready=False`, nothing new is placed
//! there), the stop is logged and counted (`tidepool_member_task_stops_total`), and the
//! `MemberCluster` controller starts a new session in its place. Tasks ending because the
//! session was stopped are the normal end. Dropping the session's last [`MemberTasks`]
//! aborts what is left.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use tidepool_api::MemberName;
use tidepool_api::metrics::metrics;
use tidepool_api::sync::Locked;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info_span};

use crate::health::Health;

/// Spawns and watches the tasks of one member's session. Cheap to clone.
#[derive(Clone, Debug)]
pub struct MemberTasks {
    member: MemberName,
    health: watch::Sender<Health>,
    cancelled: CancellationToken,
    running: Arc<Running>,
}

/// The tasks spawned, aborted when the last [`MemberTasks`] goes.
#[derive(Debug, Default)]
struct Running(Mutex<Vec<AbortHandle>>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(tasks) = self.0.get_mut() {
            tasks.iter().for_each(AbortHandle::abort);
        }
    }
}

impl MemberTasks {
    /// The tasks of `member`'s session, which `cancelled` stops and whose health `health`
    /// carries.
    pub(crate) fn new(member: MemberName, health: watch::Sender<Health>, cancelled: CancellationToken) -> Self {
        Self { member, health, cancelled, running: Arc::default() }
    }

    /// Stops with the session.
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancelled
    }

    /// Runs `task`, named `what` (in logs, the metric and the member's health), for as long
    /// as the session. It should end once [`MemberTasks::cancelled`] fires; ending or
    /// panicking before marks the member (see the module docs).
    pub fn spawn<F>(&self, what: &'static str, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.spawn_until(what, &self.cancelled.clone(), task);
    }

    /// [`MemberTasks::spawn`] for a task with a shorter life of its own: ending once `stop`
    /// (a child of [`MemberTasks::cancelled`], say) fired is its normal end too.
    pub fn spawn_until<F>(&self, what: &'static str, stop: &CancellationToken, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (member, health, cancelled) = (self.member.clone(), self.health.clone(), stop.clone());
        let span = info_span!("member_task", member = %self.member, task = what);
        let handle = tokio::spawn(
            async move {
                let ended = AssertUnwindSafe(task).catch_unwind().await;
                if cancelled.is_cancelled() {
                    return;
                }
                let how = if ended.is_ok() { "ended" } else { "panicked" };
                stopped(&member, &health, what, how);
            }
            .instrument(span),
        );
        match self.running.0.locked("member tasks") {
            Ok(mut running) => {
                running.retain(|t| !t.is_finished());
                running.push(handle.abort_handle());
            }
            // The task still runs; only the abort at the end is lost, and the session's
            // cancellation stops it anyway.
            Err(e) => error!(error = %e, "member task not recorded"),
        }
    }
}

/// Marks the member's health with the first task that stopped, and counts it.
fn stopped(member: &MemberName, health: &watch::Sender<Health>, what: &str, how: &str) {
    let why = format!("tidepool's {what} task for this member {how}; a new session replaces this one");
    error!(member = %member, task = what, how, "member task stopped while its session runs");
    metrics().count_member_task_stop(member.as_str(), what);
    health.send_if_modified(|h| {
        let first = h.stopped.is_none();
        if first {
            h.stopped = Some(why);
        }
        first
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tasks() -> (MemberTasks, watch::Receiver<Health>) {
        let (tx, rx) = watch::channel(Health::default());
        (MemberTasks::new(MemberName::new("m".to_owned()), tx, CancellationToken::new()), rx)
    }

    async fn changed(rx: &mut watch::Receiver<Health>) -> Health {
        tokio::time::timeout(Duration::from_secs(5), rx.changed()).await.unwrap().unwrap();
        rx.borrow().clone()
    }

    #[tokio::test]
    async fn a_task_that_ends_while_the_session_runs_marks_the_member_not_healthy() {
        let (tasks, mut rx) = tasks();
        tasks.spawn("capacity publisher", async {});
        let health = changed(&mut rx).await;
        assert!(!health.is_healthy(), "{health:?}");
        assert!(health.stopped.unwrap().contains("capacity publisher task for this member ended"));
    }

    #[tokio::test]
    async fn a_panic_is_caught_and_told_and_the_first_stop_is_kept() {
        let (tasks, mut rx) = tasks();
        tasks.spawn("pod watch", async { panic!("boom") });
        assert!(changed(&mut rx).await.stopped.unwrap().contains("pod watch task for this member panicked"));
        tasks.spawn("node watch", async {});
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(rx.borrow().stopped.as_ref().unwrap().contains("pod watch"), "the first stop stays");
    }

    #[tokio::test]
    async fn tasks_ending_with_the_session_are_the_normal_end_and_dropping_aborts_the_rest() {
        let (tasks, rx) = tasks();
        let stop = tasks.cancelled().clone();
        tasks.spawn("pod watch", async move { stop.cancelled().await });
        let (tx, mut forever) = tokio::sync::mpsc::channel::<()>(1);
        tasks.spawn("forever", async move {
            let _tx = tx;
            std::future::pending::<()>().await
        });
        let scoped = tasks.cancelled().child_token();
        let until = scoped.clone();
        tasks.spawn_until("namespace watch", &scoped, async move { until.cancelled().await });
        scoped.cancel();
        tasks.cancelled().cancel();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(rx.borrow().stopped, None);
        drop(tasks);
        // The aborted task dropped its sender.
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), forever.recv()).await.unwrap(), None);
    }
}
