//! The checkpoint store: an S3-compatible server (the local clusters run moto's), spoken to
//! with plain HTTP/1.1 PUT and GET over std TCP. No request is signed: the test server checks
//! no signatures, but it treats a request without an `Authorization` header as anonymous and
//! refuses anonymous reads, so a placeholder header is sent.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `http://host:port/bucket[/prefix]`: where this job's checkpoints go.
#[derive(Debug, Clone, PartialEq)]
pub struct Store {
    pub host: String,
    pub port: u16,
    pub bucket: String,
    pub prefix: String,
}

const AUTH: &str = "AWS4-HMAC-SHA256 Credential=tidepool/20260101/us-east-1/s3/aws4_request, \
                    SignedHeaders=host, Signature=0";

impl Store {
    pub fn parse(url: &str) -> Result<Store, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?}: only http:// URLs"))?;
        let (authority, path) = rest.split_once('/').ok_or_else(|| format!("{url:?}: no bucket in the path"))?;
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().map_err(|e| format!("{url:?}: port {p:?}: {e}"))?),
            None => (authority, 80),
        };
        let path = path.trim_matches('/');
        let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
        if host.is_empty() || bucket.is_empty() {
            return Err(format!("{url:?}: want http://host:port/bucket[/prefix]"));
        }
        Ok(Store { host: host.to_owned(), port, bucket: bucket.to_owned(), prefix: prefix.to_owned() })
    }

    fn path(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            format!("/{}/{key}", self.bucket)
        } else {
            format!("/{}/{}/{key}", self.bucket, self.prefix)
        }
    }

    /// Creates the bucket; one that exists already is fine.
    pub fn ensure_bucket(&self) -> Result<(), String> {
        let (status, body) = self.request("PUT", &format!("/{}", self.bucket), b"")?;
        match status {
            200 | 409 => Ok(()),
            _ => Err(format!("create bucket {}: HTTP {status}: {}", self.bucket, String::from_utf8_lossy(&body))),
        }
    }

    pub fn put(&self, key: &str, body: &[u8]) -> Result<(), String> {
        let (status, reply) = self.request("PUT", &self.path(key), body)?;
        if status == 200 {
            Ok(())
        } else {
            Err(format!("PUT {key}: HTTP {status}: {}", String::from_utf8_lossy(&reply)))
        }
    }

    /// The object, or None when there is none (a first start).
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        let (status, body) = self.request("GET", &self.path(key), b"")?;
        match status {
            200 => Ok(Some(body)),
            404 => Ok(None),
            _ => Err(format!("GET {key}: HTTP {status}: {}", String::from_utf8_lossy(&body))),
        }
    }

    fn request(&self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), String> {
        let addr = format!("{}:{}", self.host, self.port);
        // A bounded connect, tried a few times: an unanswered SYN must not hold a trainer's
        // start (or its checkpoint) for the kernel's two minutes.
        let mut conn = connect(&addr)?;
        conn.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        conn.set_write_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {AUTH}\r\n\
             Content-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).and_then(|()| conn.write_all(body)).map_err(|e| format!("{addr}: {e}"))?;
        let mut reply = Vec::new();
        conn.read_to_end(&mut reply).map_err(|e| format!("{addr}: {e}"))?;
        parse_response(&reply)
    }
}

/// Status and body of an HTTP/1.1 response read to its end (the request said `close`).
pub fn parse_response(reply: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = reply.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no end of headers in the response")?;
    let head = String::from_utf8_lossy(&reply[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut body = reply[end + 4..].to_vec();
    let length = lines.find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok()).flatten()
    });
    if let Some(n) = length {
        if body.len() < n {
            return Err(format!("response cut short: {} of {n} bytes", body.len()));
        }
        body.truncate(n);
    }
    Ok((status, body))
}

/// Dials `addr` with a 5 s timeout per attempt, up to 6 attempts a second apart.
fn connect(addr: &str) -> Result<TcpStream, String> {
    use std::net::ToSocketAddrs;
    let mut last = String::new();
    for _ in 0..6 {
        let resolved = addr.to_socket_addrs().map_err(|e| format!("resolve {addr}: {e}"))?.next();
        let Some(target) = resolved else { return Err(format!("resolve {addr}: no address")) };
        match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
            Ok(conn) => return Ok(conn),
            Err(e) => last = format!("connect {addr}: {e}"),
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_host_port_bucket_and_prefix() {
        let s = Store::parse("http://10.88.0.1:17250/checkpoints/ns/job").unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.bucket.as_str(), s.prefix.as_str()),
            ("10.88.0.1", 17250, "checkpoints", "ns/job")
        );
        assert_eq!(s.path("ps-0"), "/checkpoints/ns/job/ps-0");
        let s = Store::parse("http://store/b/").unwrap();
        assert_eq!((s.port, s.path("t"), s.prefix.as_str()), (80, "/b/t".to_owned(), ""));
        assert!(Store::parse("https://h/b").is_err());
        assert!(Store::parse("http://h:1").is_err());
        assert!(Store::parse("http://h:x/b").is_err());
    }

    #[test]
    fn responses_give_status_and_body() {
        let r = b"HTTP/1.1 200 OK\r\nServer: x\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(parse_response(r).unwrap(), (200, b"hello".to_vec()));
        let r = b"HTTP/1.1 404 NOT FOUND\r\ncontent-length: 3\r\n\r\n<E>";
        assert_eq!(parse_response(r).unwrap().0, 404);
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort").is_err());
        assert!(parse_response(b"garbage").is_err());
    }
}
