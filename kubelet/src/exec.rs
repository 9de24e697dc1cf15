//! `/exec/{namespace}/{pod}/{container}` and `/attach/...`: the API server upgrades the
//! request to SPDY/3.1 and opens one stream per channel, named by its `streamType` header
//! (`error`, `stdin`, `stdout`, `stderr`, `resize`). Once every stream the query asks for
//! is open, the command runs in the offload pod through the member's API server (a
//! WebSocket session, kube's `AttachedProcess`), and the channels are pumped both ways.
//! The outcome goes to the `error` stream as a v1 Status, as kubelets report it in the
//! `v4.channel.k8s.io` protocol: `Success`, or `Failure` with reason `NonZeroExitCode` and
//! the code as cause `ExitCode`, which `kubectl exec` turns into its own exit code.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use futures::SinkExt;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use kube::api::{AttachParams, AttachedProcess, TerminalSize};
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::frames::{CHUNK, ClientFrames, write_frames};
use super::spdy::{self, FLAG_FIN, Frame};
use super::target::{Refusal, Target, resolve};
use super::{Body, Context, flag, text, upgrade};

/// The only stream protocol spoken: the one with the Status on the error stream and a resize
/// stream. Every API server since 1.4 offers it.
pub(crate) const PROTOCOL_V4: &str = "v4.channel.k8s.io";
/// How long the API server gets to open the streams it asked for (kubelet's default).
const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the API server gets to close the connection once everything was sent.
const LINGER: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Exec,
    Attach,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Channel {
    Error,
    Stdin,
    Stdout,
    Stderr,
    Resize,
}

impl Channel {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "error" => Self::Error,
            "stdin" => Self::Stdin,
            "stdout" => Self::Stdout,
            "stderr" => Self::Stderr,
            "resize" => Self::Resize,
            _ => return None,
        })
    }
}

/// What the query asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Options {
    stdin: bool,
    stdout: bool,
    stderr: bool,
    tty: bool,
    command: Vec<String>,
}

impl Options {
    fn parse(kind: Kind, query: &[(String, String)]) -> Result<Self, String> {
        let tty = flag(query, "tty");
        let o = Options {
            stdin: flag(query, "input"),
            stdout: flag(query, "output"),
            // A terminal has one output: stderr is merged into stdout.
            stderr: flag(query, "error") && !tty,
            tty,
            command: query.iter().filter(|(k, _)| k == "command").map(|(_, v)| v.clone()).collect(),
        };
        if !(o.stdin || o.stdout || o.stderr) {
            return Err("you must specify at least 1 of stdin, stdout, stderr".into());
        }
        if kind == Kind::Exec && o.command.is_empty() {
            return Err("no command given".into());
        }
        Ok(o)
    }

    /// The streams the API server opens for these options.
    fn expected(&self) -> Vec<Channel> {
        let mut c = vec![Channel::Error];
        for (on, ch) in [
            (self.stdin, Channel::Stdin),
            (self.stdout, Channel::Stdout),
            (self.stderr, Channel::Stderr),
            (self.tty, Channel::Resize),
        ] {
            if on {
                c.push(ch);
            }
        }
        c
    }
}

pub(crate) async fn serve(
    ctx: &Context,
    kind: Kind,
    namespace: &str,
    pod: &str,
    container: &str,
    query: &[(String, String)],
    mut req: Request<Incoming>,
) -> Response<Body> {
    if let Some(refused) = upgrade::refusal(req.headers(), "exec and attach", PROTOCOL_V4) {
        return refused;
    }
    let options = match Options::parse(kind, query) {
        Ok(o) => o,
        Err(message) => return text(StatusCode::BAD_REQUEST, &message),
    };
    let target = match resolve(ctx, namespace, pod).await {
        Ok(t) => t,
        Err(Refusal(status, message)) => return text(status, &message),
    };
    let member = target.member.name.clone();
    info!(pod, %member, ?kind, command = ?options.command, "remote command");
    let container = container.to_owned();
    upgrade::switch(&mut req, pod.to_owned(), "exec", PROTOCOL_V4, move |io| {
        session(io, target, container, kind, options)
    })
}

/// Streams of the session, by channel, once all expected ones are open.
type StreamIds = HashMap<Channel, u32>;

