//! The pod sync's answers to a member, on a member of plain data.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;

use super::*;

const CLUSTER: &str = "training";
const NS: &str = "tp-team";

fn api_error(code: u16, message: &str) -> kube::Error {
    kube::Error::Api(Box::new(
        serde_json::from_value(json!({"code": code, "message": message, "reason": "r", "status": "Failure"})).unwrap(),
    ))
}

/// A member's pods as data: namespaces that exist, whether tidepool's PriorityClasses do,
/// how long each call takes, and whether reads fail.
struct Member {
    pods: Mutex<BTreeMap<(String, String), Pod>>,
    namespaces: BTreeSet<String>,
    priority_classes: bool,
    delay: Duration,
    reads_fail: bool,
    creates: Mutex<u32>,
    /// Deletes answered 503 while set.
    deletes_fail: std::sync::atomic::AtomicBool,
    deletes: Mutex<u32>,
}

impl Default for Member {
    fn default() -> Self {
        Self {
            pods: Mutex::default(),
            namespaces: BTreeSet::from([NS.to_owned()]),
            priority_classes: true,
            delay: Duration::ZERO,
            reads_fail: false,
            creates: Mutex::new(0),
            deletes_fail: false.into(),
            deletes: Mutex::new(0),
        }
    }
}

impl MemberPods for Member {
    async fn create(&self, ns: &str, pod: &Pod) -> kube::Result<()> {
        tokio::time::sleep(self.delay).await;
        *self.creates.lock().unwrap() += 1;
        let name = pod.name_any();
        if !self.namespaces.contains(ns) {
            return Err(api_error(404, &format!("namespaces \"{ns}\" not found")));
        }
        if !self.priority_classes {
            let why =
                format!("pods \"{name}\" is forbidden: no PriorityClass with name tidepool-offload-low was found");
            return Err(api_error(403, &why));
        }
        let mut pods = self.pods.lock().unwrap();
        if pods.contains_key(&(ns.to_owned(), name.clone())) {
            return Err(api_error(409, &format!("pods \"{name}\" already exists")));
        }
        pods.insert((ns.to_owned(), name), pod.clone());
        Ok(())
    }

    async fn get(&self, ns: &str, name: &str) -> kube::Result<Option<Pod>> {
        tokio::time::sleep(self.delay).await;
        if self.reads_fail {
            return Err(api_error(503, "the server is currently unable to handle the request"));
        }
        Ok(self.pods.lock().unwrap().get(&(ns.to_owned(), name.to_owned())).cloned())
    }

    async fn annotate(&self, ns: &str, name: &str, key: &str, value: Option<&str>) -> kube::Result<()> {
        let mut pods = self.pods.lock().unwrap();
        let pod = pods.get_mut(&(ns.to_owned(), name.to_owned())).ok_or_else(|| api_error(404, "not found"))?;
        let annotations = pod.metadata.annotations.get_or_insert_with(BTreeMap::new);
        match value {
            Some(v) => annotations.insert(key.to_owned(), v.to_owned()),
            None => annotations.remove(key),
        };
        Ok(())
    }

    /// As an API server with a UID precondition: 404 when there is no such pod, 409 when
    /// the name is another pod's.
    async fn delete(&self, ns: &str, name: &str, uid: Option<&str>, _: Option<u32>) -> kube::Result<()> {
        *self.deletes.lock().unwrap() += 1;
        if self.deletes_fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(api_error(503, "the server is currently unable to handle the request"));
        }
        let mut pods = self.pods.lock().unwrap();
        let key = (ns.to_owned(), name.to_owned());
        match pods.get(&key) {
            None => Err(api_error(404, &format!("pods \"{name}\" not found"))),
            Some(p) if uid.is_some_and(|uid| p.metadata.uid.as_deref() != Some(uid)) => {
                Err(api_error(409, "Precondition failed: UID in precondition does not match"))
            }
            Some(_) => {
                pods.remove(&key);
                Ok(())
            }
        }
    }
}

/// Training pod `name` with UID `uid`.
fn training_pod(name: &str, uid: &str) -> PodLite {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "team", "uid": uid},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }))
    .unwrap();
    PodLite::from(pod)
}

/// The copy of `pod` as this training cluster makes it.
fn copy_of(pod: &PodLite) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": pod.name_any(), "namespace": NS,
                     "labels": {keys::LABEL_ORIGIN_CLUSTER: CLUSTER, keys::LABEL_ORIGIN_UID: pod.metadata.uid}},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }))
    .unwrap()
}

