//! Newtypes for the names that are easy to mix up.

use crate::sync::ReadWrite;
use std::fmt;

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub fn new(s: impl Into<String>) -> Self {
                Self(s.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }
    };
}

name_type!(
    /// Name of a `MemberCluster` object.
    MemberName
);
name_type!(
    /// Name of a pool inside a member (`default` when the member declares none).
    PoolName
);
name_type!(
    /// Name of a virtual Node in the training cluster.
    VirtualNodeName
);

/// Name of the pool used when a `MemberCluster` declares no pools.
pub const DEFAULT_POOL: &str = "default";

impl VirtualNodeName {
    /// `tidepool-<member>` for the default pool, `tidepool-<member>-<pool>` otherwise.
    pub fn for_pool(member: &MemberName, pool: &PoolName) -> Self {
        if pool.as_str() == DEFAULT_POOL {
            Self(format!("tidepool-{member}"))
        } else {
            Self(format!("tidepool-{member}-{pool}"))
        }
    }
}

/// The member namespace of training namespace `namespace`: `<prefix><namespace>`. For
/// lookups; a namespace tidepool is to create comes from [`offload_namespace`], which
/// checks that the name can exist.
pub fn member_namespace(prefix: &str, namespace: &str) -> String {
    format!("{prefix}{namespace}")
}

/// Longest namespace name the API accepts (a DNS-1123 label).
pub const MAX_NAMESPACE_LEN: usize = 63;

/// A member namespace that cannot exist: its name would be too long. Not transient: the
/// same pod fails the same way every time, so it is reported, never retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "member namespace {name} would have {} characters, more than the {MAX_NAMESPACE_LEN} a namespace name may have; \
     shorten the training namespace or the member's namespacePrefix",
    name.len()
)]
pub struct NamespaceTooLong {
    pub name: String,
}

/// [`member_namespace`], refusing a name longer than a namespace name may be.
pub fn offload_namespace(prefix: &str, namespace: &str) -> Result<String, NamespaceTooLong> {
    let name = member_namespace(prefix, namespace);
    if name.len() > MAX_NAMESPACE_LEN {
        return Err(NamespaceTooLong { name });
    }
    Ok(name)
}

/// How one member names the offload namespaces of the training namespaces: their own names
/// (`same_name`) except those the member already had for itself, which fell back to
/// `<prefix><namespace>` for good; or always `<prefix><namespace>`. Shared by everything that
/// reads or writes a member's namespaces, so a training namespace maps to one member
/// namespace everywhere; rebuilt at each session start from the namespaces' labels.
#[derive(Debug)]
pub struct OffloadNamespaces {
    prefix: String,
    same_name: bool,
    /// Training namespaces whose same-named member namespace was taken.
    fallback: std::sync::RwLock<std::collections::BTreeSet<String>>,
}

impl OffloadNamespaces {
    pub fn new(prefix: impl Into<String>, same_name: bool) -> Self {
        Self { prefix: prefix.into(), same_name, fallback: Default::default() }
    }

    /// The member namespace of training namespace `namespace`.
    pub fn member_ns(&self, namespace: &str) -> String {
        if self.same_name && !self.fell_back(namespace) {
            namespace.to_owned()
        } else {
            member_namespace(&self.prefix, namespace)
        }
    }

    /// [`Self::member_ns`], refusing a name longer than a namespace name may be.
    pub fn offload_ns(&self, namespace: &str) -> Result<String, NamespaceTooLong> {
        let name = self.member_ns(namespace);
        if name.len() > MAX_NAMESPACE_LEN {
            return Err(NamespaceTooLong { name });
        }
        Ok(name)
    }

    /// Whether training namespaces keep their names where they can.
    pub fn same_name(&self) -> bool {
        self.same_name
    }

    /// Whether `namespace` fell back to the prefixed name.
    pub fn fell_back(&self, namespace: &str) -> bool {
        // A poisoned lock still holds a whole set: nothing here is written in more than one
        // step, so what a panicking holder left is as good as what it found.
        self.fallback.read_recovered("namespace fallback").contains(namespace)
    }

    /// From now on `namespace` maps to `<prefix><namespace>`: its same-named member namespace
    /// is somebody else's. True if it was not so already.
    pub fn fall_back(&self, namespace: &str) -> bool {
        self.same_name && self.fallback.write_recovered("namespace fallback").insert(namespace.to_owned())
    }

    /// Records what the member's offload namespaces say: `member_ns` holds the offload pods of
    /// training namespace `origin` (its `tidepool.io/origin-namespace` label).
    pub fn learn(&self, member_ns: &str, origin: &str) {
        if member_ns != origin && member_ns == member_namespace(&self.prefix, origin) {
            self.fall_back(origin);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_named_namespaces_fall_back_to_the_prefix_for_good() {
        let ns = OffloadNamespaces::new("tp-", true);
        assert_eq!(ns.member_ns("team-a"), "team-a");
        assert!(ns.fall_back("team-a"), "the member has a team-a of its own");
        assert!(!ns.fall_back("team-a"), "once");
        assert_eq!(ns.member_ns("team-a"), "tp-team-a");
        assert_eq!(ns.member_ns("team-b"), "team-b");
        let prefixed = OffloadNamespaces::new("tp-", false);
        assert_eq!(prefixed.member_ns("team-a"), "tp-team-a");
        assert!(!prefixed.fall_back("team-a"), "nothing to fall back from");
    }

    #[test]
    fn a_restart_learns_the_fallbacks_from_the_namespaces() {
        let ns = OffloadNamespaces::new("tp-", true);
        ns.learn("team-a", "team-a");
        ns.learn("tp-team-b", "team-b");
        ns.learn("other-c", "team-c");
        assert_eq!(ns.member_ns("team-a"), "team-a");
        assert_eq!(ns.member_ns("team-b"), "tp-team-b");
        assert_eq!(ns.member_ns("team-c"), "team-c", "a name of no mapping of ours teaches nothing");
        let long = "n".repeat(62);
        assert!(ns.offload_ns(&long).is_ok());
        ns.fall_back(&long);
        assert!(ns.offload_ns(&long).is_err(), "65 characters with the prefix");
    }

    #[test]
    fn virtual_node_names_follow_the_design() {
        let m = MemberName::from("online-a");
        assert_eq!(VirtualNodeName::for_pool(&m, &PoolName::from(DEFAULT_POOL)).as_str(), "tidepool-online-a");
        assert_eq!(VirtualNodeName::for_pool(&m, &PoolName::from("h100")).as_str(), "tidepool-online-a-h100");
    }
}
