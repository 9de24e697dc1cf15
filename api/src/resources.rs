//! Resource arithmetic over Kubernetes quantities.
//!
//! Every amount is held as an integer number of milli-units (`1` cpu = `1000`, `1Gi` memory =
//! `1073741824000`), so cpu, memory, pods and extended resources share one exact, float-free
//! representation. Arithmetic saturates instead of overflowing, and subtraction can be
//! clamped at zero where a negative amount means nothing (capacity).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Whether `name` is a device resource: an extended resource with a domain prefix
/// (`nvidia.com/gpu`, `amd.com/gpu`, MIG profiles such as `nvidia.com/mig-1g.10gb`, any
/// vendor's device), counted in whole devices. Names under `kubernetes.io/` and the
/// unprefixed ones (`cpu`, `memory`, `hugepages-2Mi`, …) are not. Devices are what a
/// training gang is placed for: the planner and the capacity model rank by them first.
pub fn is_device(name: &str) -> bool {
    match name.split_once('/') {
        Some((domain, _)) => domain != "kubernetes.io" && !domain.ends_with(".kubernetes.io"),
        None => false,
    }
}

/// Error for a quantity string Kubernetes would not accept either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {0:?}")]
pub struct QuantityError(pub String);

/// Parses a Kubernetes quantity (`100m`, `1.5`, `4Gi`, `1e3`, `500k`) into milli-units,
/// rounding up a fraction of a milli-unit like the API server does.
pub fn parse_milli(s: &str) -> Result<i64, QuantityError> {
    let err = || QuantityError(s.to_owned());
    let s = s.trim();
    let (negative, rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(num_end);
    if number.is_empty() || number == "." {
        return Err(err());
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if frac_part.contains('.') || int_part.len() + frac_part.len() > 30 {
        return Err(err());
    }
    let digits = format!("{int_part}{frac_part}");
    let mantissa: i128 = digits.parse().map_err(|_| err())?;
    let mut exp10: i32 = -(frac_part.len() as i32);
    let mut binary: i128 = 1;
    match suffix {
        "" => {}
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => binary = 1 << 10,
        "Mi" => binary = 1 << 20,
        "Gi" => binary = 1 << 30,
        "Ti" => binary = 1 << 40,
        "Pi" => binary = 1 << 50,
        "Ei" => binary = 1 << 60,
        other => {
            let e = other.strip_prefix(['e', 'E']).ok_or_else(err)?;
            let e: i32 = e.parse().map_err(|_| err())?;
            if !(-30..=30).contains(&e) {
                return Err(err());
            }
            exp10 += e;
        }
    }
    // milli-units: one more factor of 10^3.
    exp10 += 3;
    let mut value = mantissa.saturating_mul(binary);
    if exp10 >= 0 {
        value = value.saturating_mul(10i128.saturating_pow(exp10 as u32));
    } else {
        let div = 10i128.saturating_pow((-exp10) as u32);
        value = value / div + i128::from(value % div != 0);
    }
    let value = i64::try_from(value).unwrap_or(i64::MAX);
    Ok(if negative { -value } else { value })
}

/// Formats milli-units back into a quantity string (`2`, `1500m`).
pub fn format_milli(milli: i64) -> String {
    if milli % 1000 == 0 { (milli / 1000).to_string() } else { format!("{milli}m") }
}

/// Whether `name` counts bytes (memory, storage, huge pages, a colocation system's memory).
pub fn is_bytes(name: &str) -> bool {
    name == "memory" || name == "ephemeral-storage" || name.starts_with("hugepages-") || name.ends_with("memory")
}

/// Formats milli-bytes as kubectl shows sizes: the largest binary unit that divides the value
/// exactly (`16Gi`, `1536Mi`), else whole mebibytes rounded up from 1 Mi on (`1Mi`), else
/// bytes.
pub fn format_bytes(milli: i64) -> String {
    let bytes = milli / 1000 + i64::from(milli % 1000 != 0);
    const UNITS: [(&str, u32); 6] = [("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)];
    if bytes == 0 {
        return "0".to_owned();
    }
    for (unit, shift) in UNITS {
        let size = 1i64 << shift;
        if bytes % size == 0 {
            return format!("{}{unit}", bytes / size);
        }
    }
    if bytes.unsigned_abs() >= 1 << 20 {
        let mi = 1i64 << 20;
        return format!("{}Mi", bytes / mi + i64::from(bytes % mi != 0));
    }
    bytes.to_string()
}

/// The resource names of Kubernetes itself, the GPU vendors and the colocation systems, in
/// byte order: held as [`Name::Known`], never allocated.
const KNOWN: [&str; 14] = [
    "amd.com/gpu",
    "cpu",
    "ephemeral-storage",
    "hugepages-1Gi",
    "hugepages-2Mi",
    "kubernetes.io/batch-cpu",
    "kubernetes.io/batch-memory",
    "kubernetes.io/mid-cpu",
    "kubernetes.io/mid-memory",
    "memory",
    "nvidia.com/gpu",
    "pods",
    "resource.katalyst.kubewharf.io/reclaimed_memory",
    "resource.katalyst.kubewharf.io/reclaimed_millicpu",
];

/// A resource name in a [`Resources`]. A well-known one ([`KNOWN`]) is a static string:
/// copying a sum copies no name, and two known names compare by address. Any other name is
/// allocated (a tenant may write any name; nothing is interned globally).
#[derive(Clone)]
enum Name {
    Known(&'static str),
    Other(Box<str>),
}

impl Name {
    fn of(name: &str) -> Self {
        match KNOWN.binary_search(&name) {
            Ok(i) => Name::Known(KNOWN[i]),
            Err(_) => Name::Other(name.into()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Name::Known(s) => s,
            Name::Other(s) => s,
        }
    }
}

/// Equal names have equal text; a known name is never held as [`Name::Other`].
impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Name::Known(a), Name::Known(b)) => std::ptr::eq(a.as_ptr(), b.as_ptr()),
            (Name::Other(a), Name::Other(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Name {}

impl std::hash::Hash for Name {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

/// A set of named resource amounts in milli-units. Missing names are zero.
///
/// Held as a vector of `(name, amount)` sorted by name, with no name twice, rather than a
/// `BTreeMap`: every cached pod keeps one, and a pod names only a handful of resources,
/// while a `BTreeMap` allocates a node of eleven slots for its first entry. Well-known names
/// are static and others `Box<str>` (see [`Name`]), and the vector grows by exactly the names an update adds,
/// so it keeps no spare capacity either: the reallocations that costs are bounded by the
/// number of distinct names, not by the number of updates.
///
/// Behaves exactly like the map it replaces: iteration is in name order, a name set to zero
/// stays present (and counts for equality and hashing), and the serde form is a map from
/// name to integer.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Resources(Vec<(Name, i64)>);

impl Resources {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds from `(name, quantity)` pairs; for tests and literals.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, QuantityError> {
        let mut r = Self::new();
        for (k, v) in pairs {
            r.add_one(k, parse_milli(v)?);
        }
        Ok(r)
    }

    /// Reads a Kubernetes resource list. Quantities that do not parse are reported, so a
    /// caller can decide whether to skip the object or fail.
    pub fn from_quantities(list: &BTreeMap<String, Quantity>) -> Result<Self, QuantityError> {
        // The list is already sorted by name, without duplicates: no search needed.
        let mut entries = Vec::with_capacity(list.len());
        for (k, v) in list {
            entries.push((Name::of(k), parse_milli(&v.0)?));
        }
        Ok(Self(entries))
    }

    pub fn to_quantities(&self) -> BTreeMap<String, Quantity> {
        self.iter().map(|(k, v)| (k.to_owned(), Quantity(format_milli(v)))).collect()
    }

    pub fn get(&self, name: &str) -> i64 {
        self.find(name).map_or(0, |i| self.0[i].1)
    }

    pub fn set(&mut self, name: &str, milli: i64) {
        *self.entry(name) = milli;
    }

    pub fn add_one(&mut self, name: &str, milli: i64) {
        let e = self.entry(name);
        *e = e.saturating_add(milli);
    }

    /// Takes `name` out altogether (unlike setting it to zero, which keeps it present).
    pub fn remove(&mut self, name: &str) {
        if let Ok(i) = self.find(name) {
            self.0.remove(i);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|(_, v)| *v == 0)
    }

    pub fn add(&mut self, other: &Resources) {
        self.merge(other, i64::saturating_add);
    }

    /// `self − other`, per resource; may go negative.
    pub fn sub(&mut self, other: &Resources) {
        self.merge(other, |a, b| a.saturating_add(b.saturating_neg()));
    }

    /// Only the amounts that are not zero (for messages: `nvidia.com/gpu=2`, not every name).
    pub fn nonzero(&self) -> Resources {
        let mut entries: Vec<_> = self.0.iter().filter(|(_, v)| *v != 0).cloned().collect();
        entries.shrink_to_fit();
        Resources(entries)
    }

    /// Sets every negative amount to zero.
    pub fn clamp_non_negative(&mut self) {
        for (_, v) in &mut self.0 {
            *v = (*v).max(0);
        }
    }

    /// Per resource maximum (used for init containers: the largest one runs alone).
    pub fn max_with(&mut self, other: &Resources) {
        self.merge(other, i64::max);
    }

    /// As a person reads it: `cpu=4,memory=8Gi` (sizes in kubectl's units, unlike `Display`,
    /// which writes milli-bytes as bytes).
    pub fn readable(&self) -> String {
        let parts: Vec<String> = self
            .iter()
            .map(|(k, v)| format!("{k}={}", if is_bytes(k) { format_bytes(v) } else { format_milli(v) }))
            .collect();
        parts.join(",")
    }

    /// True when every amount in `self` is at most the same amount in `other`.
    pub fn fits_in(&self, other: &Resources) -> bool {
        self.iter().all(|(k, v)| v <= other.get(k))
    }

    /// Where `name` is (`Ok`), or where it would go to keep the names sorted (`Err`).
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    /// The amount of `name`, inserted as zero if it is missing (like `BTreeMap::entry`).
    fn entry(&mut self, name: &str) -> &mut i64 {
        let i = match self.find(name) {
            Ok(i) => i,
            Err(i) => {
                // Exact growth: a no-op when `merge` reserved already.
                self.0.reserve_exact(1);
                self.0.insert(i, (Name::of(name), 0));
                i
            }
        };
        &mut self.0[i].1
    }

    /// Sets every amount named in `other` to `f(own amount, other's amount)`, a missing own
    /// amount counting as zero.
    fn merge(&mut self, other: &Resources, f: impl Fn(i64, i64) -> i64) {
        // The same names in the same order (a pool's nodes and their pods mostly name the
        // same resources): amount by amount, without a search per name.
        if self.0.len() == other.0.len() && self.0.iter().zip(&other.0).all(|((a, _), (b, _))| a == b) {
            for ((_, own), (_, theirs)) in self.0.iter_mut().zip(&other.0) {
                *own = f(*own, *theirs);
            }
            return;
        }
        let missing = other.names().filter(|k| self.find(k).is_err()).count();
        self.0.reserve_exact(missing);
        for (k, v) in other.iter() {
            let e = self.entry(k);
            *e = f(*e, v);
        }
    }
}

/// Prints like the map it replaced: `Resources({"cpu": 1000})`.
impl fmt::Debug for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries = fmt::from_fn(|f| f.debug_map().entries(self.iter()).finish());
        f.debug_tuple("Resources").field(&entries).finish()
    }
}

/// A map from name to milli-units, in name order.
impl serde::Serialize for Resources {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

/// Accepts the names in any order; a name given twice keeps its last amount (as a map does).
impl<'de> serde::Deserialize<'de> for Resources {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, i64>::deserialize(deserializer)?;
        let mut entries = Vec::with_capacity(map.len());
        entries.extend(map.into_iter().map(|(k, v)| (Name::of(&k), v)));
        Ok(Self(entries))
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.iter().map(|(k, v)| format!("{k}={}", format_milli(v))).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod bytes_tests {
    use super::*;

    #[test]
    fn sizes_read_as_kubectl_shows_them() {
        let gi = 1000 * (1i64 << 30);
        let cases = [
            ("sixteen gibibytes", 16 * gi, "16Gi"),
            ("a gibibyte and a half", 3 * gi / 2, "1536Mi"),
            ("an odd size rounds up to mebibytes", 1000 * ((5 << 20) + 3), "6Mi"),
            ("small odd sizes stay bytes", 1000 * 1000, "1000"),
            ("kibibytes", 1000 * 4096, "4Ki"),
            ("nothing", 0, "0"),
        ];
        for (what, milli, want) in cases {
            assert_eq!(format_bytes(milli), want, "{what}");
        }
        assert_eq!(format_bytes(parse_milli("17179869184").unwrap()), "16Gi", "the plugin's old output");
        assert!(is_bytes("memory") && is_bytes("hugepages-2Mi") && !is_bytes("cpu") && !is_bytes("nvidia.com/gpu"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn devices_are_the_domain_prefixed_extended_resources() {
        let cases = [
            ("an NVIDIA GPU", "nvidia.com/gpu", true),
            ("an AMD GPU", "amd.com/gpu", true),
            ("a MIG profile", "nvidia.com/mig-1g.10gb", true),
            ("any vendor's device", "example.com/fpga", true),
            ("cpu", "cpu", false),
            ("memory", "memory", false),
            ("hugepages", "hugepages-2Mi", false),
            ("a kubernetes.io resource", "kubernetes.io/batch", false),
            ("a subdomain of kubernetes.io", "requests.kubernetes.io/x", false),
        ];
        for (case, name, want) in cases {
            assert_eq!(is_device(name), want, "{case}");
        }
    }

    #[test]
    fn quantities_parse_like_the_api_server() {
        let cases = [
            ("plain integer", "2", 2000),
            ("millicores", "250m", 250),
            ("decimal fraction", "1.5", 1500),
            ("binary suffix", "1Gi", 1_073_741_824_000),
            ("tebibytes", "1Ti", 1_099_511_627_776_000),
            ("decimal suffix", "500k", 500_000_000),
            ("exponent", "1e3", 1_000_000),
            ("nano rounds up to one milli", "1n", 1),
            ("micro rounds up", "1500u", 2),
            ("explicit plus", "+3", 3000),
            ("negative", "-1", -1000),
        ];
        for (name, input, want) in cases {
            assert_eq!(parse_milli(input), Ok(want), "{name}: {input}");
        }
    }

    #[test]
    fn garbage_is_rejected() {
        for bad in ["", "abc", "1.2.3", "1Xi", ".", "1e", "5 Gi"] {
            assert!(parse_milli(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn huge_values_saturate_instead_of_overflowing() {
        assert_eq!(parse_milli("9999999Ei"), Ok(i64::MAX));
    }

    #[test]
    fn arithmetic_and_fit() {
        let mut a = Resources::from_pairs([("cpu", "4"), ("nvidia.com/gpu", "8")]).unwrap();
        let b = Resources::from_pairs([("cpu", "6"), ("memory", "1Gi")]).unwrap();
        a.sub(&b);
        assert_eq!(a.get("cpu"), -2000);
        assert_eq!(a.get("memory"), -1_073_741_824_000);
        a.clamp_non_negative();
        assert_eq!(a.get("cpu"), 0);
        assert_eq!(a.get("nvidia.com/gpu"), 8000);
        let need = Resources::from_pairs([("nvidia.com/gpu", "8")]).unwrap();
        assert!(need.fits_in(&a));
        assert!(!Resources::from_pairs([("nvidia.com/gpu", "9")]).unwrap().fits_in(&a));
    }

    /// The representation this type had before: the model the compact one must match.
    type Model = BTreeMap<String, i64>;

    fn model_add_one(m: &mut Model, k: &str, v: i64) {
        let e = m.entry(k.to_owned()).or_insert(0);
        *e = e.saturating_add(v);
    }

    fn build(entries: &[(&'static str, i64)]) -> (Resources, Model) {
        let mut r = Resources::new();
        let mut m = Model::new();
        for (k, v) in entries {
            r.set(k, *v);
            m.insert((*k).to_owned(), *v);
        }
        (r, m)
    }

    fn hash_of(h: &impl std::hash::Hash) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        BuildHasherDefault::<DefaultHasher>::default().hash_one(h)
    }

    /// Every observation of `r` agrees with the map `m`.
    fn assert_same(r: &Resources, m: &Model) -> Result<(), TestCaseError> {
        let want: Vec<(&str, i64)> = m.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        prop_assert_eq!(r.iter().collect::<Vec<_>>(), want);
        prop_assert!(r.names().eq(m.keys().map(String::as_str)));
        for name in NAMES {
            prop_assert_eq!(r.get(name), m.get(name).copied().unwrap_or(0));
        }
        prop_assert_eq!(r.is_empty(), m.values().all(|v| *v == 0));
        prop_assert_eq!(format!("{r:?}"), format!("Resources({m:?})"));
        prop_assert_eq!(serde_json::to_string(r).ok(), serde_json::to_string(m).ok());
        // No spare capacity kept, whichever way the set was built.
        prop_assert_eq!(r.0.capacity(), r.0.len());
        Ok(())
    }

    const NAMES: [&str; 5] = ["cpu", "memory", "nvidia.com/gpu", "pods", "a/b"];

    fn arb_amount() -> impl Strategy<Value = i64> {
        prop_oneof![-3i64..4, Just(i64::MIN), Just(i64::MAX), any::<i64>()]
    }

    fn arb_entries() -> impl Strategy<Value = Vec<(&'static str, i64)>> {
        prop::collection::vec((prop::sample::select(&NAMES[..]), arb_amount()), 0..6)
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(&'static str, i64),
        AddOne(&'static str, i64),
        Add(Vec<(&'static str, i64)>),
        Sub(Vec<(&'static str, i64)>),
        MaxWith(Vec<(&'static str, i64)>),
        Clamp,
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        let name = || prop::sample::select(&NAMES[..]);
        prop_oneof![
            (name(), arb_amount()).prop_map(|(k, v)| Op::Set(k, v)),
            (name(), arb_amount()).prop_map(|(k, v)| Op::AddOne(k, v)),
            arb_entries().prop_map(Op::Add),
            arb_entries().prop_map(Op::Sub),
            arb_entries().prop_map(Op::MaxWith),
            Just(Op::Clamp),
        ]
    }

    #[test]
    fn debug_and_serde_forms_are_those_of_a_map() {
        let r = Resources::from_pairs([("memory", "1Ki"), ("cpu", "250m")]).unwrap();
        assert_eq!(format!("{r:?}"), r#"Resources({"cpu": 250, "memory": 1024000})"#);
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"cpu":250,"memory":1024000}"#);
        let back: Resources = serde_json::from_str(r#"{"memory":1024000,"cpu":1,"cpu":250}"#).unwrap();
        assert_eq!(back, r);
        assert!(serde_json::from_str::<Resources>(r#"{"cpu":"1"}"#).is_err());
        assert_eq!(r.to_string(), "cpu=250m,memory=1024");
    }

    #[test]
    fn known_names_are_found_and_equal_the_same_text_allocated() {
        assert!(KNOWN.windows(2).all(|w| w[0] < w[1]), "KNOWN must be sorted for its binary search");
        for name in KNOWN {
            assert!(matches!(Name::of(name), Name::Known(_)), "{name}");
            let (text, list) = (
                Resources::from_pairs([(name, "1")]).unwrap(),
                BTreeMap::from([(name.to_owned(), Quantity("1".into()))]),
            );
            assert_eq!(text, Resources::from_quantities(&list).unwrap());
        }
        assert!(matches!(Name::of("example.com/fpga"), Name::Other(_)));
        let mut a = Resources::from_pairs([("cpu", "1"), ("example.com/fpga", "1")]).unwrap();
        a.sub(&Resources::from_pairs([("cpu", "1"), ("example.com/fpga", "1")]).unwrap());
        assert_eq!(a.iter().collect::<Vec<_>>(), [("cpu", 0), ("example.com/fpga", 0)]);
    }

    #[test]
    fn a_name_set_to_zero_stays_present() {
        let mut r = Resources::new();
        r.set("cpu", 0);
        assert!(r.is_empty());
        assert_ne!(r, Resources::new());
        assert_eq!(r.names().collect::<Vec<_>>(), ["cpu"]);
        assert_eq!(r.nonzero(), Resources::new());
    }

    #[test]
    fn built_sets_keep_no_spare_capacity() {
        let list: BTreeMap<String, Quantity> = [("cpu", "2"), ("memory", "4Gi"), ("nvidia.com/gpu", "1")]
            .map(|(k, v)| (k.to_owned(), Quantity(v.to_owned())))
            .into();
        let from_list = Resources::from_quantities(&list).unwrap();
        let mut summed = Resources::new();
        summed.add(&Resources::from_pairs([("cpu", "1"), ("memory", "1Gi")]).unwrap());
        summed.add(&Resources::from_pairs([("cpu", "1"), ("nvidia.com/gpu", "1"), ("memory", "3Gi")]).unwrap());
        let parsed: Resources = serde_json::from_str(&serde_json::to_string(&from_list).unwrap()).unwrap();
        for r in [&from_list, &summed, &parsed, &from_list.nonzero(), &from_list.clone()] {
            assert_eq!(r, &from_list);
            assert_eq!(r.0.capacity(), 3, "{r:?}");
        }
    }

    proptest! {
        #[test]
        fn behaves_like_the_map_it_replaced(start in arb_entries(), ops in prop::collection::vec(arb_op(), 0..12)) {
            let (mut r, mut m) = build(&start);
            assert_same(&r, &m)?;
            for op in ops {
                match op {
                    Op::Set(k, v) => {
                        r.set(k, v);
                        m.insert(k.to_owned(), v);
                    }
                    Op::AddOne(k, v) => {
                        r.add_one(k, v);
                        model_add_one(&mut m, k, v);
                    }
                    Op::Add(other) => {
                        let (o, om) = build(&other);
                        r.add(&o);
                        om.iter().for_each(|(k, v)| model_add_one(&mut m, k, *v));
                    }
                    Op::Sub(other) => {
                        let (o, om) = build(&other);
                        r.sub(&o);
                        om.iter().for_each(|(k, v)| model_add_one(&mut m, k, v.saturating_neg()));
                    }
                    Op::MaxWith(other) => {
                        let (o, om) = build(&other);
                        r.max_with(&o);
                        for (k, v) in om {
                            let e = m.entry(k).or_insert(0);
                            *e = (*e).max(v);
                        }
                    }
                    Op::Clamp => {
                        r.clamp_non_negative();
                        m.values_mut().for_each(|v| *v = (*v).max(0));
                    }
                }
                assert_same(&r, &m)?;
            }
            let nonzero: Model = m.iter().filter(|(_, v)| **v != 0).map(|(k, v)| (k.clone(), *v)).collect();
            assert_same(&r.nonzero(), &nonzero)?;
            let back: Resources = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
            prop_assert_eq!(&back, &r);
            assert_same(&back, &m)?;
        }

        #[test]
        fn equality_fit_and_serde_do_not_depend_on_insertion_order(a in arb_entries(), b in arb_entries()) {
            let (ra, ma) = build(&a);
            let (rb, mb) = build(&b);
            let mut reversed = Resources::new();
            for (k, v) in ma.iter().rev() {
                reversed.set(k, *v);
            }
            prop_assert_eq!(&reversed, &ra);
            prop_assert_eq!(hash_of(&reversed), hash_of(&ra));
            prop_assert_eq!(ra == rb, ma == mb);
            let model_fits = ma.iter().all(|(k, v)| *v <= mb.get(k).copied().unwrap_or(0));
            prop_assert_eq!(ra.fits_in(&rb), model_fits);
            // A JSON object with its names out of order reads back sorted.
            let fields: Vec<String> = ma.iter().rev().map(|(k, v)| format!("{k:?}:{v}")).collect();
            let parsed: Resources = serde_json::from_str(&format!("{{{}}}", fields.join(","))).unwrap();
            prop_assert_eq!(&parsed, &ra);
            assert_same(&parsed, &ma)?;
        }
    }

    proptest! {
        #[test]
        fn formatting_round_trips(milli in -1_000_000_000_000i64..1_000_000_000_000) {
            prop_assert_eq!(parse_milli(&format_milli(milli)), Ok(milli));
        }

        #[test]
        fn integer_quantities_scale_by_a_thousand(n in 0i64..1_000_000_000) {
            prop_assert_eq!(parse_milli(&n.to_string()), Ok(n * 1000));
        }
    }
}
