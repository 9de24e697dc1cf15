//! Fencing of a member's client: once a replica is no longer sure it owns a member (see the
//! binary's `shard` module), its session's client refuses new calls and abandons the ones in
//! flight, so no write of this replica reaches the member after the new owner may have begun.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use kube::client::Body;
use tokio_util::sync::CancellationToken;
use tower::BoxError;

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
