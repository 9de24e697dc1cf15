//! `/portForward/{namespace}/{pod}`: `kubectl port-forward` to an offloaded pod. The API
//! server upgrades the request to SPDY/3.1 (`portforward.k8s.io`) and, for every connection
//! the user makes to the local port, opens a pair of streams sharing a `requestID`: `error`
//! and `data`, each with the `port` header. Once both of a pair are open, the pod's port is
//! dialled through the member's API server (a WebSocket port-forward, kube's
//! `Portforwarder`) and the bytes are copied both ways; a failure is written to the pair's
//! error stream, which `kubectl` prints, and the data stream is closed.

use std::collections::HashMap;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::{debug, info};

use super::frames::{CHUNK, ClientFrames, write_frames};
use super::spdy::{self, FLAG_FIN, Frame};
use super::target::{Refusal, Target, resolve};
use super::{Body, Context, text, upgrade};

/// The port-forward stream protocol kubelets speak.
const PROTOCOL: &str = "portforward.k8s.io";

pub(crate) async fn serve(ctx: &Context, namespace: &str, pod: &str, mut req: Request<Incoming>) -> Response<Body> {
    if let Some(refused) = upgrade::refusal(req.headers(), "port-forward", PROTOCOL) {
        return refused;
    }
    let target = match resolve(ctx, namespace, pod).await {
        Ok(t) => t,
        Err(Refusal(status, message)) => return text(status, &message),
    };
    info!(pod, member = %target.member.name, "port-forward");
    upgrade::switch(&mut req, pod.to_owned(), "port-forward", PROTOCOL, move |io| session(io, target))
}

/// The two streams of one forwarded connection, as they open.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Pair {
    pub(super) port: u16,
    pub(super) error: Option<u32>,
    pub(super) data: Option<u32>,
}

/// What a new stream's headers say: (request id, port, is it the data stream). Pure.
pub(super) fn stream_kind(headers: &spdy::Headers) -> Result<(String, u16, bool), String> {
    let kind = spdy::header(headers, "streamtype").ok_or("missing streamType")?;
    let data = match kind {
        "data" => true,
        "error" => false,
        other => return Err(format!("invalid stream type {other:?}")),
    };
    let port = spdy::header(headers, "port").ok_or("missing port")?;
    let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| format!("invalid port {port:?}"))?;
    let request = spdy::header(headers, "requestid").unwrap_or_default().to_owned();
    Ok((request, port, data))
}

/// One upgraded connection: pairs of streams in, one member port-forward per pair.
async fn session<IO>(io: IO, target: Target)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (read_half, write_half) = tokio::io::split(io);
    let (out, out_rx) = mpsc::channel::<Frame>(64);
    let writer = tokio::spawn(write_frames(write_half, out_rx));
    let target = std::sync::Arc::new(target);
    let mut frames = ClientFrames::new(read_half, out.clone(), "port-forward");
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    // Client bytes for each open data stream, to its pair's member connection.
    let mut inbound: HashMap<u32, mpsc::Sender<Bytes>> = HashMap::new();
    while let Some(frame) = frames.next().await {
        match frame {
            Frame::SynStream { stream, headers, .. } => {
                let (request, port, data) = match stream_kind(&headers) {
                    Ok(k) => k,
                    Err(why) => {
                        debug!(why, "port-forward: stream refused");
                        let _ = out.send(Frame::RstStream { stream, status: spdy::RST_REFUSED_STREAM }).await;
                        continue;
                    }
                };
                let _ = out.send(Frame::SynReply { stream, flags: 0, headers: vec![] }).await;
                let pair = pairs.entry(request.clone()).or_insert_with(|| Pair { port, ..Pair::default() });
                if data {
                    pair.data = Some(stream)
                } else {
                    pair.error = Some(stream)
                }
                if let Pair { port, error: Some(error), data: Some(data) } = pair.clone() {
                    pairs.remove(&request);
                    let (tx, rx) = mpsc::channel::<Bytes>(16);
                    inbound.insert(data, tx);
                    tokio::spawn(forward(target.clone(), port, error, data, rx, out.clone()));
                }
            }
            Frame::Data { stream, flags, data } => {
                if let Some(tx) = inbound.get(&stream)
                    && !data.is_empty()
                    && tx.send(data).await.is_err()
                {
                    inbound.remove(&stream);
                }
                if flags & FLAG_FIN != 0 {
                    inbound.remove(&stream);
                }
            }
            Frame::RstStream { stream, .. } => {
                inbound.remove(&stream);
            }
            _ => {}
        }
    }
    drop(inbound);
    drop(out);
    let _ = writer.await;
}

/// One forwarded connection: the pod's `port` through the member, bytes both ways; what
/// goes wrong is written to the error stream, as kubelets do.
async fn forward(
    target: std::sync::Arc<Target>,
    port: u16,
    error: u32,
    data: u32,
    mut from_client: mpsc::Receiver<Bytes>,
    out: mpsc::Sender<Frame>,
) {
    let fin = |stream| Frame::Data { stream, flags: FLAG_FIN, data: Bytes::new() };
    let mut forwarder = match target.api.portforward(&target.name, &[port]).await {
        Ok(f) => f,
        Err(e) => {
            let message = format!("member {}: port-forward to port {port}: {e}", target.member.name);
            let _ = out.send(Frame::Data { stream: error, flags: FLAG_FIN, data: Bytes::from(message) }).await;
            let _ = out.send(fin(data)).await;
            return;
        }
    };
    let (Some(stream), failure) = (forwarder.take_stream(port), forwarder.take_error(port)) else {
        let _ = out.send(fin(error)).await;
        let _ = out.send(fin(data)).await;
        return;
    };
    let (mut pod_read, mut pod_write) = tokio::io::split(stream);
    let upstream = async move {
        while let Some(chunk) = from_client.recv().await {
            if pod_write.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = pod_write.shutdown().await;
    };
    let out_data = out.clone();
    let downstream = async move {
        let mut chunk = vec![0u8; CHUNK];
        loop {
            match pod_read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let frame = Frame::Data { stream: data, flags: 0, data: Bytes::copy_from_slice(&chunk[..n]) };
                    if out_data.send(frame).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = out_data.send(fin(data)).await;
    };
    tokio::join!(upstream, downstream);
    let message = match failure {
        Some(f) => f.await,
        None => None,
    };
    let _ =
        out.send(Frame::Data { stream: error, flags: FLAG_FIN, data: Bytes::from(message.unwrap_or_default()) }).await;
    let _ = forwarder.join().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> spdy::Headers {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_stream_says_its_pair_its_port_and_its_kind() {
        let h = headers(&[("streamtype", "data"), ("port", "8080"), ("requestid", "3")]);
        assert_eq!(stream_kind(&h), Ok(("3".to_owned(), 8080, true)));
        let h = headers(&[("streamtype", "error"), ("port", "8080"), ("requestid", "3")]);
        assert_eq!(stream_kind(&h), Ok(("3".to_owned(), 8080, false)));
        for bad in [
            headers(&[("port", "80")]),
            headers(&[("streamtype", "stdin"), ("port", "80")]),
            headers(&[("streamtype", "data")]),
            headers(&[("streamtype", "data"), ("port", "0")]),
            headers(&[("streamtype", "data"), ("port", "99999")]),
        ] {
            assert!(stream_kind(&bad).is_err(), "{bad:?}");
        }
    }
}
