//! Reflection, the I/O: copies the ConfigMaps and Secrets an offload pod references into its
//! member namespace and keeps them current. What to copy, and how a copy looks, is decided
//! in [`crate::referenced`]; deleting copies nothing uses is [`crate::collect`]'s.
//!
//! Both sides are watched by metadata only: the training side tells when a source changed
//! (its `resourceVersion`), the member side which copies exist and which version each was
//! made from. Contents are read from the training API only to make a copy, so tidepool holds
//! no Secret data beyond that moment, and a consistent copy costs no API call at all. Secret
//! contents are never logged: only kinds and names are.

use std::fmt::Debug;
use std::time::Duration;

use std::future::Future;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tidepool_api::keys;
use tidepool_api::sync::Locked;
use tidepool_federation::MemberHandle;
use tidepool_federation::member_tasks::MemberTasks;
use tidepool_federation::training::listed;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::Error;
use crate::access::OffloadAccess;
use crate::isolation::Isolation;
use crate::referenced::{self, CopyTarget, Kind, Source};

/// How long a sync waits for the metadata caches after a (re)start before retrying later.
const CACHE_WAIT: Duration = Duration::from_secs(10);

/// Metadata of ConfigMaps and Secrets seen through one watch each.
#[derive(Clone)]
pub(crate) struct MetaStores {
    config_maps: Store<PartialObjectMeta<ConfigMap>>,
    /// One watch of every namespace (key `""`), or one per namespace tidepool may read
    /// Secrets in (`secretNamespaces` of the bridge).
    secrets: BTreeMap<String, Store<PartialObjectMeta<Secret>>>,
    /// Stops both watches.
    stop: CancellationToken,
}

/// A change seen by a metadata watch (after its initial list).
#[derive(Debug)]
pub(crate) enum Change {
    Applied(Kind, ObjectMeta),
    Deleted(Kind, ObjectMeta),
    /// The watch listed everything again (start, or after falling behind): changes in
    /// between were not seen one by one.
    Relisted,
}

impl MetaStores {
    /// Starts metadata watches of the training cluster's ConfigMaps (all namespaces) and
    /// Secrets (all namespaces, or only `secret_namespaces` when set), until `stop`. Only
    /// identity and version are kept: annotations can hold contents (`kubectl apply` puts a
    /// whole Secret in `last-applied-configuration`).
    pub(crate) fn sources(
        client: &Client,
        secret_namespaces: &[String],
        stop: CancellationToken,
        changes: mpsc::Sender<Change>,
    ) -> (MetaStores, Vec<BoxFuture<'static, ()>>) {
        let config = watcher::Config::default();
        let (trim, c) = (Trim::ToVersion, client.clone());
        let mut tasks: Vec<BoxFuture<'static, ()>> = Vec::new();
        let mut secrets = |api: Api<_>| {
            let (store, task) = meta_watch(api, config.clone(), Kind::Secret, trim, stop.clone(), changes.clone());
            tasks.push(task.boxed());
            store
        };
        let secrets = if secret_namespaces.is_empty() {
            [(String::new(), secrets(Api::all(c.clone())))].into()
        } else {
            secret_namespaces.iter().map(|ns| (ns.clone(), secrets(Api::namespaced(c.clone(), ns)))).collect()
        };
        let (config_maps, task) = meta_watch(Api::all(c), config.clone(), Kind::ConfigMap, trim, stop.clone(), changes);
        tasks.push(task.boxed());
        (MetaStores { config_maps, secrets, stop }, tasks)
    }

    fn secrets_of(&self, namespace: &str) -> Option<&Store<PartialObjectMeta<Secret>>> {
        self.secrets.get("").or_else(|| self.secrets.get(namespace))
    }

