//! Resource arithmetic over Kubernetes quantities.
//!
//! Every amount is held as an integer number of milli-units (`1` cpu = `1000`, `1Gi` memory =
//! `1073741824000`), so cpu, memory, pods and extended resources share one exact, float-free
//! representation. Arithmetic saturates instead of overflowing, and subtraction can be
//! clamped at zero where a negative amount means nothing (capacity).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

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

/// A set of named resource amounts in milli-units. Missing names are zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Resources(BTreeMap<String, i64>);

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
        let mut r = Self::new();
        for (k, v) in list {
            r.add_one(k, parse_milli(&v.0)?);
        }
        Ok(r)
    }

    pub fn to_quantities(&self) -> BTreeMap<String, Quantity> {
        self.0.iter().map(|(k, v)| (k.clone(), Quantity(format_milli(*v)))).collect()
    }

    pub fn get(&self, name: &str) -> i64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    pub fn set(&mut self, name: &str, milli: i64) {
        self.0.insert(name.to_owned(), milli);
    }

    pub fn add_one(&mut self, name: &str, milli: i64) {
        let e = self.0.entry(name.to_owned()).or_insert(0);
        *e = e.saturating_add(milli);
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.0.values().all(|v| *v == 0)
    }

    pub fn add(&mut self, other: &Resources) {
        for (k, v) in other.iter() {
            self.add_one(k, v);
        }
    }

    /// `self − other`, per resource; may go negative.
    pub fn sub(&mut self, other: &Resources) {
        for (k, v) in other.iter() {
            self.add_one(k, v.saturating_neg());
        }
    }

    /// Only the amounts that are not zero (for messages: `nvidia.com/gpu=2`, not every name).
    pub fn nonzero(&self) -> Resources {
        Resources(self.0.iter().filter(|(_, v)| **v != 0).map(|(k, v)| (k.clone(), *v)).collect())
    }

    /// Sets every negative amount to zero.
    pub fn clamp_non_negative(&mut self) {
        for v in self.0.values_mut() {
            *v = (*v).max(0);
        }
    }

    /// Per resource maximum (used for init containers: the largest one runs alone).
    pub fn max_with(&mut self, other: &Resources) {
        for (k, v) in other.iter() {
            let e = self.0.entry(k.to_owned()).or_insert(0);
            *e = (*e).max(v);
        }
    }

    /// True when every amount in `self` is at most the same amount in `other`.
    pub fn fits_in(&self, other: &Resources) -> bool {
        self.iter().all(|(k, v)| v <= other.get(k))
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.iter().map(|(k, v)| format!("{k}={}", format_milli(v))).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