/// One upgraded connection: its frames in, frames out, and the member's process in between.
async fn session<IO>(io: IO, target: Target, container: String, kind: Kind, options: Options)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (read_half, write_half) = tokio::io::split(io);
    let (out_tx, out_rx) = mpsc::channel::<Frame>(64);
    let writer = tokio::spawn(write_frames(write_half, out_rx));
    let (ready_tx, ready_rx) = oneshot::channel::<StreamIds>();
    let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(16);
    let (resize_tx, resize_rx) = mpsc::channel::<TerminalSize>(4);
    let mut reader =
        tokio::spawn(read_frames(read_half, out_tx.clone(), options.expected(), ready_tx, stdin_tx, resize_tx));

    let ids = tokio::select! {
        ids = tokio::time::timeout(STREAM_CREATION_TIMEOUT, ready_rx) => match ids {
            Ok(Ok(ids)) => ids,
            _ => {
                warn!("exec: the API server did not open the expected streams");
                reader.abort();
                return;
            }
        },
        _ = &mut reader => return,
    };
    let status = tokio::select! {
        status = run(&target, &container, kind, &options, &ids, &out_tx, stdin_rx, resize_rx) => status,
        // The API server hung up: dropping `run` drops the member session too.
        _ = &mut reader => {
            debug!("exec: client went away");
            return;
        }
    };
    if let Some(&id) = ids.get(&Channel::Error) {
        if let Some(status) = status {
            let _ = out_tx.send(Frame::Data { stream: id, flags: 0, data: Bytes::from(status.to_string()) }).await;
        }
        let _ = out_tx.send(Frame::Data { stream: id, flags: FLAG_FIN, data: Bytes::new() }).await;
    }
    drop(out_tx);
    let _ = writer.await;
    // The client closes once it has read everything; it gets a little while to do so.
    if tokio::time::timeout(LINGER, &mut reader).await.is_err() {
        reader.abort();
    }
}

/// Runs the command in the member and pumps its channels; the Status for the error stream
/// (`None`: success, nothing to write).
#[allow(clippy::too_many_arguments)]
async fn run(
    target: &Target,
    container: &str,
    kind: Kind,
    options: &Options,
    ids: &StreamIds,
    out: &mpsc::Sender<Frame>,
    mut stdin_rx: mpsc::Receiver<Bytes>,
    mut resize_rx: mpsc::Receiver<TerminalSize>,
) -> Option<serde_json::Value> {
    let params = AttachParams {
        container: Some(container.to_owned()),
        stdin: options.stdin,
        stdout: options.stdout,
        stderr: options.stderr,
        tty: options.tty,
        ..AttachParams::default()
    };
    let started = match kind {
        Kind::Exec => target.api.exec(&target.name, options.command.clone(), &params).await,
        Kind::Attach => target.api.attach(&target.name, &params).await,
    };
    let mut process: AttachedProcess = match started {
        Ok(p) => p,
        Err(error) => {
            // Close the output streams, so the client reads EOF and then this Status.
            for ch in [Channel::Stdout, Channel::Stderr] {
                if let Some(&id) = ids.get(&ch) {
                    let _ = out.send(Frame::Data { stream: id, flags: FLAG_FIN, data: Bytes::new() }).await;
                }
            }
            let message = format!("member {}: {error}", target.member.name);
            return Some(
                json!({"metadata": {}, "status": "Failure", "message": message, "reason": "InternalError", "code": 500}),
            );
        }
    };
    let status = process.take_status();
    if let (Some(mut stdin), true) = (process.stdin(), options.stdin) {
        tokio::spawn(async move {
            while let Some(chunk) = stdin_rx.recv().await {
                if stdin.write_all(&chunk).await.is_err() {
                    return;
                }
            }
            let _ = stdin.shutdown().await;
        });
    }
    if let Some(mut sizes) = process.terminal_size() {
        tokio::spawn(async move {
            while let Some(size) = resize_rx.recv().await {
                if sizes.send(size).await.is_err() {
                    return;
                }
            }
        });
    }
    let stdout = pump(process.stdout(), ids.get(&Channel::Stdout).copied(), out.clone());
    let stderr = pump(process.stderr(), ids.get(&Channel::Stderr).copied(), out.clone());
    tokio::join!(stdout, stderr);
    let status = match status {
        Some(s) => s.await,
        None => None,
    };
    let _ = process.join().await;
    match status {
        Some(s) if s.status.as_deref() == Some("Success") => None,
        Some(s) => {
            Some(serde_json::to_value(&s).unwrap_or_else(|_| json!({"status": "Failure", "message": s.message})))
        }
        None => Some(json!({"metadata": {}, "status": "Failure", "reason": "InternalError",
                            "message": format!("member {} ended the session without an exit status", target.member.name)})),
    }
}