    /// Metadata of `kind` `namespace/name`, if it exists.
    pub(crate) fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<ObjectMeta> {
        match kind {
            Kind::ConfigMap => {
                self.config_maps.get(&ObjectRef::new(name).within(namespace)).map(|o| o.metadata.clone())
            }
            Kind::Secret => {
                self.secrets_of(namespace)?.get(&ObjectRef::new(name).within(namespace)).map(|o| o.metadata.clone())
            }
        }
    }

    /// Every object seen, with its kind.
    pub(crate) fn all(&self) -> Vec<(Kind, ObjectMeta)> {
        let cms = self.config_maps.state().into_iter().map(|o| (Kind::ConfigMap, o.metadata.clone()));
        let secrets = self.secrets.values().flat_map(|s| s.state()).map(|o| (Kind::Secret, o.metadata.clone()));
        cms.chain(secrets).collect()
    }

    /// Waits until both caches hold a full list; false if they do not within `CACHE_WAIT`.
    pub(crate) async fn ready(&self) -> bool {
        for secrets in self.secrets.values() {
            if !listed(secrets, CACHE_WAIT).await {
                return false;
            }
        }
        listed(&self.config_maps, CACHE_WAIT).await
    }
}

/// Member-side metadata of this instance's copies, watched namespace by namespace: in a member
/// tidepool may read ConfigMaps and Secrets only in the offload namespaces it created (its
/// least-privilege role there is bound per namespace), never cluster-wide.
#[derive(Clone)]
pub(crate) struct MemberCopies {
    client: Client,
    selector: String,
    stop: CancellationToken,
    /// The member session's tasks, which the watches run as.
    tasks: MemberTasks,
    changes: mpsc::Sender<Change>,
    /// This instance's offload namespaces in the member (label-selected watch).
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// The `MemberCluster`: other members' namespaces on the same API server are theirs
    /// (and, sharded, another replica's) to bind and watch.
    member: String,
    by_namespace: Arc<Mutex<BTreeMap<String, MetaStores>>>,
    access: Arc<OffloadAccess>,
    isolation: Arc<Isolation>,
}

