//! Tidepool's kubelet API: the one HTTPS server behind every virtual node's
//! `InternalIP:kubeletEndpoint.Port` (the virtual nodes tidepool-vk makes), which the training cluster's API
//! server calls for `kubectl logs`, `exec`, `attach` and `port-forward` on offloaded pods.
//!
//! Requests are routed by pod, not by node: the training pod names its virtual node, the
//! node its member session, and the pod's offload copy in that member ([`target`]) answers
//! through the member's own API server — logs streamed back as they come ([`logs`]),
//! exec/attach bridged from the SPDY streams the API server opens here ([`exec`], framing in
//! [`spdy`]) to a WebSocket session on the member, and port-forward the same way
//! ([`portforward`]). Resource usage of the offloaded pods (`/metrics/resource`, which
//! metrics-server scrapes, and `/stats/summary`) comes from the members' metrics APIs
//! ([`stats`], pure parts in [`usage`]).
//!
//! Only callers with a client certificate from the API server's client CA get past the TLS
//! handshake ([`tls`]). Certificate and CA come from the bridge config's files, or, with
//! none configured, from the training cluster: a CertificateSigningRequest for the serving
//! certificate and the API server's published client CA ([`bootstrap`], requests in [`csr`]).
//! Each request is then authorized as a kubelet in webhook mode does it: a
//! SubjectAccessReview in the training cluster for the certificate's user and groups on the
//! node's subresource ([`authz`]).

mod authz;
mod bootstrap;
mod csr;
mod der;
mod exec;
mod frames;
mod logs;
mod portforward;
pub mod spdy;
mod stats;
mod target;
mod tls;
mod upgrade;
mod usage;

pub use stats::resource_metrics_path;

pub use bootstrap::CertError;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use rustls::server::ServerConfig;
use tidepool_api::bridge::{KubeletConfig, KubeletServing};
use tidepool_federation::Members;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, error, info, info_span, warn};

/// How long a client gets to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("kubelet.{field} {}: {message}", path.display())]
    File { field: &'static str, path: PathBuf, message: String },
    #[error("kubelet API TLS: {0}")]
    Tls(String),
    #[error("kubelet API cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What request handlers share.
pub(crate) struct Context {
    pub(crate) training: Client,
    pub(crate) members: watch::Receiver<Members>,
    /// Recent authorization decisions ([`authz`]).
    pub(crate) decisions: authz::Decisions,
    /// CPU counters and member metrics availability of the usage endpoints ([`stats`]).
    pub(crate) usage: stats::State,
}

/// Serves the kubelet API in the background until the runtime stops. `None` when the
/// config turns it off (`kubelet.serving: off`).
///
/// With files, they are read and the address bound here: a bad file or address is a
/// start-up error. Without, nothing waits: the training cluster is asked for a serving
/// certificate ([`bootstrap`]), and the address is bound once it is issued and the client CA
/// is read, retried if it is taken. Until then nothing listens, so several tidepools on one
/// host (tests) only contend for the port once one of them has a certificate.
pub async fn start(
    config: &KubeletConfig,
    training: Client,
    members: watch::Receiver<Members>,
) -> Result<Option<SocketAddr>, ServeError> {
    let addr = SocketAddr::new(config.node_address, config.port);
    let decisions = authz::Decisions::new(authz::CACHE_CAPACITY);
    let ctx = Arc::new(Context { training: training.clone(), members, decisions, usage: stats::State::default() });
    match (config.serving_mode(), &config.tls_cert_file, &config.tls_key_file, &config.client_ca_file) {
        (KubeletServing::Off, ..) => {
            warn!("kubelet.serving is off: no kubelet API, so logs and exec of offloaded pods fail");
            Ok(None)
        }
        (KubeletServing::Files, Some(cert), Some(key), Some(ca)) => {
            let (certified, roots) = tls::from_files(cert, key, ca)?;
            let resolver = Arc::new(tls::ServingCert::new(Arc::new(certified)));
            let tls = Arc::new(tls::server_config(resolver, Arc::new(roots))?);
            let listener = TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?;
            let addr = listener.local_addr().map_err(|source| ServeError::Bind { addr, source })?;
            info!(%addr, "kubelet API listening, TLS from files");
            tokio::spawn(accept_loop(listener, watch::channel(Some(tls)).1, ctx));
            Ok(Some(addr))
        }
        // Validation keeps the files together and `files` with them.
        (KubeletServing::Files, ..) => Err(ServeError::Tls("kubelet.serving is files but a file is not set".into())),
        (KubeletServing::Csr, ..) => {
            let (tls_tx, mut tls_rx) = watch::channel(None);
            let identity = csr::ServingIdentity::from_config(config);
            let span = info_span!("kubelet_tls", %addr);
            tokio::spawn(bootstrap::run(training, identity, tls_tx).instrument(span.clone()));
            tokio::spawn(
                async move {
                    if tls_rx.wait_for(Option::is_some).await.is_err() {
                        return;
                    }
                    let listener = bind_retrying(addr).await;
                    info!(%addr, "kubelet API listening, TLS from the training cluster");
                    accept_loop(listener, tls_rx, ctx).await;
                }
                .instrument(span),
            );
            Ok(Some(addr))
        }
    }
}

/// Binds `addr`, retrying (1 s doubling to 60 s) while it fails: the port may be another
/// process's for a while, and the certificate is not worth less for it.
async fn bind_retrying(addr: SocketAddr) -> TcpListener {
    let mut delay = Duration::from_secs(1);
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return listener,
            Err(error) => {
                error!(%addr, %error, retry_in_seconds = delay.as_secs(), "kubelet API cannot listen; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(60));
            }
        }
    }
}