/// Copies one output of the member's process to its stream, then closes the stream.
async fn pump<R: AsyncRead + Unpin>(source: Option<R>, stream: Option<u32>, out: mpsc::Sender<Frame>) {
    let (Some(mut source), Some(stream)) = (source, stream) else { return };
    let mut buf = vec![0u8; CHUNK];
    loop {
        match source.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let frame = Frame::Data { stream, flags: 0, data: Bytes::copy_from_slice(&buf[..n]) };
                if out.send(frame).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = out.send(Frame::Data { stream, flags: FLAG_FIN, data: Bytes::new() }).await;
}

/// Reads the client's frames until it hangs up: answers new streams and pings, reports the
/// stream ids once every expected stream is open, and passes stdin and resize data on.
async fn read_frames<R: tokio::io::AsyncRead + Unpin>(
    io: R,
    out: mpsc::Sender<Frame>,
    expected: Vec<Channel>,
    ready: oneshot::Sender<StreamIds>,
    stdin: mpsc::Sender<Bytes>,
    resize: mpsc::Sender<TerminalSize>,
) {
    let mut frames = ClientFrames::new(io, out.clone(), "exec");
    let mut channels: HashMap<u32, Channel> = HashMap::new();
    let mut ready = Some(ready);
    let mut stdin = Some(stdin);
    let mut resize_buf = Vec::new();
    while let Some(frame) = frames.next().await {
        match frame {
            Frame::SynStream { stream, headers, .. } => {
                let Some(channel) = spdy::header(&headers, "streamtype").and_then(Channel::parse) else {
                    let _ = out.send(Frame::RstStream { stream, status: spdy::RST_REFUSED_STREAM }).await;
                    continue;
                };
                channels.insert(stream, channel);
                let _ = out.send(Frame::SynReply { stream, flags: 0, headers: vec![] }).await;
                if expected.iter().all(|c| channels.values().any(|have| have == c))
                    && let Some(ready) = ready.take()
                {
                    let ids = channels.iter().map(|(id, ch)| (*ch, *id)).collect();
                    let _ = ready.send(ids);
                }
            }
            Frame::Data { stream, flags, data } => match channels.get(&stream) {
                Some(Channel::Stdin) => {
                    if let Some(tx) = &stdin
                        && !data.is_empty()
                        && tx.send(data).await.is_err()
                    {
                        stdin = None;
                    }
                    if flags & FLAG_FIN != 0 {
                        stdin = None;
                    }
                }
                Some(Channel::Resize) => {
                    resize_buf.extend_from_slice(&data);
                    for size in take_sizes(&mut resize_buf) {
                        let _ = resize.try_send(size);
                    }
                }
                _ => {}
            },
            Frame::RstStream { stream, .. } if channels.get(&stream) == Some(&Channel::Stdin) => stdin = None,
            _ => {}
        }
    }
}

/// Complete `{"Width":W,"Height":H}` messages at the front of `buf` (it keeps the rest).
fn take_sizes(buf: &mut Vec<u8>) -> Vec<TerminalSize> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Size {
        width: u16,
        height: u16,
    }
    let mut sizes = Vec::new();
    let mut stream = serde_json::Deserializer::from_slice(buf).into_iter::<Size>();
    let mut consumed = 0;
    while let Some(Ok(s)) = stream.next() {
        consumed = stream.byte_offset();
        sizes.push(TerminalSize { width: s.width, height: s.height });
    }
    buf.drain(..consumed);
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query_pairs;
    use crate::spdy::Codec;
    use bytes::BytesMut;

    #[test]
    fn the_streams_waited_for_follow_the_query() {
        let o = Options::parse(Kind::Exec, &query_pairs("command=ls&input=1&output=1&error=1&tty=0")).unwrap();
        assert_eq!(o.expected(), [Channel::Error, Channel::Stdin, Channel::Stdout, Channel::Stderr]);
        assert_eq!(o.command, ["ls"]);
        let t = Options::parse(Kind::Attach, &query_pairs("output=1&error=1&tty=1")).unwrap();
        assert_eq!(t.expected(), [Channel::Error, Channel::Stdout, Channel::Resize]);
    }

    #[test]
    fn a_request_without_channels_or_command_is_refused() {
        assert!(Options::parse(Kind::Exec, &query_pairs("command=ls")).is_err());
        assert!(Options::parse(Kind::Exec, &query_pairs("output=1")).is_err());
        assert!(Options::parse(Kind::Attach, &query_pairs("output=1")).is_ok());
    }

    /// The API server's side of a session, over an in-memory pipe: it opens the streams,
    /// pings, writes stdin and a resize, and closes stdin.
    #[tokio::test]
    async fn streams_are_answered_and_stdin_and_resize_passed_on() {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (out_tx, mut out_rx) = mpsc::channel(16);
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stdin_tx, mut stdin_rx) = mpsc::channel(4);
        let (resize_tx, mut resize_rx) = mpsc::channel(4);
        let expected = vec![Channel::Error, Channel::Stdin, Channel::Stdout, Channel::Resize];
        let reader = tokio::spawn(read_frames(server, out_tx, expected, ready_tx, stdin_tx, resize_tx));

        let mut codec = Codec::new();
        let mut wire = BytesMut::new();
        let syn = |stream: u32, kind: &str| Frame::SynStream {
            stream,
            associated: 0,
            priority: 0,
            flags: 0,
            headers: vec![("streamType".into(), kind.into())],
        };
        for frame in [
            syn(1, "error"),
            syn(3, "stdin"),
            syn(5, "stdout"),
            syn(7, "bogus"),
            syn(9, "resize"),
            Frame::Ping { id: 11 },
            Frame::Data { stream: 3, flags: 0, data: Bytes::from_static(b"input") },
            Frame::Data { stream: 9, flags: 0, data: Bytes::from_static(br#"{"Width":120,"Height":40}"#) },
            Frame::Data { stream: 3, flags: FLAG_FIN, data: Bytes::new() },
        ] {
            codec.encode(&frame, &mut wire).unwrap();
        }
        let mut client = client;
        client.write_all(&wire).await.unwrap();

        let ids = ready_rx.await.unwrap();
        assert_eq!(
            (ids[&Channel::Error], ids[&Channel::Stdin], ids[&Channel::Stdout], ids[&Channel::Resize]),
            (1, 3, 5, 9)
        );
        let mut answers = Vec::new();
        for _ in 0..6 {
            answers.push(out_rx.recv().await.unwrap());
        }
        let replies: Vec<u32> = answers
            .iter()
            .filter_map(|f| if let Frame::SynReply { stream, .. } = f { Some(*stream) } else { None })
            .collect();
        assert_eq!(replies, [1, 3, 5, 9]);
        assert!(answers.contains(&Frame::RstStream { stream: 7, status: spdy::RST_REFUSED_STREAM }));
        assert!(answers.contains(&Frame::Ping { id: 11 }));
        assert_eq!(stdin_rx.recv().await.unwrap(), Bytes::from_static(b"input"));
        assert_eq!(stdin_rx.recv().await, None, "FIN on stdin closes it");
        let size = resize_rx.recv().await.unwrap();
        assert_eq!((size.width, size.height), (120, 40));

        drop(client);
        reader.await.unwrap();
    }

    #[test]
    fn resize_messages_may_arrive_in_pieces() {
        let mut buf = br#"{"Width":80,"Height":24}{"Width":1"#.to_vec();
        let sizes = take_sizes(&mut buf);
        assert_eq!(sizes.len(), 1);
        assert_eq!((sizes[0].width, sizes[0].height), (80, 24));
        buf.extend_from_slice(br#"00,"Height":50}"#);
        let sizes = take_sizes(&mut buf);
        assert_eq!((sizes[0].width, sizes[0].height), (100, 50));
        assert!(buf.is_empty());
    }
}