impl MemberCopies {
    /// Watches the copies labelled `copy_selector` in every offload namespace labelled
    /// `namespace_selector` that is `member`'s, until `stop`.
    pub(crate) fn start(
        client: &Client,
        member: &str,
        namespace_selector: &str,
        copy_selector: &str,
        tasks: &MemberTasks,
        changes: mpsc::Sender<Change>,
        isolation: Isolation,
    ) -> Self {
        let stop = tasks.cancelled().clone();
        let (namespaces, writer) = reflector::store();
        let copies = Self {
            client: client.clone(),
            selector: copy_selector.to_owned(),
            stop: stop.clone(),
            tasks: tasks.clone(),
            changes,
            namespaces,
            member: member.to_owned(),
            by_namespace: Arc::default(),
            access: Arc::new(OffloadAccess::new(client.clone(), member)),
            isolation: Arc::new(isolation),
        };
        let events = watcher(
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default().labels(namespace_selector),
        )
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .take_until(stop.cancelled_owned());
        let found = copies.clone();
        tasks.spawn(
            "offload namespace watch",
            async move {
                let mut events = std::pin::pin!(events);
                while let Some(event) = events.next().await {
                    match event {
                        Ok(ns) if found.is_ours(&ns.metadata) => {
                            let found = found.clone();
                            tokio::spawn(async move { found.enter(&ns.metadata.name.unwrap_or_default()).await });
                        }
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "offload namespace watch failed; retrying with backoff"),
                    }
                }
            }
            .instrument(tracing::info_span!("offload_namespaces")),
        );
        copies
    }

    /// This instance's offload namespaces in the member, as its namespace watch lists them.
    pub(crate) fn namespaces(&self) -> Vec<String> {
        let state = self.namespaces.state();
        state.iter().filter(|ns| self.is_ours(&ns.metadata)).filter_map(|ns| ns.metadata.name.clone()).collect()
    }

    /// Whether a namespace the watch found (this training cluster's, by the watch's
    /// selector) is this member's, by its label. Another member's on the same API server is
    /// never entered: no binding, no watch, no write. One made before namespaces carried the
    /// label is entered once the pod sync finds it holds a copy of this member's.
    pub(crate) fn is_ours(&self, ns: &ObjectMeta) -> bool {
        ns.labels.as_ref().and_then(|l| l.get(keys::LABEL_ORIGIN_MEMBER)).is_some_and(|m| *m == self.member)
    }

    /// Makes this session's identity able to work in offload namespace `namespace` (binding
    /// it to the offload role there) and watches the copies in it; once per namespace. The
    /// caller knows it is this member's: the pod sync made or checked it, or the namespace
    /// watch saw its label.
    pub(crate) async fn enter(&self, namespace: &str) {
        if namespace.is_empty() || self.stores(namespace).is_some() {
            return;
        }
        self.access.bind(namespace).await;
        // A namespace of an earlier session gets this session's policy; the pod sync asks
        // again before each new copy and waits while it fails.
        if let Err(e) = self.isolation.ensure(namespace).await {
            warn!(member = %self.member, namespace, error = %e, "cannot write the offload namespace's NetworkPolicy");
        }
        self.watch_namespace(namespace);
    }

    /// Makes sure `namespace` has the member's NetworkPolicy ([`Isolation::ensure`]).
    pub(crate) async fn isolate(&self, namespace: &str) -> Result<(), kube::Error> {
        self.isolation.ensure(namespace).await
    }

    /// Forgets `namespace` (it was deleted): its watches stop, and entering it again binds
    /// and watches the namespace made anew.
    pub(crate) fn leave(&self, namespace: &str) {
        let Some(mut by_namespace) = self.by_namespace.locked_or_log("reflected copy watches") else { return };
        self.isolation.forget(namespace);
        if let Some(stores) = by_namespace.remove(namespace) {
            stores.stop.cancel();
            debug!(namespace, "offload namespace gone; its copy watches stopped");
        }
    }

    /// Starts the watches of `namespace` if not yet running.
    fn watch_namespace(&self, namespace: &str) {
        let Some(mut by_namespace) = self.by_namespace.locked_or_log("reflected copy watches") else { return };
        if namespace.is_empty() || by_namespace.contains_key(namespace) {
            return;
        }
        debug!(namespace, "watching reflected copies");
        let api = |ns: &str| (Api::namespaced(self.client.clone(), ns), Api::namespaced(self.client.clone(), ns));
        let (config_maps, secrets) = api(namespace);
        let config = watcher::Config::default().labels(&self.selector);
        let stop = self.stop.child_token();
        let (trim, changes) = (Trim::ManagedFields, &self.changes);
        let (config_maps, cm_task) =
            meta_watch(config_maps, config.clone(), Kind::ConfigMap, trim, stop.clone(), changes.clone());
        let (secrets, secret_task) = meta_watch(secrets, config, Kind::Secret, trim, stop.clone(), changes.clone());
        // A namespace forgotten stops its watches (`stop`): their normal end.
        self.tasks.spawn_until("reflected ConfigMap watch", &stop, cm_task);
        self.tasks.spawn_until("reflected Secret watch", &stop, secret_task);
        let stores = MetaStores { config_maps, secrets: [(String::new(), secrets)].into(), stop };
        by_namespace.insert(namespace.to_owned(), stores);
    }

    fn all_stores(&self) -> Vec<MetaStores> {
        let by_namespace = self.by_namespace.locked_or_log("reflected copy watches");
        by_namespace.map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    fn stores(&self, namespace: &str) -> Option<MetaStores> {
        self.by_namespace.locked_or_log("reflected copy watches")?.get(namespace).cloned()
    }

    /// Metadata of the copy `kind` `namespace/name`, if it exists.
    pub(crate) fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<ObjectMeta> {
        self.stores(namespace)?.get(kind, namespace, name)
    }

    /// Every copy seen, in every offload namespace.
    pub(crate) fn all(&self) -> Vec<(Kind, ObjectMeta)> {
        let stores: Vec<MetaStores> = self.all_stores();
        stores.iter().flat_map(MetaStores::all).collect()
    }

    /// Waits until the copies of `namespace` are listed (starting their watch if needed).
    pub(crate) async fn ready_in(&self, namespace: &str) -> bool {
        self.enter(namespace).await;
        match self.stores(namespace) {
            Some(stores) => stores.ready().await,
            None => false,
        }
    }

    /// Waits until the offload namespaces and the copies in each are listed.
    pub(crate) async fn ready(&self) -> bool {
        if !listed(&self.namespaces, CACHE_WAIT).await {
            return false;
        }
        let stores: Vec<MetaStores> = self.all_stores();
        for s in stores {
            if !s.ready().await {
                return false;
            }
        }
        true
    }
}

