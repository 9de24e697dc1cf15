//! Client-side rate limits and retries for the calls tidepool makes to one member.
//!
//! Every member `kube::Client` is built with a [`ThrottleLayer`] on top of kube's own stack,
//! so each call — watch, probe, read, create, patch, delete — passes through it:
//!
//! 1. the call is sorted into a [`Lane`]: creates are **bulk**, everything else (health
//!    probes, reads and watches, status writes, patches, deletes) is **priority**;
//! 2. it takes a token from the member's bucket (`spec.rateLimits`, governor GCRA). Bulk
//!    calls also take one from a smaller bulk bucket ([`bulk_quota`]) and step aside while a
//!    priority call is waiting, so a flood of pod creations never holds back a probe or a
//!    delete;
//! 3. a `429` or retryable `5xx` answer is retried after a jittered exponential backoff
//!    ([`retry_delay`], `Retry-After` honoured), at most [`MAX_ATTEMPTS`] times in all.
//!
//! What happened is counted in the member's [`MemberStats`] (plain atomics, for metrics).

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use http::{HeaderMap, Method, Request, Response};
use kube::client::Body;
use tidepool_api::crd::RateLimitSpec;
use tidepool_api::metrics::{ClusterLabels, metrics};
use tower::buffer::Buffer;
use tower::{BoxError, Layer, Service, ServiceExt};
use tracing::debug;

/// Attempts per call, the first one included.
pub const MAX_ATTEMPTS: u32 = 4;
/// Backoff before the first retry; doubles with each further one.
pub const RETRY_BASE: Duration = Duration::from_millis(200);
/// Longest backoff between two attempts, and longest `Retry-After` honoured.
pub const RETRY_MAX: Duration = Duration::from_secs(10);
/// How often a bulk call looks again whether the priority lane is clear.
const YIELD: Duration = Duration::from_millis(10);
/// Requests queued in front of kube's stack.
const BUFFER: usize = 1024;

/// Which queue a call waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Probes, reads, watches, status writes, patches, deletes: keep the member observable
    /// and let reclaim free capacity even while creations queue up.
    Priority,
    /// Creations (offload pods, namespaces, reflected ConfigMaps and Secrets).
    Bulk,
}

/// The lane of a call, from its method and path (`/api/v1/namespaces/ns/pods`). A POST to a
/// collection is a creation; a POST to a subresource (`…/pods/p/eviction`) is not.
pub fn lane(method: &Method, path: &str) -> Lane {
    if method != Method::POST {
        return Lane::Priority;
    }
    let segments: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    // Drop `api/<version>` or `apis/<group>/<version>`.
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    };
    match rest {
        Some([_collection]) => Lane::Bulk,
        Some(["namespaces", _, _collection]) => Lane::Bulk,
        _ => Lane::Priority,
    }
}

/// Sustained rate and burst of the bulk bucket: four fifths of the member's, so at least a
/// fifth of the rate stays free for the priority lane under any load of creations.
pub fn bulk_quota(qps: u32, burst: u32) -> (u32, u32) {
    let share = |v: u32| (u64::from(v) * 4 / 5).clamp(1, u64::from(u32::MAX));
    (u32::try_from(share(qps)).unwrap_or(u32::MAX), u32::try_from(share(burst)).unwrap_or(u32::MAX))
}

/// True for the answers worth another attempt: the member is overloaded or briefly broken.
pub fn retryable(status: u16) -> bool {
    matches!(status, 429 | 500 | 502 | 503 | 504)
}

/// How long to wait before retry number `retry` (1 for the first retry). `unit` is a
/// uniform random number in [0, 1): the delay is drawn from the upper half of the
/// exponential step (`RETRY_BASE · 2^(retry−1)`, capped at [`RETRY_MAX`]), so clients that
/// failed together do not retry together. A `Retry-After` from the member is a lower bound.
pub fn retry_delay(retry: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
    let step = RETRY_BASE.saturating_mul(1u32 << retry.saturating_sub(1).min(16)).min(RETRY_MAX);
    let jittered = step.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0)).min(RETRY_MAX);
    match retry_after {
        Some(after) => jittered.max(after.min(RETRY_MAX)),
        None => jittered,
    }
}

