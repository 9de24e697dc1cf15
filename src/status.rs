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

const GPU: &str = "nvidia.com/gpu";

/// A bar of `width` cells filled in proportion to `used` of `total`; a pool using more than
/// it may lend ends in `!` (the deficit is printed next to it).
pub fn bar(used: i64, total: i64, width: usize) -> String {
    if total <= 0 {
        return if used > 0 { "!".repeat(width) } else { ".".repeat(width) };
    }
    let filled = ((used.clamp(0, total) as i128 * width as i128) / total as i128) as usize;
    let mut cells: Vec<char> = "#".repeat(filled).chars().chain(".".repeat(width - filled).chars()).collect();
    if used > total
        && let Some(last) = cells.last_mut()
    {
        *last = '!';
    }
    cells.into_iter().collect()
}

fn amount(map: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>, name: &str) -> i64 {
    map.get(name).and_then(|q| parse_milli(&q.0).ok()).unwrap_or(0)
}

pub async fn render(client: Client, scheduler_name: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    let members = Api::<MemberCluster>::all(client.clone()).list(&ListParams::default()).await?;
    writeln!(out, "MEMBERS")?;
    for m in &members.items {
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
                writeln!(
                    out,
                    "    {:<36} {label:<3} [{}] {:>6} / {:<6}{deficit}",
                    p.virtual_node,
                    bar(used, cap, 24),
                    format_milli(used),
                    format_milli(cap)
                )?;
            }
        }
    }

    let pods = Api::<Pod>::all(client).list(&ListParams::default()).await?;
    let live = |p: &Pod| {
        p.metadata.deletion_timestamp.is_none()
            && !matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
    };
    let ours: Vec<&Pod> = pods
        .items
        .iter()
        .filter(|p| live(p) && p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()) == Some(scheduler_name))
        .collect();
    let mut gangs: BTreeMap<String, (usize, usize, Option<String>, Option<String>)> = BTreeMap::new();
    for p in &ours {
        let key = tidepool_dispatcher::gang::gang_of_pod(p).to_string();
        let e = gangs.entry(key).or_default();
        match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            Some(node) => {
                e.0 += 1;
                e.2 = Some(node);
            }
            None => {
                e.1 += 1;
                let why = p.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|cs| {
                    cs.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False").and_then(|c| c.message.clone())
                });
                if why.is_some() {
                    e.3 = why;
                }
            }
        }
    }
    writeln!(out, "\nGANGS PLACED")?;
    for (key, (bound, pending, node, _)) in gangs.iter().filter(|(_, g)| g.0 > 0) {
        let waiting = if *pending > 0 { format!(" (+{pending} elastic waiting)") } else { String::new() };
        writeln!(out, "  {key:<48} {bound:>4} pods on {}{waiting}", node.as_deref().unwrap_or("?"))?;
    }
    writeln!(out, "\nGANGS WAITING")?;
    for (key, (_, pending, _, why)) in gangs.iter().filter(|(_, g)| g.0 == 0) {
        writeln!(out, "  {key:<48} {pending:>4} pods  {}", why.as_deref().unwrap_or("not yet considered"))?;
    }
    writeln!(out, "\nRECLAIMS IN PROGRESS")?;
    let now = jiff::Timestamp::now();
    for p in pods.items.iter().filter(|p| live(p)) {
        let Some(deadline) = p.annotations().get(keys::ANNOTATION_RECLAIM_DEADLINE) else { continue };
        let left = deadline.parse::<jiff::Timestamp>().map_or(String::new(), |d| {
            let secs = d.duration_since(now).as_secs();
            if secs > 0 { format!("{secs}s left") } else { "deadline passed".to_owned() }
        });
        let acked =
            if p.annotations().contains_key(keys::ANNOTATION_CHECKPOINT_DONE) { ", checkpoint acked" } else { "" };
        let band = p.labels().get(keys::LABEL_BAND).cloned().unwrap_or_default();
        writeln!(
            out,
            "  {}/{} band {band} on {}: deadline {deadline} ({left}{acked})",
            p.namespace().unwrap_or_default(),
            p.name_any(),
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("?")
        )?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_show_use_and_overuse() {
        assert_eq!(bar(0, 16, 8), "........");
        assert_eq!(bar(8, 16, 8), "####....");
        assert_eq!(bar(16, 16, 8), "########");
        assert_eq!(bar(20, 16, 8), "#######!");
        assert_eq!(bar(2, 0, 4), "!!!!");
        assert_eq!(bar(0, 0, 4), "....");
    }
}