/// What of an object's metadata a cache drops.
#[derive(Debug, Clone, Copy)]
enum Trim {
    /// Everything but name, namespace, UID and resource version.
    ToVersion,
    /// Only the managed fields, which nothing here reads.
    ManagedFields,
}

/// A metadata watch of `api` (metadata-only requests: `PartialObjectMeta<K>`) into a store,
/// sending each change to `changes` until `stop`: the store, and the task to run it.
fn meta_watch<K>(
    api: Api<PartialObjectMeta<K>>,
    config: watcher::Config,
    kind: Kind,
    trim: Trim,
    stop: CancellationToken,
    changes: mpsc::Sender<Change>,
) -> (Store<PartialObjectMeta<K>>, impl Future<Output = ()> + Send + 'static)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, config)
        .default_backoff()
        .modify(move |o| {
            let m = &mut o.metadata;
            m.managed_fields = None;
            if let Trim::ToVersion = trim {
                (m.annotations, m.labels, m.owner_references, m.finalizers) = (None, None, None, None);
            }
        })
        .reflect(writer)
        .take_until(stop.cancelled_owned());
    let task = async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let change = match event {
                Ok(watcher::Event::Apply(o)) => Change::Applied(kind, o.metadata),
                Ok(watcher::Event::Delete(o)) => Change::Deleted(kind, o.metadata),
                Ok(watcher::Event::InitDone) => Change::Relisted,
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
                Err(e) => {
                    warn!(error = %e, "metadata watch failed; retrying with backoff");
                    continue;
                }
            };
            if changes.send(change).await.is_err() {
                return;
            }
        }
    };
    (store, task.instrument(tracing::info_span!("metadata_watch", kind = %kind)))
}

/// Result of syncing one pod's copies.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Every source that exists is copied and current; the optional ones that do not exist
    /// are listed, for [`referenced::drop_references`].
    Ready(BTreeSet<Source>),
    /// Required sources that do not exist in training, described for an Event.
    Missing(Vec<String>),
    /// A source that must not travel; the message names the field that references it.
    Refused(String),
    /// The member has an object of that name that tidepool did not copy.
    Conflict(String),
    /// The caches are not ready or a copy changed under us: try again shortly.
    Retry,
}

/// Where one pod's copies go.
pub(crate) struct Reflection<'a> {
    pub training: &'a Client,
    /// Training-side metadata.
    pub sources: &'a MetaStores,
    pub member: &'a MemberHandle,
    /// Member-side metadata of this instance's copies.
    pub copies: &'a MemberCopies,
    pub cluster: &'a str,
    pub origin_namespace: &'a str,
    pub member_namespace: &'a str,
    /// Whether tidepool reads Secrets in `origin_namespace` (`secretNamespaces`).
    pub reads_secrets: bool,
}

