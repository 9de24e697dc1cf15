//! IP networks (`address/prefix`), as numbers: what pod CIDRs are compared and checked with.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IP network, `address/prefix`, its host bits ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    address: IpAddr,
    prefix: u8,
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (address, prefix) = s.split_once('/').ok_or_else(|| format!("{s:?} is not address/prefix"))?;
        let address: IpAddr = address.parse().map_err(|_| format!("{s:?} has no IP address"))?;
        let prefix: u8 = prefix.parse().map_err(|_| format!("{s:?} has no prefix length"))?;
        let most = if address.is_ipv4() { 32 } else { 128 };
        if prefix > most {
            return Err(format!("{s:?}: a prefix longer than {most} bits"));
        }
        Ok(Cidr { address, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

impl Cidr {
    /// A network of `prefix` bits at `address` (a prefix past the family's width is cut to it).
    pub fn new(address: IpAddr, prefix: u8) -> Self {
        Cidr { address, prefix: prefix.min(if address.is_ipv4() { 32 } else { 128 }) }
    }

    /// First and last address as numbers of the family's width (IPv4 in the low 32 bits), and
    /// the family.
    pub fn range(&self) -> (bool, u128, u128) {
        let (v6, bits) = number(self.address);
        let width = if v6 { 128u32 } else { 32 };
        let host_bits = width - u32::from(self.prefix);
        let host_mask = if host_bits == 128 { u128::MAX } else { (1u128 << host_bits) - 1 };
        (v6, bits & !host_mask, bits | host_mask)
    }

    /// Whether the network holds address `at` of family `v6`.
    pub fn holds(&self, v6: bool, at: u128) -> bool {
        let (family, start, end) = self.range();
        family == v6 && start <= at && at <= end
    }

    /// Whether the two networks share an address.
    pub fn overlaps(&self, other: &Cidr) -> bool {
        let (a6, a0, a1) = self.range();
        let (b6, b0, b1) = other.range();
        a6 == b6 && a0 <= b1 && b0 <= a1
    }
}

/// An address as its family (`true`: IPv6) and a number of the family's width.
pub fn number(ip: IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(a) => (false, u128::from(u32::from(a))),
        IpAddr::V6(a) => (true, u128::from(a)),
    }
}