/// `Retry-After` in seconds (the form API servers send); dates are ignored.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// Calls and waits of one member's client, for metrics. Monotonic counters.
#[derive(Debug, Default)]
pub struct MemberStats {
    /// Calls sent in the priority lane (each attempt counts).
    pub priority_calls: AtomicU64,
    /// Calls sent in the bulk lane (each attempt counts).
    pub bulk_calls: AtomicU64,
    /// Calls that had to wait for the rate limit.
    pub throttled_calls: AtomicU64,
    /// Total time calls waited for the rate limit, in microseconds.
    pub throttle_wait_micros: AtomicU64,
    /// Attempts repeated after a 429 or 5xx.
    pub retries: AtomicU64,
    /// `429 Too Many Requests` answers.
    pub rate_limited: AtomicU64,
    /// Retryable `5xx` answers.
    pub server_errors: AtomicU64,
}

/// A copy of [`MemberStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub priority_calls: u64,
    pub bulk_calls: u64,
    pub throttled_calls: u64,
    pub throttle_wait: Duration,
    pub retries: u64,
    pub rate_limited: u64,
    pub server_errors: u64,
}

impl MemberStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            priority_calls: get(&self.priority_calls),
            bulk_calls: get(&self.bulk_calls),
            throttled_calls: get(&self.throttled_calls),
            throttle_wait: Duration::from_micros(get(&self.throttle_wait_micros)),
            retries: get(&self.retries),
            rate_limited: get(&self.rate_limited),
            server_errors: get(&self.server_errors),
        }
    }

    /// Every call sent, both lanes.
    pub fn calls(&self) -> u64 {
        self.priority_calls.load(Ordering::Relaxed) + self.bulk_calls.load(Ordering::Relaxed)
    }
}

/// Builds a member client whose every call goes through a [`ThrottleLayer`]. kube's own
/// retry layer is switched off: retries are counted and rate-limited here.
/// Every attempt that reaches the member is counted (`tidepool_api_requests_total`) under
/// `member`, and throttle waits are exported too.
pub fn client(
    config: kube::Config,
    member: &str,
    limits: &RateLimitSpec,
    stats: Arc<MemberStats>,
) -> kube::Result<kube::Client> {
    client_with(config, member, limits, stats, &Guard::default())
}

/// Who a member client says it is, and the fence that stops it (see [`crate::fence`]).
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// `User-Agent` of every call (the member's audit log names the replica by it).
    pub user_agent: Option<String>,
    /// Cancelled: every call fails at once, those in flight are abandoned.
    pub fence: tokio_util::sync::CancellationToken,
}

/// Like [`client`], with `guard`'s user agent and fence; the fence is outermost, so a call
/// waiting for its rate limit or retrying stops too.
pub fn client_with(
    mut config: kube::Config,
    member: &str,
    limits: &RateLimitSpec,
    stats: Arc<MemberStats>,
    guard: &Guard,
) -> kube::Result<kube::Client> {
    config.default_retry = false;
    if let Some(agent) = guard.user_agent.as_deref().and_then(|a| http::HeaderValue::from_str(a).ok()) {
        config.headers.push((http::header::USER_AGENT, agent));
    }
    let layer = ThrottleLayer::named(limits, stats, member);
    let counted = crate::api_metrics::ApiMetricsLayer::new(member);
    let fence = crate::fence::FenceLayer::new(guard.fence.clone());
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&counted)
        .with_layer(&layer)
        .with_layer(&fence)
        .build())
}

/// The buckets' clock: tokio's, the one the waits sleep on, so a test that pauses time
/// drives the rate limits too. Outside a paused test it reads the monotonic clock, as
/// governor's own default does.
#[derive(Debug, Clone, Copy, Default)]
struct TokioClock;

impl Clock for TokioClock {
    type Instant = std::time::Instant;