impl Reflection<'_> {
    /// Makes the member namespace hold a current copy of every source `spec` references
    /// that exists in training, and no copy of one that does not (a deleted source is
    /// deleted in the member too). Writes nothing when all copies are current.
    pub(crate) async fn run(&self, refs: &referenced::References) -> Result<Outcome, Error> {
        if refs.is_empty() {
            return Ok(Outcome::Ready(BTreeSet::new()));
        }
        let unread = refs.iter().find(|(source, _)| source.kind == Kind::Secret && !self.reads_secrets);
        if let Some((source, usage)) = unread {
            return Ok(Outcome::Refused(format!(
                "{}: Secret {}/{}: tidepool reads no Secrets in namespace {} (the bridge's secretNamespaces)",
                usage.field, self.origin_namespace, source.name, self.origin_namespace
            )));
        }
        if !self.sources.ready().await || !self.copies.ready_in(self.member_namespace).await {
            return Ok(Outcome::Retry);
        }
        let mut missing = Vec::new();
        let mut absent = BTreeSet::new();
        for (source, usage) in refs {
            let describe = || format!("{} {}/{} ({})", source.kind, self.origin_namespace, source.name, usage.field);
            let copy = self.copies.get(source.kind, self.member_namespace, &source.name);
            let origin = self.sources.get(source.kind, self.origin_namespace, &source.name);
            let written = match source_step(origin.as_ref(), copy.as_ref()) {
                SourceStep::Current => continue,
                SourceStep::Gone { delete } => {
                    if let Some(copy) = copy.filter(|_| delete) {
                        self.delete(source, &copy).await?;
                    }
                    Written::SourceGone
                }
                SourceStep::Write => self.copy(source, copy.as_ref()).await?,
            };
            match written_outcome(&written, usage.required) {
                Some(SourceEnd::Done) => {}
                Some(SourceEnd::Missing) => missing.push(describe()),
                Some(SourceEnd::Absent) => {
                    absent.insert(source.clone());
                }
                None => return Ok(self.failed(source, usage, written)),
            }
        }
        Ok(if missing.is_empty() { Outcome::Ready(absent) } else { Outcome::Missing(missing) })
    }

    /// The outcome of a copy that could not be written: refused, someone else's, or stale.
    fn failed(&self, source: &Source, usage: &referenced::Use, written: Written) -> Outcome {
        match written {
            Written::Refused(why) => Outcome::Refused(format!(
                "{}: {} {}/{} {why}",
                usage.field, source.kind, self.origin_namespace, source.name
            )),
            Written::Conflict => Outcome::Conflict(format!(
                "member {} already has {} {}/{} that tidepool did not copy; it is not overwritten",
                self.member.name, source.kind, self.member_namespace, source.name
            )),
            Written::Done | Written::SourceGone | Written::Stale => Outcome::Retry,
        }
    }

    /// Reads the source and writes its copy; `current` is the copy's metadata if one exists.
    async fn copy(&self, source: &Source, current: Option<&ObjectMeta>) -> Result<Written, Error> {
        let target =
            CopyTarget { cluster: self.cluster, member: self.member.name.as_str(), namespace: self.member_namespace };
        match source.kind {
            Kind::ConfigMap => {
                let api = Api::<ConfigMap>::namespaced(self.training.clone(), self.origin_namespace);
                let Some(origin) = api.get_opt(&source.name).await.map_err(|e| Error::training("read ConfigMap", e))?
                else {
                    return Ok(Written::SourceGone);
                };
                match referenced::config_map_copy(&origin, &target) {
                    Ok(copy) => self.put(source, copy, current).await,
                    Err(e) => Ok(Written::Refused(e.to_string())),
                }
            }
            Kind::Secret => {
                let api = Api::<Secret>::namespaced(self.training.clone(), self.origin_namespace);
                let Some(origin) = api.get_opt(&source.name).await.map_err(|e| Error::training("read Secret", e))?
                else {
                    return Ok(Written::SourceGone);
                };
                match referenced::secret_copy(&origin, &target) {
                    Ok(copy) => self.put(source, copy, current).await,
                    Err(e) => Ok(Written::Refused(e.to_string())),
                }
            }
        }
    }

    /// Creates the copy, or replaces ours (the whole object, so keys removed in training go
    /// in the member too). Never touches an object this instance did not copy.
    async fn put<K>(&self, source: &Source, mut copy: K, current: Option<&ObjectMeta>) -> Result<Written, Error>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + Serialize + DeserializeOwned + Debug,
    {
        let api = Api::<K>::namespaced(self.member.client.clone(), self.member_namespace);
        let name = &source.name;
        let version = match current {
            Some(meta) => meta.resource_version.clone(),
            None => match api.create(&PostParams::default(), &copy).await {
                Ok(_) => {
                    info!(member = %self.member.name, kind = %source.kind, name, namespace = self.member_namespace, "reflected copy created");
                    return Ok(Written::Done);
                }
                Err(e) if tidepool_federation::api_code(&e, &[409]) => {
                    // Not in our cache: either the cache lags behind our own write, or the
                    // object is someone else's.
                    let existing = api.get_opt(name).await.map_err(|e| self.member_error("read reflected copy", e))?;
                    match existing {
                        Some(o) if referenced::is_ours(o.meta(), self.cluster, self.member.name.as_str()) => {
                            o.meta().resource_version.clone()
                        }
                        Some(_) => return Ok(Written::Conflict),
                        None => return Ok(Written::Stale),
                    }
                }
                Err(e) if tidepool_federation::api_code(&e, &[404]) => return Ok(Written::Stale),
                Err(e) => return Err(self.member_error("create reflected copy", e)),
            },
        };
        // Optimistic concurrency on the version we saw: a concurrent change makes this a
        // conflict and the next sync starts from the new state.
        copy.meta_mut().resource_version = version;
        match api.replace(name, &PostParams::default(), &copy).await {
            Ok(_) => {
                info!(member = %self.member.name, kind = %source.kind, name, namespace = self.member_namespace, "reflected copy updated");
                Ok(Written::Done)
            }
            Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => Ok(Written::Stale),
            Err(e) if tidepool_federation::api_code(&e, &[422]) => {
                // An immutable field (a Secret's type) changed with the source: replace the
                // copy as a whole.
                debug!(member = %self.member.name, kind = %source.kind, name, "reflected copy cannot be updated in place; recreating");
                match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(e) if tidepool_federation::api_code(&e, &[404]) => {}
                    Err(e) => return Err(self.member_error("delete reflected copy", e)),
                }
                copy.meta_mut().resource_version = None;
                match api.create(&PostParams::default(), &copy).await {
                    Ok(_) => Ok(Written::Done),
                    Err(e) if tidepool_federation::api_code(&e, &[409]) => Ok(Written::Stale),
                    Err(e) => Err(self.member_error("create reflected copy", e)),
                }
            }
            Err(e) => Err(self.member_error("update reflected copy", e)),
        }
    }

    async fn delete(&self, source: &Source, copy: &ObjectMeta) -> Result<(), Error> {
        delete_reflected(self.member, source.kind, copy).await
    }

    fn member_error(&self, what: &'static str, e: kube::Error) -> Error {
        Error::member(&self.member.name, what, e)
    }
}

