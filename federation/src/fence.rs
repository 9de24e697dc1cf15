//! Fencing of a member's client: once a replica is no longer sure it owns a member (see the
//! binary's `shard` module), its clients of the member refuse new calls and abandon the ones
//! in flight, so no write of this replica reaches the member after the new owner may have
//! begun.
//!
//! The fences hang off the owned set itself ([`Owned`]): the sharder cancels a member's fence
//! in the same step as it takes the member out of the set, so no task has to notice first —
//! not a session, not one still connecting, not a drain.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use std::task::{Context, Poll};
use tidepool_api::sync::Locked;

use http::{Request, Response};
use kube::client::Body;
use tidepool_api::MemberName;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::BoxError;

/// The members a sharded replica owns, as its sharder publishes them, with the fences of
/// their clients.
#[derive(Debug, Clone)]
pub struct Owned {
    members: watch::Receiver<BTreeSet<MemberName>>,
    fences: Arc<Fences>,
}

/// The sharder's side of [`Owned`].
#[derive(Debug)]
pub struct OwnedSender {
    members: watch::Sender<BTreeSet<MemberName>>,
    fences: Arc<Fences>,
}

/// One fence per owned member; each client of the member gets a child of it.
#[derive(Debug, Default)]
struct Fences(Mutex<BTreeMap<MemberName, CancellationToken>>);

/// A new owned set, empty.
pub fn owned() -> (OwnedSender, Owned) {
    let (tx, rx) = watch::channel(BTreeSet::new());
    let fences = Arc::new(Fences::default());
    (OwnedSender { members: tx, fences: fences.clone() }, Owned { members: rx, fences })
}

impl OwnedSender {
    /// The members owned from now on. A member leaving the set is fenced before anyone hears
    /// of the new set. Returns whether the set changed.
    pub fn publish(&self, owned: &BTreeSet<MemberName>) -> bool {
        {
            // A panic while the map was held leaves at worst a fence not yet cancelled: the
            // map is still the one to cancel from.
            let mut fences = self.fences.0.recovered("fences");
            fences.retain(|member, fence| {
                let keep = owned.contains(member);
                if !keep {
                    fence.cancel();
                }
                keep
            });
            for member in owned {
                fences.entry(member.clone()).or_default();
            }
        }
        self.members.send_if_modified(|current| {
            let changed = current != owned;
            if changed {
                current.clone_from(owned);
            }
            changed
        })
    }
}

impl Owned {
    /// Whether `member` is owned now.
    pub fn contains(&self, member: &MemberName) -> bool {
        self.members.borrow().contains(member)
    }

    /// The owned set, to follow.
    pub fn members(&self) -> watch::Receiver<BTreeSet<MemberName>> {
        self.members.clone()
    }

    /// A fence for one client of `member`: cancelled when the member leaves the owned set, and
    /// already when it is not owned now. Cancelling it stops that client only.
    pub fn fence(&self, member: &MemberName) -> CancellationToken {
        let fences = self.fences.0.recovered("fences");
        match fences.get(member) {
            Some(fence) => fence.child_token(),
            None => {
                let fenced = CancellationToken::new();
                fenced.cancel();
                fenced
            }
        }
    }
}

/// The error a fenced call fails with.
#[derive(Debug, thiserror::Error)]
#[error("member client fenced: this replica no longer owns the member")]
pub struct Fenced;

/// Wraps a member client's stack so that cancelling `fence` stops every call.
#[derive(Debug, Clone)]
pub struct FenceLayer {
    fence: CancellationToken,
}

impl FenceLayer {
    pub fn new(fence: CancellationToken) -> Self {
        Self { fence }
    }
}

impl<S> tower::Layer<S> for FenceLayer {
    type Service = FenceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FenceService { inner, fence: self.fence.clone() }
    }
}

#[derive(Debug, Clone)]
pub struct FenceService<S> {
    inner: S,
    fence: CancellationToken,
}

impl<S, B> tower::Service<Request<Body>> for FenceService<S>
where
    S: tower::Service<Request<Body>, Response = Response<B>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if self.fence.is_cancelled() {
            return Box::pin(async { Err(Fenced.into()) });
        }
        let fence = self.fence.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            tokio::select! {
                biased;
                () = fence.cancelled() => Err(Fenced.into()),
                result = response => result,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<MemberName> {
        names.iter().map(|n| MemberName::new((*n).to_owned())).collect()
    }

    #[test]
    fn a_member_leaving_the_owned_set_fences_every_client_of_it_in_the_same_step() {
        let (tx, owned) = owned();
        let (a, b) = (MemberName::new("a".to_owned()), MemberName::new("b".to_owned()));
        assert!(owned.fence(&a).is_cancelled(), "a member not owned yet gets a fenced client");
        assert!(tx.publish(&set(&["a", "b"])));
        let (session, drain, other) = (owned.fence(&a), owned.fence(&a), owned.fence(&b));
        assert!(!session.is_cancelled() && !drain.is_cancelled() && !other.is_cancelled());
        // One client's end (a session replaced on rotation) stops that client only.
        session.cancel();
        assert!(!drain.is_cancelled() && !owned.fence(&a).is_cancelled());
        assert!(!tx.publish(&set(&["a", "b"])), "the same set is no change");
        assert!(tx.publish(&set(&["b"])));
        assert!(drain.is_cancelled(), "fenced before the new set was read");
        assert!(!owned.contains(&a) && owned.contains(&b));
        assert!(!other.is_cancelled());
        assert!(owned.fence(&a).is_cancelled(), "a client made after the loss starts fenced");
        // Owned again: a fresh fence, the old clients stay fenced.
        tx.publish(&set(&["a", "b"]));
        assert!(!owned.fence(&a).is_cancelled() && drain.is_cancelled());
    }
}
