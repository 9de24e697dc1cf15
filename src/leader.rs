//! Lease-based leader election: one active replica at a time.
//!
//! A replica that does not hold the Lease only reads it: it starts no controller and writes
//! nothing else. Expiry is judged on this replica's own clock, from when it last saw the
//! Lease record change (as client-go does), so clock skew between replicas does not matter.
//! The leader renews every retry period; if it cannot renew for a whole lease duration it
//! stops (the process exits and is restarted as a standby), because by then another replica
//! may have taken over.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tidepool_api::bridge::LeaderElectionConfig;
use tidepool_api::metrics::metrics;
use tokio::time::Instant;
use tracing::{info, warn};

/// The part of a Lease that says who holds it; a change of any field is a sign of life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub holder: Option<String>,
    pub renew_time: Option<String>,
    pub transitions: i32,
}

impl Record {
    pub fn of(spec: Option<&LeaseSpec>) -> Self {
        Self {
            holder: spec.and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty()),
            renew_time: spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0.to_string()),
            transitions: spec.and_then(|s| s.lease_transitions).unwrap_or(0),
        }
    }
}

/// What to do after reading the Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No Lease yet: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Released, or not renewed for a whole duration as seen from here: take it over.
    TakeOver,
    /// Someone else holds it and is alive.
    Wait,
}

/// The pure decision. `seen` is the record last observed and when (on our clock) it
/// changed; it is updated here.
pub fn decide(
    current: Option<&Record>,
    me: &str,
    seen: &mut Option<(Record, Instant)>,
    now: Instant,
    duration: Duration,
) -> Step {
    let Some(record) = current else { return Step::Create };
    match &record.holder {
        Some(holder) if holder == me => return Step::Renew,
        None => return Step::TakeOver,
        Some(_) => {}
    }
    match seen {
        Some((last, since)) if last == record => {
            if now.duration_since(*since) >= duration {
                Step::TakeOver
            } else {
                Step::Wait
            }
        }
        _ => {
            *seen = Some((record.clone(), now));
            Step::Wait
        }
    }
}

/// Elects this replica through the Lease `namespace/name`.
#[derive(Debug, Clone)]
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    retry: Duration,
}

impl Elector {
    pub fn new(client: kube::Client, namespace: &str, config: &LeaderElectionConfig, identity: String) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: config.lease_name.clone(),
            identity,
            duration: Duration::from_secs(config.lease_duration_seconds),
            retry: Duration::from_secs(config.retry_period_seconds),
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Returns once this replica holds the Lease. Errors are logged and retried: a standby
    /// waits out API trouble as long as it takes.
    pub async fn acquire(&self) {
        let mut seen = None;
        let mut logged_holder = None;
        loop {
            match self.try_acquire(&mut seen).await {
                Ok(None) => {
                    info!(lease = %self.name, identity = %self.identity, "became the leader");
                    metrics().leader.set(1);
                    return;
                }
                Ok(Some(holder)) => {
                    if logged_holder.as_ref() != Some(&holder) {
                        info!(lease = %self.name, %holder, "standing by: another replica leads");
                        logged_holder = Some(holder);
                    }
                }
                Err(e) => warn!(lease = %self.name, error = %e, "cannot read or write the leader Lease"),
            }
            tokio::time::sleep(self.retry).await;
        }
    }

    /// One round: `Ok(None)` when we now hold the Lease, `Ok(Some(holder))` while someone
    /// else does.
    async fn try_acquire(&self, seen: &mut Option<(Record, Instant)>) -> Result<Option<String>, kube::Error> {
        let lease = self.api.get_opt(&self.name).await?;
        let record = lease.as_ref().map(|l| Record::of(l.spec.as_ref()));
        match decide(record.as_ref(), &self.identity, seen, Instant::now(), self.duration) {
            Step::Create => {
                let lease = Lease {
                    metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                    spec: Some(self.spec(None, 0)),
                };
                self.api.create(&PostParams::default(), &lease).await?;
                Ok(None)
            }
            Step::Renew | Step::TakeOver => {
                let Some(mut lease) = lease else { return Ok(Some(String::new())) };
                let ours = record.as_ref().and_then(|r| r.holder.as_deref()) == Some(self.identity.as_str());
                let transitions = record.map_or(0, |r| r.transitions) + i32::from(!ours);
                let acquired = lease.spec.as_ref().and_then(|s| s.acquire_time.clone()).filter(|_| ours);
                lease.spec = Some(self.spec(acquired, transitions));
                // resourceVersion is kept: a concurrent taker makes this a 409 and we wait.
                self.api.replace(&self.name, &PostParams::default(), &lease).await?;
                Ok(None)
            }
            Step::Wait => Ok(record.and_then(|r| r.holder)),
        }
    }