/// What became of one copy's write.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Written {
    Done,
    SourceGone,
    Refused(String),
    Conflict,
    Stale,
}

/// What one referenced source needs, from the two caches' metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SourceStep {
    /// The copy is there and current: nothing to write.
    Current,
    /// The source does not exist in training; its copy (if any, and `delete`) goes too.
    Gone { delete: bool },
    /// Copy it: no copy yet, or a stale one.
    Write,
}

fn source_step(origin: Option<&ObjectMeta>, copy: Option<&ObjectMeta>) -> SourceStep {
    match (origin, copy) {
        (None, copy) => SourceStep::Gone { delete: copy.is_some() },
        (Some(origin), Some(copy)) if referenced::is_current(copy, origin) => SourceStep::Current,
        (Some(_), _) => SourceStep::Write,
    }
}

/// How one source ends in the pod's outcome, or `None` when the write failed the whole
/// reflection (see [`Reflection::failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SourceEnd {
    Done,
    /// Required and not in training: the pod waits.
    Missing,
    /// Optional and not in training: the reference is dropped from the copy.
    Absent,
}

fn written_outcome(written: &Written, required: bool) -> Option<SourceEnd> {
    match written {
        Written::Done => Some(SourceEnd::Done),
        Written::SourceGone if required => Some(SourceEnd::Missing),
        Written::SourceGone => Some(SourceEnd::Absent),
        Written::Refused(_) | Written::Conflict | Written::Stale => None,
    }
}

