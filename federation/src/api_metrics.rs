//! A tower layer on a `kube::Client` that counts every API request by cluster, verb,
//! resource and answer (`tidepool_api_requests_total`): how many calls tidepool makes to each
//! member, and proof that a standby replica writes nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tidepool_api::metrics::{ApiLabels, api_code, api_resource, api_verb, metrics};

/// Counts the requests of one cluster's client.
#[derive(Debug, Clone)]
pub struct ApiMetricsLayer {
    cluster: String,
}

impl ApiMetricsLayer {
    /// `cluster` is `training` or a member's name.
    pub fn new(cluster: impl Into<String>) -> Self {
        Self { cluster: cluster.into() }
    }
}

impl<S> tower::Layer<S> for ApiMetricsLayer {
    type Service = ApiMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ApiMetrics { inner, cluster: self.cluster.clone() }
    }
}

#[derive(Debug, Clone)]
pub struct ApiMetrics<S> {
    inner: S,
    cluster: String,
}

impl<S, B, R> tower::Service<http::Request<B>> for ApiMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let uri = request.uri();
        let (resource, named) = api_resource(uri.path());
        let verb = api_verb(request.method().as_str(), uri.query().unwrap_or(""), named);
        let cluster = self.cluster.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            let code = api_code(result.as_ref().ok().map(|r| r.status().as_u16()));
            metrics().api_requests.get_or_create(&ApiLabels { cluster, verb, resource, code }).inc();
            result
        })
    }
}

/// A client for `config` whose requests are counted under `cluster`.
pub fn counted_client(config: kube::Config, cluster: &str) -> Result<kube::Client, kube::Error> {
    let builder = kube::client::ClientBuilder::try_from(config)?;
    Ok(builder.with_layer(&ApiMetricsLayer::new(cluster)).build())
}