    fn now(&self) -> Self::Instant {
        tokio::time::Instant::now().into_std()
    }
}

type Bucket = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<std::time::Instant>>;

/// The state the lanes of one member share.
struct Limits {
    all: Bucket,
    bulk: Bucket,
    clock: TokioClock,
    /// Priority calls waiting for a token; bulk calls wait while there are any.
    priority_waiting: AtomicUsize,
    stats: Arc<MemberStats>,
    /// The member's name in exported metrics; empty: not exported.
    cluster: String,
}

fn quota(qps: u32, burst: u32) -> Quota {
    let nz = |v: u32| NonZeroU32::new(v.max(1)).unwrap_or(NonZeroU32::MIN);
    Quota::per_second(nz(qps)).allow_burst(nz(burst))
}

/// Counts a priority call as waiting while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Limits {
    /// Waits until `lane` may send one call.
    async fn acquire(&self, lane: Lane) {
        let started = tokio::time::Instant::now();
        let mut waited = false;
        let _waiting = (lane == Lane::Priority).then(|| Waiting::new(&self.priority_waiting));
        if lane == Lane::Bulk {
            loop {
                if self.priority_waiting.load(Ordering::SeqCst) > 0 {
                    waited = true;
                    tokio::time::sleep(YIELD).await;
                    continue;
                }
                match self.bulk.check() {
                    Ok(()) => break,
                    Err(not_until) => {
                        waited = true;
                        tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
                    }
                }
            }
        }
        loop {
            if lane == Lane::Bulk && self.priority_waiting.load(Ordering::SeqCst) > 0 {
                waited = true;
                tokio::time::sleep(YIELD).await;
                continue;
            }
            match self.all.check() {
                Ok(()) => break,
                Err(not_until) => {
                    waited = true;
                    tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
                }
            }
        }
        let stats = &self.stats;
        match lane {
            Lane::Priority => stats.priority_calls.fetch_add(1, Ordering::Relaxed),
            Lane::Bulk => stats.bulk_calls.fetch_add(1, Ordering::Relaxed),
        };
        if waited {
            stats.throttled_calls.fetch_add(1, Ordering::Relaxed);
            let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            stats.throttle_wait_micros.fetch_add(micros, Ordering::Relaxed);
            if !self.cluster.is_empty() {
                let labels = ClusterLabels { cluster: self.cluster.clone() };
                metrics().api_throttled.get_or_create(&labels).inc();
                metrics().api_throttle_seconds.get_or_create(&labels).inc_by(started.elapsed().as_secs_f64());
            }
        }
    }
}

/// Tower layer that rate-limits and retries a member client's calls.
#[derive(Clone)]
pub struct ThrottleLayer {
    limits: Arc<Limits>,
}

impl fmt::Debug for ThrottleLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottleLayer").finish_non_exhaustive()
    }
}

impl ThrottleLayer {
    pub fn new(spec: &RateLimitSpec, stats: Arc<MemberStats>) -> Self {
        Self::named(spec, stats, "")
    }

    /// Like [`ThrottleLayer::new`], exporting its waits as metrics of member `cluster`.
    pub fn named(spec: &RateLimitSpec, stats: Arc<MemberStats>, cluster: &str) -> Self {
        let (qps, burst) = (spec.qps(), spec.burst());
        let (bulk_qps, bulk_burst) = bulk_quota(qps, burst);
        Self {
            limits: Arc::new(Limits {
                all: RateLimiter::direct_with_clock(quota(qps, burst), TokioClock),
                bulk: RateLimiter::direct_with_clock(quota(bulk_qps, bulk_burst), TokioClock),
                clock: TokioClock,
                priority_waiting: AtomicUsize::new(0),
                stats,
                cluster: cluster.to_owned(),
            }),
        }
    }
}

type Inner<S> = Buffer<Request<Body>, <S as Service<Request<Body>>>::Future>;

