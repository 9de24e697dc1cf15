//! A member pod's status as the offload cache keeps it: its JSON, deflated against a preset
//! dictionary of what pod statuses have in common.
//!
//! The cache holds one status per mirrored pod and reads it only when the status is copied
//! up (or a copy is found deleting). As plain JSON a Running pod's status is 700–1,000 bytes,
//! nearly all of it keys, condition types and reasons every status repeats; against the
//! dictionary it deflates to about 110 bytes (BENCHMARKS.md, "Memory per mirrored pod:
//! futures and statuses"). Packing and unpacking each take a few microseconds, once per
//! status change and once per status copied up.

use std::cell::RefCell;

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use k8s_openapi::api::core::v1::PodStatus;

/// What statuses share, most common last (deflate reaches the nearest copy most cheaply):
/// the shape of a status as `k8s_openapi` writes it, from real kubelets and kwok alike.
const DICTIONARY: &str = concat!(
    r#"{"allocatedResources":{"cpu":"1","memory":"1Gi","nvidia.com/gpu":"1"},"resources":{"limits":{"cpu":"1","memory":"1Gi"},"requests":{"cpu":"1","memory":"1Gi"}},"#,
    r#""user":{"linux":{"gid":0,"supplementalGroups":[0],"uid":0}},"volumeMounts":[{"mountPath":"/var/run/secrets/kubernetes.io/serviceaccount","name":"kube-api-access-","readOnly":true,"recursiveReadOnly":"Disabled"}]"#,
    r#"{"lastState":{"terminated":{"containerID":"containerd://","exitCode":137,"finishedAt":"2026-01-01T00:00:00Z","reason":"OOMKilled","startedAt":"2026-01-01T00:00:00Z"}},"#,
    r#""state":{"waiting":{"message":"Back-off restarting failed container","reason":"CrashLoopBackOff"}}}"#,
    r#""state":{"terminated":{"containerID":"containerd://","exitCode":0,"finishedAt":"2026-01-01T00:00:00Z","reason":"Completed","startedAt":"2026-01-01T00:00:00Z"}}"#,
    r#""message":"containers with unready status: [main]","reason":"ContainersNotReady","status":"False","type":"ContainersReady"},"#,
    r#""nominatedNodeName":"","qosClass":"BestEffort","qosClass":"Guaranteed","reason":"Evicted","phase":"Pending","phase":"Succeeded","phase":"Failed","#,
    r#"{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"PodReadyToStartContainers"},"#,
    r#"{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"True","type":"Initialized"},"#,
    r#"{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"True","type":"Ready"},"#,
    r#"{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"True","type":"ContainersReady"},"#,
    r#"{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"True","type":"PodScheduled"}],"#,
    r#""containerStatuses":[{"containerID":"containerd://","image":"","imageID":"","lastState":{},"name":"main","ready":true,"restartCount":0,"started":true,"#,
    r#""state":{"running":{"startedAt":"2026-01-01T00:00:00Z"}}}],"#,
    r#""hostIP":"10.0.0.1","hostIPs":[{"ip":"10.0.0.1"}],"observedGeneration":1,"phase":"Running","podIP":"10.244.0.1","podIPs":[{"ip":"10.244.0.1"}],"#,
    r#""qosClass":"Burstable","startTime":"2026-01-01T00:00:00Z"}"#,
);

thread_local! {
    /// One deflate and one inflate state per thread (a deflate state is a few hundred KiB
    /// to set up), reset between uses.
    static CODEC: RefCell<(Compress, Decompress)> =
        RefCell::new((Compress::new(Compression::fast(), false), Decompress::new(false)));
}

/// A pod status, deflated (see the module's documentation).
#[derive(Clone, PartialEq, Eq)]
pub struct PackedStatus {
    /// The JSON's length, so unpacking allocates once.
    len: u32,
    bytes: Box<[u8]>,
}

impl std::fmt::Debug for PackedStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedStatus").field("len", &self.len).field("packed", &self.bytes.len()).finish()
    }
}

