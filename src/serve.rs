//! The operations endpoint: `/metrics` (OpenMetrics text), `/healthz` (the process runs) and
//! `/readyz` (503 until [`crate::ready`] says ready; a standby replica answers `standby`).

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tidepool_api::metrics::metrics;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info};

use crate::ready::Readiness;

/// Binds `addr` (an error here stops start-up: a wrong address is a config mistake) and
/// serves it in the background.
pub async fn start(addr: SocketAddr, ready: watch::Receiver<Readiness>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("metrics.bindAddress {addr}: {e}"))?;
    info!(%addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else { continue };
            let ready = ready.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |r| {
                    let readiness = ready.borrow().clone();
                    async move { Ok::<_, Infallible>(answer(&r, &readiness)) }
                });
                let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                if let Err(e) = conn.await {
                    debug!(%peer, error = %e, "metrics connection ended");
                }
            });
        }
    });
    Ok(())
}

fn answer(request: &Request<Incoming>, readiness: &Readiness) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match request.uri().path() {
        "/metrics" => {
            (StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics().encode())
        }
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        "/readyz" => {
            let status = if readiness.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            (status, "text/plain", format!("{}\n", readiness.body()))
        }
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".to_owned()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}