#[tokio::test]
async fn a_copy_is_made_once_whatever_the_number_of_syncs() {
    let member = Member::default();
    let pod = training_pod("trainer-0", "u1");
    let copy = copy_of(&pod);
    assert_eq!(create_copy(&member, (NS, &copy), (CLUSTER, &pod)).await.unwrap(), Created::Made);
    // A second sync before the member's watch showed the copy: the 409 is the copy itself.
    assert_eq!(create_copy(&member, (NS, &copy), (CLUSTER, &pod)).await.unwrap(), Created::There);
    assert_eq!(member.pods.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn another_origins_pod_of_that_name_is_reported_and_left_as_it_is() {
    let member = Member::default();
    let theirs: Pod = serde_json::from_value(json!({
        "metadata": {"name": "trainer-0", "namespace": NS, "labels": {"app": "theirs"}},
        "spec": {"containers": [{"name": "c", "image": "theirs"}]},
    }))
    .unwrap();
    member.pods.lock().unwrap().insert((NS.to_owned(), "trainer-0".to_owned()), theirs.clone());
    let pod = training_pod("trainer-0", "u1");
    let created = create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap();
    assert_eq!(created, Created::Foreign(format!("already has pod {NS}/trainer-0 with another origin")));
    assert_eq!(member.pods.lock().unwrap()[&(NS.to_owned(), "trainer-0".to_owned())], theirs);
    // Another training cluster's copy is another origin too.
    let mut elsewhere = copy_of(&training_pod("trainer-0", "u9"));
    elsewhere.labels_mut().insert(keys::LABEL_ORIGIN_CLUSTER.to_owned(), "other-training".to_owned());
    member.pods.lock().unwrap().insert((NS.to_owned(), "trainer-0".to_owned()), elsewhere);
    let created = create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap();
    assert!(matches!(created, Created::Foreign(_)), "{created:?}");
}

#[tokio::test]
async fn an_earlier_pods_copy_of_this_cluster_is_not_foreign() {
    // The copy of a deleted pod of the same name, not gone yet: the next sync sees it in the
    // watch and deletes it or waits for it, instead of reporting a conflict.
    let member = Member::default();
    let earlier = training_pod("trainer-0", "u0");
    let mut left = copy_of(&earlier);
    left.annotations_mut().insert(keys::ANNOTATION_ORIGIN_NAMESPACE.to_owned(), "team".to_owned());
    member.pods.lock().unwrap().insert((NS.to_owned(), "trainer-0".to_owned()), left);
    let pod = training_pod("trainer-0", "u1");
    assert_eq!(create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap(), Created::There);
}

#[tokio::test]
async fn a_409_that_cannot_be_read_is_looked_at_again_never_called_foreign() {
    let member = Member { reads_fail: true, ..Member::default() };
    member.pods.lock().unwrap().insert((NS.to_owned(), "trainer-0".to_owned()), Pod::default());
    let pod = training_pod("trainer-0", "u1");
    assert_eq!(create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap(), Created::There);
}

#[tokio::test]
async fn a_namespace_deleted_under_the_sync_is_to_be_made_again() {
    let member = Member { namespaces: BTreeSet::new(), ..Member::default() };
    let pod = training_pod("trainer-0", "u1");
    assert_eq!(create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap(), Created::NamespaceGone);
    assert!(member.pods.lock().unwrap().is_empty());
}

#[tokio::test]
async fn missing_priority_classes_are_named_and_any_other_refusal_is_the_callers() {
    let member = Member { priority_classes: false, ..Member::default() };
    let pod = training_pod("trainer-0", "u1");
    let created = create_copy(&member, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap();
    assert!(
        matches!(&created, Created::PriorityClassesMissing(why) if why.contains("no PriorityClass")),
        "{created:?}"
    );

    // A member whose own policy refuses the copy: an error for the sync's error policy
    // (a MemberForbidden Event), not a state it acts on.
    struct Refusing;
    impl MemberPods for Refusing {
        async fn create(&self, _: &str, _: &Pod) -> kube::Result<()> {
            Err(api_error(403, "pods is forbidden: ValidatingAdmissionPolicy 'freeze' denied request"))
        }
        async fn get(&self, _: &str, _: &str) -> kube::Result<Option<Pod>> {
            Ok(None)
        }
        async fn annotate(&self, _: &str, _: &str, _: &str, _: Option<&str>) -> kube::Result<()> {
            Ok(())
        }
        async fn delete(&self, _: &str, _: &str, _: Option<&str>, _: Option<u32>) -> kube::Result<()> {
            Ok(())
        }
    }
    let refused = create_copy(&Refusing, (NS, &copy_of(&pod)), (CLUSTER, &pod)).await.unwrap_err();
    let error = crate::Error::member(&tidepool_api::MemberName::from("member-a"), "create offload pod", refused);
    assert_eq!(error.event_reason(), Some("MemberForbidden"));
    assert!(!error.is_transient());
}

#[tokio::test(start_paused = true)]
async fn syncs_racing_on_a_slow_member_still_make_one_copy() {
    let member = Member { delay: Duration::from_secs(20), ..Member::default() };
    let pod = training_pod("trainer-0", "u1");
    let copy = copy_of(&pod);
    let (a, b) = tokio::join!(
        create_copy(&member, (NS, &copy), (CLUSTER, &pod)),
        create_copy(&member, (NS, &copy), (CLUSTER, &pod)),
    );
    let mut answers = [a.unwrap(), b.unwrap()];
    answers.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(answers, [Created::Made, Created::There]);
    assert_eq!((*member.creates.lock().unwrap(), member.pods.lock().unwrap().len()), (2, 1));
}

#[tokio::test]
async fn the_notice_moves_onto_the_copy_once_and_off_when_withdrawn() {
    let member = Member::default();
    let pod = training_pod("trainer-0", "u1");
    member.create(NS, &copy_of(&pod)).await.unwrap();
    let read = || OffloadPod::from(member.pods.lock().unwrap()[&(NS.to_owned(), "trainer-0".to_owned())].clone());
    let deadline = "2026-12-05T10:00:00Z";
    assert!(sync_notice(&member, &read(), Some(deadline)).await.unwrap());
    assert_eq!(read().reclaim_deadline(), Some(deadline));
    assert!(!sync_notice(&member, &read(), Some(deadline)).await.unwrap(), "written twice");
    assert!(sync_notice(&member, &read(), None).await.unwrap());
    assert_eq!(read().reclaim_deadline(), None);
}

#[test]
fn a_deletion_is_sent_once_until_it_is_old_or_did_not_go_out() {
    let sent = SentDeletions::default();
    let t0 = Instant::now();
    assert!(sent.claim("a", t0).unwrap());
    assert!(!sent.claim("a", t0 + Duration::from_secs(1)).unwrap(), "the watch has not caught up yet");
    assert!(sent.claim("b", t0).unwrap(), "another pod is another deletion");
    assert!(sent.claim("a", t0 + DELETION_MEMORY).unwrap(), "a deletion the watch never showed goes again");
    sent.release("b").unwrap();
    assert!(sent.claim("b", t0 + Duration::from_secs(1)).unwrap(), "a deletion that failed goes again");
}

/// The member's copy `name` with member UID `uid`, stored in `member`.
fn stored_copy(member: &Member, name: &str, uid: &str) -> OffloadPod {
    let mut copy = copy_of(&training_pod(name, "t-1"));
    copy.metadata.uid = Some(uid.to_owned());
    member.pods.lock().unwrap().insert((NS.to_owned(), name.to_owned()), copy.clone());
    OffloadPod::from(copy)
}

#[tokio::test]
async fn a_copy_is_deleted_once_by_its_uid_and_again_only_when_the_member_did_not_take_it() {
    let (member, sent, t0) = (Member::default(), SentDeletions::default(), Instant::now());
    let copy = stored_copy(&member, "trainer-0", "m-1");
    assert!(delete_copy(&member, &sent, &copy, Some(30), t0).await.unwrap());
    assert!(member.pods.lock().unwrap().is_empty());
    // The member's watch has not shown it gone yet: no second call.
    assert!(!delete_copy(&member, &sent, &copy, Some(30), t0 + Duration::from_secs(2)).await.unwrap());
    assert_eq!(*member.deletes.lock().unwrap(), 1);

    // The name is another pod's now (a new copy of a pod of the same name): the precondition
    // keeps it, and there is nothing left to delete.
    let old = stored_copy(&member, "trainer-1", "m-2");
    let new = stored_copy(&member, "trainer-1", "m-3");
    assert!(delete_copy(&member, &sent, &old, None, t0).await.unwrap());
    assert_eq!(OffloadPod::from(member.pods.lock().unwrap()[&(NS.to_owned(), "trainer-1".to_owned())].clone()), new);

    // A member that does not answer: an error, and the next sync sends it again.
    let copy = stored_copy(&member, "trainer-2", "m-4");
    member.deletes_fail.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(matches!(delete_copy(&member, &sent, &copy, None, t0).await, Err(DeleteFailed::Member(_))));
    member.deletes_fail.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(delete_copy(&member, &sent, &copy, None, t0 + Duration::from_secs(1)).await.unwrap());
    assert!(!member.pods.lock().unwrap().contains_key(&(NS.to_owned(), "trainer-2".to_owned())));
}
