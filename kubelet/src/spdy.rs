//! SPDY/3.1 framing, the server's half of what the API server speaks to a kubelet for
//! `exec` and `attach` (it upgrades the HTTP/1.1 request with `Upgrade: SPDY/3.1`).
//!
//! Pure: bytes in, [`Frame`]s out and back, no I/O. A [`Codec`] belongs to one connection,
//! because header blocks of one direction form a single zlib stream (primed with the SPDY/3
//! dictionary, each block ended by a sync flush), so blocks can only be read in order.
//!
//! Frame layouts (all integers big-endian):
//! - control: `1 | version:15 = 3 | type:16 | flags:8 | length:24 | payload`
//! - data: `0 | stream:31 | flags:8 | length:24 | payload`
//! - a header block: `count:32` then per header `len:32 name len:32 value`; several values of
//!   one name are joined by NUL.

use std::sync::OnceLock;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

pub const VERSION: u16 = 3;
pub const FLAG_FIN: u8 = 0x01;
/// The largest payload a frame can carry (its length field has 24 bits).
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// Header blocks bigger than this once inflated are refused: the apiserver sends a few short
/// headers per stream, and a small compressed block could otherwise inflate without bound.
const MAX_HEADER_BLOCK: usize = 256 * 1024;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const SETTINGS: u16 = 4;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes used here.
pub const RST_PROTOCOL_ERROR: u32 = 1;
pub const RST_REFUSED_STREAM: u32 = 3;
pub const RST_CANCEL: u32 = 5;

