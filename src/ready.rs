//! What `/readyz` says ([`Readiness`]) and how the active replica gets there ([`follow`]).
//!
//! A replica is ready once connected to the training cluster and, if it is the active one,
//! once what it acts on is complete: the shared training pod cache has listed every pod,
//! and every selected `MemberCluster` has either a session whose pools have their first
//! capacity (computed from complete member watches) or been judged by the controller
//! without one (unreachable, bad Secret: its status says why; it does not hold the replica
//! back). Sharded, only the members this replica owns are waited for. A standby replica is
//! ready once connected, so a rollout does not wait for
//! leadership. Readiness is not liveness: `/healthz` answers as long as the process runs.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use tidepool_api::MemberCluster;
use tidepool_api::MemberName;
use tidepool_api::metrics::{MemberLabels, metrics};
use tidepool_federation::{Members, TrainingPods};
use tokio::sync::watch;
use tracing::{debug, info};

/// How often the active replica looks again while it syncs.
const POLL: Duration = Duration::from_secs(1);

/// The `/readyz` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Connecting,
    /// Connected, waiting for leadership.
    Standby,
    /// Active, its caches still filling: what it waits for.
    Syncing(String),
    Ready,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Standby | Readiness::Ready)
    }

    /// The response body, one line.
    pub fn body(&self) -> String {
        match self {
            Readiness::Connecting => "not ready: connecting to the training cluster".to_owned(),
            Readiness::Standby => "standby".to_owned(),
            Readiness::Syncing(what) => format!("not ready: waiting for {what}"),
            Readiness::Ready => "ok".to_owned(),
        }
    }
}

/// How far one selected member has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberSync {
    /// A session, every pool's capacity computed once.
    Synced,
    /// Judged by the controller, no session: it is not to be waited for.
    Judged,
    /// Not judged yet, or a session whose watches are still listing.
    Pending,
}

/// What the active replica has seen of its caches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    pub pods_listed: bool,
    /// The selected `MemberCluster`s and how far each has come, or why they could not be
    /// listed.
    pub members: Result<Vec<(String, MemberSync)>, String>,
}

/// The readiness of a replica: `connected` to the training cluster, `active` (leading, or
/// leader election off), with `progress` of its caches. Pure.
pub fn decide(connected: bool, active: bool, progress: &Progress) -> Readiness {
    if !connected {
        return Readiness::Connecting;
    }
    if !active {
        return Readiness::Standby;
    }
    let mut waiting = Vec::new();
    if !progress.pods_listed {
        waiting.push("the training pod cache".to_owned());
    }
    match &progress.members {
        Err(error) => waiting.push(format!("the MemberCluster list ({error})")),
        Ok(members) => {
            let pending: Vec<&str> =
                members.iter().filter(|(_, s)| *s == MemberSync::Pending).map(|(n, _)| n.as_str()).collect();
            if !pending.is_empty() {
                waiting.push(format!("member {}", pending.join(", ")));
            }
        }
    }
    if waiting.is_empty() { Readiness::Ready } else { Readiness::Syncing(waiting.join("; ")) }
}

/// How far member `name` has come, from the federation's published sessions. Sharded,
/// `owned` is what this replica owns now: another replica's member is not waited for here.
fn member_sync(name: &str, members: &Members, owned: Option<&BTreeSet<MemberName>>) -> MemberSync {
    let name_ = MemberName::new(name);
    if owned.is_some_and(|owned| !owned.contains(&name_)) {
        return MemberSync::Judged;
    }
    if let Some(member) = members.get(&name_) {
        // Each pool's capacity channel gets its first value from complete watches (see
        // `Session::wait_synced`); nobody marks the handle's own receiver as seen. A closed
        // channel is a session that ended: nothing to wait for.
        let synced = member.pools.iter().all(|p| !matches!(p.capacity.has_changed(), Ok(false)));
        return if synced { MemberSync::Synced } else { MemberSync::Pending };
    }
    // The controller sets the member's `tidepool_member_ready` series at the end of every
    // reconcile that reached a verdict (federation/src/controller.rs): a series without a
    // session is a member it has tried and could not connect.
    if metrics().member_ready.get(&MemberLabels { member: name.to_owned() }).is_some() {
        MemberSync::Judged
    } else {
        MemberSync::Pending
    }
}

