//! Newtypes for the names that are easy to mix up.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_node_names_follow_the_design() {
        let m = MemberName::from("online-a");
        assert_eq!(VirtualNodeName::for_pool(&m, &PoolName::from(DEFAULT_POOL)).as_str(), "tidepool-online-a");
        assert_eq!(VirtualNodeName::for_pool(&m, &PoolName::from("h100")).as_str(), "tidepool-online-a-h100");
    }
}
