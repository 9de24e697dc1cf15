//! Member Events, the I/O: one task per member session watches the Events about pods in
//! this instance's offload namespaces (one watch per namespace: tidepool may read only
//! there) and writes what [`crate::relay::Relay`] decides onto the training pods.
//!
//! Apart from the pod sync: this task has its own watches and writes its Events one at a
//! time, so a storm of member Events (a thousand copies failing to pull) delays only other
//! Events, never a pod's creation or status. Its memory and its writes are bounded by
//! [`crate::relay::Limits`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as CoreEvent, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::context::{Context, OffloadWatch};
use crate::relay::{Limits, MemberEvent, PodRef, Relay, Write};

/// How often the offload cache is looked at for namespaces not watched yet (copies also
/// hint at theirs as they come).
const SCAN: Duration = Duration::from_secs(10);

/// Relays `watch`'s member's Events about copies until its session ends. `hints` names
/// namespaces copies were seen in.
pub(crate) async fn run(ctx: Arc<Context>, watch: OffloadWatch, mut hints: mpsc::Receiver<String>) {
    let member = watch.member.clone();
    let (events_tx, mut events) = mpsc::channel::<CoreEvent>(1024);
    let mut watched: HashSet<String> = HashSet::new();
    let mut relay = Relay::new(Limits::default());
    let start = |ns: String, watched: &mut HashSet<String>| {
        if ns.is_empty() || !watched.insert(ns.clone()) {
            return;
        }
        debug!(namespace = ns, "watching member Events");
        let stream = watcher(
            Api::<CoreEvent>::namespaced(member.client.clone(), &ns),
            watcher::Config::default().fields("involvedObject.kind=Pod"),
        )
        .default_backoff()
        .applied_objects()
        .take_until(member.cancelled.clone().cancelled_owned());
        let tx = events_tx.clone();
        member.tasks.spawn("member Event watch", async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(e) => {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => debug!(error = %e, "member Event watch failed; retrying with backoff"),
                }
            }
        });
    };
    loop {
        tokio::select! {
            () = member.cancelled.cancelled() => return,
            Some(ns) = hints.recv() => start(ns, &mut watched),
            Some(event) = events.recv() => {
                if let Some(write) = observe(&watch, &mut relay, &event) {
                    publish(&ctx, &watch, write).await;
                }
            }
            () = tokio::time::sleep(SCAN) => {
                for copy in watch.store.state() {
                    start(copy.namespace().to_owned(), &mut watched);
                }
            }
        }
    }
}

/// The relay's decision for member Event `event`, if it is about one of the session's copies.
fn observe(watch: &OffloadWatch, relay: &mut Relay, event: &CoreEvent) -> Option<Write> {
    let about = &event.involved_object;
    let copy = watch.store.get(about.namespace.as_deref()?, about.name.as_deref()?)?;
    if about.uid.is_some() && about.uid.as_deref() != copy.uid() {
        return None;
    }
    let (namespace, name) = copy.origin_name()?;
    let pod = PodRef { namespace: namespace.to_owned(), name: name.to_owned(), uid: copy.origin_uid()?.to_owned() };
    let count = event.series.as_ref().and_then(|s| s.count).or(event.count).unwrap_or(1);
    let component = event
        .source
        .as_ref()
        .and_then(|s| s.component.clone())
        .or_else(|| event.reporting_component.clone())
        .unwrap_or_default();
    let relayed = MemberEvent {
        uid: event.metadata.uid.clone()?,
        type_: event.type_.clone().unwrap_or_default(),
        reason: event.reason.clone().unwrap_or_default(),
        message: event.message.clone().unwrap_or_default(),
        count,
        component,
    }
    .bounded();
    let before = relay.dropped;
    let write = relay.observe(&pod, &relayed);
    if relay.dropped > before && relay.dropped.is_power_of_two() {
        warn!(pod = name, namespace, dropped = relay.dropped, "member Events dropped: the pod is at its bound");
    }
    write
}

/// Writes one relayed Event: a new one, or the count of one made before (made anew if it
/// expired meanwhile). Through the core Events API, whose `count`, `firstTimestamp` and
/// `lastTimestamp` are what `kubectl describe` shows as "(x3 over 2m)" (the events.k8s.io API
/// refuses them on create).
async fn publish(ctx: &Context, watch: &OffloadWatch, write: Write) {
    let (name, pod, event, count, create) = match write {
        Write::Create { name, pod, event, count } => (name, pod, event, count, true),
        Write::Count { name, pod, event, count } => (name, pod, event, count, false),
    };
    let api = Api::<CoreEvent>::namespaced(ctx.training.clone(), &pod.namespace);
    let result = if create {
        create_event(&api, watch, &name, &pod, &event, count).await
    } else {
        match set_count(&api, &name, count).await {
            Err(kube::Error::Api(e)) if e.code == 404 => create_event(&api, watch, &name, &pod, &event, count).await,
            other => other,
        }
    };
    if let Err(e) = result {
        debug!(error = %e, event = name, "cannot relay member Event");
    }
}

async fn set_count(api: &Api<CoreEvent>, name: &str, count: i32) -> Result<(), kube::Error> {
    let patch = json!({"count": count, "lastTimestamp": Time(jiff::Timestamp::now())});
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.map(|_| ())
}

async fn create_event(
    api: &Api<CoreEvent>,
    watch: &OffloadWatch,
    name: &str,
    pod: &PodRef,
    event: &MemberEvent,
    count: i32,
) -> Result<(), kube::Error> {
    let now = Time(jiff::Timestamp::now());
    let from = format!("{}/{}", watch.member.name, event.component);
    let object = CoreEvent {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(pod.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Pod".to_owned()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid: Some(pod.uid.clone()),
            ..Default::default()
        },
        type_: Some(event.type_.clone()),
        reason: Some(event.reason.clone()),
        message: Some(event.message.clone()),
        // `kubectl describe` shows it as from the member's component, through tidepool.
        source: Some(EventSource { component: Some(from.clone()), host: None }),
        count: Some(count),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        reporting_component: Some("tidepool".to_owned()),
        reporting_instance: Some(from.chars().take(128).collect()),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &object).await {
        // Made before this process (a restart): never counted down.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let had = api.get_opt(name).await.ok().flatten().and_then(|e| e.count).unwrap_or(0);
            set_count(api, name, count.max(had + 1)).await
        }
        other => other.map(|_| ()),
    }
}
