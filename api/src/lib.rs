//! Tidepool's vocabulary as data: the `MemberCluster` custom resource, the label and
//! annotation keys every component agrees on, resource arithmetic over Kubernetes
//! quantities, and the bridge configuration file with its validation.
//!
//! This crate does no I/O. Everything here is plain data and pure functions, so the other
//! crates (and their tests) can share one definition of each fact. Start with [`crd`] for the
//! API an admin writes, [`bridge`] for the file `tidepool run --config` reads, and
//! [`resources`] for the capacity arithmetic.

pub mod bridge;
pub mod colocation;
pub mod crd;
pub mod cron;
pub mod keys;
pub mod metrics;
pub mod names;
pub mod net;
pub mod node_match;
pub mod pod;
pub mod resources;
pub mod schema;
pub mod sync;
pub mod terminal;
pub mod text;

pub use bridge::BridgeConfig;
pub use crd::{MemberCluster, MemberClusterSpec, MemberClusterStatus};
pub use names::{MemberName, PoolName, VirtualNodeName};
pub use resources::Resources;

/// One problem found while validating user input, with the path of the offending field
/// (`spec.pools[1].name`), so the message points where the user has to look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl FieldError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), message: message.into() }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Joins field errors into one line for a status condition or a CLI message.
pub fn describe(errors: &[FieldError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// Checks a DNS-1123 label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters).
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Checks a DNS-1123 subdomain (labels joined by dots, at most 253 characters).
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Checks a label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters of alphanumerics, `-`, `_` and `.`, beginning and ending alphanumeric.
pub fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, s),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
    name_ok && prefix.is_none_or(is_dns_subdomain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys() {
        assert!(is_label_key("topology.kubernetes.io/zone"));
        assert!(is_label_key("rack"));
        assert!(!is_label_key("Bad Prefix/rack"));
        assert!(!is_label_key("example.com/"));
        assert!(!is_label_key("-rack"));
    }

    #[test]
    fn dns_names() {
        assert!(is_dns_label("member-a"));
        assert!(!is_dns_label("Member"));
        assert!(!is_dns_label("-a"));
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(is_dns_subdomain("tidepool.io"));
        assert!(!is_dns_subdomain("a..b"));
    }
}
