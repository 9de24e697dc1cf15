//! `tidepool status`: the bridge at a glance in a terminal — members and their pools
//! (capacity, used, deficit), gangs waiting and placed, reclaims in progress. Reads only the
//! training cluster: everything tidepool decides is recorded there.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use tidepool_api::resources::{format_milli, parse_milli};
use tidepool_api::{MemberCluster, keys};

use crate::kubectl::{JobRow, ReclaimRow, bar};

const GPU: &str = "nvidia.com/gpu";

fn amount(map: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>, name: &str) -> i64 {
    map.get(name).and_then(|q| parse_milli(&q.0).ok()).unwrap_or(0)
}

/// The status of the bridge as the training cluster records it: reads the MemberClusters and
/// the pods, then [`format`]s them.
pub async fn render(client: Client, scheduler_name: &str) -> anyhow::Result<String> {
    let members = Api::<MemberCluster>::all(client.clone()).list(&ListParams::default()).await?;
    let pods = Api::<Pod>::all(client).list(&ListParams::default()).await?;
    Ok(format(&members.items, &pods.items, scheduler_name, jiff::Timestamp::now())?)
}

/// The whole text of `tidepool status`. Pure.
pub fn format(
    members: &[MemberCluster],
    pods: &[Pod],
    scheduler_name: &str,
    now: jiff::Timestamp,
) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    members_section(&mut out, members)?;
    let ours = pods.iter().filter(|p| {
        crate::kubectl::live(p) && p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()) == Some(scheduler_name)
    });
    gangs_section(&mut out, &crate::kubectl::gangs(ours, now))?;
    reclaims_section(&mut out, &crate::kubectl::reclaims(pods, now))?;
    Ok(out)
}

/// Each member, its readiness and each pool's GPU and CPU: used of what it lends.
fn members_section(out: &mut String, members: &[MemberCluster]) -> std::fmt::Result {
    writeln!(out, "MEMBERS")?;
    for m in members {
        let status = m.status.clone().unwrap_or_default();
        let ready = status.conditions.iter().find(|c| c.type_ == keys::CONDITION_READY);
        let state = ready.map_or("Unknown".to_owned(), |c| {
            if c.status == "True" { "Ready".to_owned() } else { format!("NotReady ({}: {})", c.reason, c.message) }
        });
        let paused = if m.spec.paused { " [paused]" } else { "" };
        writeln!(out, "  {}{paused}  {state}", m.name_any())?;
        for p in &status.pools {
            for (name, label) in [(GPU, "gpu"), ("cpu", "cpu")] {
                let (cap, used, deficit) = (amount(&p.capacity, name), amount(&p.used, name), amount(&p.deficit, name));
                if cap == 0 && used == 0 {
                    continue;
                }
                let deficit = if deficit > 0 { format!("  deficit {}", format_milli(deficit)) } else { String::new() };
                let (bar, used, cap) = (bar(used, cap, 24), format_milli(used), format_milli(cap));
                writeln!(out, "    {:<36} {label:<3} [{bar}] {used:>6} / {cap:<6}{deficit}", p.virtual_node)?;
            }
        }
    }
    Ok(())
}

/// The gangs (rows of `kubectl tidepool jobs`): placed ones with their nodes and the elastic
/// pods still waiting, then those with no pod placed and why.
fn gangs_section(out: &mut String, gangs: &[JobRow]) -> std::fmt::Result {
    writeln!(out, "\nGANGS PLACED")?;
    for g in gangs.iter().filter(|g| g.placed > 0) {
        let pending = g.pods - g.placed;
        let waiting = if pending > 0 { format!(" (+{pending} elastic waiting)") } else { String::new() };
        writeln!(out, "  {:<48} {:>4} pods on {}{waiting}", g.gang, g.placed, g.nodes.join(","))?;
    }
    writeln!(out, "\nGANGS WAITING")?;
    for g in gangs.iter().filter(|g| g.placed == 0) {
        writeln!(out, "  {:<48} {:>4} pods  {}", g.gang, g.pods, g.waiting.as_deref().unwrap_or("not yet considered"))?;
    }
    Ok(())
}

