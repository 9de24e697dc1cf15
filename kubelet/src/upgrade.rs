//! The upgrade exec, attach and port-forward share: the API server asks for SPDY/3.1 with
//! `Connection: Upgrade` and offers stream protocols in `X-Stream-Protocol-Version`; the
//! kubelet picks one it speaks, answers `101 Switching Protocols` naming it, and the session
//! runs on the upgraded connection once hyper hands it over.

use std::future::Future;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{CONNECTION, HeaderMap, HeaderValue, UPGRADE};
use hyper::upgrade::Upgraded;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tracing::warn;

use super::{Body, full, text};

pub(super) const PROTOCOL_HEADER: &str = "X-Stream-Protocol-Version";

/// Whether any value of header `name` lists `token` (comma-separated, case as `exact` says).
fn lists(headers: &HeaderMap, name: impl hyper::header::AsHeaderName, token: &str, exact: bool) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| if exact { t.trim() == token } else { t.trim().eq_ignore_ascii_case(token) })
}

/// The refusal, as a kubelet answers it, of a request that is not an upgrade to SPDY/3.1
/// (400, saying that `what` needs one) or that does not offer `protocol` (403).
pub(super) fn refusal(headers: &HeaderMap, what: &str, protocol: &str) -> Option<Response<Body>> {
    if !(lists(headers, CONNECTION, "upgrade", false) && lists(headers, UPGRADE, "SPDY/3.1", false)) {
        return Some(text(StatusCode::BAD_REQUEST, &format!("{what} need a Connection: Upgrade to SPDY/3.1")));
    }
    if !lists(headers, PROTOCOL_HEADER, protocol, true) {
        return Some(text(
            StatusCode::FORBIDDEN,
            &format!("unable to negotiate a stream protocol: this kubelet speaks {protocol}"),
        ));
    }
    None
}

/// Answers `101 Switching Protocols` with `protocol`, and runs `session` on the upgraded
/// connection (for `pod`; a failed upgrade is logged as `what`'s).
pub(super) fn switch<F, Fut>(
    req: &mut Request<Incoming>,
    pod: String,
    what: &'static str,
    protocol: &'static str,
    session: F,
) -> Response<Body>
where
    F: FnOnce(TokioIo<Upgraded>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        match upgrade.await {
            Ok(upgraded) => session(TokioIo::new(upgraded)).await,
            Err(error) => warn!(pod, %error, "{what} upgrade failed"),
        }
    });
    let mut response = full(StatusCode::SWITCHING_PROTOCOLS, Bytes::new());
    let h = response.headers_mut();
    h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(UPGRADE, HeaderValue::from_static("SPDY/3.1"));
    h.insert(PROTOCOL_HEADER, HeaderValue::from_static(protocol));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (hyper::header::HeaderName::from_static(k), HeaderValue::from_static(v))).collect()
    }

    #[test]
    fn only_an_spdy_upgrade_offering_the_protocol_is_let_through() {
        let upgrade = [("connection", "keep-alive, Upgrade"), ("upgrade", "spdy/3.1")];
        let offered =
            headers(&[upgrade[0], upgrade[1], ("x-stream-protocol-version", "v5.channel.k8s.io, v4.channel.k8s.io")]);
        assert!(refusal(&offered, "exec", "v4.channel.k8s.io").is_none());
        let not_offered = headers(&[upgrade[0], upgrade[1], ("x-stream-protocol-version", "v3.channel.k8s.io")]);
        assert_eq!(refusal(&not_offered, "exec", "v4.channel.k8s.io").map(|r| r.status()), Some(StatusCode::FORBIDDEN));
        let websocket =
            headers(&[upgrade[0], ("upgrade", "websocket"), ("x-stream-protocol-version", "v4.channel.k8s.io")]);
        assert_eq!(refusal(&websocket, "exec", "v4.channel.k8s.io").map(|r| r.status()), Some(StatusCode::BAD_REQUEST));
        let plain = headers(&[("x-stream-protocol-version", "portforward.k8s.io")]);
        assert_eq!(
            refusal(&plain, "port-forward", "portforward.k8s.io").map(|r| r.status()),
            Some(StatusCode::BAD_REQUEST)
        );
    }
}