impl PackedStatus {
    /// `None` only if the status cannot be written as JSON or deflate fails (neither
    /// happens with a status that came from an API server).
    pub fn pack(status: &PodStatus) -> Option<PackedStatus> {
        let json = serde_json::to_vec(status).ok()?;
        let len = u32::try_from(json.len()).ok()?;
        // Raw deflate can grow incompressible input a little: room for that, and the end.
        let mut out = Vec::with_capacity(json.len() + json.len() / 16 + 64);
        CODEC.with_borrow_mut(|(deflate, _)| {
            deflate.reset();
            deflate.set_dictionary(DICTIONARY.as_bytes()).ok()?;
            match deflate.compress_vec(&json, &mut out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => Some(()),
                _ => None,
            }
        })?;
        Some(PackedStatus { len, bytes: out.into_boxed_slice() })
    }

    /// The status again; `None` if the bytes do not inflate to a status (they always do:
    /// only [`PackedStatus::pack`] makes them).
    pub fn unpack(&self) -> Option<PodStatus> {
        let mut json = Vec::with_capacity(self.len as usize);
        CODEC.with_borrow_mut(|(_, inflate)| {
            inflate.reset(false);
            inflate.set_dictionary(DICTIONARY.as_bytes()).ok()?;
            match inflate.decompress_vec(&self.bytes, &mut json, FlushDecompress::Finish) {
                Ok(Status::StreamEnd) => Some(()),
                _ => None,
            }
        })?;
        serde_json::from_slice(&json).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn status(v: serde_json::Value) -> PodStatus {
        serde_json::from_value(v).unwrap()
    }

    /// A Running pod's status as kwok writes it (read from a member of the e2e clusters).
    fn kwok_running() -> PodStatus {
        status(json!({
            "conditions": [
                {"lastTransitionTime": "2026-12-03T19:16:51Z", "status": "True", "type": "Initialized"},
                {"lastTransitionTime": "2026-12-03T19:16:51Z", "status": "True", "type": "Ready"},
                {"lastTransitionTime": "2026-12-03T19:16:51Z", "status": "True", "type": "ContainersReady"},
                {"lastTransitionTime": "2026-12-03T19:16:51Z", "status": "True", "type": "PodScheduled"}],
            "containerStatuses": [{"image": "example.invalid/trainer:1", "imageID": "", "lastState": {},
                "name": "main", "ready": true, "restartCount": 0,
                "state": {"running": {"startedAt": "2026-12-03T19:16:51Z"}}}],
            "hostIP": "127.0.0.3", "hostIPs": [{"ip": "127.0.0.3"}], "phase": "Running",
            "podIP": "10.244.38.24", "podIPs": [{"ip": "10.244.38.24"}], "qosClass": "Burstable",
            "startTime": "2026-12-03T19:16:51Z"
        }))
    }

    #[test]
    fn a_running_status_comes_back_whole_in_a_sixth_of_its_json() {
        let running = kwok_running();
        let packed = PackedStatus::pack(&running).unwrap();
        assert_eq!(packed.unpack(), Some(running.clone()));
        let json = serde_json::to_vec(&running).unwrap().len();
        assert!(packed.bytes.len() * 6 <= json, "{} bytes packed from {json}", packed.bytes.len());
    }

    #[test]
    fn an_empty_status_and_one_unlike_the_dictionary_come_back_whole() {
        let empty = PodStatus::default();
        assert_eq!(PackedStatus::pack(&empty).unwrap().unpack(), Some(empty));
        let odd = status(json!({"phase": "Failed", "reason": "ὅ τι 🦀", "message": "x".repeat(5000)}));
        assert_eq!(PackedStatus::pack(&odd).unwrap().unpack(), Some(odd));
    }

    #[test]
    fn the_dictionary_fits_deflates_window() {
        assert!(DICTIONARY.len() < 32 * 1024);
    }

    proptest! {
        /// Whatever the member writes, the pod sync reads the same status back.
        #[test]
        fn any_status_round_trips(
            phase in proptest::option::of("[A-Za-z]{0,12}"),
            message in proptest::option::of(".{0,300}"),
            ip in proptest::option::of("[0-9.:a-f]{0,39}"),
            restarts in 0i32..1000,
            names in proptest::collection::vec("[a-z0-9-]{1,20}", 0..5),
        ) {
            let statuses: Vec<_> = names.iter().map(|n| json!({
                "name": n, "image": "img", "imageID": "", "ready": false, "restartCount": restarts,
                "state": {"waiting": {"reason": "ContainerCreating"}}
            })).collect();
            let s = status(json!({"phase": phase, "message": message, "podIP": ip, "containerStatuses": statuses}));
            prop_assert_eq!(PackedStatus::pack(&s).unwrap().unpack(), Some(s));
        }
    }
}
