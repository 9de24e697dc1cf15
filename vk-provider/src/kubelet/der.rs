//! Just enough DER to read an issued certificate's validity window, which decides when it is
//! renewed ([`super::csr::renewal_delay`]): two timestamps do not need an X.509 library.
//! Tests also read a request's subject and SANs with it.

use jiff::Timestamp;

pub(super) const SEQUENCE: u8 = 0x30;
#[cfg(test)]
pub(super) const SET: u8 = 0x31;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;
/// `[0]`, constructed: the version of a certificate, the attributes of a request.
pub(super) const CONTEXT_0: u8 = 0xa0;

/// One DER element: its tag byte and its contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tlv<'a> {
    pub tag: u8,
    pub content: &'a [u8],
}

/// The element at the front of `input`, and what follows it. `None` for what is not DER of
/// the shapes certificates use (multi-byte tags, indefinite or over-long lengths, truncation).
pub(super) fn next(input: &[u8]) -> Option<(Tlv<'_>, &[u8])> {
    let (&tag, rest) = input.split_first()?;
    if tag & 0x1f == 0x1f {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (bytes, rest) = rest.split_at(n);
        (bytes.iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b)), rest)
    };
    if rest.len() < len {
        return None;
    }
    let (content, rest) = rest.split_at(len);
    Some((Tlv { tag, content }, rest))
}

/// The elements inside a constructed element's contents, in order.
pub(super) fn children(mut content: &[u8]) -> Option<Vec<Tlv<'_>>> {
    let mut out = Vec::new();
    while !content.is_empty() {
        let (tlv, rest) = next(content)?;
        out.push(tlv);
        content = rest;
    }
    Some(out)
}

/// The only element of `input`, if it has tag `tag`.
pub(super) fn single(input: &[u8], tag: u8) -> Option<Tlv<'_>> {
    match next(input)? {
        (tlv, []) if tlv.tag == tag => Some(tlv),
        _ => None,
    }
}

/// `notBefore` and `notAfter` of a DER certificate (RFC 5280 §4.1).
pub(super) fn validity(certificate: &[u8]) -> Option<(Timestamp, Timestamp)> {
    let certificate = single(certificate, SEQUENCE)?;
    let tbs = next(certificate.content).map(|(tbs, _)| tbs).filter(|t| t.tag == SEQUENCE)?;
    let mut fields = children(tbs.content)?.into_iter();
    // version [0] (absent in v1), serialNumber, signature, issuer, validity
    let first = fields.next()?;
    if first.tag == CONTEXT_0 {
        fields.next()?;
    }
    let validity = fields.nth(2).filter(|v| v.tag == SEQUENCE)?;
    match children(validity.content)?.as_slice() {
        [not_before, not_after] => Some((time(not_before)?, time(not_after)?)),
        _ => None,
    }
}

/// A `UTCTime` or `GeneralizedTime` in the one form RFC 5280 allows: UTC, whole seconds.
fn time(tlv: &Tlv<'_>) -> Option<Timestamp> {
    let text = std::str::from_utf8(tlv.content).ok()?.strip_suffix('Z')?;
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let number = |s: &str| s.parse::<i16>().ok();
    let (year, rest) = match (tlv.tag, text.len()) {
        // Two-digit years: 50–99 are 19xx, 00–49 are 20xx (RFC 5280 §4.1.2.5.1).
        (UTC_TIME, 12) => {
            let yy = number(&text[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (GENERALIZED_TIME, 14) => (number(&text[..4])?, &text[4..]),
        _ => return None,
    };
    let two = |i: usize| rest.get(i..i + 2).and_then(|s| s.parse::<i8>().ok());
    let datetime = jiff::civil::DateTime::new(year, two(0)?, two(2)?, two(4)?, two(6)?, two(8)?, 0).ok()?;
    jiff::tz::Offset::UTC.to_timestamp(datetime).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(not_before: (i32, u8, u8), not_after: (i32, u8, u8)) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["x.example".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
        params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_validity_window_is_read_from_a_certificate() {
        let (not_before, not_after) = validity(&certificate((2026, 3, 1), (2027, 3, 1))).unwrap();
        assert_eq!(not_before, "2026-03-01T00:00:00Z".parse::<Timestamp>().unwrap());
        assert_eq!(not_after, "2027-03-01T00:00:00Z".parse::<Timestamp>().unwrap());
    }

    #[test]
    fn years_past_2049_are_generalized_times() {
        let (_, not_after) = validity(&certificate((2026, 3, 1), (2061, 7, 9))).unwrap();
        assert_eq!(not_after, "2061-07-09T00:00:00Z".parse::<Timestamp>().unwrap());
    }

    #[test]
    fn two_digit_years_before_50_are_this_century() {
        let utc = |s: &str| time(&Tlv { tag: UTC_TIME, content: s.as_bytes() });
        assert_eq!(utc("491231235959Z"), Some("2049-12-31T23:59:59Z".parse().unwrap()));
        assert_eq!(utc("500101000000Z"), Some("1950-01-01T00:00:00Z".parse().unwrap()));
        assert_eq!(utc("500101000000+0100"), None);
        assert_eq!(utc("5001010000Z"), None);
    }

    #[test]
    fn what_is_not_a_certificate_has_no_validity() {
        let good = certificate((2026, 3, 1), (2027, 3, 1));
        assert!(validity(&good[..good.len() - 1]).is_none(), "truncated");
        assert!(validity(b"not der at all").is_none());
        assert!(validity(&[]).is_none());
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(validity(&trailing).is_none(), "trailing bytes");
    }
}
