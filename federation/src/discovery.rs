//! What a member's API server serves, read through discovery (which every authenticated
//! identity may read, so tidepool needs no right on CRDs).

use kube::Client;

/// Whether the member serves the PodGroups of `scheduler` (its CRD is installed): `Ok(false)`
/// when the API group or the resource is unknown there. Read through discovery, which every
/// authenticated identity may read, so tidepool needs no right on CRDs.
pub async fn serves_pod_groups(
    client: &Client,
    scheduler: tidepool_api::crd::GangScheduler,
) -> Result<bool, kube::Error> {
    let (group, version, plural) = scheduler.pod_group_api();
    serves(client, &format!("{group}/{version}"), plural).await
}

/// Whether `client`'s server serves resource `plural` of `group_version`, through discovery:
/// `Ok(false)` when the group, its version or the resource is unknown there.
pub async fn serves(client: &Client, group_version: &str, plural: &str) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == plural)),
        Err(e) if crate::api_code(&e, &[404]) => Ok(false),
        Err(e) => Err(e),
    }
}
