//! `GET /containerLogs/{namespace}/{pod}/{container}`: the offload pod's log from the
//! member's API server, with the same options, streamed back chunk by chunk as it arrives.
//! A client that goes away drops the response body, and with it the member request.

use bytes::Bytes;
use futures::{AsyncReadExt, StreamExt};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use kube::api::LogParams;
use tracing::debug;

use super::target::{Refusal, resolve};
use super::{Body, Context, flag, param, text};

/// Size of the chunks read from the member and written to the client.
const CHUNK: usize = 16 * 1024;

/// The kubelet's log options, as the API server sends them (`PodLogOptions` as a query).
pub(crate) fn log_params(container: &str, query: &[(String, String)]) -> Result<LogParams, String> {
    fn number(query: &[(String, String)], key: &str) -> Result<Option<i64>, String> {
        param(query, key).map(|v| v.parse::<i64>().map_err(|_| format!("{key}: not a number: {v}"))).transpose()
    }
    // Old clients say `tail=N` (or `tail=all`).
    let tail_lines = match param(query, "tail") {
        Some("all") => None,
        Some(_) => number(query, "tail")?,
        None => number(query, "tailLines")?,
    };
    let since_time = param(query, "sinceTime")
        .map(|v| v.parse::<jiff::Timestamp>().map_err(|e| format!("sinceTime: {e}")))
        .transpose()?;
    Ok(LogParams {
        container: Some(container.to_owned()),
        follow: flag(query, "follow"),
        limit_bytes: number(query, "limitBytes")?,
        pretty: false,
        previous: flag(query, "previous"),
        since_seconds: number(query, "sinceSeconds")?,
        since_time,
        tail_lines,
        timestamps: flag(query, "timestamps"),
    })
}

pub(crate) async fn serve(
    ctx: &Context,
    namespace: &str,
    pod: &str,
    container: &str,
    query: &[(String, String)],
) -> Response<Body> {
    let params = match log_params(container, query) {
        Ok(p) => p,
        Err(message) => return text(StatusCode::BAD_REQUEST, &message),
    };
    let target = match resolve(ctx, namespace, pod).await {
        Ok(t) => t,
        Err(Refusal(status, message)) => return text(status, &message),
    };
    let reader = match target.api.log_stream(&target.name, &params).await {
        Ok(r) => Box::pin(r),
        Err(e) => {
            let Refusal(status, message) = Refusal::api(&format!("member {}", target.member.name), &e);
            return text(status, &message);
        }
    };
    debug!(pod, namespace, container, member = %target.member.name, follow = params.follow, "streaming logs");
    let closed = Closed { pod: format!("{namespace}/{pod}"), follow: params.follow };
    let chunks = futures::stream::unfold(Some(reader), move |reader| async move {
        let mut reader = reader?;
        let mut buf = vec![0u8; CHUNK];
        match reader.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Frame::data(Bytes::from(buf))), Some(reader)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    // The guard goes with the body: dropped when the stream ends or the client goes away.
    let chunks = chunks.inspect(move |_| {
        let _ = &closed;
    });
    let mut response = Response::new(StreamBody::new(chunks).boxed_unsync());
    response.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain"));
    response
}

/// Logs when a log stream ends, for whatever reason (end of log, client gone, error).
struct Closed {
    pod: String,
    follow: bool,
}

impl Drop for Closed {
    fn drop(&mut self) {
        debug!(pod = %self.pod, follow = self.follow, "log stream closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query_pairs;

    #[test]
    fn the_api_servers_log_options_map_one_to_one() {
        let q = query_pairs(
            "follow=true&tailLines=5&sinceSeconds=30&timestamps=1&previous=false&limitBytes=100\
             &sinceTime=2026-01-02T03%3A04%3A05Z",
        );
        let p = log_params("main", &q).unwrap();
        assert_eq!(p.container.as_deref(), Some("main"));
        assert!(p.follow && p.timestamps && !p.previous);
        assert_eq!((p.tail_lines, p.since_seconds, p.limit_bytes), (Some(5), Some(30), Some(100)));
        assert_eq!(p.since_time.unwrap().to_string(), "2026-01-02T03:04:05Z");
    }

    #[test]
    fn the_old_tail_parameter_still_counts() {
        assert_eq!(log_params("c", &query_pairs("tail=3")).unwrap().tail_lines, Some(3));
        assert_eq!(log_params("c", &query_pairs("tail=all&tailLines=3")).unwrap().tail_lines, None);
    }

    #[test]
    fn a_malformed_option_is_a_bad_request() {
        assert!(log_params("c", &query_pairs("tailLines=x")).unwrap_err().contains("tailLines"));
        assert!(log_params("c", &query_pairs("sinceTime=yesterday")).is_err());
    }
}