    fn spec(&self, acquired: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        let now = MicroTime(jiff::Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: i32::try_from(self.duration.as_secs()).ok(),
            acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// Renews the Lease every retry period; returns when leadership is lost: another replica
    /// holds it, or no renewal succeeded for a whole lease duration.
    pub async fn hold(&self) -> String {
        let mut last_renewal = Instant::now();
        loop {
            tokio::time::sleep(self.retry).await;
            match self.renew().await {
                Ok(true) => last_renewal = Instant::now(),
                Ok(false) => return "another replica took the leader Lease".into(),
                Err(e) => {
                    warn!(lease = %self.name, error = %e, "cannot renew the leader Lease");
                    if last_renewal.elapsed() + self.retry >= self.duration {
                        return format!("could not renew the leader Lease for {:?}: {e}", last_renewal.elapsed());
                    }
                }
            }
        }
    }

    async fn renew(&self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else { return Ok(false) };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(false);
        }
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        self.api.replace(&self.name, &PostParams::default(), &lease).await?;
        Ok(true)
    }

    /// Gives the Lease up (clean shutdown), so a standby takes over at once instead of
    /// after a lease duration.
    pub async fn release(&self) {
        metrics().leader.set(0);
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else { return };
        let Some(spec) = lease.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        if let Err(e) = self.api.replace(&self.name, &PostParams::default(), &lease).await {
            warn!(lease = %self.name, error = %e, "cannot release the leader Lease");
        }
    }
}

/// This replica's name: the pod name in a Deployment, else host and process id.
pub fn identity() -> String {
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.is_empty()
    {
        return pod;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}-{}", host.trim(), std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_by(holder: &str, renew: &str) -> Record {
        Record { holder: Some(holder.into()), renew_time: Some(renew.into()), transitions: 0 }
    }

    const D: Duration = Duration::from_secs(10);

    #[test]
    fn missing_lease_is_created_and_own_lease_renewed() {
        let now = Instant::now();
        let mut seen = None;
        assert_eq!(decide(None, "a", &mut seen, now, D), Step::Create);
        assert_eq!(decide(Some(&held_by("a", "t1")), "a", &mut seen, now, D), Step::Renew);
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let released = Record { holder: None, renew_time: None, transitions: 3 };
        assert_eq!(decide(Some(&released), "b", &mut None, Instant::now(), D), Step::TakeOver);
    }

    #[test]
    fn a_live_leader_is_waited_for_and_a_silent_one_replaced_after_a_full_duration() {
        let t0 = Instant::now();
        let mut seen = None;
        // First sight: waits, whatever the remote timestamp says (it may be skewed).
        assert_eq!(decide(Some(&held_by("a", "t1")), "b", &mut seen, t0, D), Step::Wait);
        // Unchanged for less than a duration: still waits.
        assert_eq!(decide(Some(&held_by("a", "t1")), "b", &mut seen, t0 + D / 2, D), Step::Wait);
        // Renewed: the clock restarts.
        assert_eq!(decide(Some(&held_by("a", "t2")), "b", &mut seen, t0 + D - Duration::from_millis(1), D), Step::Wait);
        assert_eq!(decide(Some(&held_by("a", "t2")), "b", &mut seen, t0 + D + D / 2, D), Step::Wait);
        // Silent for a whole duration since the last change: taken over.
        assert_eq!(decide(Some(&held_by("a", "t2")), "b", &mut seen, t0 + 2 * D, D), Step::TakeOver);
    }

    #[test]
    fn a_new_holder_restarts_the_clock() {
        let t0 = Instant::now();
        let mut seen = None;
        assert_eq!(decide(Some(&held_by("a", "t1")), "c", &mut seen, t0, D), Step::Wait);
        assert_eq!(decide(Some(&held_by("b", "t1")), "c", &mut seen, t0 + D, D), Step::Wait);
        assert_eq!(decide(Some(&held_by("b", "t1")), "c", &mut seen, t0 + 2 * D, D), Step::TakeOver);
    }
}