/// Watches the active replica's caches fill and publishes its readiness on `ready` until
/// it is ready (it stays so: later trouble is the members' status and the metrics' to
/// report, not a reason to take a working replica out of its Service).
pub async fn follow(
    ready: watch::Sender<Readiness>,
    training: Client,
    member_selector: Option<String>,
    (members, owned): (watch::Receiver<Members>, Option<watch::Receiver<BTreeSet<MemberName>>>),
    pods: TrainingPods,
) {
    let api = Api::<MemberCluster>::all(training);
    let mut params = ListParams::default();
    if let Some(selector) = &member_selector {
        params = params.labels(selector);
    }
    let listed = pods.listed();
    tokio::pin!(listed);
    let mut pods_listed = false;
    loop {
        tokio::select! {
            () = &mut listed, if !pods_listed => pods_listed = true,
            () = tokio::time::sleep(POLL) => {}
        }
        let selected = api
            .list_metadata(&params)
            .await
            .map(|list| list.items.iter().map(|m| m.name_any()).collect::<Vec<_>>())
            .map_err(|e| e.to_string());
        let progress = {
            let members = members.borrow();
            let owned = owned.as_ref().map(|o| o.borrow().clone());
            Progress {
                pods_listed,
                members: selected.map(|names| {
                    names
                        .into_iter()
                        .map(|name| {
                            let sync = member_sync(&name, &members, owned.as_ref());
                            (name, sync)
                        })
                        .collect()
                }),
            }
        };
        let readiness = decide(true, true, &progress);
        let done = readiness == Readiness::Ready;
        if ready.send_if_modified(|current| {
            let changed = *current != readiness;
            *current = readiness.clone();
            changed
        }) {
            debug!(readiness = %readiness.body(), "readiness changed");
        }
        if done {
            info!("ready: training pods listed, every member synced or judged");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(pods_listed: bool, members: &[(&str, MemberSync)]) -> Progress {
        Progress { pods_listed, members: Ok(members.iter().map(|(n, s)| (n.to_string(), *s)).collect()) }
    }

    #[test]
    fn readiness_follows_connection_role_and_caches() {
        use MemberSync::*;
        let all_synced = progress(true, &[("a", Synced), ("b", Synced)]);
        let cases = [
            ("not connected is not ready, whatever else", decide(false, true, &all_synced), Readiness::Connecting),
            (
                "a connected standby is ready without any cache",
                decide(true, false, &progress(false, &[("a", Pending)])),
                Readiness::Standby,
            ),
            ("active with everything synced is ready", decide(true, true, &all_synced), Readiness::Ready),
            (
                "active with no member at all is ready once pods are listed",
                decide(true, true, &progress(true, &[])),
                Readiness::Ready,
            ),
            (
                "active before the pod cache has listed waits for it",
                decide(true, true, &progress(false, &[("a", Synced)])),
                Readiness::Syncing("the training pod cache".into()),
            ),
            (
                "active waits for every pending member, named",
                decide(true, true, &progress(true, &[("a", Pending), ("b", Synced), ("c", Pending)])),
                Readiness::Syncing("member a, c".into()),
            ),
            (
                "a member judged without a session does not hold readiness back",
                decide(true, true, &progress(true, &[("a", Judged), ("b", Synced)])),
                Readiness::Ready,
            ),
            (
                "both waits are named",
                decide(true, true, &progress(false, &[("a", Pending)])),
                Readiness::Syncing("the training pod cache; member a".into()),
            ),
            (
                "members that cannot be listed are waited for",
                decide(true, true, &Progress { pods_listed: true, members: Err("forbidden".into()) }),
                Readiness::Syncing("the MemberCluster list (forbidden)".into()),
            ),
        ];
        for (case, got, want) in cases {
            assert_eq!(got, want, "{case}");
        }
    }

    #[test]
    fn only_standby_and_ready_answer_ready_and_standby_says_so() {
        assert!(Readiness::Ready.is_ready() && Readiness::Standby.is_ready());
        assert!(!Readiness::Connecting.is_ready() && !Readiness::Syncing("x".into()).is_ready());
        assert_eq!(Readiness::Standby.body(), "standby");
        assert_eq!(Readiness::Ready.body(), "ok");
        assert_eq!(Readiness::Syncing("member a".into()).body(), "not ready: waiting for member a");
    }

    #[test]
    fn a_member_the_controller_has_not_judged_is_pending_and_a_judged_one_is_not() {
        let members = Members::new();
        let name = "ready-test-member-judged";
        assert_eq!(member_sync(name, &members, None), MemberSync::Pending);
        metrics().member_ready.get_or_create(&MemberLabels { member: name.to_owned() }).set(0);
        assert_eq!(member_sync(name, &members, None), MemberSync::Judged);
        metrics().forget_member(name);
    }

    #[test]
    fn sharded_a_member_another_replica_owns_is_not_waited_for_and_an_owned_one_is() {
        let members = Members::new();
        let (mine, theirs) = ("ready-test-owned", "ready-test-elsewhere");
        let owned = BTreeSet::from([MemberName::new(mine)]);
        assert_eq!(member_sync(theirs, &members, Some(&owned)), MemberSync::Judged);
        assert_eq!(member_sync(mine, &members, Some(&owned)), MemberSync::Pending);
    }
}
