//! The member client's throttle layer (`spec.rateLimits`) against a real member API server:
//! every call reaches the server once, through the limiter, and the calls beyond the burst
//! wait for it. How fast they may go is checked on paused time in
//! `federation::throttle::tests`; here, that the calls beyond the burst took at least the
//! time the rate allows them (a lower bound, which a slow machine only makes longer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PodTemplate;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use tidepool_api::crd::RateLimitSpec;
use tidepool_federation::{MemberStats, throttle};

use crate::harness::Env;

/// `apiserver_request_total` for LISTs of `resource`, all answer codes, from the server's
/// `/metrics`: what the member itself saw, not what the client thinks it sent.
async fn served_lists(client: &Client, resource: &str) -> u64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    let label = format!("resource=\"{resource}\"");
    text.lines()
        .filter(|l| l.starts_with("apiserver_request_total{") && l.contains(&label) && l.contains("verb=\"LIST\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::test]
async fn a_member_client_keeps_to_its_rate_limit() {
    const CALLS: u32 = 45;
    const QPS: u32 = 10;
    const BURST: u32 = 5;
    let env = Env::load();
    let direct = env.client("member-b").await;
    let kubeconfig = Kubeconfig::read_from(env.kubeconfig_path("member-b")).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.unwrap();
    let stats = Arc::new(MemberStats::default());
    let limits = RateLimitSpec { qps: Some(QPS), burst: Some(BURST) };
    let throttled = throttle::client(config, "e2e-throttle", &limits, stats.clone()).unwrap();

    // PodTemplates: a resource nothing else in the member lists, so the server's count is ours.
    let lists = |client: Client| async move {
        let api = Api::<PodTemplate>::all(client);
        let started = Instant::now();
        let results = futures::future::join_all((0..CALLS).map(|_| {
            let api = api.clone();
            async move { api.list(&ListParams::default().limit(1)).await }
        }))
        .await;
        assert!(results.iter().all(Result::is_ok), "a list failed: {:?}", results.iter().find(|r| r.is_err()));
        started.elapsed()
    };

    let before = served_lists(&direct, "podtemplates").await;
    let unthrottled = lists(direct.clone()).await;
    let middle = served_lists(&direct, "podtemplates").await;
    let elapsed = lists(throttled).await;
    let after = served_lists(&direct, "podtemplates").await;
    eprintln!("{CALLS} lists: direct {unthrottled:?}, throttled at {QPS}/s burst {BURST}: {elapsed:?}");

    // The counters are live: a scrape that failed would read as zero, not as CALLS.
    assert!(middle - before >= u64::from(CALLS), "server saw {} direct lists", middle - before);
    // Exactly CALLS: each call reached the server once, none twice (no retries), none lost.
    assert_eq!(after - middle, u64::from(CALLS), "server saw {} throttled lists", after - middle);
    let s = stats.snapshot();
    assert_eq!((s.priority_calls, s.bulk_calls, s.retries), (u64::from(CALLS), 0, 0), "{s:?}");
    // All CALLS asked at once: BURST went out at once, the rest waited for the limiter (one
    // more may have found a token that came due while the calls were being started).
    assert!(s.throttled_calls >= u64::from(CALLS - BURST - 1), "{s:?}");
    assert!(s.throttled_calls <= u64::from(CALLS - BURST), "{s:?}");
    assert!(s.throttle_wait > Duration::ZERO, "{s:?}");
    // No faster than the limit: the calls past the burst (one may have found a token come due)
    // need (CALLS - BURST - 1) / QPS seconds at least. Unthrottled, these lists take a fraction.
    let least = Duration::from_secs_f64(f64::from(CALLS - BURST - 1) / f64::from(QPS));
    assert!(elapsed >= least, "{CALLS} lists at {QPS}/s burst {BURST} took {elapsed:?}, under {least:?}");
}
