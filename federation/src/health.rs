//! Health of a connected member, as every consumer sees it (deploy/docs/architecture.md,
//! "Rules the code keeps"): a session keeps running while its member does not answer, so nothing is torn
//! down by a partition; consumers read [`Health`] instead and hold back.
//!
//! Two writers share one `watch` channel: the session's prober (reachability, refused
//! credentials, the loss timeout) and the `MemberCluster` controller (a Secret or spec that
//! no longer yields a working connection while the old session still runs).

use std::time::Duration;

use kube::Client;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often a connected member's API server is asked for `/version`.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(3);
/// How long one probe may take before it counts as failed.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(4);
/// Failed probes in a row before the member counts as unreachable: one slow answer from a
/// busy API server must not taint its nodes.
pub const FAILURES_BEFORE_UNREACHABLE: u32 = 2;

/// What is wrong with a connected member, if anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    /// Set while probes fail: the last failure, with no secret in it.
    pub unreachable: Option<String>,
    /// Set once the member has been unreachable for `memberLossTimeoutSeconds`, counted from
    /// the first failed probe; cleared when it answers again.
    pub lost: bool,
    /// Set while the member answers but refuses the credentials (401/403).
    pub refused: Option<String>,
    /// Set by the controller while the current Secret or spec cannot be used: (reason,
    /// message). The session keeps the connection it had, but nothing new is placed.
    pub unusable: Option<(String, String)>,
    /// Set when a task of the session ended or panicked while the session ran
    /// ([`crate::member_tasks`]): its numbers would go stale, so nothing new is placed until
    /// the new session that replaces it runs.
    pub stopped: Option<String>,
}

impl Health {
    /// True when the member may get new pods.
    pub fn is_healthy(&self) -> bool {
        self.unreachable.is_none() && self.refused.is_none() && self.unusable.is_none() && self.stopped.is_none()
    }

    /// True when the member's API server is answering with the session's credentials, so
    /// writes to it are worth trying.
    pub fn is_answering(&self) -> bool {
        self.unreachable.is_none() && self.refused.is_none()
    }
}

/// Result of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    Answered,
    Refused(String),
    Failed(String),
}

/// The prober's memory between probes. Pure: [`Prober::observe`] is tested with tables.
#[derive(Debug)]
pub struct Prober {
    loss_timeout: Duration,
    failures: u32,
    first_failure: Option<Instant>,
}

impl Prober {
    pub fn new(loss_timeout: Duration) -> Self {
        Self { loss_timeout, failures: 0, first_failure: None }
    }

    /// Folds one probe result taken at `now` into `health`; true if it changed.
    pub fn observe(&mut self, health: &mut Health, probe: Probe, now: Instant) -> bool {
        let before = health.clone();
        match probe {
            Probe::Answered => {
                self.failures = 0;
                self.first_failure = None;
                health.unreachable = None;
                health.lost = false;
                health.refused = None;
            }
            Probe::Refused(message) => {
                self.failures = 0;
                self.first_failure = None;
                health.unreachable = None;
                health.lost = false;
                health.refused = Some(message);
            }
            Probe::Failed(message) => {
                self.failures = self.failures.saturating_add(1);
                let since = *self.first_failure.get_or_insert(now);
                if self.failures >= FAILURES_BEFORE_UNREACHABLE {
                    health.unreachable = Some(message);
                    health.lost = now.saturating_duration_since(since) >= self.loss_timeout;
                }
            }
        }
        *health != before
    }
}

/// Probes the member every [`PROBE_INTERVAL`] until `stop`, publishing what it finds.
pub async fn run(client: Client, health: watch::Sender<Health>, loss_timeout: Duration, stop: CancellationToken) {
    let mut prober = Prober::new(loss_timeout);
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let probe = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(_)) => Probe::Answered,
            Ok(Err(kube::Error::Api(s))) if s.code == 401 || s.code == 403 => {
                Probe::Refused(format!("the member refused the credentials: {}", s.message))
            }
            Ok(Err(e)) => Probe::Failed(format!("probe failed: {e}")),
            Err(_) => Probe::Failed(format!("no answer within {}s", PROBE_TIMEOUT.as_secs())),
        };
        let now = Instant::now();
        health.send_if_modified(|h| {
            let changed = prober.observe(h, probe, now);
            if changed {
                if h.lost {
                    warn!(reason = "MemberLost", "member unreachable past the loss timeout");
                } else if let Some(why) = &h.unreachable {
                    warn!(reason = "Unreachable", message = %why, "member unreachable");
                } else if let Some(why) = &h.refused {
                    warn!(reason = "Unauthorized", message = %why, "member refuses the credentials");
                } else {
                    info!("member answers again");
                }
            }
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> Probe {
        Probe::Failed("timeout".into())
    }

    #[test]
    fn a_single_slow_answer_does_not_make_a_member_unreachable() {
        let mut p = Prober::new(Duration::from_secs(30));
        let mut h = Health::default();
        let t0 = Instant::now();
        assert!(!p.observe(&mut h, failed(), t0));
        assert!(h.is_healthy());
        assert!(!p.observe(&mut h, Probe::Answered, t0 + PROBE_INTERVAL));
        assert!(!p.observe(&mut h, failed(), t0 + 2 * PROBE_INTERVAL));
        assert!(h.is_healthy());
    }

    #[test]
    fn the_loss_timeout_counts_from_the_first_failed_probe() {
        let mut p = Prober::new(Duration::from_secs(30));
        let mut h = Health::default();
        let t0 = Instant::now();
        p.observe(&mut h, failed(), t0);
        assert!(p.observe(&mut h, failed(), t0 + Duration::from_secs(3)));
        assert!(h.unreachable.is_some() && !h.lost && !h.is_healthy() && !h.is_answering());
        assert!(!p.observe(&mut h, failed(), t0 + Duration::from_secs(29)));
        assert!(!h.lost);
        assert!(p.observe(&mut h, failed(), t0 + Duration::from_secs(30)));
        assert!(h.lost);
        // Back: everything clears, and a later outage counts from its own first failure.
        assert!(p.observe(&mut h, Probe::Answered, t0 + Duration::from_secs(40)));
        assert_eq!(h, Health::default());
        p.observe(&mut h, failed(), t0 + Duration::from_secs(100));
        p.observe(&mut h, failed(), t0 + Duration::from_secs(103));
        assert!(h.unreachable.is_some() && !h.lost);
    }

    #[test]
    fn refused_credentials_are_not_an_outage() {
        let mut p = Prober::new(Duration::from_secs(1));
        let mut h = Health::default();
        let t0 = Instant::now();
        assert!(p.observe(&mut h, Probe::Refused("401".into()), t0));
        assert!(!p.observe(&mut h, Probe::Refused("401".into()), t0 + Duration::from_secs(60)));
        assert!(h.refused.is_some() && h.unreachable.is_none() && !h.lost && !h.is_answering());
    }

    #[test]
    fn an_unusable_secret_holds_placements_but_not_writes() {
        let h = Health { unusable: Some(("KubeconfigInvalid".into(), "bad".into())), ..Default::default() };
        assert!(!h.is_healthy());
        assert!(h.is_answering());
    }
}