/// Header name/value pairs, names in lower case as SPDY requires.
pub type Headers = Vec<(String, String)>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    SynStream {
        stream: u32,
        associated: u32,
        priority: u8,
        flags: u8,
        headers: Headers,
    },
    SynReply {
        stream: u32,
        flags: u8,
        headers: Headers,
    },
    RstStream {
        stream: u32,
        status: u32,
    },
    /// Entries are `(flags, id, value)`.
    Settings {
        flags: u8,
        entries: Vec<(u8, u32, u32)>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream: u32,
        flags: u8,
        headers: Headers,
    },
    WindowUpdate {
        stream: u32,
        delta: u32,
    },
    Data {
        stream: u32,
        flags: u8,
        data: Bytes,
    },
    /// A control frame of a type this codec does not know: the spec says to ignore it.
    Unknown {
        kind: u16,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpdyError {
    #[error("unsupported SPDY version {0}")]
    Version(u16),
    #[error("{0} frame too short")]
    Short(&'static str),
    #[error("header block: {0}")]
    HeaderBlock(&'static str),
    #[error("header compression: {0}")]
    Zlib(String),
    #[error("frame payload of {0} bytes is over the 24-bit limit")]
    TooLarge(usize),
}

/// The SPDY/3 header compression dictionary (draft 3, section 2.6.10.1): length-prefixed
/// common header names and values, then common value fragments.
pub fn dictionary() -> &'static [u8] {
    static DICT: OnceLock<Vec<u8>> = OnceLock::new();
    DICT.get_or_init(|| {
        const WORDS: &[&str] = &[
            "options",
            "head",
            "post",
            "put",
            "delete",
            "trace",
            "accept",
            "accept-charset",
            "accept-encoding",
            "accept-language",
            "accept-ranges",
            "age",
            "allow",
            "authorization",
            "cache-control",
            "connection",
            "content-base",
            "content-encoding",
            "content-language",
            "content-length",
            "content-location",
            "content-md5",
            "content-range",
            "content-type",
            "date",
            "etag",
            "expect",
            "expires",
            "from",
            "host",
            "if-match",
            "if-modified-since",
            "if-none-match",
            "if-range",
            "if-unmodified-since",
            "last-modified",
            "location",
            "max-forwards",
            "pragma",
            "proxy-authenticate",
            "proxy-authorization",
            "range",
            "referer",
            "retry-after",
            "server",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "user-agent",
            "vary",
            "via",
            "warning",
            "www-authenticate",
            "method",
            "get",
            "status",
            "200 OK",
            "version",
            "HTTP/1.1",
            "url",
            "public",
            "set-cookie",
            "keep-alive",
            "origin",
        ];
        const TAIL: &str = "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505\
            203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized\
            403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable\
            Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT\
            chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,\
            text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.";
        let mut d = Vec::with_capacity(1423);
        for w in WORDS {
            d.extend_from_slice(&(w.len() as u32).to_be_bytes());
            d.extend_from_slice(w.as_bytes());
        }
        d.extend_from_slice(TAIL.as_bytes());
        d
    })
}

/// One connection's framing state: the two header compression streams.
pub struct Codec {
    inflate: Decompress,
    deflate: Compress,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec").finish_non_exhaustive()
    }
}

impl Default for Codec {
    fn default() -> Self {
        Self::new()
    }
}

impl Codec {
    pub fn new() -> Self {
        let mut deflate = Compress::new(Compression::default(), true);
        // Cannot fail on a fresh stream.
        let _ = deflate.set_dictionary(dictionary());
        Self { inflate: Decompress::new(true), deflate }
    }

    /// Takes one whole frame off the front of `buf`; `None` while `buf` holds only part of one.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, SpdyError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([0, buf[5], buf[6], buf[7]]) as usize;
        if buf.len() < 8 + len {
            return Ok(None);
        }
        let head = buf.split_to(8);
        let mut p = buf.split_to(len).freeze();
        let flags = head[4];
        if head[0] & 0x80 == 0 {
            let stream = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            return Ok(Some(Frame::Data { stream, flags, data: p }));
        }
        let version = u16::from_be_bytes([head[0] & 0x7f, head[1]]);
        if version != VERSION {
            return Err(SpdyError::Version(version));
        }
        let kind = u16::from_be_bytes([head[2], head[3]]);
        let need =
            |p: &Bytes, n: usize, what: &'static str| if p.len() < n { Err(SpdyError::Short(what)) } else { Ok(()) };
        let frame = match kind {
            SYN_STREAM => {
                need(&p, 10, "SYN_STREAM")?;
                let stream = p.get_u32() & 0x7fff_ffff;
                let associated = p.get_u32() & 0x7fff_ffff;
                let priority = p.get_u8() >> 5;
                let _slot = p.get_u8();
                Frame::SynStream { stream, associated, priority, flags, headers: self.read_headers(&p)? }
            }
            SYN_REPLY | HEADERS => {
                need(&p, 4, "SYN_REPLY")?;
                let stream = p.get_u32() & 0x7fff_ffff;
                let headers = self.read_headers(&p)?;
                if kind == SYN_REPLY {
                    Frame::SynReply { stream, flags, headers }
                } else {
                    Frame::Headers { stream, flags, headers }
                }
            }
            RST_STREAM => {
                need(&p, 8, "RST_STREAM")?;
                Frame::RstStream { stream: p.get_u32() & 0x7fff_ffff, status: p.get_u32() }
            }
            SETTINGS => {
                need(&p, 4, "SETTINGS")?;
                let n = p.get_u32() as usize;
                need(&p, n.saturating_mul(8), "SETTINGS")?;
                let entries = (0..n)
                    .map(|_| {
                        let id = p.get_u32();
                        ((id >> 24) as u8, id & 0x00ff_ffff, p.get_u32())
                    })
                    .collect();
                Frame::Settings { flags, entries }
            }
            PING => {
                need(&p, 4, "PING")?;
                Frame::Ping { id: p.get_u32() }
            }
            GOAWAY => {
                need(&p, 8, "GOAWAY")?;
                Frame::GoAway { last_good: p.get_u32() & 0x7fff_ffff, status: p.get_u32() }
            }
            WINDOW_UPDATE => {
                need(&p, 8, "WINDOW_UPDATE")?;
                Frame::WindowUpdate { stream: p.get_u32() & 0x7fff_ffff, delta: p.get_u32() & 0x7fff_ffff }
            }
            kind => Frame::Unknown { kind },
        };
        Ok(Some(frame))
    }

    /// Appends `frame` to `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut BytesMut) -> Result<(), SpdyError> {
        let mut p = BytesMut::new();
        let (kind, flags) = match frame {
            Frame::Data { stream, flags, data } => {
                if data.len() > MAX_PAYLOAD {
                    return Err(SpdyError::TooLarge(data.len()));
                }
                out.put_u32(stream & 0x7fff_ffff);
                put_flags_len(out, *flags, data.len());
                out.extend_from_slice(data);
                return Ok(());
            }
            Frame::SynStream { stream, associated, priority, flags, headers } => {
                p.put_u32(*stream);
                p.put_u32(*associated);
                p.put_u8((priority & 0x7) << 5);
                p.put_u8(0);
                self.write_headers(headers, &mut p)?;
                (SYN_STREAM, *flags)
            }
            Frame::SynReply { stream, flags, headers } => {
                p.put_u32(*stream);
                self.write_headers(headers, &mut p)?;
                (SYN_REPLY, *flags)
            }
            Frame::Headers { stream, flags, headers } => {
                p.put_u32(*stream);
                self.write_headers(headers, &mut p)?;
                (HEADERS, *flags)
            }
            Frame::RstStream { stream, status } => {
                p.put_u32(*stream);
                p.put_u32(*status);
                (RST_STREAM, 0)
            }
            Frame::Settings { flags, entries } => {
                p.put_u32(entries.len() as u32);
                for (f, id, value) in entries {
                    p.put_u32((u32::from(*f) << 24) | (id & 0x00ff_ffff));
                    p.put_u32(*value);
                }
                (SETTINGS, *flags)
            }
            Frame::Ping { id } => {
                p.put_u32(*id);
                (PING, 0)
            }
            Frame::GoAway { last_good, status } => {
                p.put_u32(*last_good);
                p.put_u32(*status);
                (GOAWAY, 0)
            }
            Frame::WindowUpdate { stream, delta } => {
                p.put_u32(*stream);
                p.put_u32(*delta);
                (WINDOW_UPDATE, 0)
            }
            Frame::Unknown { kind } => (*kind, 0),
        };
        if p.len() > MAX_PAYLOAD {
            return Err(SpdyError::TooLarge(p.len()));
        }
        out.put_u16(0x8000 | VERSION);
        out.put_u16(kind);
        put_flags_len(out, flags, p.len());
        out.extend_from_slice(&p);
        Ok(())
    }

    fn write_headers(&mut self, headers: &Headers, out: &mut BytesMut) -> Result<(), SpdyError> {
        let mut raw = Vec::new();
        raw.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        for (name, value) in headers {
            for s in [name.to_ascii_lowercase().as_str(), value.as_str()] {
                raw.extend_from_slice(&(s.len() as u32).to_be_bytes());
                raw.extend_from_slice(s.as_bytes());
            }
        }
        let mut compressed = Vec::with_capacity(raw.len() + 64);
        let mut input = raw.as_slice();
        loop {
            let before = self.deflate.total_in();
            compressed.reserve(raw.len() + 64);
            self.deflate
                .compress_vec(input, &mut compressed, FlushCompress::Sync)
                .map_err(|e| SpdyError::Zlib(e.to_string()))?;
            input = &input[(self.deflate.total_in() - before) as usize..];
            // Done once all input is in and the flush left spare room in the buffer.
            if input.is_empty() && compressed.len() < compressed.capacity() {
                break;
            }
        }
        out.extend_from_slice(&compressed);
        Ok(())
    }

    fn read_headers(&mut self, compressed: &[u8]) -> Result<Headers, SpdyError> {
        let mut raw: Vec<u8> = Vec::with_capacity(compressed.len() * 4 + 64);
        let mut input = compressed;
        loop {
            let (before, produced) = (self.inflate.total_in(), raw.len());
            if raw.capacity() - raw.len() < 256 {
                raw.reserve(1024);
            }
            let result = self.inflate.decompress_vec(input, &mut raw, FlushDecompress::Sync);
            let used = (self.inflate.total_in() - before) as usize;
            input = &input[used..];
            if result.is_ok() && used == 0 && raw.len() == produced && !input.is_empty() {
                return Err(SpdyError::HeaderBlock("compressed data makes no progress"));
            }
            match result {
                Ok(Status::StreamEnd) => break,
                Ok(_) if input.is_empty() && raw.len() < raw.capacity() => break,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate.set_dictionary(dictionary()).map_err(|e| SpdyError::Zlib(e.to_string()))?;
                }
                Err(e) => return Err(SpdyError::Zlib(e.to_string())),
            }
            if raw.len() > MAX_HEADER_BLOCK {
                return Err(SpdyError::HeaderBlock("too large"));
            }
        }
        parse_header_block(&raw)
    }
}

