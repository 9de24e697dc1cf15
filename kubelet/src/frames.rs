//! The two halves of one SPDY connection, shared by exec/attach and port-forward: frames
//! written from a channel, and frames read with the connection-level ones handled here
//! (pings answered, GO_AWAY and bad data end the session), so each user sees only its
//! streams: SYN_STREAM, DATA and RST_STREAM.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::warn;

use super::spdy::{Codec, Frame};

/// Largest DATA payload written, and the read buffer's first size.
pub(crate) const CHUNK: usize = 32 * 1024;

/// Writes `frames` to `io` until every sender is gone or the client stops reading.
pub(crate) async fn write_frames<W: AsyncWrite + Unpin>(mut io: W, mut frames: mpsc::Receiver<Frame>) {
    let mut codec = Codec::new();
    let mut buf = BytesMut::new();
    while let Some(frame) = frames.recv().await {
        buf.clear();
        if let Err(error) = codec.encode(&frame, &mut buf) {
            warn!(%error, "kubelet API: cannot encode a SPDY frame");
            break;
        }
        if io.write_all(&buf).await.is_err() || io.flush().await.is_err() {
            break;
        }
    }
    let _ = io.shutdown().await;
}

/// The client's frames, read from one connection.
pub(crate) struct ClientFrames<R> {
    io: R,
    codec: Codec,
    buf: BytesMut,
    /// Where the answers to pings (and the GO_AWAY for bad data) go.
    out: mpsc::Sender<Frame>,
    /// The session's kind, for the log.
    what: &'static str,
}

impl<R: AsyncRead + Unpin> ClientFrames<R> {
    pub(crate) fn new(io: R, out: mpsc::Sender<Frame>, what: &'static str) -> Self {
        Self { io, codec: Codec::new(), buf: BytesMut::with_capacity(CHUNK), out, what }
    }

    /// The next SYN_STREAM, DATA or RST_STREAM; `None` once the client hung up, sent
    /// GO_AWAY, or sent what does not decode (answered with GO_AWAY).
    pub(crate) async fn next(&mut self) -> Option<Frame> {
        loop {
            let frame = match self.codec.decode(&mut self.buf) {
                Ok(Some(frame)) => frame,
                Ok(None) => match self.io.read_buf(&mut self.buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(_) => continue,
                },
                Err(error) => {
                    warn!(%error, "{}: bad SPDY data from the client", self.what);
                    let _ = self.out.send(Frame::GoAway { last_good: 0, status: 1 }).await;
                    return None;
                }
            };
            match frame {
                Frame::Ping { id } => {
                    let _ = self.out.send(Frame::Ping { id }).await;
                }
                Frame::GoAway { .. } => return None,
                f @ (Frame::SynStream { .. } | Frame::Data { .. } | Frame::RstStream { .. }) => return Some(f),
                Frame::SynReply { .. }
                | Frame::Headers { .. }
                | Frame::Settings { .. }
                | Frame::WindowUpdate { .. }
                | Frame::Unknown { .. } => {}
            }
        }
    }
}