/// Accepts connections; each handshake uses the config `tls` holds when its connection is
/// accepted (a connection accepted before there is one is closed).
async fn accept_loop(listener: TcpListener, tls: watch::Receiver<Option<Arc<ServerConfig>>>, ctx: Arc<Context>) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(%error, "kubelet API accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(config) = tls.borrow().clone() else { continue };
        let (acceptor, ctx) = (TlsAcceptor::from(config), ctx.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => return debug!(%peer, %error, "kubelet API handshake refused"),
                Err(_) => return debug!(%peer, "kubelet API handshake timed out"),
            };
            // The verifier checked the chain; its leaf says who the caller is.
            let identity = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|leaf| authz::Identity::from_certificate(leaf))
                .map(Arc::new);
            let service = hyper::service::service_fn(move |req| handle(ctx.clone(), identity.clone(), req));
            // The timer bounds how long a request's headers may take (hyper's default, 30 s).
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(TokioIo::new(tls), service);
            if let Err(error) = conn.with_upgrades().await {
                debug!(%peer, %error, "kubelet API connection ended with an error");
            }
        });
    }
}

async fn handle(
    ctx: Arc<Context>,
    identity: Option<Arc<authz::Identity>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let query = query_pairs(req.uri().query().unwrap_or(""));
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    debug!(method = %req.method(), %path, user = identity.as_ref().map(|i| i.user.as_str()), "kubelet API request");
    // Every request is authorized before it is routed, as the kubelet's filter does: what
    // is not served is not told apart from what is forbidden.
    let Some(identity) = identity else {
        return Ok(text(StatusCode::UNAUTHORIZED, "Unauthorized"));
    };
    if let Err((status, message)) = authz::authorize(&ctx, &identity, &authz::asked(req.method(), &path)).await {
        return Ok(text(status, &message));
    }
    let response = match (req.method(), segments.as_slice()) {
        (&Method::GET, ["healthz"]) => text(StatusCode::OK, "ok"),
        (&Method::GET, ["pods"]) => pods(&ctx).await,
        (&Method::GET, ["metrics", "resource"]) => stats::serve_resource(&ctx, None).await,
        (&Method::GET, ["metrics", "resource", node]) => stats::serve_resource(&ctx, Some(node)).await,
        (&Method::GET, ["stats", "summary"]) => stats::serve_summary(&ctx, None).await,
        (&Method::GET, ["stats", "summary", node]) => stats::serve_summary(&ctx, Some(node)).await,
        (&Method::GET, ["containerLogs", ns, pod, container]) => logs::serve(&ctx, ns, pod, container, &query).await,
        // Kubelets also accept the pod UID before the container name.
        (_, [kind @ ("exec" | "attach"), ns, pod, container] | [kind @ ("exec" | "attach"), ns, pod, _, container]) => {
            let kind = if *kind == "exec" { exec::Kind::Exec } else { exec::Kind::Attach };
            let (ns, pod, container) = (ns.to_string(), pod.to_string(), container.to_string());
            exec::serve(&ctx, kind, &ns, &pod, &container, &query, req).await
        }
        (_, ["portForward", ns, pod] | ["portForward", ns, pod, _]) => {
            let (ns, pod) = (ns.to_string(), pod.to_string());
            portforward::serve(&ctx, &ns, &pod, req).await
        }
        _ => text(StatusCode::NOT_FOUND, "not found"),
    };
    Ok(response)
}

/// `GET /pods`: the training pods bound to tidepool's virtual nodes, as a PodList.
async fn pods(ctx: &Context) -> Response<Body> {
    let nodes: std::collections::HashSet<String> =
        ctx.members.borrow().values().flat_map(|m| m.pools.iter().map(|p| p.node.to_string())).collect();
    match Api::<Pod>::all(ctx.training.clone()).list(&ListParams::default()).await {
        Ok(list) => {
            let items: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some_and(|n| nodes.contains(n)))
                .collect();
            let body = serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items});
            let mut response = full(StatusCode::OK, Bytes::from(body.to_string()));
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
            response
        }
        Err(error) => text(StatusCode::BAD_GATEWAY, &format!("listing training pods: {error}")),
    }
}

pub(crate) fn full(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Full::new(body).map_err(|never| match never {}).boxed_unsync());
    *response.status_mut() = status;
    response
}

pub(crate) fn text(status: StatusCode, message: &str) -> Response<Body> {
    let mut response = full(status, Bytes::from(format!("{message}\n")));
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

/// `application/x-www-form-urlencoded` query pairs, in order (`command` repeats).
pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned())).collect()
}

/// The first value of `key` in `query`.
pub(crate) fn param<'a>(query: &'a [(String, String)], key: &str) -> Option<&'a str> {
    query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// A boolean query flag as Go's `strconv.ParseBool` reads it (absent: false).
pub(crate) fn flag(query: &[(String, String)], key: &str) -> bool {
    matches!(param(query, key), Some("1" | "t" | "T" | "true" | "TRUE" | "True"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_decoded_and_repeats_kept_in_order() {
        let q = query_pairs("command=sh&command=-c&command=echo+a%20b%3B%25&input=1&bad=%zz&end=%4");
        let commands: Vec<_> = q.iter().filter(|(k, _)| k == "command").map(|(_, v)| v.as_str()).collect();
        assert_eq!(commands, ["sh", "-c", "echo a b;%"]);
        assert!(flag(&q, "input"));
        assert!(!flag(&q, "output"));
        assert_eq!(param(&q, "bad"), Some("%zz"));
        assert_eq!(param(&q, "end"), Some("%4"));
    }
}