fn put_flags_len(out: &mut BytesMut, flags: u8, len: usize) {
    out.put_u8(flags);
    out.put_slice(&(len as u32).to_be_bytes()[1..]);
}

fn parse_header_block(mut raw: &[u8]) -> Result<Headers, SpdyError> {
    fn take<'a>(raw: &mut &'a [u8]) -> Result<&'a [u8], SpdyError> {
        if raw.len() < 4 {
            return Err(SpdyError::HeaderBlock("truncated length"));
        }
        let n = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize;
        if raw.len() < 4 + n {
            return Err(SpdyError::HeaderBlock("truncated string"));
        }
        let s = &raw[4..4 + n];
        *raw = &raw[4 + n..];
        Ok(s)
    }
    if raw.len() < 4 {
        return Err(SpdyError::HeaderBlock("no count"));
    }
    let count = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize;
    raw = &raw[4..];
    let mut headers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let name = String::from_utf8_lossy(take(&mut raw)?).to_ascii_lowercase();
        let value = String::from_utf8_lossy(take(&mut raw)?).into_owned();
        headers.push((name, value));
    }
    Ok(headers)
}

/// The first value of header `name` (case-insensitive).
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.split('\0').next().unwrap_or(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(pairs: &[(&str, &str)]) -> Headers {
        pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    fn round_trip(frames: &[Frame]) -> Vec<Frame> {
        let (mut writer, mut reader) = (Codec::new(), Codec::new());
        let mut wire = BytesMut::new();
        for f in frames {
            writer.encode(f, &mut wire).unwrap();
        }
        let mut out = Vec::new();
        while let Some(f) = reader.decode(&mut wire).unwrap() {
            out.push(f);
        }
        assert!(wire.is_empty(), "bytes left over");
        out
    }

    #[test]
    fn the_dictionary_is_the_spdy3_one() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert_eq!(&d[..11], b"\0\0\0\x07options");
        assert!(d.ends_with(b",*,enq=0."));
    }

    #[test]
    fn every_frame_type_survives_a_round_trip() {
        let frames = vec![
            Frame::SynStream {
                stream: 1,
                associated: 0,
                priority: 2,
                flags: 0,
                headers: hs(&[("streamtype", "error"), ("x", "a\0b")]),
            },
            Frame::SynReply { stream: 1, flags: 0, headers: vec![] },
            Frame::Headers { stream: 3, flags: FLAG_FIN, headers: hs(&[("k", "v")]) },
            Frame::RstStream { stream: 5, status: RST_CANCEL },
            Frame::Settings { flags: 1, entries: vec![(0, 7, 65536), (1, 4, 100)] },
            Frame::Ping { id: 7 },
            Frame::GoAway { last_good: 9, status: 0 },
            Frame::WindowUpdate { stream: 3, delta: 4096 },
            Frame::Data { stream: 3, flags: FLAG_FIN, data: Bytes::from_static(b"hello") },
            Frame::Data { stream: 5, flags: 0, data: Bytes::new() },
        ];
        assert_eq!(round_trip(&frames), frames);
    }

    #[test]
    fn header_blocks_share_one_compression_stream_per_direction() {
        // The second block repeats the first: with a shared stream it compresses to less.
        let h = hs(&[("streamtype", "stdout"), ("x-stream-protocol-version", "v4.channel.k8s.io")]);
        let mut c = Codec::new();
        let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
        c.encode(&Frame::SynStream { stream: 1, associated: 0, priority: 0, flags: 0, headers: h.clone() }, &mut a)
            .unwrap();
        c.encode(&Frame::SynStream { stream: 3, associated: 0, priority: 0, flags: 0, headers: h.clone() }, &mut b)
            .unwrap();
        assert!(b.len() < a.len(), "{} !< {}", b.len(), a.len());
        // ... and a reader must see them in order.
        let mut r = Codec::new();
        a.extend_from_slice(&b);
        let Some(Frame::SynStream { headers, .. }) = r.decode(&mut a).unwrap() else { panic!("first") };
        assert_eq!(headers, h);
        let Some(Frame::SynStream { stream: 3, headers, .. }) = r.decode(&mut a).unwrap() else { panic!("second") };
        assert_eq!(header(&headers, "streamType"), Some("stdout"));
    }

    #[test]
    fn a_frame_split_across_reads_waits_for_its_last_byte() {
        let mut w = Codec::new();
        let mut wire = BytesMut::new();
        let frame = Frame::SynStream { stream: 1, associated: 0, priority: 0, flags: 0, headers: hs(&[("a", "b")]) };
        w.encode(&frame, &mut wire).unwrap();
        w.encode(&Frame::Data { stream: 1, flags: 0, data: Bytes::from_static(b"xyz") }, &mut wire).unwrap();
        let mut r = Codec::new();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for byte in wire.iter() {
            buf.put_u8(*byte);
            while let Some(f) = r.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], frame);
    }

    #[test]
    fn a_block_compressed_by_plain_zlib_with_the_dictionary_is_read() {
        // What Go's compress/zlib writer with the SPDY dictionary produces, built independently.
        let mut raw = Vec::new();
        raw.extend_from_slice(&1u32.to_be_bytes());
        for s in ["streamtype", "stdin"] {
            raw.extend_from_slice(&(s.len() as u32).to_be_bytes());
            raw.extend_from_slice(s.as_bytes());
        }
        let mut z = Compress::new(Compression::best(), true);
        z.set_dictionary(dictionary()).unwrap();
        let mut compressed = Vec::with_capacity(256);
        z.compress_vec(&raw, &mut compressed, FlushCompress::Sync).unwrap();
        let mut payload = BytesMut::new();
        payload.put_u32(5);
        payload.put_u32(0);
        payload.put_u16(0);
        payload.extend_from_slice(&compressed);
        let mut wire = BytesMut::new();
        wire.put_u16(0x8003);
        wire.put_u16(1);
        put_flags_len(&mut wire, 0, payload.len());
        wire.extend_from_slice(&payload);
        let frame = Codec::new().decode(&mut wire).unwrap().unwrap();
        assert_eq!(
            frame,
            Frame::SynStream {
                stream: 5,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: hs(&[("streamtype", "stdin")])
            }
        );
    }

    #[test]
    fn another_version_is_refused() {
        let mut wire = BytesMut::from(&[0x80, 0x02, 0, 6, 0, 0, 0, 4, 0, 0, 0, 1][..]);
        assert_eq!(Codec::new().decode(&mut wire), Err(SpdyError::Version(2)));
    }

    #[test]
    fn a_truncated_header_block_is_an_error() {
        assert!(parse_header_block(&[0, 0, 0, 1, 0, 0, 0, 9, b'a']).is_err());
        assert_eq!(parse_header_block(&[0, 0, 0, 0]).unwrap(), vec![]);
    }
}
