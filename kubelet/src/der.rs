//! Just enough DER to read an issued certificate's validity window, which decides when it is
//! renewed ([`super::csr::renewal_delay`]), and a caller's certificate subject, which is who
//! the caller is ([`super::authz`]): two timestamps and two names do not need an X.509
//! library. Tests also read a request's subject and SANs with it.

use jiff::Timestamp;

pub(super) const SEQUENCE: u8 = 0x30;
pub(super) const SET: u8 = 0x31;
const OID: u8 = 0x06;
const UTF8_STRING: u8 = 0x0c;
const PRINTABLE_STRING: u8 = 0x13;
const T61_STRING: u8 = 0x14;
const IA5_STRING: u8 = 0x16;
const BMP_STRING: u8 = 0x1e;
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

/// `id-at-commonName` (2.5.4.3), as DER contents.
const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// `id-at-organizationName` (2.5.4.10), as DER contents.
const OID_ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];

/// The fields of a DER certificate's `tbsCertificate` from `serialNumber` on (RFC 5280
/// §4.1): serialNumber, signature, issuer, validity, subject, …
fn tbs_fields(certificate: &[u8]) -> Option<Vec<Tlv<'_>>> {
    let certificate = single(certificate, SEQUENCE)?;
    let tbs = next(certificate.content).map(|(tbs, _)| tbs).filter(|t| t.tag == SEQUENCE)?;
    let mut fields = children(tbs.content)?;
    // version [0] is absent in v1 certificates.
    if fields.first()?.tag == CONTEXT_0 {
        fields.remove(0);
    }
    Some(fields)
}

/// `notBefore` and `notAfter` of a DER certificate (RFC 5280 §4.1).
pub(super) fn validity(certificate: &[u8]) -> Option<(Timestamp, Timestamp)> {
    let fields = tbs_fields(certificate)?;
    let validity = fields.get(3).filter(|v| v.tag == SEQUENCE)?;
    match children(validity.content)?.as_slice() {
        [not_before, not_after] => Some((time(not_before)?, time(not_after)?)),
        _ => None,
    }
}

/// The names of a certificate's subject that Kubernetes reads as an identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Subject {
    /// The last `CN`, as Go's `pkix.Name` keeps it.
    pub common_name: Option<String>,
    /// Every `O`, in order.
    pub organizations: Vec<String>,
}

/// The `CN` and `O` of a DER certificate's subject. `None` for what is not a certificate; a
/// name in a string type not read here (UniversalString, …) is left out.
pub(super) fn subject(certificate: &[u8]) -> Option<Subject> {
    let fields = tbs_fields(certificate)?;
    names(fields.get(4).filter(|v| v.tag == SEQUENCE)?.content)
}

/// The `CN` and `O` of the contents of a `Name`:
/// `SEQUENCE OF SET OF SEQUENCE { type OID, value ANY }`.
fn names(name: &[u8]) -> Option<Subject> {
    let mut subject = Subject::default();
    for rdn in children(name)? {
        if rdn.tag != SET {
            return None;
        }
        for attribute in children(rdn.content)? {
            let [oid, value] = children(single_content(attribute, SEQUENCE)?)?[..] else { return None };
            if oid.tag != OID {
                return None;
            }
            let Some(text) = string(&value) else { continue };
            match oid.content {
                OID_COMMON_NAME => subject.common_name = Some(text),
                OID_ORGANIZATION => subject.organizations.push(text),
                _ => {}
            }
        }
    }
    Some(subject)
}

fn single_content(tlv: Tlv<'_>, tag: u8) -> Option<&[u8]> {
    (tlv.tag == tag).then_some(tlv.content)
}

/// A directory string as text: UTF8String, PrintableString and IA5String as they are,
/// T61String as Latin-1 and BMPString as UTF-16, as Go's `encoding/asn1` reads them.
fn string(tlv: &Tlv<'_>) -> Option<String> {
    match tlv.tag {
        UTF8_STRING | PRINTABLE_STRING | IA5_STRING => std::str::from_utf8(tlv.content).ok().map(str::to_owned),
        T61_STRING => Some(tlv.content.iter().map(|&b| char::from(b)).collect()),
        BMP_STRING if tlv.content.len().is_multiple_of(2) => {
            let units = tlv.content.chunks_exact(2).map(|p| u16::from_be_bytes([p[0], p[1]]));
            char::decode_utf16(units).collect::<Result<String, _>>().ok()
        }
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

    fn named(names: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (kind, value) in names {
            params.distinguished_name.push(kind.clone(), *value);
        }
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_subject_gives_the_common_name_and_every_organization() {
        use rcgen::DnType::*;
        let cert =
            named(&[(OrganizationName, "system:nodes"), (CommonName, "system:node:worker-7"), (CountryName, "NL")]);
        assert_eq!(
            subject(&cert),
            Some(Subject {
                common_name: Some("system:node:worker-7".into()),
                organizations: vec!["system:nodes".into()]
            })
        );
        assert_eq!(subject(&named(&[(CountryName, "NL")])), Some(Subject::default()));
    }

    /// One attribute `type = value` as a relative distinguished name (a SET of one).
    fn rdn(oid: &[u8], tag: u8, value: &str) -> Vec<u8> {
        let tlv = |tag: u8, content: &[u8]| [&[tag, content.len() as u8][..], content].concat();
        tlv(SET, &tlv(SEQUENCE, &[tlv(OID, oid), tlv(tag, value.as_bytes())].concat()))
    }

    #[test]
    fn every_organization_is_a_group_and_the_last_common_name_is_the_user() {
        // rcgen writes one value per type, so this Name is written by hand.
        let name = [
            rdn(OID_ORGANIZATION, UTF8_STRING, "system:nodes"),
            rdn(OID_COMMON_NAME, PRINTABLE_STRING, "first"),
            rdn(OID_ORGANIZATION, PRINTABLE_STRING, "team-a"),
            rdn(OID_COMMON_NAME, UTF8_STRING, "system:node:worker-7"),
        ]
        .concat();
        let subject = names(&name).unwrap();
        assert_eq!(subject.common_name.as_deref(), Some("system:node:worker-7"));
        assert_eq!(subject.organizations, ["system:nodes", "team-a"]);
        assert_eq!(names(&rdn(OID_COMMON_NAME, 0x1c, "x")), Some(Subject::default()), "unread type left out");
        assert_eq!(names(&name[1..]), None, "not DER");
    }

    #[test]
    fn directory_strings_are_read_in_the_types_go_reads() {
        let s = |tag, content: &[u8]| string(&Tlv { tag, content });
        assert_eq!(s(UTF8_STRING, "jürgen".as_bytes()).as_deref(), Some("jürgen"));
        assert_eq!(s(PRINTABLE_STRING, b"admin").as_deref(), Some("admin"));
        assert_eq!(s(T61_STRING, &[0x6a, 0xfc]).as_deref(), Some("jü"));
        assert_eq!(s(BMP_STRING, &[0x00, 0x6a, 0x00, 0xfc]).as_deref(), Some("jü"));
        assert_eq!(s(BMP_STRING, &[0x00]), None, "odd length");
        assert_eq!(s(UTF8_STRING, &[0xff]), None, "not UTF-8");
        assert_eq!(s(0x1c, b"\0\0\0a"), None, "UniversalString is not read");
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
        assert!(subject(&trailing).is_none(), "trailing bytes");
        assert!(subject(b"not der at all").is_none());
    }
}