/// Deletes a copy exactly as it was seen: if it changed since, it is left for the next pass.
pub(crate) async fn delete_reflected(member: &MemberHandle, kind: Kind, copy: &ObjectMeta) -> Result<(), Error> {
    let (Some(name), Some(namespace)) = (copy.name.as_deref(), copy.namespace.as_deref()) else {
        return Err(Error::MissingField("metadata.name"));
    };
    let dp = DeleteParams {
        preconditions: Some(Preconditions { uid: copy.uid.clone(), resource_version: copy.resource_version.clone() }),
        ..Default::default()
    };
    let result = match kind {
        Kind::ConfigMap => {
            Api::<ConfigMap>::namespaced(member.client.clone(), namespace).delete(name, &dp).await.map(|_| ())
        }
        Kind::Secret => Api::<Secret>::namespaced(member.client.clone(), namespace).delete(name, &dp).await.map(|_| ()),
    };
    match result {
        Ok(()) => {
            info!(member = %member.name, kind = %kind, name, namespace, "reflected copy deleted");
            Ok(())
        }
        Err(e) if tidepool_federation::api_code(&e, &[404, 409]) => {
            debug!(member = %member.name, kind = %kind, name, namespace, error = %e, "reflected copy changed or gone; left for the next pass");
            Ok(())
        }
        Err(e) => Err(Error::member(&member.name, "delete reflected copy", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_api::keys;

    fn meta(version: &str, made_from: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            resource_version: Some(version.into()),
            annotations: made_from
                .map(|v| [(keys::ANNOTATION_ORIGIN_RESOURCE_VERSION.to_owned(), v.to_owned())].into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_source_is_copied_when_its_copy_is_missing_or_stale_and_its_copy_goes_with_it() {
        let origin = meta("5", None);
        assert_eq!(source_step(Some(&origin), None), SourceStep::Write);
        assert_eq!(source_step(Some(&origin), Some(&meta("9", Some("4")))), SourceStep::Write, "stale");
        assert_eq!(source_step(Some(&origin), Some(&meta("9", None))), SourceStep::Write, "no origin version");
        assert_eq!(source_step(Some(&origin), Some(&meta("9", Some("5")))), SourceStep::Current);
        assert_eq!(source_step(None, Some(&meta("9", Some("5")))), SourceStep::Gone { delete: true });
        assert_eq!(source_step(None, None), SourceStep::Gone { delete: false });
    }

    #[test]
    fn a_gone_source_holds_the_pod_only_when_required_and_a_failed_write_ends_the_reflection() {
        assert_eq!(written_outcome(&Written::Done, true), Some(SourceEnd::Done));
        assert_eq!(written_outcome(&Written::SourceGone, true), Some(SourceEnd::Missing));
        assert_eq!(written_outcome(&Written::SourceGone, false), Some(SourceEnd::Absent));
        for failed in [Written::Refused("too big".into()), Written::Conflict, Written::Stale] {
            assert_eq!(written_outcome(&failed, false), None, "{failed:?}");
        }
    }
}