/// Every live pod under a reclaim notice (rows of `kubectl tidepool reclaims`): its band,
/// node, deadline and whether it acked.
fn reclaims_section(out: &mut String, reclaims: &[ReclaimRow]) -> std::fmt::Result {
    writeln!(out, "\nRECLAIMS IN PROGRESS")?;
    for r in reclaims {
        let left = match r.seconds_left {
            Some(secs) if secs > 0 => format!("{secs}s left"),
            Some(_) => "deadline passed".to_owned(),
            None => String::new(),
        };
        let acked = if r.acknowledged { ", checkpoint acked" } else { "" };
        let node = if r.node.is_empty() { "?" } else { &r.node };
        writeln!(
            out,
            "  {}/{} band {} on {node}: deadline {} ({left}{acked})",
            r.namespace, r.pod, r.band, r.deadline
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, ready: (&str, &str, &str), pools: serde_json::Value) -> MemberCluster {
        let (status, reason, message) = ready;
        serde_json::from_value(serde_json::json!({
            "apiVersion": "tidepool.io/v1alpha1", "kind": "MemberCluster",
            "metadata": {"name": name},
            "spec": {"kubeconfigSecretRef": {"name": "k", "namespace": "tidepool-system"}},
            "status": {"conditions": [{"type": "Ready", "status": status, "reason": reason, "message": message,
                                       "lastTransitionTime": "2026-12-05T10:00:00Z"}],
                       "pools": pools},
        }))
        .unwrap()
    }

    fn pod(name: &str, gang: &str, node: Option<&str>, extra: serde_json::Value) -> Pod {
        let mut pod = serde_json::json!({
            "metadata": {"name": name, "namespace": "team", "labels": {"tidepool.io/band": "low"},
                         "annotations": {"tidepool.io/gang": gang}},
            "spec": {"schedulerName": "tidepool", "nodeName": node, "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": if node.is_some() { "Running" } else { "Pending" }},
        });
        json_merge(&mut pod, extra);
        serde_json::from_value(pod).unwrap()
    }

    fn json_merge(into: &mut serde_json::Value, from: serde_json::Value) {
        match (into, from) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    json_merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (slot, v) => *slot = v,
        }
    }

    /// `tidepool status` as an operator reads it (deploy/docs/operations.md): each member's
    /// readiness and pools, placed gangs with their elastic pods waiting, waiting gangs with
    /// the dispatcher's reason, and reclaims under way; ended pods and other schedulers'
    /// pods are left out.
    #[test]
    fn the_status_shows_members_gangs_and_reclaims() {
        let members = [
            member(
                "member-a",
                ("True", "Connected", ""),
                serde_json::json!([{
                "name": "default", "virtualNode": "tidepool-member-a", "nodes": 2,
                "capacity": {"cpu": "8", "nvidia.com/gpu": "4"}, "used": {"cpu": "6", "nvidia.com/gpu": "4"},
                "deficit": {"cpu": "500m"}}]),
            ),
            member("member-b", ("False", "Unreachable", "dial tcp: refused"), serde_json::json!([])),
        ];
        let waiting = serde_json::json!({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "gang team/big: 3 of 4 pods fit on no pool"}]}});
        let noticed = serde_json::json!({"metadata": {"annotations": {
            "tidepool.io/reclaim-deadline": "2026-12-05T10:01:00Z", "tidepool.io/checkpoint-done": "step=40"}}});
        let pods = [
            pod("ps-0", "ctr", Some("tidepool-member-a"), noticed),
            pod("worker-0", "ctr", Some("tidepool-member-a"), serde_json::json!({})),
            pod("worker-1", "ctr", None, serde_json::json!({})),
            pod("big-0", "big", None, waiting),
            pod("done-0", "done", Some("tidepool-member-a"), serde_json::json!({"status": {"phase": "Succeeded"}})),
            pod("other-0", "other", None, serde_json::json!({"spec": {"schedulerName": "default-scheduler"}})),
        ];
        let now: jiff::Timestamp = "2026-12-05T10:00:30Z".parse().unwrap();
        let text = format(&members, &pods, "tidepool", now).unwrap();
        let expected = [
            "MEMBERS",
            "  member-a  Ready",
            "    tidepool-member-a                    gpu [########################]      4 / 4     ",
            "    tidepool-member-a                    cpu [##################......]      6 / 8       deficit 500m",
            "  member-b  NotReady (Unreachable: dial tcp: refused)",
            "",
            "GANGS PLACED",
            "  team/gang/ctr                                       2 pods on tidepool-member-a (+1 elastic waiting)",
            "",
            "GANGS WAITING",
            "  team/gang/big                                       1 pods  gang team/big: 3 of 4 pods fit on no pool",
            "",
            "RECLAIMS IN PROGRESS",
            "  team/ps-0 band low on tidepool-member-a: deadline 2026-12-05T10:01:00Z (30s left, checkpoint acked)",
            "",
        ];
        assert_eq!(text, expected.join("\n"));
    }
}