impl<S, B> Layer<S> for ThrottleLayer
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send + Sync,
{
    type Service = Throttle<Inner<S>>;

    fn layer(&self, inner: S) -> Self::Service {
        // A buffer makes the inner service cheap to clone, so each call (and each retry of
        // it) can be sent from its own future.
        Throttle { inner: Buffer::new(inner, BUFFER), limits: self.limits.clone() }
    }
}

/// The service of [`ThrottleLayer`].
#[derive(Clone)]
pub struct Throttle<S> {
    inner: S,
    limits: Arc<Limits>,
}

impl<S> fmt::Debug for Throttle<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Throttle").finish_non_exhaustive()
    }
}

/// A copy of `req` for another attempt, when its body is in memory (kube's are).
fn try_clone(req: &Request<Body>) -> Option<Request<Body>> {
    let body = req.body().try_clone()?;
    let mut copy = Request::new(body);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    *copy.extensions_mut() = req.extensions().clone();
    Some(copy)
}

impl<S, B> Service<Request<Body>> for Throttle<S>
where
    S: Service<Request<Body>, Response = Response<B>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Response<B>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is awaited per call on a clone of the buffer, after the rate limit.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let limits = self.limits.clone();
        Box::pin(send(inner, limits, req))
    }
}

async fn send<S, B>(mut inner: S, limits: Arc<Limits>, mut req: Request<Body>) -> Result<Response<B>, BoxError>
where
    S: Service<Request<Body>, Response = Response<B>, Error = BoxError> + Send,
{
    let lane = lane(req.method(), req.uri().path());
    let mut attempt = 1;
    loop {
        limits.acquire(lane).await;
        let again = if attempt < MAX_ATTEMPTS { try_clone(&req) } else { None };
        let response = inner.ready().await?.call(req).await?;
        let status = response.status().as_u16();
        if !retryable(status) {
            return Ok(response);
        }
        let counter = if status == 429 { &limits.stats.rate_limited } else { &limits.stats.server_errors };
        counter.fetch_add(1, Ordering::Relaxed);
        let Some(next) = again else {
            return Ok(response);
        };
        let delay = retry_delay(attempt, retry_after(response.headers()), fastrand::f64());
        drop(response);
        limits.stats.retries.fetch_add(1, Ordering::Relaxed);
        debug!(status, attempt, delay_ms = delay.as_millis(), "member answered with a retryable error; retrying");
        tokio::time::sleep(delay).await;
        req = next;
        attempt += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creations_are_bulk_and_everything_else_is_priority() {
        let cases = [
            (Method::POST, "/api/v1/namespaces/tp-a/pods", Lane::Bulk),
            (Method::POST, "/api/v1/namespaces", Lane::Bulk),
            (Method::POST, "/api/v1/namespaces/tp-a/configmaps", Lane::Bulk),
            (Method::POST, "/apis/scheduling.k8s.io/v1/priorityclasses", Lane::Bulk),
            (Method::POST, "/apis/batch/v1/namespaces/x/jobs", Lane::Bulk),
            (Method::POST, "/api/v1/namespaces/tp-a/pods/p/eviction", Lane::Priority),
            (Method::POST, "/api/v1/namespaces/tp-a/pods/p/binding", Lane::Priority),
            (Method::GET, "/version", Lane::Priority),
            (Method::GET, "/api/v1/pods", Lane::Priority),
            (Method::DELETE, "/api/v1/namespaces/tp-a/pods/p", Lane::Priority),
            (Method::PATCH, "/api/v1/namespaces/tp-a/pods/p/status", Lane::Priority),
            (Method::PUT, "/api/v1/namespaces/tp-a/configmaps/c", Lane::Priority),
            (Method::POST, "/version", Lane::Priority),
        ];
        for (method, path, want) in cases {
            assert_eq!(lane(&method, path), want, "{method} {path}");
        }
    }

    #[test]
    fn the_bulk_bucket_leaves_a_fifth_of_the_rate_to_the_priority_lane() {
        assert_eq!(bulk_quota(50, 100), (40, 80));
        assert_eq!(bulk_quota(5, 5), (4, 4));
        // Never zero: a member limited to one call per second still gets its pods.
        assert_eq!(bulk_quota(1, 1), (1, 1));
        assert_eq!(bulk_quota(u32::MAX, 10), (3_435_973_836, 8));
    }

    #[test]
    fn backoff_doubles_with_jitter_and_is_capped() {
        // Lower and upper end of each step's jitter range.
        assert_eq!(retry_delay(1, None, 0.0), Duration::from_millis(100));
        assert_eq!(retry_delay(1, None, 1.0), Duration::from_millis(200));
        assert_eq!(retry_delay(2, None, 1.0), Duration::from_millis(400));
        assert_eq!(retry_delay(3, None, 0.0), Duration::from_millis(400));
        assert_eq!(retry_delay(30, None, 1.0), RETRY_MAX);
        // Every draw stays inside its step's range.
        for retry in 1..8 {
            for i in 0..100 {
                let unit = f64::from(i) / 100.0;
                let d = retry_delay(retry, None, unit);
                let step = RETRY_BASE.saturating_mul(1 << (retry - 1)).min(RETRY_MAX);
                assert!(d >= step / 2 && d <= step, "retry {retry} unit {unit}: {d:?}");
            }
        }
    }

    #[test]
    fn retry_after_is_honoured_within_the_cap() {
        assert_eq!(retry_delay(1, Some(Duration::from_secs(3)), 0.5), Duration::from_secs(3));
        // A shorter Retry-After does not shorten the backoff.
        assert_eq!(retry_delay(3, Some(Duration::ZERO), 1.0), Duration::from_millis(800));
        assert_eq!(retry_delay(1, Some(Duration::from_secs(3600)), 0.0), RETRY_MAX);
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static(" 7 "));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"));
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn only_overload_and_transient_server_errors_are_retried() {
        for code in [429, 500, 502, 503, 504] {
            assert!(retryable(code), "{code}");
        }
        for code in [200, 201, 400, 401, 403, 404, 409, 410, 422, 501] {
            assert!(!retryable(code), "{code}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn priority_calls_overtake_waiting_creations() {
        // 10/s, burst 5; the bulk bucket 8/s, burst 4. Five probes empty the shared bucket at
        // once; four creations then hold a bulk token each and wait for the shared bucket's
        // next token, due at 100 ms (time is paused: it only moves when every task waits).
        let stats = Arc::new(MemberStats::default());
        let layer = ThrottleLayer::new(&RateLimitSpec { qps: Some(10), burst: Some(5) }, stats.clone());
        let limits = layer.limits.clone();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let acquire = |lane: Lane, name: String| {
            let (limits, order) = (limits.clone(), order.clone());
            tokio::spawn(async move {
                limits.acquire(lane).await;
                order.lock().map(|mut o| o.push(name)).ok();
            })
        };
        let mut tasks: Vec<_> = (0..5).map(|i| acquire(Lane::Priority, format!("early{i}"))).collect();
        tasks.extend((0..4).map(|i| acquire(Lane::Bulk, format!("bulk{i}"))));
        // Every creation has asked before the late probe does: they are all waiting.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(order.lock().map(|o| o.len()).unwrap_or(0), 5, "only the five early probes went at once");
        tasks.push(acquire(Lane::Priority, "probe".to_owned()));
        for t in tasks {
            t.await.ok();
        }
        let order = order.lock().map(|o| o.clone()).unwrap_or_default();
        // The probe asked last and goes first of the waiting calls.
        assert_eq!(order.get(5).map(String::as_str), Some("probe"), "{order:?}");
        let s = stats.snapshot();
        assert_eq!((s.bulk_calls, s.priority_calls), (4, 6));
        // The four creations and the late probe waited; the early probes did not.
        assert_eq!(s.throttled_calls, 5, "{s:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_burst_calls_go_out_one_per_interval_and_never_sooner() {
        // 45 calls at once against 10/s with a burst of 5: GCRA lets 5 go at once, then one
        // every 100 ms, so call k (from 0) gets its token at (k − 4) × 100 ms at the earliest.
        let stats = Arc::new(MemberStats::default());
        let layer = ThrottleLayer::new(&RateLimitSpec { qps: Some(10), burst: Some(5) }, stats.clone());
        let start = tokio::time::Instant::now();
        let tasks: Vec<_> = (0..45)
            .map(|_| {
                let limits = layer.limits.clone();
                tokio::spawn(async move {
                    limits.acquire(Lane::Priority).await;
                    start.elapsed()
                })
            })
            .collect();
        let mut at = Vec::new();
        for t in tasks {
            at.push(t.await.unwrap());
        }
        at.sort();
        for (k, t) in at.iter().enumerate() {
            let earliest = Duration::from_millis(100) * u32::try_from(k.saturating_sub(4)).unwrap();
            assert!(*t >= earliest, "call {k} went at {t:?}, before {earliest:?}");
        }
        assert_eq!(at.iter().filter(|t| t.is_zero()).count(), 5, "the burst: {at:?}");
        assert_eq!(stats.snapshot().throttled_calls, 40);
    }

    /// Answers each call with the next status of `script` (the last one repeats).
    fn scripted(
        script: Vec<u16>,
        seen: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    ) -> impl Service<
        Request<Body>,
        Response = Response<String>,
        Error = BoxError,
        Future = BoxFuture<'static, Result<Response<String>, BoxError>>,
    > + Send
    + 'static {
        let script = Arc::new(std::sync::Mutex::new(script.into_iter().collect::<std::collections::VecDeque<_>>()));
        tower::service_fn(move |req: Request<Body>| {
            let (script, seen) = (script.clone(), seen.clone());
            Box::pin(async move {
                let body = req.into_body().collect_bytes().await.map_err(Box::new)?;
                seen.lock().map(|mut s| s.push(body.to_vec())).ok();
                let status = script
                    .lock()
                    .map(|mut s| if s.len() > 1 { s.pop_front() } else { s.front().copied() })
                    .ok()
                    .flatten()
                    .unwrap_or(200);
                let mut response = Response::new(String::new());
                *response.status_mut() = http::StatusCode::from_u16(status)?;
                if status == 429 {
                    response.headers_mut().insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("0"));
                }
                Ok::<_, BoxError>(response)
            }) as BoxFuture<'static, Result<Response<String>, BoxError>>
        })
    }

    fn create() -> Request<Body> {
        let mut req = Request::new(Body::from(b"{\"kind\":\"Pod\"}".to_vec()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = http::Uri::from_static("/api/v1/namespaces/tp-a/pods");
        req
    }

    #[tokio::test]
    async fn overload_answers_are_retried_with_the_same_body() {
        let stats = Arc::new(MemberStats::default());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut svc = ThrottleLayer::new(&RateLimitSpec::default(), stats.clone())
            .layer(scripted(vec![429, 503, 201], seen.clone()));
        let response = svc.ready().await.unwrap().call(create()).await.unwrap();
        assert_eq!(response.status(), 201);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|b| b == br#"{"kind":"Pod"}"#));
        let s = stats.snapshot();
        assert_eq!((s.bulk_calls, s.retries, s.rate_limited, s.server_errors), (3, 2, 1, 1));
    }

    #[tokio::test]
    async fn retries_stop_after_the_last_attempt_and_hand_back_the_answer() {
        let stats = Arc::new(MemberStats::default());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut svc =
            ThrottleLayer::new(&RateLimitSpec::default(), stats.clone()).layer(scripted(vec![500], seen.clone()));
        let response = svc.ready().await.unwrap().call(create()).await.unwrap();
        assert_eq!(response.status(), 500);
        assert_eq!(seen.lock().unwrap().len(), MAX_ATTEMPTS as usize);
        assert_eq!(stats.snapshot().retries, u64::from(MAX_ATTEMPTS - 1));
        // A client error is final at once.
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut svc =
            ThrottleLayer::new(&RateLimitSpec::default(), stats.clone()).layer(scripted(vec![409], seen.clone()));
        assert_eq!(svc.ready().await.unwrap().call(create()).await.unwrap().status(), 409);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}
